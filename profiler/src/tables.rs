//! What the kernel side needs to know about each profiled process, kept current as processes
//! appear, exec and exit: DWARF unwind tables, the Python frame walker's registration (and
//! GIL probes), and the allocation probes.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::alloc::AllocProbes;
use crate::bpf::Uprobes;
use crate::os::cpu_budget::CpuBudget;
use crate::os::procs::{Process, ProcessRegistry};
use crate::os::workers::ProcessReads;
use crate::python::tracker::PyTracker;
use crate::unwinder::Unwinder;

/// How long one turn of the capture loop may wait in all for the reads it starts (a new
/// process's build-ids, tables, interpreter): most take milliseconds, and taken in the turn
/// that started them, the process's tables are in place before its interpreter has started
/// (a large library's table takes longer, and comes on a later turn). A read that never
/// returns costs the loop this much once.
const TURN_GRACE: Duration = Duration::from_millis(200);

/// How often processes that are gone are forgotten.
const GC_INTERVAL: Duration = Duration::from_secs(2);

pub struct Tables {
    /// DWARF unwind tables (none with `--unwind fp`).
    pub unwinder: Option<Unwinder>,
    pub python: PyTracker,
    /// Allocation probes (with `--alloc`).
    pub alloc: Option<AllocProbes>,
    last_gc: Instant,
    /// CPU time spent on each process, bounded per interval (the agent's).
    cpu: Option<CpuBudget>,
}

impl Tables {
    /// The unwinder's figures (all zero without one: `--unwind fp`).
    pub fn unwinder_stats(&self) -> crate::unwinder::UnwinderStats {
        self.unwinder
            .as_ref()
            .map(|u| u.stats())
            .unwrap_or_default()
    }

    pub fn new(unwinder: Option<Unwinder>, python: PyTracker, alloc: Option<AllocProbes>) -> Self {
        Self {
            unwinder,
            python,
            alloc,
            last_gc: Instant::now(),
            cpu: None,
        }
    }

    /// Bounds the CPU time spent on each process per interval: bringing its tables up to
    /// date here and the reads on workers count; a process over it is left as it is until
    /// the interval ends.
    pub fn set_cpu_budget(&mut self, budget: CpuBudget) {
        self.each_reads(|r| r.set_budget(budget.clone()));
        self.cpu = Some(budget);
    }

    /// Applies `f` to where each of the unwinder, the Python tracker and the allocation
    /// probes reads.
    fn each_reads(&mut self, f: impl Fn(&mut ProcessReads)) {
        if let Some(u) = self.unwinder.as_mut() {
            f(u.reads());
        }
        f(self.python.reads());
        if let Some(a) = self.alloc.as_mut() {
            f(a.reads());
        }
    }

    /// Brings one process's entries up to date (a new process, exec, dlopen).
    pub fn sync_process(&mut self, process: &Process, probes: &mut (dyn Uprobes + '_)) {
        let pid = process.pid;
        let budget = self.cpu.clone();
        if budget.as_ref().is_some_and(|b| b.is_over(pid)) {
            return;
        }
        crate::os::cpu_budget::charged(budget.as_ref(), pid, || {
            if let Some(u) = self.unwinder.as_mut() {
                let _ = u.sync_process(process);
            }
            self.python.sync(process, Some(&mut *probes));
            if let Some(a) = self.alloc.as_mut() {
                a.sync(process, probes);
            }
        });
    }

    /// Brings only one process's unwind entry up to date (its table's turn came), counted
    /// against its CPU budget like [`Tables::sync_process`]: a process over it waits for the
    /// next interval, which syncs it again.
    fn sync_unwinder(&mut self, process: &Process) {
        let budget = self.cpu.as_ref();
        if budget.is_some_and(|b| b.is_over(process.pid)) {
            return;
        }
        if let Some(u) = self.unwinder.as_mut() {
            crate::os::cpu_budget::charged(budget, process.pid, || {
                let _ = u.sync_process(process);
            });
        }
    }

    /// Like [`Tables::sync_process`], waiting for what is read on workers (each read up to
    /// its deadline) rather than taking it on a later sync: for a process that does not run
    /// yet (a command held before its main) or that sampling has not started for, whose
    /// first samples should find its tables.
    pub fn sync_process_waiting(&mut self, process: &Process, probes: &mut (dyn Uprobes + '_)) {
        self.set_waiting(true);
        self.sync_process(process, probes);
        self.set_waiting(false);
    }

    /// Makes syncs wait for what is read on workers (each read up to its deadline), until
    /// set off again: [`Tables::sync_process_waiting`] for several processes at once.
    pub(crate) fn set_waiting(&mut self, on: bool) {
        self.each_reads(|r| r.set_waiting(on));
    }

    /// Brings the processes whose maps changed up to date (the capture's list, drained), and
    /// every few seconds forgets processes that are gone and detaches their probes.
    pub fn sync(
        &mut self,
        changed: &mut Vec<u32>,
        registry: &ProcessRegistry,
        probes: &mut (dyn Uprobes + '_),
    ) {
        // Reads started in this turn are waited for up to TURN_GRACE in all.
        let until = Instant::now() + TURN_GRACE;
        self.each_reads(|r| r.begin_turn(until));
        // Processes whose reads came back from the workers take them now.
        changed.extend(self.python.ready_pids());
        if let Some(u) = self.unwinder.as_mut() {
            changed.extend(u.ready_pids());
        }
        if let Some(a) = self.alloc.as_mut() {
            changed.extend(a.ready_pids());
        }
        changed.sort_unstable();
        changed.dedup();
        for pid in changed.drain(..) {
            if let Some(p) = registry.get(pid) {
                self.sync_process(p, probes);
            }
        }
        // Processes that waited for the table-building budget, oldest first, while it allows
        // (each at most once a turn: one that needs more than one new table may wait again).
        for _ in 0..self.unwinder_stats().processes_waiting {
            let Some(pid) = self.unwinder.as_mut().and_then(Unwinder::next_due) else {
                break;
            };
            if let Some(p) = registry.get(pid) {
                self.sync_unwinder(p);
            }
        }
        if self.last_gc.elapsed() >= GC_INTERVAL {
            self.last_gc = Instant::now();
            self.gc(probes);
            // Rows freed by processes that exited go to the tables that did not fit before.
            let retry = self
                .unwinder
                .as_ref()
                .map(Unwinder::retry_pids)
                .unwrap_or_default();
            for pid in retry {
                if let Some(p) = registry.get(pid) {
                    self.sync_unwinder(p);
                }
            }
        }
    }

    /// Whether a read handed to a worker may come back soon: a loop that sleeps long
    /// between turns should look again sooner.
    pub fn reads_due(&self) -> bool {
        self.python.reads_due()
            || self.unwinder.as_ref().is_some_and(Unwinder::reads_due)
            || self.alloc.as_ref().is_some_and(AllocProbes::reads_due)
    }

    fn gc(&mut self, probes: &mut (dyn Uprobes + '_)) {
        if let Some(u) = self.unwinder.as_mut() {
            u.gc();
        }
        self.python.gc();
        if let Some(a) = self.alloc.as_mut() {
            for pid in a.pids() {
                if !crate::os::pids::alive(Path::new("/proc"), pid) {
                    a.forget(pid);
                    probes.detach_process_probes(pid);
                }
            }
        }
    }
}
