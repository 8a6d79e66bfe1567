//! Builds the allocation sampler library (`libpyrometer_alloc.so`, the `alloc-preload` crate)
//! that `pyrometer` carries inside itself (`src/alloc/embedded.rs`), so that a binary from
//! `cargo install`, `cargo build --bins` or a copy needs no file beside it.
//!
//! Cargo has no stable artifact dependencies, so this runs a nested `cargo build` of the
//! crate. It gets a target directory of its own under `OUT_DIR`: the outer build holds the
//! lock of its own build directory while build scripts run, and a nested build waiting for
//! that lock would wait for ever. The nested build uses the outer one's profile (release or
//! debug, the workspace's settings for the crate), target triple and jobserver.
//!
//! Where the library cannot be built (a target other than x86_64 Linux, whose instructions
//! it uses; a source tree without the `alloc-preload` directory) an empty file is embedded
//! and `record --alloc` says that this binary carries no library.
//!
//! It carries the CUPTI library (`libpyrometer_cupti.so`, C in `gpu-inject/c/`) the same way,
//! built here with gcc against the CUDA headers of NVIDIA's wheels: `$PYROMETER_CUDA_INCLUDE`,
//! else `target/cuda-headers/include` (what `cargo xtask cuda-headers` makes). Without them
//! an empty file is embedded, a cargo warning says how to get them, and `record --gpu-kernels`
//! says in one line what is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

const LIBRARY: &str = "libpyrometer_alloc.so";

fn main() {
    let manifest_dir = PathBuf::from(var("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(var("OUT_DIR"));
    let crate_dir = manifest_dir.join("../alloc-preload");
    let embedded = out_dir.join(LIBRARY);
    for path in [
        crate_dir.join("src"),
        crate_dir.join("Cargo.toml"),
        // The workspace's profiles for the crate, and its locked dependencies.
        manifest_dir.join("../Cargo.toml"),
        manifest_dir.join("../Cargo.lock"),
    ] {
        println!("cargo::rerun-if-changed={}", path.display());
    }

    let supported =
        var("CARGO_CFG_TARGET_ARCH") == "x86_64" && var("CARGO_CFG_TARGET_OS") == "linux";
    let bytes = if supported && crate_dir.join("Cargo.toml").is_file() {
        let built = build(&crate_dir, &out_dir.join("alloc-preload"));
        std::fs::read(&built).unwrap_or_else(|e| panic!("read {}: {e}", built.display()))
    } else {
        println!(
            "cargo::warning=this pyrometer carries no allocation sampler library (it is built for x86_64 Linux only): record --alloc needs --alloc-uprobes or PYROMETER_ALLOC_LIB"
        );
        Vec::new()
    };
    write_if_changed(&embedded, &bytes);
    println!(
        "cargo::rustc-env=PYROMETER_ALLOC_HASH={:016x}",
        fnv1a(&bytes)
    );

    let cupti = match cuda_include(&manifest_dir) {
        Some(include) if supported => {
            build_cupti(&manifest_dir.join("../gpu-inject/c"), &include, &out_dir)
        }
        Some(_) => Vec::new(),
        None => {
            println!(
                "cargo::warning=CUDA headers not found (target/cuda-headers/include or $PYROMETER_CUDA_INCLUDE): this pyrometer carries no libpyrometer_cupti.so and record --gpu-kernels is unavailable; run `cargo xtask cuda-headers` and build again"
            );
            Vec::new()
        }
    };
    write_if_changed(&out_dir.join(CUPTI_LIBRARY), &cupti);
    println!(
        "cargo::rustc-env=PYROMETER_CUPTI_HASH={:016x}",
        fnv1a(&cupti)
    );
}

const CUPTI_LIBRARY: &str = "libpyrometer_cupti.so";

/// The include directory holding cupti.h, and a watch on where it would appear: a build made
/// before `cargo xtask cuda-headers` picks the headers up once they are there.
fn cuda_include(manifest_dir: &Path) -> Option<PathBuf> {
    println!("cargo::rerun-if-env-changed=PYROMETER_CUDA_INCLUDE");
    if let Some(dir) = std::env::var_os("PYROMETER_CUDA_INCLUDE") {
        let dir = PathBuf::from(dir);
        println!("cargo::rerun-if-changed={}", dir.display());
        return dir.join("cupti.h").is_file().then_some(dir);
    }
    let headers = manifest_dir.join("../target/cuda-headers");
    // Watched as a directory that exists: cargo reruns a build script for every build while a
    // watched path is missing (and rebuilds what depends on it).
    let _ = std::fs::create_dir_all(&headers);
    println!("cargo::rerun-if-changed={}", headers.display());
    let include = headers.join("include");
    include.join("cupti.h").is_file().then_some(include)
}

/// Compiles every C file of `c_dir` into the CUPTI library; returns its bytes.
fn build_cupti(c_dir: &Path, include: &Path, out_dir: &Path) -> Vec<u8> {
    println!("cargo::rerun-if-changed={}", c_dir.display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(c_dir)
        .unwrap_or_else(|e| panic!("{}: {e}", c_dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "c"))
        .collect();
    // A fixed order: the same sources make the same bytes.
    sources.sort();
    let lib = out_dir.join("cupti-build").join(CUPTI_LIBRARY);
    std::fs::create_dir_all(lib.parent().expect("a parent"))
        .unwrap_or_else(|e| panic!("{}: {e}", out_dir.display()));
    let status = Command::new("gcc")
        .args([
            "-O2",
            "-g",
            "-std=gnu11",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-pthread",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wl,--build-id",
            "-Wl,-z,defs",
        ])
        .arg("-I")
        .arg(c_dir)
        .arg("-isystem")
        .arg(include)
        .args(&sources)
        .arg("-o")
        .arg(&lib)
        .args(["-ldl", "-lm"])
        .status()
        .unwrap_or_else(|e| panic!("cannot run gcc: {e} (is gcc installed?)"));
    assert!(
        status.success(),
        "gcc failed to build {CUPTI_LIBRARY}: {status}"
    );
    std::fs::read(&lib).unwrap_or_else(|e| panic!("read {}: {e}", lib.display()))
}

/// Runs the nested build into `target_dir`; returns the library's path.
fn build(crate_dir: &Path, target_dir: &Path) -> PathBuf {
    let target = var("TARGET");
    let release = var("PROFILE") == "release";
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(crate_dir.join("Cargo.toml"))
        .args(["--lib", "--locked", "--color", "never", "--target", &target])
        .arg("--target-dir")
        .arg(target_dir)
        // A build directory set in the user's configuration would be the outer build's
        // too, and with it its lock: the nested build keeps everything in its own.
        .env("CARGO_BUILD_BUILD_DIR", target_dir)
        // Under `cargo clippy` this names clippy-driver: the library is built, not linted
        // (the workspace's clippy run lints it).
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR");
    if release {
        cmd.arg("--release");
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo for {}: {e}", crate_dir.display()));
    assert!(
        status.success(),
        "building {} failed ({status}): see the errors above",
        crate_dir.display()
    );
    target_dir
        .join(&target)
        .join(if release { "release" } else { "debug" })
        .join(LIBRARY)
}

/// Leaves the file alone when it already holds `bytes`, so an unchanged library does not
/// make the crate compile again.
fn write_if_changed(path: &Path, bytes: &[u8]) {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return;
    }
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// FNV-1a, 64 bits: names the library's cache directory (the content itself is compared
/// when a cached copy is reused, so this need not resist collisions made on purpose).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by cargo for build scripts"))
}
