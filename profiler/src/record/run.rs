//! A recording's loop and its end: samples are read until the duration runs out, the
//! command exits, the `--pid` targets are gone or Ctrl-C; then they become one profile.

use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant, SystemTime};

use super::report::{
    AllocReport, GcReport, GilReport, GpuKernelsReport, RunReport, leak_sites, self_cpu_ns,
    thread_comm,
};
use super::{Observer, Recorded, Recording};
use crate::capture::gpu::samples::GpuCapture;
use crate::capture::{
    Activity, AllocState, Capture, DEFAULT_ACTIVITY_BUCKET_NS, DEFAULT_ACTIVITY_BUCKETS,
    DEFAULT_TIMELINE_EVENTS, Timeline,
};
use crate::command::CommandError;
use crate::gpu::{self, Poller};
use crate::model::Profile;
use crate::os::clock::monotonic_now_ns;
use crate::os::{pids, signals};
use crate::python::run_delay::RunDelays;
use crate::symbolize::Symbolizer;

/// The state of a recording that runs.
pub(super) struct Running {
    capture: Capture,
    poller: Option<Poller>,
    /// The GIL table's preempted column: each Python thread's run-queue delay, read while
    /// the threads live (a `-- CMD`'s are gone by the time the table is made).
    run_delays: Option<RunDelays>,
    last_delay_poll: Option<Instant>,
    started: Instant,
    cpu_at_start: u64,
    wall_start: SystemTime,
    child_status: Option<ExitStatus>,
    elapsed: Duration,
}

impl Recording {
    /// Samples until the duration runs out, the command exits, the `--pid` targets are gone
    /// or a signal comes (forwarded to the command, which then decides).
    pub fn run(&mut self, observer: &mut dyn Observer) -> Result<(), CommandError> {
        let running = self.running(observer)?;
        self.run = Some(running);
        let mut last_alive_check = Instant::now();
        loop {
            self.poll_run_delays(false);
            let run = self.run.as_mut().expect("set above");
            let notices = self
                .profiler
                .pump(&mut run.capture, Duration::from_millis(10));
            for notice in notices {
                observer.notice(&notice);
            }
            self.poll_comm(observer);
            let lost = self.profiler.sampler.counters().ringbuf_drops;
            observer.progress(self.running_mut().capture.samples, lost);

            if let Some(sig) = signals::take() {
                match &self.child {
                    // The child decides when it is done; recording ends when it exits.
                    Some(c) => unsafe {
                        // SAFETY: plain kill(2) of our own child.
                        libc::kill(c.id() as i32, sig);
                    },
                    None => break,
                }
            }
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c
                    .try_wait()
                    .map_err(|e| CommandError::Input(format!("waiting for the command: {e}")))?
            {
                self.running_mut().child_status = Some(status);
                break;
            }
            let started = self.running_mut().started;
            if self.config.duration.is_some_and(|d| started.elapsed() >= d) {
                break;
            }
            if !self.root_pids.is_empty()
                && last_alive_check.elapsed() >= Duration::from_millis(200)
            {
                last_alive_check = Instant::now();
                let proc_root = Path::new("/proc");
                if self.root_pids.iter().all(|&p| !pids::alive(proc_root, p)) {
                    break;
                }
            }
        }
        let elapsed = self.running_mut().started.elapsed();
        self.running_mut().elapsed = elapsed;
        Ok(())
    }

    fn running_mut(&mut self) -> &mut Running {
        self.run.as_mut().expect("Recording::run set it")
    }

