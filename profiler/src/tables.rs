//! What the kernel side needs to know about each profiled process, kept current as processes
//! appear, exec and exit: DWARF unwind tables, the Python frame walker's registration (and
//! GIL probes), and the allocation probes.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::alloc::AllocProbes;
use crate::bpf::Uprobes;
use crate::os::procs::{Process, ProcessRegistry};
use crate::python::tracker::PyTracker;
use crate::unwinder::Unwinder;

/// How often processes that are gone are forgotten.
const GC_INTERVAL: Duration = Duration::from_secs(2);

pub struct Tables {
    /// DWARF unwind tables (none with `--unwind fp`).
    pub unwinder: Option<Unwinder>,
    pub python: PyTracker,
    /// Allocation probes (with `--alloc`).
    pub alloc: Option<AllocProbes>,
    last_gc: Instant,
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
        }
    }

    /// Brings one process's entries up to date (a new process, exec, dlopen).
    pub fn sync_process(&mut self, process: &Process, probes: &mut (dyn Uprobes + '_)) {
        if let Some(u) = self.unwinder.as_mut() {
            let _ = u.sync_process(process);
        }
        self.python.sync(process, Some(&mut *probes));
        if let Some(a) = self.alloc.as_mut() {
            a.sync(process, probes);
        }
    }

    /// Brings the processes whose maps changed up to date (the capture's list, drained), and
    /// every few seconds forgets processes that are gone and detaches their probes.
    pub fn sync(
        &mut self,
        changed: &mut Vec<u32>,
        registry: &ProcessRegistry,
        probes: &mut (dyn Uprobes + '_),
    ) {
        changed.sort_unstable();
        changed.dedup();
        for pid in changed.drain(..) {
            if let Some(p) = registry.get(pid) {
                self.sync_process(p, probes);
            }
        }
        if self.last_gc.elapsed() >= GC_INTERVAL {
            self.last_gc = Instant::now();
            self.gc(probes);
            // Rows freed by processes that exited go to the tables that did not fit before.
            if let Some(u) = self.unwinder.as_mut() {
                for pid in u.retry_pids() {
                    if let Some(p) = registry.get(pid) {
                        let _ = u.sync_process(p);
                    }
                }
            }
        }
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
