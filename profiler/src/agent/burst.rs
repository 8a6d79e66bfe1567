//! An on-demand capture in the sampling loop: the programs already loaded, attached to
//! cpu-clock events of the target's threads at the request's frequency, beside the node-wide
//! always-on events. Samples of those events carry their period, so the loop counts them
//! into the burst's own capture (with per-sample times, for the Chrome timeline) and the
//! always-on profile keeps exactly the samples it would have had.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use aya::programs::perf_event::PerfEventLinkId;
use pyrometer_proto::capture::{CaptureRequest, Failure, UploadRequest};

use super::captures::{failed, unix_now_ns};
use crate::capture::{Capture, DEFAULT_TIMELINE_EVENTS, Timeline};
use crate::os::clock::monotonic_now_ns;
use crate::output::{self, OutputFormat};
use crate::profiler::{Profiler, Route};
use crate::python::run_delay::RunDelays;
use crate::python::tracker::Attached;
use crate::symbolize::Symbolizer;

/// How often the target's threads are listed again, for threads started during the burst.
const RESCAN: Duration = Duration::from_millis(200);
/// Threads of the targets given events, at most.
const MAX_THREADS: usize = 1024;

/// Record kinds other than an on-CPU sample.
const NOT_ON_CPU: u32 = pyrometer_ebpf::SAMPLE_OFFCPU
    | pyrometer_ebpf::SAMPLE_GIL_WAIT
    | pyrometer_ebpf::SAMPLE_ALLOC
    | pyrometer_ebpf::SAMPLE_FREE
    | pyrometer_ebpf::SAMPLE_GC
    | pyrometer_ebpf::SAMPLE_GPU_LAUNCH
    | pyrometer_ebpf::SAMPLE_GPU_CHANNEL
    | pyrometer_ebpf::SAMPLE_EVENT_EXEC;

/// What the agent samples, for checking a request's options.
pub(super) struct Sources {
    /// The GIL probes are loaded (`agent --gil`).
    pub gil: bool,
    pub off_cpu: bool,
    pub alloc: bool,
    pub frequency_hz: u64,
}

/// Where a record goes: the burst's samples to the burst, the targets' other records
/// (off-CPU intervals, allocations) to both when asked for, everything else to the
/// always-on capture.
pub(super) struct Router {
    pids: Vec<u32>,
    burst_below: u64,
    gil: bool,
    off_cpu: bool,
    alloc: bool,
}

impl Router {
    pub(super) fn route(&self, h: &pyrometer_ebpf::SampleHeader) -> Route {
        if !self.pids.contains(&h.pid) {
            return Route::Main;
        }
        if h.flags & NOT_ON_CPU == 0 {
            return if h.aux != 0 && h.aux < self.burst_below {
                Route::Side
            } else {
                Route::Main
            };
        }
        // The GIL probes are on for the burst alone: the always-on profile has no GIL view.
        if h.flags & pyrometer_ebpf::SAMPLE_GIL_WAIT != 0 {
            return if self.gil { Route::Side } else { Route::Main };
        }
        let off_cpu = h.flags & pyrometer_ebpf::SAMPLE_OFFCPU != 0;
        let alloc = h.flags & (pyrometer_ebpf::SAMPLE_ALLOC | pyrometer_ebpf::SAMPLE_FREE) != 0;
        if (off_cpu && self.off_cpu) || (alloc && self.alloc) {
            Route::Both
        } else {
            Route::Main
        }
    }
}

pub(super) struct Burst {
    request: CaptureRequest,
    node: String,
    links: HashMap<u32, PerfEventLinkId>,
    pub(super) capture: Capture,
    period_ns: u64,
    /// Periods below this are the burst's events (the always-on period is above it).
    burst_below: u64,
    started: Instant,
    started_unix_ns: u64,
    /// CLOCK_MONOTONIC ns of the timeline's zero.
    origin_ns: u64,
    last_scan: Instant,
    /// With `--gil`: the targets' GIL probes.
    gil: Option<GilView>,
}

/// A burst's GIL view: the GIL probes on for its processes alone, while it runs.
#[derive(Default)]
struct GilView {
    /// Targets whose probes are on.
    attached: Vec<u32>,
    /// Targets whose probes are not (yet) on, with why (None: their binary's sites are still
    /// searched for). Asked again at each rescan: a process registers after its first samples.
    waiting: Vec<(u32, Option<String>)>,
    /// CLOCK_MONOTONIC ns when the probes came off.
    stopped_ns: u64,
    /// The targets' threads' run-queue delays, read at each rescan: the table's `preempted`.
    run_delays: RunDelays,
}

impl GilView {
    /// Attaches the probes of the targets still waiting, and reads the targets' run-queue
    /// delays.
    fn attach(&mut self, profiler: &mut Profiler) {
        for &pid in self
            .attached
            .iter()
            .chain(self.waiting.iter().map(|(p, _)| p))
        {
            self.run_delays.poll(pid);
        }
        for (pid, why) in &mut self.waiting {
            let python = &mut profiler.tables.python;
            match python.attach_gil_to(*pid, &mut profiler.sampler) {
                Ok(Attached::Done) => self.attached.push(*pid),
                Ok(Attached::Pending) => *why = None,
                Err(e) => *why = Some(e),
            }
        }
        let attached = &self.attached;
        self.waiting.retain(|(pid, _)| !attached.contains(pid));
    }

