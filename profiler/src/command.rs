//! What the commands (`record`, `top`, the agent) share with the command line: their one
//! error type, which says which exit code it is, and the option values and defaults that
//! reach into the kernel side.

use std::time::Duration;

/// Why a command could not run, in one line a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The request is wrong: an option, a target, a file (exit code 2).
    #[error("{0}")]
    Input(String),
    /// Privileges or kernel support are missing (exit code 3).
    #[error("{0}")]
    Kernel(String),
}

/// The privileges sampling needs (root, or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE), or the
/// one line that says which are missing.
pub(crate) fn check_sampling_privileges() -> Result<(), CommandError> {
    use crate::os::privileges;
    privileges::check(privileges::SAMPLING, privileges::effective())
        .map_err(|e| CommandError::Kernel(e.to_string()))
}

/// Makes SIGINT and SIGTERM end a command's loop instead of the process: the first thing a
/// command does, so a signal during start-up stops it cleanly.
pub fn install_signal_handlers() {
    crate::os::signals::install();
}

/// Whether SIGINT or SIGTERM came since the last call (after [`install_signal_handlers`]).
pub fn signal_received() -> bool {
    crate::os::signals::take().is_some()
}

/// `--off-cpu-min`'s default (record and agent): long enough that a thread blocking for
/// microseconds at a high rate sends nothing, short enough to catch a 1 ms I/O wait.
pub const DEFAULT_OFF_CPU_MIN: Duration = crate::bpf::DEFAULT_OFF_CPU_MIN;

/// `--alloc-sample-bytes`'s default: mean bytes between allocation samples.
pub const DEFAULT_ALLOC_SAMPLE_BYTES: u64 = crate::bpf::DEFAULT_ALLOC_SAMPLE_BYTES;

/// `--alloc-live`'s default: sampled blocks tracked at once for their free.
pub const DEFAULT_ALLOC_LIVE: u32 = crate::bpf::DEFAULT_ALLOC_LIVE;

/// Directories searched for separate debug files besides those given.
pub const DEFAULT_DEBUG_DIRS: &[&str] = crate::symbolize::DEFAULT_DEBUG_DIRS;

/// Debug files fetched by build id from debuginfod servers: the settings `record` and the
/// agent take, and the counts they report.
pub mod debuginfod {
    pub use crate::symbolize::debuginfod::{
        DEFAULT_CACHE_MAX_BYTES, DEFAULT_LIMITS, DebuginfodConfig, DebuginfodStats, Limits,
        parse_urls,
    };
}

/// `--debug-reject` names (dwarf, off_cpu, gil, alloc, sampler) as `debug_reject` bits: the
/// kernel then refuses those stages, which is how the degraded paths are tested.
pub fn debug_reject_bits(names: &[String]) -> Result<u32, CommandError> {
    names.iter().try_fold(0, |bits, name| {
        if name == "sampler" {
            return Ok(bits | pyrometer_ebpf::REJECT_SAMPLER);
        }
        crate::bpf::Feature::from_key(name)
            .map(|f| bits | f.reject_bit())
            .ok_or_else(|| {
                CommandError::Input(format!(
                    "--debug-reject {name}: expected dwarf, off_cpu, gil, alloc or sampler"
                ))
            })
    })
}
