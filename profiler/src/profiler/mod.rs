//! The profiler every command samples with: the kernel programs ([`Sampler`]), the tables
//! that feed them (unwind tables, the Python walker's registrations, allocation probes), the
//! process registry, and the read loop that turns ring-buffer records into a [`Capture`].
//! `record`, `top` and the agent differ in what they target and what they make of a capture,
//! not in how they sample.

pub mod comm;
pub mod discover;
pub mod held;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::alloc::AllocProbes;
use crate::bpf::{BpfError, Feature, Refusal, Sampler, SamplerConfig};
use crate::capture::Capture;
use crate::os::pids;
use crate::os::procs::ProcessRegistry;
use crate::python::tracker::PyTracker;
use crate::tables::Tables;
use crate::unwinder::Unwinder;
use held::{HeldStacks, HeldStats};

/// Why the profiler could not be opened: the kernel side is missing or refused (exit 3).
#[derive(Debug, thiserror::Error)]
pub enum ProfilerError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error("BPF map unwind_rows: {0}")]
    Unwinder(#[from] crate::unwinder::UnwinderError),
}

/// Where [`Profiler::drain_routed`] counts a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Main,
    Side,
    Both,
}

/// The loaded kernel side, its tables and the processes it knows.
pub struct Profiler {
    pub sampler: Sampler,
    pub tables: Tables,
    pub registry: ProcessRegistry,
    /// Records read and not yet counted (kept to reuse the allocation).
    batch: Vec<Vec<u8>>,
    /// Samples with a copy of their stack, waiting for their tables.
    held: HeldStacks,
}

impl Profiler {
    /// Loads the programs `config` asks for and the tables that feed them: DWARF unwind
    /// tables when `config.dwarf`, the Python walker (with the GIL probes when `config.gil`),
    /// allocation probes when `config.alloc` (for the processes chosen one by one when
    /// `own_targets`). A stage the kernel refuses is switched off ([`Profiler::refusals`] says
    /// which, for the caller to tell); no sampler at all is an error.
    pub fn open(config: &SamplerConfig, debug_dirs: &[PathBuf]) -> Result<Self, ProfilerError> {
        let mut sampler = Sampler::load(config)?;
        let unwinder = if sampler.dwarf() {
            Some(Unwinder::new(sampler.take_unwind_maps()?)?)
        } else {
            None
        };
        let mut python = PyTracker::new(Some(sampler.take_py_procs()?));
        python.set_bodies(sampler.take_py_bodies()?);
        if config.gil && !sampler.refused(Feature::Gil) {
            python.enable_gil(debug_dirs.to_vec());
        }
        if config.gc && !sampler.refused(Feature::Gc) {
            python.enable_gc(debug_dirs.to_vec());
        }
        if config.asyncio && !sampler.refused(Feature::Async) {
            python.enable_async();
        }
        let alloc_probes = match config.alloc {
            Some(alloc) if !sampler.refused(Feature::Alloc) => {
                let probes = AllocProbes::new(debug_dirs.to_vec());
                // The agent probes allocators only in the processes chosen for it; every
                // other process is only checked for the preloaded library.
                Some(if alloc.own_targets {
                    probes.only_chosen()
                } else {
                    probes
                })
            }
            _ => None,
        };
        Ok(Self {
            sampler,
            tables: Tables::new(unwinder, python, alloc_probes),
            registry: ProcessRegistry::new(),
            batch: Vec::new(),
            held: HeldStacks::default(),
        })
    }

    /// Features the kernel refused: each was switched off, and the capture goes on.
    pub fn refusals(&self) -> &[Refusal] {
        self.sampler.refusals()
    }

    /// Whether the kernel refused `feature` (it is off).
    pub fn refused(&self, feature: Feature) -> bool {
        self.sampler.refused(feature)
    }

    /// The time one sample stands for: the sampling period, in ns.
    pub fn period_ns(&self) -> i64 {
        1_000_000_000 / i64::try_from(self.sampler.frequency_hz().max(1)).unwrap_or(i64::MAX)
    }

    /// Samples per second per CPU.
    pub fn frequency_hz(&self) -> u64 {
        self.sampler.frequency_hz()
    }

