//! The symbolizer's view of one process as such: its JIT code, named from its perf map (read
//! off the sampling loop, never from FUSE), and its budget.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::perfmap::{self, PerfMap};
use super::{FrameKind, Symbolizer};
use crate::model::Frame;
use crate::os::mounts::Mounts;
use crate::os::procs::ProcessRegistry;
use crate::os::untrusted::Root;

impl Symbolizer {
    /// Whether `pid` is over its budget: what is kept for it, its perf map as parsed and its
    /// mappings, costs more than the budget. Found so once, it stays so until it is gone.
    pub(super) fn over(&mut self, registry: &ProcessRegistry, pid: u32) -> bool {
        if self.over_budget.contains(&pid) {
            return true;
        }
        let maps = registry.get(pid).map_or(0, |p| p.held_bytes());
        let perf_map = self.perf_maps.get(&pid).map_or(0, PerfMap::held_bytes);
        if maps.saturating_add(perf_map) <= self.process_budget {
            return false;
        }
        self.over_budget.insert(pid);
        self.perf_maps.remove(&pid);
        self.stats.processes_over_budget += 1;
        true
    }

    /// A frame from the process's perf map, re-reading the map on a miss (rate-limited).
    pub(super) fn jit(
        &mut self,
        registry: &ProcessRegistry,
        pid: u32,
        addr: u64,
        lookup: u64,
    ) -> Option<Frame> {
        let interval = self.perf_map_interval;
        let pm = self.perf_maps.entry(pid).or_default();
        let due = pm.last_read.is_none_or(|t| t.elapsed() >= interval);
        if due && (pm.last_read.is_none() || pm.lookup(lookup).is_none()) {
            // Inside a container the JIT names the file by its namespace pid.
            let ns_pid = registry.get(pid).map_or(pid, |p| p.ns_pid);
            let own = || Root::of_process(registry.proc_root(), pid).ok();
            // A perf map on FUSE is not opened: its reader could wait for good (os::mounts).
            let theirs = Mounts::of_process(registry.proc_root(), &pid.to_string());
            let ours = Mounts::of_process(Path::new("/proc"), "self");
            let mut candidates = Vec::new();
            let mut add = |root: Option<Root>, mounts: &Mounts, path: PathBuf| {
                if let Some(root) = root.filter(|_| !mounts.may_block(&path)) {
                    candidates.push((root, path));
                }
            };
            add(own(), &theirs, format!("/tmp/perf-{ns_pid}.map").into());
            if ns_pid != pid {
                add(own(), &theirs, format!("/tmp/perf-{pid}.map").into());
            }
            add(
                Root::open(Path::new("/")).ok(),
                &ours,
                format!("/tmp/perf-{pid}.map").into(),
            );
            pm.last_read = Some(Instant::now());
            // On a worker: a file on a mount that never answers holds the worker, not this.
            let key = super::reads::ReadKey::PerfMap(pid);
            let read = self.off_loop(pid, key, move || perfmap::read(&candidates));
            let pm = self.perf_maps.entry(pid).or_default();
            match read {
                Some(perfmap::Read::Entries(e)) => pm.entries = e,
                Some(perfmap::Read::Absent) => pm.entries.clear(),
                Some(perfmap::Read::Refused) => {
                    pm.entries.clear();
                    self.stats.refused_files += 1;
                }
                None => {}
            }
        }
        let pm = self.perf_maps.get(&pid)?;
        let e = pm.lookup(lookup)?;
        Some(Frame {
            function: e.name.clone(),
            file: None,
            line: None,
            module: Some(format!("/tmp/perf-{pid}.map")),
            build_id: None,
            address: addr,
            kind: FrameKind::Jit,
            inlined: false,
        })
    }
}