    /// The capture (with per-sample times when asked for, allocation state), and the GPU
    /// poller: a missing driver turns the GPU source off, not the recording.
    fn running(&mut self, observer: &mut dyn Observer) -> Result<Running, CommandError> {
        let started = Instant::now();
        let cpu_at_start = self_cpu_ns();
        let wall_start = SystemTime::now();
        // Per-sample times only when the output draws them; their number is bounded.
        let mut capture = if self.config.timeline {
            Capture::with_timeline(Timeline::new(
                DEFAULT_TIMELINE_EVENTS,
                monotonic_now_ns(),
                u64::try_from(self.profiler.period_ns()).unwrap_or(1),
            ))
        } else {
            Capture::default()
        };
        capture.maps_read_after_exec.extend(self.held_maps_read);
        capture.off_cpu = self.sources.off_cpu;
        capture.gil = self.sources.gil;
        capture.gc = self.sources.gc;
        capture.frames = self.frames();
        if self.sources.alloc
            && let Some(alloc) = self.config.alloc
        {
            let mut state = AllocState::new(alloc.sample_bytes);
            state.min_age_ns = alloc
                .min_age
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
            capture.alloc = Some(state);
        }
        if self.sources.gpu_kernels
            && let Some(g) = &self.config.gpu_kernels
        {
            capture.gpu = Some(gpu_capture(self.config.timeline, &g.nvml_lib));
        }
        let mut poller = None;
        if let Some((interval, lib)) = &self.config.gpu {
            match gpu::NvmlSource::open(lib) {
                Ok(source) => {
                    capture.activity = Some(Activity::new(
                        monotonic_now_ns(),
                        DEFAULT_ACTIVITY_BUCKET_NS,
                        DEFAULT_ACTIVITY_BUCKETS,
                    ));
                    poller = Some(
                        Poller::start(source, *interval, gpu::DEFAULT_SERIES_CAPACITY).map_err(
                            |e| CommandError::Input(format!("starting the GPU poller: {e}")),
                        )?,
                    );
                }
                Err(e) => observer.notice(&format!("GPU source off: {e}")),
            }
        }
        Ok(Running {
            capture,
            poller,
            run_delays: self.sources.gil.then(RunDelays::default),
            last_delay_poll: None,
            started,
            cpu_at_start,
            wall_start,
            child_status: None,
            elapsed: Duration::ZERO,
        })
    }

