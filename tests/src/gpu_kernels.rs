//! The GPU-kernel tests' set-up: the CUPTI stand-in (fixtures/cupti_standin.c), the workload
//! that plays a training step on it (fixtures/gpu_phases.py with fixtures/gpuwork.c) and the
//! injection library `record --gpu-kernels` uses (libpyrometer_cupti.so, carried inside
//! `pyrometer` and written out by `pyrometer install-preload --gpu`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::{fixture, pyrometer_bin};

/// What the GPU-kernel tests run with.
pub struct Standin {
    /// The directory holding the stand-in `libcupti.so.13` (CUPTI 13.5).
    pub cupti: PathBuf,
    /// The same as CUPTI 13.0: no `_v2` API, no timestamp callback.
    pub cupti_old: PathBuf,
    /// `libpyrometer_cupti.so`.
    pub library: PathBuf,
    /// The real libcupti of NVIDIA's wheel (loads without a driver, starts nothing).
    pub real_cupti: PathBuf,
}

/// The stand-in and the library, or None after printing why the calling test skips (the CUDA
/// headers were not fetched, so neither was built). A `pyrometer` that carries no library where
/// the headers are there is a set-up error, not a skip.
pub fn standin() -> Option<Standin> {
    let dir = env!("CUPTI_STANDIN");
    if dir.is_empty() {
        crate::skip(
            "cuda-headers",
            "the CUDA headers were not fetched, so the CUPTI stand-in and \
             libpyrometer_cupti.so were not built (run `cargo xtask cuda-headers`)",
        );
        return None;
    }
    let library = install_gpu_library(&crate::scratch("gpu-library"));
    let headers = Path::new(env!("CUDA_HEADERS"));
    Some(Standin {
        cupti: PathBuf::from(dir),
        cupti_old: Path::new(dir).with_file_name("cupti-standin-old"),
        library,
        real_cupti: headers.join("../lib/libcupti.so.13"),
    })
}

/// `pyrometer install-preload --gpu DIR`: the CUPTI library the built `pyrometer` carries,
/// written into `dir`; its path (which the command prints).
pub fn install_gpu_library(dir: &Path) -> PathBuf {
    let out = Command::new(pyrometer_bin())
        .args(["install-preload", "--gpu"])
        .arg(dir)
        .output()
        .expect("run pyrometer");
    crate::assert_ok(&out);
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert_eq!(path, dir.join("libpyrometer_cupti.so"));
    path
}

impl Standin {
    /// `python3 fixtures/gpu_phases.py ARGS` with the library injected (CUDA and NVTX) and `env`
    /// on top; `cupti` is the stand-in directory to load.
    pub fn workload(&self, cupti: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(python());
        cmd.arg(crate::python::source("gpu_phases.py"))
            .args(args)
            .env("GPUWORK_LIB", fixture("libgpuwork.so"))
            .env("LD_LIBRARY_PATH", cupti)
            .env("CUDA_INJECTION64_PATH", &self.library)
            .env("NVTX_INJECTION64_PATH", &self.library)
            .env_remove("PYROMETER_GPU_SAMPLE_EVERY")
            .env_remove("PYROMETER_GPU_DUMP")
            .env_remove("PYROMETER_CUPTI_LIB");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }
}

/// Runs `cmd`, panicking with its stderr unless it succeeded.
pub fn succeed(mut cmd: Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The workload's ground truth (its last stdout line): per phase, launches and device ns.
pub fn truth(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!(
            "workload printed no truth ({e}): stdout {text} stderr {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The interpreter the workload runs on: pyenv's shared 3.11 (symbols for the Python walk).
pub fn python() -> PathBuf {
    crate::python::pyenv("3.11.7")
}
