//! The GPU library (`libpyrometer_cupti.so`, C in `gpu-inject/c/`, carried inside `pyrometer`):
//! where it is, how a command gets it (CUDA's and NVTX's injection variables), which processes
//! have it mapped, and the two probes on each copy of it (`gpu_launch`, `gpu_channel` in `ebpf/src/bpf/gpu.h`), attached
//! once per copy for every process: its functions run only in processes that load it.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::bpf::{GPU_CHANNEL, GPU_LAUNCH, ProbedCopies, Uprobes};
use crate::os::procs::{BinaryKey, Process};

pub use crate::capture::gpu::LIBRARY;
/// Overrides where `pyrometer` looks for the library.
pub const LIBRARY_ENV: &str = "PYROMETER_CUPTI_INJECT";
/// CUDA's injection variable: the driver loads the library it names at `cuInit`.
pub const CUDA_INJECTION_ENV: &str = "CUDA_INJECTION64_PATH";
/// NVTX's: the first NVTX call loads the library it names (the ranges become a label).
pub const NVTX_INJECTION_ENV: &str = "NVTX_INJECTION64_PATH";
/// The library's 1-in-N (256 when unset: gpu-inject/c/common.h).
pub const SAMPLE_EVERY_ENV: &str = "PYROMETER_GPU_SAMPLE_EVERY";

const LAUNCH_FN: &str = "pyrometer_gpu_launch";
const CHANNEL_FN: &str = "pyrometer_gpu_channel";

/// The library this `pyrometer` hands to processes: `$PYROMETER_CUPTI_INJECT` when set (a copy
/// a process in a container sees at that path), else an installed copy (next to the
/// executable, or `../lib/pyrometer/` from it, as `install-preload --gpu` writes it), else the
/// copy it carries, written to its cache directory. The error is one line saying what is
/// missing.
pub fn library() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "${LIBRARY_ENV} names {}, which is not a file",
                p.display()
            ))
        };
    }
    if let Some(p) = crate::os::elfsyms::shipped_library(LIBRARY, LIBRARY_ENV) {
        return Ok(p);
    }
    crate::alloc::embedded::CUPTI
        .cached()
        .map_err(|e| e.to_string())
}

/// What a command started with the library gets in its environment: CUDA's injection variable,
/// and NVTX's unless the environment names another NVTX tool already (which then keeps it: the
/// second value says so). `sample_every` sets the library's N.
pub fn command_env(
    library: &Path,
    sample_every: Option<u32>,
    existing_nvtx: Option<OsString>,
) -> (Vec<(&'static str, OsString)>, Option<OsString>) {
    let mut env = vec![(CUDA_INJECTION_ENV, library.as_os_str().to_os_string())];
    let kept = existing_nvtx.filter(|v| !v.is_empty() && v != library.as_os_str());
    if kept.is_none() {
        env.push((NVTX_INJECTION_ENV, library.as_os_str().to_os_string()));
    }
    if let Some(n) = sample_every {
        env.push((SAMPLE_EVERY_ENV, n.to_string().into()));
    }
    (env, kept)
}

/// The file offsets of the library's marker functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOffsets {
    pub launch: u64,
    pub channel: u64,
}

/// Finds the marker functions in the library at `path`.
pub fn probe_offsets(path: &Path) -> Result<ProbeOffsets, String> {
    let found = crate::os::elfsyms::exported_offsets(path, &[LAUNCH_FN, CHANNEL_FN])?;
    let need = |i: usize, name: &str| {
        found[i].ok_or_else(|| {
            format!(
                "{}: no {name} (not pyrometer's GPU library?)",
                path.display()
            )
        })
    };
    Ok(ProbeOffsets {
        launch: need(0, LAUNCH_FN)?,
        channel: need(1, CHANNEL_FN)?,
    })
}

/// The copy of the library `process` maps, if any (the path as this process reaches it).
pub fn mapped_library(process: &Process) -> Option<(BinaryKey, PathBuf)> {
    process.mapped_file(LIBRARY)
}

/// The probes on each copy of the library attached so far.
#[derive(Default)]
pub struct GpuProbes {
    copies: ProbedCopies,
}

impl GpuProbes {
    /// Attaches both probes to the library at `path` (identified by `key`) unless they are on
    /// it already.
    pub fn attach(
        &mut self,
        key: BinaryKey,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        self.copies.attach(key, path, probes, attach_probes)
    }

    /// Attaches to the library file at `path` before any process maps it (a command about to
    /// start with it, the agent's own copy): a uprobe sits on the file, so every process that
    /// loads it later is seen from its first launch.
    pub fn attach_file(
        &mut self,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        self.copies.attach_file(path, probes, attach_probes)
    }

    /// Attaches to the copy `process` maps, if it maps one.
    pub fn attach_mapped(
        &mut self,
        process: &Process,
        probes: &mut (dyn Uprobes + '_),
    ) -> Option<Result<(), String>> {
        let (key, path) = mapped_library(process)?;
        Some(self.attach(key, &path, probes))
    }
}

/// The launch and channel probes on one copy.
fn attach_probes(path: &Path, probes: &mut (dyn Uprobes + '_)) -> Result<(), String> {
    let offsets = probe_offsets(path)?;
    probes
        .attach_uprobe(GPU_LAUNCH, path, offsets.launch)
        .and_then(|()| probes.attach_uprobe(GPU_CHANNEL, path, offsets.channel))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_gets_both_injections_unless_nvtx_is_taken() {
        let lib = Path::new("/opt/p/libpyrometer_cupti.so");
        let (env, kept) = command_env(lib, Some(8), None);
        let names: Vec<&str> = env.iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [CUDA_INJECTION_ENV, NVTX_INJECTION_ENV, SAMPLE_EVERY_ENV]
        );
        assert_eq!(env[2].1, "8");
        assert!(kept.is_none());
        let (env, kept) = command_env(lib, None, Some("/opt/nsys/libToolsInjection64.so".into()));
        assert_eq!(env.len(), 1);
        assert_eq!(
            kept.as_deref(),
            Some(std::ffi::OsStr::new("/opt/nsys/libToolsInjection64.so"))
        );
    }
}
