//! Adding the processes `--comm` names as targets, each with its tables in place first.

use std::collections::HashSet;

use super::Profiler;
use super::discover::{Discovery, Due};
use crate::os::pids::{comm_matches_among, new_comm_matches};
use crate::os::procevents::ProcEvents;

impl Profiler {
    /// Adds the processes among those `due` whose comm matches `re` and that are not in
    /// `known` (which gains them) as targets, pyrometer itself excepted, each after its tables
    /// are up to date (unwind tables, the Python walker's registration, allocation probes) so
    /// that none of its samples is walked without them: a process that sat idle until now
    /// would otherwise lose the Python frames of its first busy ~100 ms, while its first
    /// samples wait for the registration they trigger. Returns one message per pid that could
    /// not be added. `record`, `top` and the agent look at every process at first, then,
    /// where they can, at the processes the kernel says started, exec'd or renamed themselves,
    /// else at every process again twice a second ([`Discovery`]).
    pub fn add_comm_matches(
        &mut self,
        due: &Due,
        re: &regex::Regex,
        known: &mut HashSet<u32>,
        follow_children: bool,
    ) -> Vec<String> {
        let pids = match due {
            Due::Nothing => return Vec::new(),
            Due::All => new_comm_matches(re, known),
            Due::These(candidates) => comm_matches_among(re, candidates, known),
        };
        let mut errors = Vec::new();
        for pid in pids {
            // Chosen before the sync below reads its executable (`add_target` after it
            // chooses it too).
            self.tables.python.choose(pid);
            self.sync_pid(pid);
            if let Err(e) = self.add_target(pid, follow_children) {
                errors.push(format!("cannot target pid {pid}: {e}"));
            }
        }
        errors
    }
}

/// Finds the processes `--comm` names as they appear, for `record` and `top`: from the
/// kernel's process events (a process started, exec'd or renamed itself), looked at on every
/// turn of the capture loop, so a process is a target within milliseconds of taking the name
/// (a Ray worker takes `ray::IDLE` after it starts, and its first task may follow at once);
/// without the events (another network namespace), by reading every process's name twice a
/// second. The 500 ms scan alone lost a new worker's first ~250 ms of samples on average.
pub struct CommFinder {
    re: regex::Regex,
    follow_children: bool,
    discovery: Discovery,
    known: HashSet<u32>,
    exited: Vec<u32>,
}

impl CommFinder {
    /// `events`: the kernel's process events ([`super::discover::open_events`]), or None to
    /// scan.
    pub fn new(re: &regex::Regex, follow_children: bool, events: Option<ProcEvents>) -> Self {
        Self {
            re: re.clone(),
            follow_children,
            discovery: Discovery::new(events),
            known: HashSet::new(),
            exited: Vec::new(),
        }
    }

    /// Adds the processes that took a matching name since the last call (every process on
    /// the first call), each after its tables are up to date; says which could not be added.
    pub fn poll(&mut self, profiler: &mut Profiler) -> Vec<String> {
        self.exited.clear();
        let due = self.discovery.due(&mut self.exited);
        // A pid that exited may come back as another process, to be looked at again.
        for pid in &self.exited {
            self.known.remove(pid);
        }
        profiler.add_comm_matches(&due, &self.re, &mut self.known, self.follow_children)
    }
}
