//! Whether the capabilities the agent keeps once attached still let it open a uprobe perf
//! event. Some kernels (6.18 among them) refuse a uprobe to a process holding CAP_PERFMON
//! but not CAP_SYS_ADMIN; the agent attaches uprobes to processes and library copies it
//! sees only after the drop, so it asks the running kernel before dropping: a forked child
//! drops exactly as the agent will and opens one uprobe on its own executable.

use super::perf::{PerfAttr, perf_event_open};
use super::privileges::{self, Capability};
use std::ffi::CString;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("fork: {0}")]
    Fork(std::io::Error),
    #[error("waitpid: {0}")]
    Wait(std::io::Error),
    #[error("the checking child could not drop its privileges (status {0})")]
    Child(i32),
}

/// The child's exit statuses.
const OPENED: i32 = 0;
const REFUSED: i32 = 1;
const DROP_FAILED: i32 = 2;
/// No uprobe PMU or some other error than a refusal: nothing a capability would change.
const UNSUPPORTED: i32 = 3;

/// True when, after becoming `run_as` with only `keep`, this kernel refuses a uprobe perf
/// event with EACCES or EPERM. Must run while the process has one thread (as the drop
/// itself must), so that the forked child can allocate and drop safely.
pub fn refused_after_drop(
    run_as: Option<(u32, u32)>,
    keep: &[Capability],
) -> Result<bool, ProbeError> {
    // Read before the fork: the child only drops and makes the one system call.
    let pmu_type = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    let Some(pmu_type) = pmu_type else {
        return Ok(false);
    };
    let path = CString::new("/proc/self/exe").expect("no NUL in a literal");
    // SAFETY: fork of a process with one thread; the child only drops its privileges, makes
    // one perf_event_open and leaves through _exit, running no destructors of the parent's
    // state.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(ProbeError::Fork(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        let status = child(run_as, keep, pmu_type, &path);
        // SAFETY: leaving the child without unwinding into the parent's code.
        unsafe { libc::_exit(status) };
    }
    let mut status = 0;
    loop {
        // SAFETY: waitpid on the child just forked, into a local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(ProbeError::Wait(err));
        }
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    match code {
        OPENED | UNSUPPORTED => Ok(false),
        REFUSED => Ok(true),
        other => Err(ProbeError::Child(other)),
    }
}

fn child(run_as: Option<(u32, u32)>, keep: &[Capability], pmu_type: u32, path: &CString) -> i32 {
    if let Some((uid, gid)) = run_as
        && privileges::become_user(uid, gid).is_err()
    {
        return DROP_FAILED;
    }
    if privileges::drop_all_but(keep).is_err() {
        return DROP_FAILED;
    }
    // The attributes aya gives a uprobe: the PMU's type, the path in config1, the offset in
    // config2, one process. Offset 0 is the ELF header, in no executable mapping, so nothing
    // is written into this short-lived process either.
    let attr = PerfAttr {
        config1: path.as_ptr() as u64,
        ..PerfAttr::new(pmu_type)
    };
    // The path outlives the call; this process.
    // SAFETY: getpid has no preconditions.
    let fd = perf_event_open(&attr, unsafe { libc::getpid() });
    if fd >= 0 {
        return OPENED;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => REFUSED,
        _ => UNSUPPORTED,
    }
}
