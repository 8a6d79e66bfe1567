//! The parts of a capture that `record` and `top` share: loading the kernel programs with the
//! tables that feed them, adding `--pid` targets, and one turn of the read loop.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pyrometer::alloc::AllocProbes;
use pyrometer::bpf::{Feature, Sampler, SamplerConfig};
use pyrometer::capture::Capture;
use pyrometer::procs::ProcessRegistry;
use pyrometer::tables::Tables;
use pyrometer::target;

use crate::{EXIT_PRIVILEGES, exit_error};

/// Loads the programs `config` asks for and the tables that feed them: DWARF unwind tables
/// when `config.dwarf`, the Python walker (with the GIL probes when `config.gil`), allocation
/// probes when `config.alloc`. A stage the kernel refuses is switched off and said so in one
/// line (`Sampler::refused` tells the caller); no sampler at all is a kernel error (exit 3).
pub fn open(config: &SamplerConfig, debug_dirs: &[PathBuf]) -> anyhow::Result<(Sampler, Tables)> {
    let refused = |e: pyrometer::bpf::BpfError| exit_error(EXIT_PRIVILEGES, e.to_string());
    let mut sampler = Sampler::load(config).map_err(refused)?;
    for refusal in sampler.refusals() {
        eprintln!("pyrometer: {refusal}");
    }
    let unwinder = if sampler.dwarf() {
        Some(sampler.unwinder().map_err(refused)?)
    } else {
        None
    };
    let mut python = sampler.python_tracker().map_err(refused)?;
    if config.gil && !sampler.refused(Feature::Gil) {
        python.enable_gil(debug_dirs.to_vec());
    }
    let alloc = config.alloc.is_some() && !sampler.refused(Feature::Alloc);
    let alloc_probes = alloc.then(|| AllocProbes::new(debug_dirs.to_vec()));
    Ok((sampler, Tables::new(unwinder, python, alloc_probes)))
}

/// Targets `pids` (and with `subprocesses` their descendants, current and future), with their
/// tables and probes in place before the first sample, so even the first stacks unwind fully
/// and carry their Python frames.
pub fn add_pids(
    sampler: &mut Sampler,
    tables: &mut Tables,
    registry: &mut ProcessRegistry,
    pids: &[u32],
    subprocesses: bool,
) -> anyhow::Result<()> {
    let mut all = pids.to_vec();
    if subprocesses {
        all.extend(target::descendants(Path::new("/proc"), pids));
    }
    for &pid in &all {
        sampler.add_target(pid, subprocesses)?;
    }
    for pid in all {
        if let Ok(p) = registry.observe(pid) {
            tables.sync_process(p, sampler);
        }
    }
    Ok(())
}

/// One turn of the capture loop: waits up to `wait` for records, counts them into `capture`,
/// brings the tables of processes that changed up to date. Returns the Python tracker's and
/// the allocation probes' notices (one line each) for the caller to show.
pub fn pump(
    sampler: &mut Sampler,
    tables: &mut Tables,
    registry: &mut ProcessRegistry,
    capture: &mut Capture,
    batch: &mut Vec<Vec<u8>>,
    wait: Duration,
) -> Vec<String> {
    sampler.wait(wait);
    sampler.drain_into(batch);
    for rec in batch.drain(..) {
        capture.ingest(&rec, sampler, registry, &mut tables.python);
    }
    tables.sync(&mut capture.maps_changed, registry, sampler);
    let mut notices = tables.python.take_notices();
    if let Some(a) = tables.alloc.as_mut() {
        notices.extend(a.take_notices());
    }
    notices
}