    fn detach(&mut self, profiler: &mut Profiler) {
        if self.stopped_ns != 0 {
            return;
        }
        for &pid in &self.attached {
            profiler
                .tables
                .python
                .detach_gil_from(pid, &mut profiler.sampler);
            self.run_delays.poll(pid);
        }
        self.stopped_ns = monotonic_now_ns();
    }

    /// The table `record --gil` prints, for the burst's threads, and a line for each target
    /// without the view. The kernel's state of those threads is forgotten after.
    fn table(&self, burst: &Burst, profiler: &mut Profiler) -> String {
        let pids = &burst.request.pids;
        let threads: Vec<_> = profiler
            .sampler
            .gil_threads()
            .into_iter()
            .filter(|(_, g)| pids.contains(&g.pid))
            .collect();
        profiler.sampler.forget_gil_threads(pids);
        let python = &mut profiler.tables.python;
        let rows = crate::python::gil_report::rows(
            &threads,
            &burst.capture.thread_samples,
            burst.period_ns,
            self.stopped_ns,
            |pid, tid| python.thread_name(pid, tid).map(|n| n.to_string()),
            |pid, tid| self.run_delays.preempted_ns(pid, tid),
        );
        let registry = &profiler.registry;
        let comm = |pid: u32| {
            registry
                .get(pid)
                .map_or_else(|| "?".to_string(), |p| p.comm.clone())
        };
        let elapsed = self.stopped_ns.saturating_sub(burst.origin_ns);
        let mut text = if threads.is_empty() {
            "GIL: no Python thread took the GIL while probed\n".to_string()
        } else {
            format!(
                "GIL over {:.1}s ({} contended waits sampled with their stacks, {:.3}s):\n{}",
                elapsed as f64 / 1e9,
                burst.capture.gil_wait_events,
                burst.capture.gil_wait_ns as f64 / 1e9,
                crate::python::gil_report::render(&rows, elapsed, comm),
            )
        };
        for (pid, why) in &self.waiting {
            let why = why
                .as_deref()
                .unwrap_or("its interpreter binary was still searched for the GIL's probe sites");
            text.push_str(&format!("GIL view unavailable for pid {pid}: {why}\n"));
        }
        text
    }
}

/// Wall-clock minus CLOCK_MONOTONIC now, in ns: the monotonic reading between two wall
/// readings, so the offset is off by at most half the (sub-microsecond) gap between them.
fn monotonic_to_unix_ns() -> i64 {
    let before = unix_now_ns();
    let mono = monotonic_now_ns();
    let after = unix_now_ns();
    let wall = before / 2 + after / 2 + (before % 2 + after % 2) / 2;
    i64::try_from(wall)
        .unwrap_or(i64::MAX)
        .saturating_sub(i64::try_from(mono).unwrap_or(i64::MAX))
}

