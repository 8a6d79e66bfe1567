//! Which processes to look at for `--comm` and `--alloc-comm`. Reading every process's name
//! twice a second cost as much CPU as the rest of the agent on a quiet node; with the kernel's
//! process events (the proc connector) only the processes that started, exec'd or renamed
//! themselves since the last look are read, and the others never again. Where the events
//! cannot be had (no CAP_NET_ADMIN, a network namespace of its own) or the kernel dropped
//! some, every process is read, as before.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::os::procevents::{ProcEvent, ProcEvents, ProcEventsError};

/// How often every process is read without events.
pub const SCAN_EVERY: Duration = Duration::from_millis(500);

/// The kernel's process events for finding processes by name. When they cannot be had, the
/// error says so and that every process's name is read twice a second instead.
pub fn open_events() -> Result<ProcEvents, EventsUnavailable> {
    ProcEvents::open().map_err(|source| EventsUnavailable { source })
}

/// Why discovery falls back to scans.
#[derive(Debug, thiserror::Error)]
#[error(
    "{source}; finding processes by name by reading every process's name every {ms} ms instead",
    ms = SCAN_EVERY.as_millis()
)]
pub struct EventsUnavailable {
    source: ProcEventsError,
}

/// What to look at now.
#[derive(Debug, PartialEq, Eq)]
pub enum Due {
    Nothing,
    /// Every process.
    All,
    /// These processes (sorted, no repeats).
    These(Vec<u32>),
}

pub struct Discovery {
    events: Option<ProcEvents>,
    /// Processes that started, exec'd or renamed themselves since the last look.
    pending: HashSet<u32>,
    /// When every process was last read (None: never).
    last_scan: Option<Instant>,
    /// The kernel dropped events: read every process.
    lost: bool,
    /// Times events were lost, for /metrics.
    pub overflows: u64,
    scratch: Vec<ProcEvent>,
}

impl Discovery {
    /// `events`: the subscription, when it could be had.
    pub fn new(events: Option<ProcEvents>) -> Self {
        Self {
            events,
            pending: HashSet::new(),
            last_scan: None,
            lost: false,
            overflows: 0,
            scratch: Vec::new(),
        }
    }

    /// Whether the kernel's events drive discovery (else it scans).
    pub fn event_driven(&self) -> bool {
        self.events.is_some()
    }

    /// What to look at now; the processes that exited since the last call are added to
    /// `exited` (their pids may come back as other processes).
    pub fn due(&mut self, exited: &mut Vec<u32>) -> Due {
        let Some(events) = self.events.as_mut() else {
            return self.scan_if_due();
        };
        self.scratch.clear();
        if !events.drain(&mut self.scratch) {
            self.overflows += 1;
            self.lost = true;
        }
        for e in self.scratch.drain(..) {
            match e {
                // A new process has its parent's (thread's) name until it execs.
                ProcEvent::Fork {
                    child_pid,
                    child_tgid,
                    ..
                } if child_pid == child_tgid => {
                    self.pending.insert(child_tgid);
                }
                ProcEvent::Exec { tgid } => {
                    self.pending.insert(tgid);
                }
                // /proc/PID/comm is the main thread's name.
                ProcEvent::Comm { pid, tgid } if pid == tgid => {
                    self.pending.insert(tgid);
                }
                ProcEvent::Exit { pid, tgid } if pid == tgid => {
                    self.pending.remove(&tgid);
                    exited.push(tgid);
                }
                _ => {}
            }
        }
        if self.last_scan.is_none() || self.lost {
            self.lost = false;
            self.pending.clear();
            self.last_scan = Some(Instant::now());
            return Due::All;
        }
        if self.pending.is_empty() {
            return Due::Nothing;
        }
        let mut pids: Vec<u32> = self.pending.drain().collect();
        pids.sort_unstable();
        Due::These(pids)
    }

    fn scan_if_due(&mut self) -> Due {
        if self.last_scan.is_some_and(|t| t.elapsed() < SCAN_EVERY) {
            return Due::Nothing;
        }
        self.last_scan = Some(Instant::now());
        Due::All
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_events_every_process_is_read_twice_a_second() {
        let mut d = Discovery::new(None);
        let mut exited = Vec::new();
        assert_eq!(d.due(&mut exited), Due::All);
        assert_eq!(d.due(&mut exited), Due::Nothing);
        d.last_scan = Some(Instant::now() - SCAN_EVERY);
        assert_eq!(d.due(&mut exited), Due::All);
    }

    #[test]
    fn with_events_only_new_processes_are_read() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            skip_ledger::skip(
                "root",
                "subscribing to process events needs root (CAP_NET_ADMIN)",
            );
            return;
        }
        let mut d = Discovery::new(Some(ProcEvents::open().expect("as root")));
        let mut exited = Vec::new();
        assert_eq!(d.due(&mut exited), Due::All, "everything once at the start");
        let mut child = std::process::Command::new("/bin/sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        // Other processes of a busy machine come and go too: wait for this one.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut found = false;
        while !found && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            match d.due(&mut exited) {
                Due::These(pids) => found = pids.contains(&pid),
                Due::All => panic!("no events lost on a 4 MiB buffer in 50 ms"),
                Due::Nothing => {}
            }
        }
        assert!(found, "the new process {pid} is due");
        child.kill().unwrap();
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !exited.contains(&pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            d.due(&mut exited);
        }
        assert!(exited.contains(&pid), "its exit is reported");
    }
}
