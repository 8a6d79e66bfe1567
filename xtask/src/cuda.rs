//! `cargo xtask cuda-headers`: the CUDA headers the GPU-kernel library (`gpu-inject/c/`) and its
//! stand-in libcupti (`tests/fixtures/cupti_standin.c`) build against, from NVIDIA's wheels on
//! the Python registry (CUPTI, the runtime, the runtime's `crt/` and NVTX), pinned. No CUDA
//! toolkit and no GPU are needed: the wheels are zip files whose `nvidia/cu13/include/` is
//! unpacked into `target/cuda-headers/include`, beside the real `libcupti.so.13` (in `lib/`,
//! which the tests load to check that the library stands aside, unharmed, where CUPTI cannot
//! start). `target/cuda-headers/made` records the pins it was made with; the build scripts
//! watch the directory, so a build after this picks the headers up.
//!
//! The wheels are not fetched by a build script: `cargo build` stays offline, and builds
//! without the library (saying so) where the headers are missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The wheels, pinned: one CUDA release (13.5), whose CUPTI has the subscriber-aware
/// (`_v2`) API the library prefers when the process's own libcupti has it too.
pub const WHEELS: &[&str] = &[
    "nvidia-cuda-cupti==13.5.25",
    "nvidia-cuda-runtime==13.5.37",
    "nvidia-cuda-crt==13.5.37",
    "nvidia-nvtx==13.5.25",
];

/// What the wheels hold under this prefix is unpacked (`include/...`, `lib/...`).
const PREFIX: &str = "nvidia/cu13/";

/// `target/cuda-headers`.
pub fn dir(root: &Path) -> PathBuf {
    root.join("target/cuda-headers")
}

/// Fetches and unpacks the headers unless the pinned ones are there; returns the include
/// directory. A failure is said and returned.
pub fn ensure(root: &Path) -> Result<PathBuf> {
    let dir = dir(root);
    let made = dir.join("made");
    let want = WHEELS.join(" ");
    let include = dir.join("include");
    if std::fs::read_to_string(&made).is_ok_and(|m| m == want) && include.join("cupti.h").exists() {
        return Ok(include);
    }
    let wheels = root.join("target/cuda-wheels");
    let _ = std::fs::remove_dir_all(&wheels);
    std::fs::create_dir_all(&wheels)?;
    let python = crate::pyenv_python();
    crate::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
            ])
            .arg(&wheels)
            .args(WHEELS),
    )
    .context("downloading the CUDA header wheels")?;
    // Unpacked beside the old tree, then swapped in: a failed run leaves no half tree that a
    // build would take for the headers.
    let fresh = root.join("target/cuda-headers.new");
    let _ = std::fs::remove_dir_all(&fresh);
    std::fs::create_dir_all(&fresh)?;
    crate::run(
        Command::new(&python)
            .arg("-c")
            .arg(UNPACK)
            .arg(&wheels)
            .arg(&fresh)
            .arg(PREFIX),
    )
    .context("unpacking the CUDA header wheels")?;
    if !fresh.join("include/cupti.h").exists() || !fresh.join("include/cuda.h").exists() {
        bail!(
            "the wheels in {} hold no cupti.h/cuda.h under {PREFIX}include",
            wheels.display()
        );
    }
    std::fs::write(fresh.join("made"), &want)?;
    // The directory itself stays (the build scripts watch it); only its contents change.
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    for entry in std::fs::read_dir(&fresh)? {
        let entry = entry?;
        std::fs::rename(entry.path(), dir.join(entry.file_name()))?;
    }
    std::fs::remove_dir(&fresh)?;
    let _ = std::fs::remove_dir_all(&wheels);
    Ok(include)
}

/// Unpacks every wheel in argv[1] into argv[2], keeping what lies under the prefix argv[3]
/// (without it): members are checked to stay inside the destination.
const UNPACK: &str = r#"
import os, sys, zipfile
src, dest, prefix = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
for name in sorted(os.listdir(src)):
    if not name.endswith(".whl"):
        continue
    with zipfile.ZipFile(os.path.join(src, name)) as z:
        for m in z.infolist():
            if m.is_dir() or not m.filename.startswith(prefix):
                continue
            rel = m.filename[len(prefix):]
            if not (rel.startswith("include/") or rel.startswith("lib/libcupti.so")):
                continue
            out = os.path.realpath(os.path.join(dest, rel))
            if not out.startswith(dest + os.sep):
                sys.exit("refusing " + m.filename)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(m) as f, open(out, "wb") as o:
                o.write(f.read())
"#;
