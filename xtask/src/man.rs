//! The man pages, generated from the CLI definitions by the built binaries into `man/`
//! (`pyrometer.1`, one page per subcommand, `pyrometer-collector.1`): run by `cargo xtask test`
//! after the build, so they always describe the options the binaries accept.

use std::path::Path;
use std::process::Command;

use anyhow::Result;

pub fn generate(root: &Path) -> Result<()> {
    let dir = root.join("man");
    let bin = crate::debug_dir();
    crate::run(
        Command::new(bin.join("pyrometer"))
            .args(["man", "--out-dir"])
            .arg(&dir),
    )?;
    crate::run(
        Command::new(bin.join("pyrometer-collector"))
            .arg("--man-dir")
            .arg(&dir),
    )?;
    eprintln!("man pages: {}", dir.display());
    Ok(())
}
