//! What the kernel says about a thread: its name, scheduler state and, when it sleeps, the
//! system call it sleeps in. Combined with the GIL state this gives `dump`'s thread states.

use std::path::Path;

use crate::os::proctext;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
/// What a thread of a dumped process is doing, from its `/proc` state and wait channel.
pub enum ThreadState {
    /// On a CPU or runnable (`R`).
    Running,
    /// Sleeping in a futex wait on the GIL's own mutex or condition variable.
    WaitingForGil,
    /// Sleeping for anything else: a lock, I/O, `time.sleep`, a join.
    Blocked,
    /// Stopped by a signal or a tracer (`T`, `t`).
    Stopped,
    /// Gone, or the state could not be read.
    Unknown,
}

impl ThreadState {
    /// The state as `dump` prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            ThreadState::Running => "running",
            ThreadState::WaitingForGil => "waiting for GIL",
            ThreadState::Blocked => "blocked",
            ThreadState::Stopped => "stopped",
            ThreadState::Unknown => "unknown",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OsThread {
    pub name: Option<String>,
    pub state: ThreadState,
    /// For a sleeping thread: the system call (and futex address) it sleeps in.
    pub reason: Option<String>,
}

const SYS_FUTEX: u64 = 202;

/// x86_64 system calls a blocked Python thread is commonly found in.
fn syscall_name(nr: u64) -> Option<&'static str> {
    Some(match nr {
        0 => "read",
        1 => "write",
        7 => "poll",
        23 => "select",
        35 => "nanosleep",
        43 => "accept",
        45 => "recvfrom",
        47 => "recvmsg",
        61 => "wait4",
        202 => "futex",
        230 => "clock_nanosleep",
        232 => "epoll_wait",
        270 => "pselect6",
        271 => "ppoll",
        281 => "epoll_pwait",
        288 => "accept4",
        _ => return None,
    })
}

/// Reads `/proc/PID/task/TID/{comm,stat,syscall}`. `gil` is the GIL state's address range:
/// a futex wait inside it is a wait for the GIL (take_gil waits on `gil->cond` or
/// `gil->mutex`, both inside the struct), any other sleep is "blocked".
pub fn os_thread(proc_root: &Path, pid: u32, tid: u32, gil: Option<(u64, u64)>) -> OsThread {
    let dir = proc_root
        .join(pid.to_string())
        .join("task")
        .join(tid.to_string());
    let name = proctext::read(&dir.join("comm"), proctext::TEXT_CAP)
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string());
    let sched = proctext::read(&dir.join("stat"), proctext::TEXT_CAP)
        .ok()
        .and_then(|s| parse_stat_state(&s));
    let (state, reason) = match sched {
        Some('R') => (ThreadState::Running, None),
        Some('T' | 't') => (ThreadState::Stopped, None),
        Some('S' | 'D' | 'I') => {
            // Needs the same access as process_vm_readv; without it the sleep is unexplained.
            let syscall = proctext::read(&dir.join("syscall"), proctext::TEXT_CAP).ok();
            classify_sleep(syscall.as_deref(), gil)
        }
        _ => (ThreadState::Unknown, None),
    };
    OsThread {
        name,
        state,
        reason,
    }
}

/// The state letter of a `stat` line; the comm in parentheses may itself hold `)`.
pub fn parse_stat_state(stat: &str) -> Option<char> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().next()?.chars().next()
}

/// `/proc/.../syscall` is `NR ARG1 ... SP PC` for a sleeping thread, `running` otherwise.
pub fn classify_sleep(
    syscall: Option<&str>,
    gil: Option<(u64, u64)>,
) -> (ThreadState, Option<String>) {
    let Some(line) = syscall else {
        return (ThreadState::Blocked, None);
    };
    let mut fields = line.split_whitespace();
    let Some(nr) = fields.next().and_then(|n| n.parse::<u64>().ok()) else {
        return (ThreadState::Blocked, None);
    };
    let arg0 = fields
        .next()
        .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok());
    if nr == SYS_FUTEX {
        if let (Some(addr), Some((gil, size))) = (arg0, gil)
            && gil <= addr
            && addr < gil + size
        {
            return (ThreadState::WaitingForGil, Some("futex on the GIL".into()));
        }
        let reason = match arg0 {
            Some(addr) => format!("futex wait at {addr:#x} (a lock, condition or join)"),
            None => "futex wait".into(),
        };
        return (ThreadState::Blocked, Some(reason));
    }
    let reason = syscall_name(nr).map_or_else(|| format!("syscall {nr}"), str::to_string);
    (ThreadState::Blocked, Some(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_state() {
        assert_eq!(parse_stat_state("12 (py (x) y) S 1 2 3"), Some('S'));
        assert_eq!(parse_stat_state("12 (python3) R 1"), Some('R'));
        assert_eq!(parse_stat_state("garbage"), None);
    }

    #[test]
    fn sleeps() {
        let gil = Some((0x1000, 208));
        let (s, _) = classify_sleep(Some("202 0x1020 0x189 0x0 0x0 0x0 0x0 0x7ffd 0x7f"), gil);
        assert_eq!(s, ThreadState::WaitingForGil);
        let (s, r) = classify_sleep(Some("202 0x5000 0x189 0x0 0x0 0x0 0x0 0x7ffd 0x7f"), gil);
        assert_eq!(s, ThreadState::Blocked);
        assert!(r.unwrap().contains("futex wait at 0x5000"));
        let (s, r) = classify_sleep(Some("230 0x1 0x0 0x0 0x0 0x0 0x0 0x7ffd 0x7f"), gil);
        assert_eq!(
            (s, r.as_deref()),
            (ThreadState::Blocked, Some("clock_nanosleep"))
        );
        assert_eq!(classify_sleep(Some("running"), gil).0, ThreadState::Blocked);
        assert_eq!(classify_sleep(None, None).0, ThreadState::Blocked);
    }
}
