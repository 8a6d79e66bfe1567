//! New processes wait a second for their unwind tables and Python registration. On a busy
//! node most processes live for less (a compiler, a shell pipeline) and get a sample or two
//! at 19 Hz; building the tables of each one's binaries (a large program's `.eh_frame` is
//! tens of ms of work) was most of the agent's CPU time. Their samples unwind by frame
//! pointers until then. Only node-wide (without `--pid` or `--comm`): processes the user
//! chose get their tables at once.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// How long a process must live before its tables are built.
pub const WAIT: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct Young {
    /// Processes seen, waiting, since when.
    waiting: HashMap<u32, Instant>,
    /// Processes whose tables were built: later changes (a `dlopen`) are synced at once.
    grown: HashSet<u32>,
}

impl Young {
    /// Keeps in `changed` the processes whose tables are due now: those already built, and
    /// those that waited [`WAIT`] and are still alive; the others wait.
    pub fn filter(&mut self, changed: &mut Vec<u32>, proc_root: &Path) {
        let now = Instant::now();
        changed.retain(|pid| {
            if self.grown.contains(pid) {
                return true;
            }
            self.waiting.entry(*pid).or_insert(now);
            false
        });
        let due: Vec<u32> = self
            .waiting
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= WAIT)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in due {
            self.waiting.remove(&pid);
            if crate::os::pids::alive(proc_root, pid) {
                self.grown.insert(pid);
                changed.push(pid);
            }
        }
    }

    /// Forgets the processes that are gone (after each push).
    pub fn forget_exited(&mut self, proc_root: &Path) {
        self.grown
            .retain(|&pid| crate::os::pids::alive(proc_root, pid));
    }

    /// A process exec'd: its new image waits like a new process.
    pub fn exec(&mut self, pid: u32) {
        self.grown.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_waits_then_is_synced_once_and_changes_pass_at_once() {
        let me = std::process::id();
        let mut young = Young::default();
        let mut changed = vec![me];
        young.filter(&mut changed, Path::new("/proc"));
        assert!(changed.is_empty(), "waits");
        young.waiting.insert(me, Instant::now() - WAIT);
        young.filter(&mut changed, Path::new("/proc"));
        assert_eq!(changed, [me], "due and alive");
        changed.clear();
        young.filter(&mut changed, Path::new("/proc"));
        assert!(changed.is_empty(), "synced once");
        changed.push(me);
        young.filter(&mut changed, Path::new("/proc"));
        assert_eq!(changed, [me], "a later change (dlopen) passes at once");
        young.exec(me);
        young.filter(&mut changed, Path::new("/proc"));
        assert!(changed.is_empty(), "an exec'd image waits again");
    }

    #[test]
    fn a_process_gone_before_its_time_is_never_synced() {
        // pid_max itself is never a valid pid.
        let gone: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let mut young = Young::default();
        let mut changed = vec![gone];
        young.filter(&mut changed, Path::new("/proc"));
        young.waiting.insert(gone, Instant::now() - WAIT);
        young.filter(&mut changed, Path::new("/proc"));
        assert!(changed.is_empty());
        assert!(young.waiting.is_empty());
    }
}
