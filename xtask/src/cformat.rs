//! The kernel-side C is formatted by clang-format with the repository's `.clang-format`, as
//! the Rust is by rustfmt: `cargo xtask test` fails on a file that is not.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

/// `clang-format --dry-run --Werror` over every `.c` and `.h` of `ebpf/src/bpf`.
pub fn check(root: &Path) -> Result<()> {
    let dir = root.join("ebpf/src/bpf");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "c" || e == "h"))
        .collect();
    files.sort();
    crate::run(
        Command::new("clang-format")
            .args(["--dry-run", "--Werror"])
            .args(&files),
    )
}