    /// Reads the run-queue delays of the Python processes' threads every 50 ms (`always`:
    /// now).
    fn poll_run_delays(&mut self, always: bool) {
        let Some(run) = self.run.as_mut() else {
            return;
        };
        let Some(d) = run.run_delays.as_mut() else {
            return;
        };
        if always
            || run
                .last_delay_poll
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(50))
        {
            run.last_delay_poll = Some(Instant::now());
            for pid in self.profiler.tables.python.pids() {
                d.poll(pid);
            }
        }
    }

    /// Ends the recording: the last records, the still-blocked threads, the GPU polls, then
    /// the profile (symbolized now) and the report.
    pub fn finish(mut self) -> Recorded {
        self.poll_run_delays(true);
        let Some(mut run) = self.run.take() else {
            panic!("Recording::finish before Recording::run");
        };
        let mut gpu_state = run.poller.take().map(Poller::stop);
        let capture_cpu_ns = self_cpu_ns().saturating_sub(run.cpu_at_start);
        let stopped_ns = monotonic_now_ns();
        let stack_copies = self.profiler.finish(&mut run.capture, stopped_ns);
        let period_ns = self.profiler.period_ns();
        let (sampler, mut tables, mut registry) = self.profiler.into_parts();
        let (counters, bpf) = (sampler.counters(), sampler.program_stats());
        let gil_threads = sampler.gil_threads();
        // The programs detach now; what is left is user space's.
        drop(sampler);
        if let Some(mut c) = self.child.take() {
            // Duration ran out or Ctrl-C with a child: it keeps running, as with `perf record`.
            run.child_status = c.try_wait().ok().flatten().or(run.child_status);
        }
        let capture = &mut run.capture;
        let gil = self.sources.gil.then(|| {
            gil_report(
                capture,
                &gil_threads,
                &mut tables.python,
                &registry,
                run.run_delays.as_ref(),
                period_ns,
                stopped_ns,
                run.elapsed,
            )
        });
        let mut alloc = capture.alloc.as_mut().map(|a| {
            a.now_ns = stopped_ns;
            AllocReport {
                mean: a.mean,
                samples: a.samples,
                frees: a.frees,
                moves: a.moves,
                uprobes: 0,
                preload_libraries: 0,
                objects: a.objects,
                bytes: a.bytes,
                leaks: None,
                unprobed: Vec::new(),
                live_dropped: 0,
            }
        });
        if let (Some(report), Some(probes)) = (alloc.as_mut(), tables.alloc.as_ref()) {
            report.live_dropped = capture.alloc_live_dropped;
            report.uprobes = probes.attached;
            report.preload_libraries = probes.preload.len();
            let mut pids: Vec<u32> = capture.pids.iter().copied().collect();
            pids.sort_unstable();
            for pid in pids.into_iter().filter(|&p| !probes.has_allocator(p)) {
                let p = registry.get(pid);
                let comm = p.map_or("?", |p| p.comm.as_str());
                report.unprobed.push(probes.unprobed_reason(
                    pid,
                    comm,
                    p.and_then(|p| p.exe.as_deref()),
                ));
            }
        }
        let mut symbolizer = symbolizer(&self.config);
        let sampled_pids = capture.pids.clone();
        let activity = capture.activity.take();
        capture.name_late_threads(&mut tables.python);
        let gpu_kernels = capture.gpu.as_mut().map(gpu_kernels_report);
        let capture = std::mem::take(&mut run.capture);
        let (samples, off_cpu_events, off_cpu_ns) =
            (capture.samples, capture.off_cpu_events, capture.off_cpu_ns);
        let gc = self.sources.gc.then(|| gc_report(&capture, &tables.python));
        let processes = capture.pids.len();
        let py_frames = (capture.py_frames_seen, capture.py_unresolved);
        let bad = capture.bad_records;
        let waiting = fetch_debug_files(&self.config, &capture, &mut registry, &mut symbolizer);
        let (mut profile, mut timeline) =
            capture.into_profile_and_timeline(&mut registry, &mut symbolizer, period_ns);
        let leaks = self.config.alloc.filter(|a| a.leaks && self.sources.alloc);
        if self.sources.alloc {
            profile.default_type = default_alloc_type(&profile, leaks.is_some());
        } else if let Ok(t) = profile.type_index("gpu_time") {
            profile.default_type = t;
        }
        let mut gpu_polls = None;
        if let Some(st) = gpu_state.as_mut() {
            // Never taken before, so this is every poll's, even those the bounded series
            // dropped. Labels only add to each sample's, so samples keep their indexes (the
            // timeline's events point at them).
            gpu::label_profile(&mut profile, &gpu::gpus_by_pid(&st.take_process_usage()));
            if let Some(t) = timeline.as_mut() {
                t.counters = st.counter_tracks();
            }
            gpu_polls = Some((st.series.len(), st.dropped));
        }
        profile.duration_nanos = i64::try_from(run.elapsed.as_nanos()).unwrap_or(i64::MAX);
        profile.time_nanos = run
            .wall_start
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_nanos()).unwrap_or(0))
            .unwrap_or(0);
        let lost = counters.ringbuf_drops + bad;
        profile.comments.push(format!(
            "pyrometer record at {} Hz: {samples} samples, {lost} lost",
            self.config.frequency
        ));
        if let (Some(report), Some(l)) = (alloc.as_mut(), leaks) {
            report.leaks = Some((l.min_age.unwrap_or_default(), leak_sites(&profile, 10)));
        }
        let gpus = gpu_state.as_ref().map(|st| {
            let profiled = |pid: u32| sampled_pids.contains(&pid);
            gpu::summary::summarize(st, activity.as_ref(), Some(&profiled))
        });
        let report = RunReport {
            samples,
            lost,
            processes,
            elapsed: run.elapsed,
            unsymbolized: symbolizer.stats().unsymbolized,
            output: Default::default(),
            counters,
            off_cpu: self.sources.off_cpu.then(|| {
                let min = self
                    .config
                    .off_cpu
                    .unwrap_or(crate::bpf::DEFAULT_OFF_CPU_MIN);
                (off_cpu_events, off_cpu_ns, min)
            }),
            gil,
            gc,
            alloc,
            py_frames,
            python: tables.python.stats(),
            unwinder: tables.unwinder_stats(),
            stack_copies,
            bpf,
            capture_cpu_ns,
            gpus,
            gpu_kernels,
            debuginfod: debuginfod_report(&symbolizer, waiting),
        };
        Recorded {
            profile,
            timeline,
            report,
            child_status: run.child_status,
            gpu_polls,
        }
    }
}

/// The symbolizer of the recording's end: the debug directories, and debuginfod servers
/// when given.
fn symbolizer(config: &super::RecordConfig) -> Symbolizer {
    let symbolizer = Symbolizer::new().with_debug_dirs(super::debug_dirs(&config.debug_dirs));
    match &config.debuginfod {
        Some(cfg) => symbolizer.with_debuginfod(cfg.clone()),
        None => symbolizer,
    }
}

/// With debuginfod servers: a first pass over the stacks finds the binaries whose debug
/// files are missing and starts their downloads, then waits for them (up to
/// `debuginfod_wait`), so that the profile is made with their names. The downloads still
/// under way.
fn fetch_debug_files(
    config: &super::RecordConfig,
    capture: &Capture,
    registry: &mut crate::os::procs::ProcessRegistry,
    symbolizer: &mut Symbolizer,
) -> usize {
    if symbolizer.debuginfod().is_none() {
        return 0;
    }
    symbolizer.uncounted(|s| capture.request_debug_files(registry, s));
    symbolizer.wait_for_debug_files(config.debuginfod_wait)
}

