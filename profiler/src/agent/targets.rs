//! The agent's choice of processes: by name (`--comm`), and for allocation sampling
//! (`--alloc-pid`, `--alloc-comm`), found as they appear.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::{AgentConfig, AllocTargets, Log};
use crate::alloc::AllocProbes;
use crate::bpf::Sampler;
use crate::profiler::Profiler;
use crate::profiler::discover::Due;

/// Processes already chosen (until they exit): as sampling targets, and for allocation
/// sampling.
#[derive(Default)]
pub(super) struct Known {
    pub(super) targets: HashSet<u32>,
    pub(super) alloc: HashSet<u32>,
    /// The `--alloc-pid` processes were added (once: a chosen pid that exits is not
    /// chosen again when the number comes back).
    alloc_pids_added: bool,
    /// Chosen for allocation sampling while their dynamic loader was still at work (seen
    /// at their exec, before libc was mapped), with when: looked at again on each scan.
    alloc_loading: HashMap<u32, Instant>,
}

/// How long a process chosen at its exec is given to map its libraries before its
/// allocator is said to be missing.
const LOADER_WAIT: Duration = Duration::from_secs(2);

impl Known {
    /// A pid that exited may come back as another process, to be looked at again.
    pub(super) fn exited(&mut self, pid: u32) {
        self.targets.remove(&pid);
        self.alloc.remove(&pid);
        self.alloc_loading.remove(&pid);
    }

    /// Whether a scan is due for processes chosen while their loader was at work.
    pub(super) fn alloc_loading(&self) -> bool {
        !self.alloc_loading.is_empty()
    }
}

/// Adds the processes chosen by name (`--comm`, `--alloc-comm`) among those `due`, and the
/// `--alloc-pid` ones on the first call.
pub(super) fn scan(
    profiler: &mut Profiler,
    cfg: &AgentConfig,
    known: &mut Known,
    due: &Due,
    log: &Log,
) {
    if let Some(re) = &cfg.comm {
        for e in profiler.add_comm_matches(due, re, &mut known.targets, false) {
            log(&e);
        }
    }
    if let Some(a) = &cfg.alloc {
        add_alloc_targets(profiler, a, known, due, log);
    }
}

/// Samples the allocations of the chosen processes not probed yet: the --alloc-pid ones and
/// those whose comm matches --alloc-comm (again every scan, for processes started later).
fn add_alloc_targets(
    profiler: &mut Profiler,
    alloc: &AllocTargets,
    known: &mut Known,
    due: &Due,
    log: &Log,
) {
    let mut pids: Vec<u32> = known.alloc_loading.keys().copied().collect();
    if !std::mem::replace(&mut known.alloc_pids_added, true) {
        pids.extend(
            alloc
                .pids
                .iter()
                .copied()
                .filter(|&p| known.alloc.insert(p)),
        );
    }
    if let Some(re) = &alloc.comm {
        pids.extend(match due {
            Due::Nothing => Vec::new(),
            Due::All => crate::os::pids::new_comm_matches(re, &mut known.alloc),
            Due::These(candidates) => {
                crate::os::pids::comm_matches_among(re, candidates, &mut known.alloc)
            }
        });
    }
    let Profiler {
        sampler,
        tables,
        registry,
        ..
    } = profiler;
    for pid in pids {
        // Chosen before, while its loader was at work: its maps read again.
        let since = known.alloc_loading.remove(&pid);
        if since.is_some() {
            let _ = registry.refresh(pid);
        } else if let Err(e) = sampler.add_alloc_target(pid) {
            log(&format!("cannot sample the allocations of pid {pid}: {e}"));
            continue;
        }
        let Ok(p) = registry.observe(pid) else {
            continue;
        };
        if let Some(probes) = tables.alloc.as_mut() {
            probes.choose(pid);
            // Asked for by name or pid: its allocator is searched for now (up to the
            // search's deadline), so the line below says whether it is sampled.
            probes.reads().set_waiting(true);
            probes.sync(p, sampler);
            probes.reads().set_waiting(false);
            if probes.has_allocator(pid) {
                log(&format!(
                    "sampling the allocations of pid {pid} ({})",
                    p.comm
                ));
            } else if p.loading() && since.is_none_or(|t| t.elapsed() < LOADER_WAIT) {
                // Its libc is not mapped yet: looked at again on the next scan.
                known
                    .alloc_loading
                    .insert(pid, since.unwrap_or_else(Instant::now));
            } else {
                log(&probes.unprobed_reason(pid, &p.comm, p.exe.as_deref()));
            }
        }
    }
}

/// Attaches the allocation probes to the sampler library this agent hands out (an installed
/// copy, else the one it carries, written to its cache directory), so the processes that
/// preload it are sampled from their first allocation, started before the agent or after
/// it. Other copies (a container's) are probed when a process mapping one is seen.
pub(super) fn attach_own_library(probes: &mut AllocProbes, sampler: &mut Sampler, log: &Log) {
    let lib = match crate::alloc::preload::library() {
        Ok(lib) => lib,
        Err(e) => {
            log(&format!(
                "{e}: processes that preload a copy are probed when they are seen"
            ));
            return;
        }
    };
    match probes.preload.attach_file(&lib, sampler) {
        Ok(()) => log(&format!(
            "sampling the allocations of processes that preload {}",
            lib.display()
        )),
        Err(e) => log(&format!("cannot probe {}: {e}", lib.display())),
    }
}
