//! `install-preload`: the allocation sampler library this `pyrometer` carries
//! (`libpyrometer_alloc.so`), written into a directory of the user's choosing, for set-ups
//! that preload it from a file of their own (a systemd unit, a container image, Ray
//! workers). A process started with it in `LD_PRELOAD` samples its allocations in process;
//! `record --alloc` and the agent probe the copy installed next to `pyrometer`. With `--gpu`
//! it writes the CUPTI library of `--gpu-kernels` (`libpyrometer_cupti.so`) instead, for
//! `CUDA_INJECTION64_PATH`.

use std::path::{Path, PathBuf};

use crate::command::CommandError;

/// Writes the carried library as `dir/libpyrometer_alloc.so` and returns its path. `dir` is
/// made (0755) when missing; an existing copy is replaced whole, never rewritten in place, so
/// processes that map it keep running. An input error when this build carries no library or
/// `dir` cannot be written.
pub fn install(dir: &Path) -> Result<PathBuf, CommandError> {
    crate::alloc::embedded::ALLOC
        .install(dir)
        .map_err(|e| CommandError::Input(e.to_string()))
}

/// Writes the carried CUPTI library as `dir/libpyrometer_cupti.so` and returns its path, as
/// [`install`] does the allocation sampler.
pub fn install_gpu(dir: &Path) -> Result<PathBuf, CommandError> {
    crate::alloc::embedded::CUPTI
        .install(dir)
        .map_err(|e| CommandError::Input(e.to_string()))
}
