//! Compiles the kernel-side programs in `src/bpf/*.bpf.c` with clang (`-target bpf`) into
//! objects that `src/lib.rs` embeds. Debian's clang and libbpf-dev (for `bpf_helpers.h`) are
//! installed by `cargo xtask deps`; without them the build stops with a message saying so.

use std::{env, path::PathBuf, process::Command};

/// Each `src/bpf/NAME.bpf.c` becomes `$OUT_DIR/NAME.bpf.o`.
const PROGRAMS: &[&str] = &["sampler"];

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let src = PathBuf::from("src/bpf");
    println!("cargo:rerun-if-changed=src/bpf");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    let multiarch = format!("/usr/include/{}-linux-gnu", env::consts::ARCH);
    let target_arch = match env::consts::ARCH {
        "x86_64" => "x86",
        "aarch64" => "arm64",
        other => other,
    };
    for name in PROGRAMS {
        let input = src.join(format!("{name}.bpf.c"));
        let output = out.join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"])
            .arg(format!("-D__TARGET_ARCH_{target_arch}"))
            .arg(format!("-I{multiarch}"))
            .arg("-Isrc/bpf")
            .arg("-c")
            .arg(&input)
            .arg("-o")
            .arg(&output)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("clang failed ({s}) compiling {}", input.display()),
            Err(e) => panic!(
                "cannot run {clang} ({e}): install Debian's clang and libbpf-dev (`cargo xtask deps` does)"
            ),
        }
    }
}