    /// Adds a process the user chose (by pid or name) to the kernel's target set;
    /// `follow_children` makes the processes it starts targets too. Being chosen, its
    /// executable is read for an interpreter whatever it is called.
    pub fn add_target(&mut self, pid: u32, follow_children: bool) -> Result<(), BpfError> {
        self.sampler.add_target(pid, follow_children)?;
        self.tables.python.choose(pid);
        Ok(())
    }

    /// Targets `pids` (and with `subprocesses` their descendants, current and future), with
    /// their tables and probes in place before the first sample, so even the first stacks
    /// unwind fully and carry their Python frames.
    pub fn add_pids(&mut self, pids: &[u32], subprocesses: bool) -> Result<(), BpfError> {
        let mut all = pids.to_vec();
        if subprocesses {
            all.extend(pids::descendants(Path::new("/proc"), pids));
        }
        for &pid in &all {
            self.add_target(pid, subprocesses)?;
        }
        // Before sampling starts: the reads are waited for (each up to its deadline).
        for pid in all {
            if let Ok(p) = self.registry.observe(pid) {
                self.tables.sync_process_waiting(p, &mut self.sampler);
            }
        }
        Ok(())
    }

    /// Reads process `pid` and brings its tables up to date: what is read of its files is
    /// read on workers and taken on a later turn of the loop.
    pub fn sync_pid(&mut self, pid: u32) {
        if let Ok(p) = self.registry.observe(pid) {
            self.tables.sync_process(p, &mut self.sampler);
        }
    }

    /// Starts sampling at the configured frequency.
    pub fn start(&mut self) -> Result<(), BpfError> {
        self.sampler.start()
    }

    /// One turn of the capture loop: waits up to `wait` for records, counts them into
    /// `capture`, brings the tables of processes that changed up to date. Returns the Python
    /// tracker's and the allocation probes' notices (one line each) for the caller to show.
    pub fn pump(&mut self, capture: &mut Capture, wait: Duration) -> Vec<String> {
        self.read(capture, wait);
        self.sync(capture);
        let mut notices = self.tables.python.take_notices();
        if let Some(a) = self.tables.alloc.as_mut() {
            notices.extend(a.take_notices());
        }
        notices
    }

    /// Waits up to `wait` for records and counts them into `capture` (the tables wait for
    /// [`Profiler::sync`]).
    pub fn read(&mut self, capture: &mut Capture, wait: Duration) {
        self.wait(wait);
        self.drain(capture);
    }

    /// Waits up to `wait` for records, without reading them: a caller that checks for a
    /// stop between the two ([`Profiler::drain`]) reads everything written before the stop.
    pub fn wait(&mut self, wait: Duration) {
        self.sampler.wait(wait);
    }

    /// Counts the records waiting in the ring buffer into `capture`; those with a stack copy
    /// wait for their tables ([`held`]), and those whose tables came since are counted.
    pub fn drain(&mut self, capture: &mut Capture) {
        self.release_held(capture, false);
        self.sampler.drain_into(&mut self.batch);
        let mut batch = std::mem::take(&mut self.batch);
        for rec in batch.drain(..) {
            for (r, _) in self.hold_or_pass(rec, Route::Main, capture) {
                self.ingest(capture, &r);
            }
        }
        self.batch = batch;
    }

    fn ingest(&mut self, capture: &mut Capture, rec: &[u8]) {
        capture.ingest(
            rec,
            &self.sampler,
            &mut self.registry,
            &mut self.tables.python,
        );
    }

    /// The records to count now: `rec` itself unless it waits for its tables, and any held
    /// record it pushed out for room. `capture` asks for the waiting record's tables.
    fn hold_or_pass(
        &mut self,
        rec: Vec<u8>,
        route: Route,
        capture: &mut Capture,
    ) -> Vec<(Vec<u8>, Route)> {
        match pyrometer_ebpf::RawSample::parse(&rec) {
            Ok(s) if s.stack_copy().is_some() && capture.note_held(&s, &mut self.registry) => {
                self.held.hold(&s, &rec, route)
            }
            _ => vec![(rec, route)],
        }
    }