/// What debuginfod servers gave the recording, when it had some.
fn debuginfod_report(
    symbolizer: &Symbolizer,
    pending: usize,
) -> Option<super::report::DebuginfodReport> {
    symbolizer
        .debuginfod()
        .map(|d| super::report::DebuginfodReport {
            stats: d.stats(),
            pending,
            last_error: d.last_error(),
            cache: d.cache_dir().to_path_buf(),
        })
}

/// What the GPU libraries reported, for the end of the recording.
fn gpu_kernels_report(g: &mut GpuCapture) -> GpuKernelsReport {
    GpuKernelsReport {
        text: crate::gpu::kernels::report::render(g),
        json: crate::gpu::kernels::report::json(g),
        records: g.account.kernels_and_copies(),
    }
}

/// GPU work kept for a Chrome trace (kernels, copies); later work counts in the totals only.
const DEFAULT_GPU_SLICES: usize = 200_000;

/// The capture's GPU-kernel state: device work kept for a trace when the output draws one,
/// and NVML's index of each device UUID (the `gpu` label), its device list read once.
fn gpu_capture(timeline: bool, nvml_lib: &std::ffi::OsStr) -> GpuCapture {
    let mut g = GpuCapture::new(if timeline { DEFAULT_GPU_SLICES } else { 0 });
    if let Ok(source) = gpu::NvmlSource::open(nvml_lib) {
        g.nvml_index = source
            .devices()
            .iter()
            .map(|d| (d.uuid.clone(), d.index))
            .collect();
    }
    g
}

/// The sample type single-type outputs show by default with allocation sampling.
fn default_alloc_type(profile: &Profile, leaks: bool) -> usize {
    let wanted = if leaks { "inuse_space" } else { "alloc_space" };
    profile
        .type_index(wanted)
        .unwrap_or_else(|_| profile.single_type_default())
}

/// The garbage collector's part of the report: collections, pauses by generation, and the
/// processes that could not be probed.
fn gc_report(capture: &Capture, python: &crate::python::tracker::PyTracker) -> GcReport {
    let mut by_generation = std::collections::BTreeMap::new();
    for (raw, count) in &capture.stacks {
        if let Some(g) = raw.gc_generation {
            let g = (g != crate::capture::GC_GENERATION_UNKNOWN).then_some(g);
            *by_generation.entry(g).or_insert(0) += count.gc_ns;
        }
    }
    let mut unavailable: Vec<(u32, String)> = python
        .gc_probes()
        .map(|g| g.unavailable.iter().map(|(p, r)| (*p, r.clone())).collect())
        .unwrap_or_default();
    unavailable.sort();
    GcReport {
        events: capture.gc_events,
        ns: capture.gc_ns,
        by_generation,
        unavailable,
    }
}

/// The GIL table and what goes with it.
#[allow(clippy::too_many_arguments)]
fn gil_report(
    capture: &Capture,
    gil_threads: &[(u32, pyrometer_ebpf::GilThread)],
    python: &mut crate::python::tracker::PyTracker,
    registry: &crate::os::procs::ProcessRegistry,
    run_delays: Option<&RunDelays>,
    period_ns: i64,
    stopped_ns: u64,
    elapsed: Duration,
) -> GilReport {
    let rows = crate::python::gil_report::rows(
        gil_threads,
        &capture.thread_samples,
        period_ns.unsigned_abs(),
        stopped_ns,
        |pid, tid| {
            python
                .thread_name(pid, tid)
                .map(|n| n.to_string())
                .or_else(|| thread_comm(pid, tid))
        },
        |pid, tid| run_delays?.preempted_ns(pid, tid),
    );
    let comm = |pid: u32| {
        registry
            .get(pid)
            .map_or_else(|| "?".to_string(), |p| p.comm.clone())
    };
    let mut unavailable: Vec<(u32, String)> = python
        .gil_unavailable()
        .iter()
        .map(|(&p, r)| (p, r.clone()))
        .collect();
    unavailable.sort();
    let free_threaded = python
        .free_threaded()
        .processes()
        .map(|(p, f)| (p, f.comm.clone(), f.gil_enabled))
        .collect();
    GilReport {
        free_threaded,
        table: crate::python::gil_report::render(&rows, elapsed.as_nanos() as u64, comm),
        unavailable,
        wait_events: capture.gil_wait_events,
        wait_ns: capture.gil_wait_ns,
    }
}
