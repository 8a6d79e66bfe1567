//! Per-thread time spent runnable but not running (the scheduler's run-queue delay), read in
//! user space from `/proc/PID/task/TID/schedstat` while recording. On a busy machine a Python
//! thread that holds the GIL may sit preempted, and a thread handed the GIL waits for a CPU
//! before it runs: that time is neither the program holding the GIL usefully nor waiting for
//! it, so the GIL table reports it in a column of its own.
//!
//! The kernel keeps `run_delay` from a thread's creation on, so a thread born while the
//! tracker watches its process counts from zero; one that was already running when its
//! process was first read counts from that first read. The last value read stands for the
//! end: a thread that ends between two polls loses at most one poll interval.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// Threads tracked at most (bounded memory); further ones are counted in `dropped`.
pub const MAX_THREADS: usize = 65_536;

#[derive(Debug, Clone, Copy, Default)]
struct Delay {
    first_ns: u64,
    last_ns: u64,
}

/// Run-queue delay per (pid, tid) of the processes polled.
#[derive(Debug)]
pub struct RunDelays {
    proc_root: PathBuf,
    threads: HashMap<(u32, u32), Delay>,
    /// Processes read at least once: a thread first met in one of them was born since.
    seen: HashSet<u32>,
    /// Threads not tracked because `MAX_THREADS` were.
    pub dropped: u64,
}

impl Default for RunDelays {
    fn default() -> Self {
        Self::with_proc_root("/proc")
    }
}

impl RunDelays {
    pub fn with_proc_root(root: impl Into<PathBuf>) -> Self {
        RunDelays {
            proc_root: root.into(),
            threads: HashMap::new(),
            seen: HashSet::new(),
            dropped: 0,
        }
    }

    /// Reads every thread of `pid` once; a process that is gone is skipped.
    pub fn poll(&mut self, pid: u32) {
        let task = self.proc_root.join(pid.to_string()).join("task");
        let Ok(entries) = std::fs::read_dir(&task) else {
            return;
        };
        let known = !self.seen.insert(pid);
        for tid in entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
            let Some(delay) = read_run_delay(&task.join(tid.to_string()).join("schedstat")) else {
                continue;
            };
            if let Some(d) = self.threads.get_mut(&(pid, tid)) {
                d.last_ns = d.last_ns.max(delay);
            } else if self.threads.len() < MAX_THREADS {
                let first_ns = if known { 0 } else { delay };
                self.threads.insert(
                    (pid, tid),
                    Delay {
                        first_ns,
                        last_ns: delay,
                    },
                );
            } else {
                self.dropped += 1;
            }
        }
    }

    /// Nanoseconds `tid` of `pid` spent runnable and not running while tracked.
    pub fn preempted_ns(&self, pid: u32, tid: u32) -> Option<u64> {
        self.threads
            .get(&(pid, tid))
            .map(|d| d.last_ns.saturating_sub(d.first_ns))
    }
}

/// The second field of a schedstat file: `on-CPU-ns run-delay-ns timeslices`.
fn read_run_delay(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, pid: u32, tid: u32, delay: u64) {
        let dir = root.join(format!("{pid}/task/{tid}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("schedstat"), format!("123 {delay} 7\n")).unwrap();
    }

    #[test]
    fn threads_present_at_the_first_read_count_from_it_later_ones_from_zero() {
        let root = std::env::temp_dir().join(format!("pyrometer-rundelay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        write(&root, 10, 10, 5_000);
        let mut d = RunDelays::with_proc_root(&root);
        d.poll(10);
        write(&root, 10, 10, 8_000);
        write(&root, 10, 11, 700);
        d.poll(10);
        // Thread 11 ended: its last value stays.
        std::fs::remove_dir_all(root.join("10/task/11")).unwrap();
        write(&root, 10, 10, 9_000);
        d.poll(10);
        d.poll(99);
        assert_eq!(d.preempted_ns(10, 10), Some(4_000));
        assert_eq!(d.preempted_ns(10, 11), Some(700));
        assert_eq!(d.preempted_ns(99, 99), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn reads_this_process() {
        let mut d = RunDelays::default();
        let pid = std::process::id();
        d.poll(pid);
        // The kernel may have no delay accounting built in; then there is no file to read.
        if Path::new(&format!("/proc/{pid}/task/{pid}/schedstat")).exists() {
            assert_eq!(
                d.preempted_ns(pid, pid),
                Some(0),
                "counted from the first read"
            );
        }
    }
}