impl Burst {
    /// Starts `request` on `profiler`, or says why it cannot run.
    pub(super) fn start(
        request: CaptureRequest,
        node: &str,
        profiler: &mut Profiler,
        sources: &Sources,
    ) -> Result<Self, Box<UploadRequest>> {
        let fail = |failure, why: String| Box::new(failed(&request, node, failure, why));
        for &pid in &request.pids {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return Err(fail(
                    Failure::Input,
                    format!("no process {pid} on node '{node}'"),
                ));
            }
        }
        let refused = |what: &str, flag: &str| {
            format!(
                "the agent of node '{node}' runs without {what} (start it with {flag} to capture them)"
            )
        };
        if request.gil && !sources.gil {
            return Err(fail(Failure::Kernel, refused("the GIL probes", "--gil")));
        }
        if request.off_cpu && !sources.off_cpu {
            return Err(fail(
                Failure::Kernel,
                refused("off-CPU sampling", "--off-cpu"),
            ));
        }
        if request.alloc && !sources.alloc {
            return Err(fail(
                Failure::Kernel,
                refused("allocation sampling", "--alloc"),
            ));
        }
        let frequency = u64::from(request.frequency_hz);
        if frequency <= sources.frequency_hz {
            return Err(fail(
                Failure::Input,
                format!(
                    "a capture samples faster than the always-on {} Hz: ask for more than that",
                    sources.frequency_hz
                ),
            ));
        }
        let period_ns = 1_000_000_000 / frequency.max(1);
        let always_on = 1_000_000_000 / sources.frequency_hz.max(1);
        let origin_ns = monotonic_now_ns();
        let mut capture =
            Capture::with_timeline(Timeline::new(DEFAULT_TIMELINE_EVENTS, origin_ns, period_ns));
        capture.off_cpu = request.off_cpu;
        capture.gil = request.gil;
        let gil = request.gil.then(|| GilView {
            waiting: request.pids.iter().map(|&p| (p, None)).collect(),
            ..GilView::default()
        });
        let mut burst = Self {
            node: node.to_string(),
            links: HashMap::new(),
            capture,
            period_ns,
            // Between the two periods: cpu-clock keeps the period it was opened with.
            burst_below: (period_ns + always_on) / 2,
            started: Instant::now(),
            started_unix_ns: unix_now_ns(),
            origin_ns,
            last_scan: Instant::now(),
            request,
            gil,
        };
        for &pid in &burst.request.pids.clone() {
            profiler.sync_pid(pid);
        }
        if let Some(gil) = burst.gil.as_mut() {
            // Measured from now: what earlier captures left is gone.
            profiler.sampler.forget_gil_threads(&burst.request.pids);
            gil.attach(profiler);
        }
        if let Err(e) = burst.scan(profiler) {
            burst.stop(profiler);
            let why = format!("node '{node}': {e}");
            return Err(Box::new(failed(&burst.request, node, Failure::Kernel, why)));
        }
        Ok(burst)
    }

    /// Gives every thread of the targets not yet sampled its event.
    fn scan(&mut self, profiler: &mut Profiler) -> Result<(), crate::bpf::BpfError> {
        self.last_scan = Instant::now();
        let frequency = u64::from(self.request.frequency_hz);
        for &pid in &self.request.pids {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for tid in tasks
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
            {
                if self.links.contains_key(&tid) || self.links.len() >= MAX_THREADS {
                    continue;
                }
                match profiler.sampler.attach_thread(tid, frequency) {
                    Ok(link) => {
                        self.links.insert(tid, link);
                    }
                    // A thread that ended between the listing and the attach.
                    Err(_) if !Path::new(&format!("/proc/{pid}/task/{tid}")).exists() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// What routes the loop's records while the burst runs.
    pub(super) fn router(&self) -> Router {
        Router {
            pids: self.request.pids.clone(),
            burst_below: self.burst_below,
            gil: self.gil.is_some(),
            off_cpu: self.request.off_cpu,
            alloc: self.request.alloc,
        }
    }

    /// A turn of the loop: new threads get their events. True when the burst is over.
    pub(super) fn tick(&mut self, profiler: &mut Profiler) -> bool {
        if self.last_scan.elapsed() >= RESCAN {
            let _ = self.scan(profiler);
            if let Some(gil) = self.gil.as_mut() {
                gil.attach(profiler);
            }
        }
        self.started.elapsed() >= Duration::from_millis(u64::from(self.request.duration_ms))
    }

    fn stop(&mut self, profiler: &mut Profiler) {
        for (_, link) in self.links.drain() {
            profiler.sampler.detach_thread(link);
        }
        if let Some(gil) = self.gil.as_mut() {
            gil.detach(profiler);
        }
    }

    /// Detaches the events and makes the result: the profile (gzipped pprof) and its
    /// timeline (a gzipped Chrome trace). The caller drains the ring buffer into
    /// [`Burst::capture`] once more after [`Burst::detach`].
    pub(super) fn detach(&mut self, profiler: &mut Profiler) {
        self.stop(profiler);
    }

    pub(super) fn finish(
        self,
        profiler: &mut Profiler,
        symbolizer: &mut Symbolizer,
    ) -> UploadRequest {
        let ended = unix_now_ns();
        // The offset as it is now: a wall clock stepped during the capture shifts the
        // timeline with it, as a reader of the node's logs would expect.
        let origin_unix_ns = u64::try_from(
            i64::try_from(self.origin_ns)
                .unwrap_or(i64::MAX)
                .saturating_add(monotonic_to_unix_ns()),
        )
        .unwrap_or(0);
        let samples = self.capture.samples;
        let text = self
            .gil
            .as_ref()
            .map(|g| g.table(&self, profiler))
            .unwrap_or_default();
        let period = i64::try_from(self.period_ns).unwrap_or(i64::MAX);
        let (profile, timeline) =
            self.capture
                .into_profile_and_timeline(&mut profiler.registry, symbolizer, period);
        let title = format!("pyrometer capture {} on {}", self.request.id, self.node);
        let mut pprof = Vec::new();
        let mut chrome = Vec::new();
        let written =
            output::write(&profile, OutputFormat::Pprof, 0, &title, &mut pprof).and_then(|()| {
                let mut gz =
                    flate2::write::GzEncoder::new(&mut chrome, flate2::Compression::fast());
                output::write_with_timeline(
                    &profile,
                    timeline.as_ref(),
                    OutputFormat::ChromeTrace,
                    0,
                    &title,
                    &mut gz,
                )?;
                gz.finish()?;
                Ok(())
            });
        if let Err(e) = written {
            return failed(&self.request, &self.node, Failure::Internal, e.to_string());
        }
        UploadRequest {
            id: self.request.id.clone(),
            node: self.node.clone(),
            pprof,
            chrome,
            started_unix_ns: self.started_unix_ns,
            ended_unix_ns: ended,
            origin_unix_ns,
            samples,
            text,
            ..Default::default()
        }
    }
}