    /// Counts the held records whose tables are in, walked again (all of them with `all`,
    /// as far as the tables now go: at the end of a capture).
    pub fn release_held(&mut self, capture: &mut Capture, all: bool) {
        if self.held.is_empty() {
            return;
        }
        for (r, _) in self.held.release(self.tables.unwinder.as_ref(), all) {
            self.ingest(capture, &r);
        }
        self.refresh_for_held(capture);
    }

    /// Reads again the maps of processes a held sample was taken in a mapping of that their
    /// entry lacks (as often as the registry allows), for the next sync to register it.
    fn refresh_for_held(&mut self, capture: &mut Capture) {
        for pid in self.held.take_refresh() {
            match self.registry.refresh(pid) {
                Ok(true) => capture.maps_changed.push(pid),
                Ok(false) => self.held.refresh_later(),
                Err(_) => {}
            }
        }
    }

    /// What became of the samples that came with a copy of their stack.
    pub fn held_stats(&self) -> HeldStats {
        self.held.stats()
    }

    /// Like [`Profiler::drain`], each record counted into `main`, `side` or both as `route`
    /// says from its header (an on-demand capture beside the always-on one).
    pub fn drain_routed(
        &mut self,
        main: &mut Capture,
        side: &mut Capture,
        route: impl Fn(&pyrometer_ebpf::SampleHeader) -> Route,
    ) {
        let mut ready = if self.held.is_empty() {
            Vec::new()
        } else {
            self.held.release(self.tables.unwinder.as_ref(), false)
        };
        self.refresh_for_held(main);
        self.sampler.drain_into(&mut self.batch);
        let mut batch = std::mem::take(&mut self.batch);
        for rec in batch.drain(..) {
            let to =
                pyrometer_ebpf::RawSample::parse(&rec).map_or(Route::Main, |s| route(&s.header));
            let into = if to == Route::Side {
                &mut *side
            } else {
                &mut *main
            };
            ready.extend(self.hold_or_pass(rec, to, into));
        }
        self.batch = batch;
        self.ingest_routed(ready, main, side);
    }

    fn ingest_routed(
        &mut self,
        records: Vec<(Vec<u8>, Route)>,
        main: &mut Capture,
        side: &mut Capture,
    ) {
        for (rec, to) in records {
            if matches!(to, Route::Side | Route::Both) {
                self.ingest(side, &rec);
            }
            if matches!(to, Route::Main | Route::Both) {
                self.ingest(main, &rec);
            }
        }
    }

    /// Counts every held record now, into `main`, `side` or both as it was routed when it
    /// came: at the end of the capture `side` is.
    pub fn release_held_routed(&mut self, main: &mut Capture, side: &mut Capture) {
        let all = self.held.release(self.tables.unwinder.as_ref(), true);
        self.ingest_routed(all, main, side);
    }

    /// Brings the tables of the processes whose maps `capture` saw change up to date.
    pub fn sync(&mut self, capture: &mut Capture) {
        self.tables
            .sync(&mut capture.maps_changed, &self.registry, &mut self.sampler);
    }

    /// After the last turn: the records still in flight, and the intervals of threads still
    /// blocked at `now_ns` as if they woke now. Returns what became of the samples that came
    /// with a stack copy, all of them counted now.
    pub fn finish(&mut self, capture: &mut Capture, now_ns: u64) -> HeldStats {
        // Samples taken just before the stop may still be on their way to the ring buffer.
        std::thread::sleep(Duration::from_millis(20));
        self.read(capture, Duration::ZERO);
        // Tables read since the last turn are taken, then every held sample is counted.
        self.sync(capture);
        self.release_held(capture, true);
        self.flush_off_cpu(capture, now_ns);
        self.held.stats()
    }

    /// Counts the intervals of threads still blocked at `now_ns` up to then (the rest
    /// counts when they wake, or at the next flush).
    pub fn flush_off_cpu(&mut self, capture: &mut Capture, now_ns: u64) {
        let pending = self.sampler.pending_off_cpu(now_ns);
        capture.ingest_pending(
            &pending,
            &self.sampler,
            &mut self.registry,
            &mut self.tables.python,
        );
    }

    /// The parts, to drop the sampler (which detaches every program) and keep the tables
    /// and the registry for symbolization.
    pub fn into_parts(self) -> (Sampler, Tables, ProcessRegistry) {
        (self.sampler, self.tables, self.registry)
    }
}
