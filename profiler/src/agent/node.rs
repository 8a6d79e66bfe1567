//! The agent's sampling loop: the profiler, the processes it chose, and each interval's
//! capture, symbolized into a profile at every push.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant, SystemTime};

use super::burst::{Burst, Sources};
use super::captures::Channel;
use super::delivery::{Batch, Shared, spool_batch};
use super::export::Exporter;
use super::metrics::{self, AgentMetrics};
use super::metrics_server;
use super::targets::{Known, attach_own_library, scan};
use super::{AgentConfig, Log};
use crate::bpf::{AllocConfig, Feature, Filter, GpuKernelsConfig, SamplerConfig};
use crate::capture::{AllocState, Capture, LiveBlock};
use crate::command::CommandError;
use crate::gpu::kernels::probes::GpuProbes;
use crate::gpu::{self, Poller};
use crate::os::clock::monotonic_now_ns;
use crate::os::cpu_budget::CpuBudget;
use crate::os::{privileges, signals};
use crate::profiler::Profiler;
use crate::profiler::discover::{self, Discovery, Due};
use crate::symbolize::Symbolizer;

/// The longest the sampling loop sleeps between two reads of the ring buffer. Nothing read
/// here is late at a second: the kernel wakes the loop at once for what is (see
/// [`Node::turn`]), and samples wait for the push anyway. Each wake-up costs a context switch
/// and the loop's bookkeeping, which at 19 Hz cost more than the samples it found.
const POLL: Duration = Duration::from_secs(1);

/// The poll while Ray workers are sampled (and how long after the last of their samples),
/// or while new Python threads await their names.
const SHORT_POLL: Duration = Duration::from_millis(20);
const RAY_LINGER: Duration = Duration::from_secs(5);

/// How often the kernel's counters are copied to /metrics between pushes (Prometheus
/// scrapes every 15-60 s).
const COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// How long naming a push's (or a capture's) frames waits for reads of the processes' files
/// in all, at most: reads that answer slowly (a FUSE mount a process serves) cannot hold a
/// push back longer, however many files there are. A read still running goes on; what it
/// names is used from the next push on.
const READS_WAIT: Duration = Duration::from_secs(1);

/// When naming frames that starts now stops waiting for reads: [`READS_WAIT`], or the push
/// interval when that is shorter.
fn reads_wait_until(cfg: &AgentConfig) -> Instant {
    Instant::now() + READS_WAIT.min(cfg.interval)
}

/// The ring buffer, sized by CPU count: 128 KiB a CPU, 1 to 8 MiB. At 19 Hz that holds
/// seconds of samples, against a read every 200 ms (and a wake-up when a quarter is filled,
/// as in a burst of off-CPU records). Its pages count in the agent's resident set (mapped
/// twice, for records that wrap): 8 MiB on a 2-CPU node was a third of it.
fn ring_buffer_bytes() -> u32 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    (cpus.saturating_mul(128 << 10))
        .next_power_of_two()
        .clamp(1 << 20, 8 << 20)
}

pub(super) struct Node {
    profiler: Profiler,
    pub(super) metrics: Arc<AgentMetrics>,
    symbolizer: Symbolizer,
    poller: Option<Poller>,
    log: Log,
    /// With `--pid` or `--comm`: only chosen processes are sampled, each read at once.
    selective: bool,
    /// Processes are chosen by name (`--comm`, `--alloc-comm`).
    pub(super) by_name: bool,
    pub(super) discovery: Discovery,
    known: Known,
    exited: Vec<u32>,
    capture: Capture,
    interval_start: Instant,
    interval_wall: SystemTime,
    last_counters: Option<Instant>,
    told_rows_full: bool,
    ray_seen: Option<Instant>,
    names_awaited: bool,
    samples_total: u64,
    /// GPU kernels by launching stack, unless the kernel refused its probes.
    gpu_probes: Option<GpuProbes>,
    /// NVML's index of each GPU's UUID (the `gpu` label).
    nvml_index: std::collections::HashMap<String, u32>,
    /// On-demand captures from the collector, and the one running.
    channel: Option<Channel>,
    burst: Option<Burst>,
    /// CPU time spent on each process, bounded per push interval.
    cpu: CpuBudget,
}

impl Node {
    /// Loads and starts the kernel side, finds the chosen processes, serves `/metrics`,
    /// starts the GPU poller, and drops every capability the loop does not need.
    pub(super) fn open(cfg: &mut AgentConfig, log: Log) -> Result<Self, CommandError> {
        let kernel = |e: &dyn std::fmt::Display| CommandError::Kernel(e.to_string());
        // No thread before the privilege drop (credentials and capabilities are per thread):
        // the chosen processes' files are read after it, on the workers, with their deadlines.
        crate::os::workers::hold_threads();
        let selective = !cfg.pids.is_empty() || cfg.comm.is_some();
        let debug_dirs: Vec<PathBuf> = crate::symbolize::DEFAULT_DEBUG_DIRS
            .iter()
            .map(PathBuf::from)
            .collect();
        let mut profiler =
            Profiler::open(&sampler_config(cfg, selective), &debug_dirs).map_err(|e| kernel(&e))?;
        // The GIL probes go on for a capture's processes only, while it runs.
        profiler.tables.python.gil_on_request();
        // Node-wide, every process is registered at its first sample and tables of binaries
        // seen before are reused at once; building new ones is paid from a bounded budget.
        // Processes the user chose get theirs at once, whatever they cost.
        if !selective && let Some(u) = profiler.tables.unwinder.as_mut() {
            u.set_budget(crate::unwinder::Budget::limited(
                crate::unwinder::budget::NODE_RATE_NS_PER_S,
                crate::unwinder::budget::NODE_BURST_NS,
            ));
        }
        // What the kernel refused is off from here on; each says so once, and /metrics says
        // which features the agent runs without.
        for refusal in profiler.refusals() {
            log(&refusal.to_string());
        }
        if let Some(re) = &cfg.exclude_cgroup {
            profiler.registry.set_opt_out(re.clone());
        }
        let cpu = CpuBudget::new(cfg.process_cpu_budget);
        profiler.tables.set_cpu_budget(cpu.clone());
        if profiler.refused(Feature::Alloc) {
            cfg.alloc = None;
        }
        if profiler.refused(Feature::OffCpu) {
            cfg.off_cpu_min_ns = None;
        }
        if profiler.refused(Feature::Gc) {
            cfg.gc = false;
        }
        for &pid in &cfg.pids {
            profiler
                .add_target(pid, true)
                .map_err(|e| CommandError::Input(format!("adding pid {pid}: {e}")))?;
        }
        if let Some(probes) = profiler.tables.alloc.as_mut() {
            attach_own_library(probes, &mut profiler.sampler, &log);
        }
        let gpu_probes = super::gpu::open(&mut profiler, &log);
        let mut known = Known::default();
        // Opened while the agent still has CAP_NET_ADMIN, which subscribing needs.
        let by_name = cfg.comm.is_some() || cfg.alloc.as_ref().is_some_and(|a| a.comm.is_some());
        let events = by_name
            .then(|| {
                discover::open_events()
                    .map_err(|e| log(&e.to_string()))
                    .ok()
            })
            .flatten();
        let mut discovery = Discovery::new(events);
        let mut exited = Vec::new();
        let due = discovery.due(&mut exited);
        // Allocation probes (the preloaded library's copies, --alloc-comm), --gc and GPU kernel
        // probes attach uprobes to processes and libraries seen after the drop.
        let late_uprobes = profiler.tables.alloc.is_some() || cfg.gc || gpu_probes.is_some();
        let (metrics, symbolizer, poller) =
            Self::serve(cfg, &profiler, debug_dirs, late_uprobes, &log)?;
        // The processes chosen now, read on the workers: a file that never answers (a FUSE
        // mount a process serves, out of the mount table) holds one worker up to the read's
        // deadline, not the agent's start. Tables for the processes already known before
        // sampling starts, so their first samples unwind fully (each read waited for up to
        // its deadline); with neither --pid nor --comm, new processes get theirs when their
        // first sample arrives.
        profiler.tables.set_waiting(true);
        scan(&mut profiler, cfg, &mut known, &due, &log);
        for &pid in &cfg.pids {
            profiler.sync_pid(pid);
        }
        profiler.tables.set_waiting(false);
        profiler.start().map_err(|e| kernel(&e))?;
        let symbolizer = symbolizer.with_cpu_budget(cpu.clone());
        let nvml_index = super::gpu::nvml_index(poller.as_ref());
        let gpu = gpu_probes.is_some().then_some(&nvml_index);
        let capture = new_capture(cfg, &profiler, selective, Default::default(), None, gpu);
        Ok(Self {
            profiler,
            metrics,
            symbolizer,
            poller,
            log,
            selective,
            by_name,
            discovery,
            known,
            exited,
            capture,
            interval_start: Instant::now(),
            interval_wall: SystemTime::now(),
            last_counters: None,
            told_rows_full: false,
            ray_seen: None,
            names_awaited: false,
            samples_total: 0,
            gpu_probes,
            nvml_index,
            channel: None,
            burst: None,
            cpu,
        })
    }

    /// Binds `/metrics`, makes the symbolizer, drops the capabilities, starts the GPU poller
    /// and the metrics server (threads start only once the capabilities are gone: they are
    /// per thread).
    fn serve(
        cfg: &AgentConfig,
        profiler: &Profiler,
        debug_dirs: Vec<PathBuf>,
        late_uprobes: bool,
        log: &Log,
    ) -> Result<(Arc<AgentMetrics>, Symbolizer, Option<Poller>), CommandError> {
        let metrics_listener = match cfg.metrics_listen {
            Some(addr) => Some(std::net::TcpListener::bind(addr).map_err(|e| {
                CommandError::Input(format!("cannot serve metrics on {addr}: {e}"))
            })?),
            None => None,
        };
        // Read whole while root, before the capability drop: a later read of an address the
        // kept file does not cover would see zeros, and one read a run costs nothing here.
        let mut symbolizer = Symbolizer::new()
            .without_kallsyms_cache()
            .with_debug_dirs(debug_dirs)
            .with_dwarf_budget(cfg.dwarf_budget_bytes)
            .with_process_budget(cfg.process_budget_bytes);
        if let Some(d) = &cfg.debuginfod {
            symbolizer = symbolizer.with_debuginfod(d.clone());
            // Made while root, for the user the agent becomes, which writes and evicts in it.
            if let Some(client) = symbolizer.debuginfod() {
                client.prepare(cfg.run_as).map_err(|e| {
                    CommandError::Input(format!(
                        "cannot make the debuginfod cache {}: {e} (choose another with --debuginfod-cache)",
                        d.cache_dir.display()
                    ))
                })?;
                log(&format!(
                    "debug files fetched from {} into {}",
                    d.urls.join(" "),
                    d.cache_dir.display()
                ));
            }
        }
        // Kernel symbol addresses read as zeros without CAP_SYSLOG, which goes with the drop.
        if !symbolizer.kernel_available() || symbolizer.kernel_restricted() {
            log("kernel symbols unreadable (/proc/kallsyms): kernel frames stay addresses");
        }
        let keep = kept_capabilities(cfg.run_as, late_uprobes, log);
        // Everything privileged is open now. Before the first thread starts, so that every
        // thread runs as the unprivileged user with the reduced sets.
        if let Some((uid, gid)) = cfg.run_as {
            privileges::become_user(uid, gid).map_err(|e| {
                CommandError::Kernel(format!("cannot become uid {uid} after attaching: {e}"))
            })?;
            log(&format!("running as uid {uid}, gid {gid}"));
        }
        let kept = privileges::drop_all_but(&keep).map_err(|e| {
            CommandError::Kernel(format!("cannot drop capabilities after attaching: {e}"))
        })?;
        log(&format!(
            "capabilities reduced to {}",
            privileges::names(kept).join(", ")
        ));
        let metrics = Arc::new(AgentMetrics::default());
        let _ = metrics.refused.set(
            profiler
                .refusals()
                .iter()
                .map(|r| (r.feature.key(), r.program.clone()))
                .collect(),
        );
        let poller = start_gpu(cfg, &metrics, log)?;
        if let Some(listener) = metrics_listener {
            let bound = metrics_server::serve_on(listener, metrics.clone())
                .map_err(|e| CommandError::Input(format!("cannot serve metrics: {e}")))?;
            log(&format!("metrics on http://{bound}/metrics"));
        }
        // NVML's own system calls (its ioctls on /dev/nvidia*, its threads) have not been
        // checked on a real GPU: while it is loaded, calls outside the list are logged.
        let mode = match (cfg.seccomp, &poller) {
            (super::SeccompMode::Kill, Some(_)) => {
                log(
                    "NVML loaded: the seccomp filter logs calls outside its list instead of killing",
                );
                super::SeccompMode::Log
            }
            (mode, _) => mode,
        };
        crate::os::seccomp::install(mode).map_err(|e| CommandError::Kernel(e.to_string()))?;
        if mode != super::SeccompMode::Off {
            log(&format!(
                "seccomp filter installed ({} system calls; others {})",
                crate::os::seccomp::AGENT_SYSCALLS.len(),
                if mode == super::SeccompMode::Kill {
                    "kill the agent"
                } else {
                    "are logged"
                }
            ));
        }
        crate::os::workers::release_threads();
        Ok((metrics, symbolizer, poller))
    }

    /// Samples until told to stop, pushing every interval (and once more at the stop).
    pub(super) fn run(&mut self, cfg: &AgentConfig, shared: &Shared, otlp: Option<&Exporter>) {
        loop {
            let stopping = self.turn(cfg);
            if stopping {
                // The last push holds every sample: those waiting for their tables too.
                self.profiler.release_held(&mut self.capture, true);
            }
            let push_due = stopping || self.interval_start.elapsed() >= cfg.interval;
            // Some 25 map reads, a system call each: every few seconds, and with each push
            // so that /metrics agrees with what was pushed.
            if push_due
                || self
                    .last_counters
                    .is_none_or(|t| t.elapsed() >= COUNTERS_EVERY)
            {
                self.last_counters = Some(Instant::now());
                self.publish_counters();
            }
            if push_due {
                self.push(cfg, shared, otlp);
            }
            if stopping {
                break;
            }
        }
    }

    /// One turn of the loop: reads the ring buffer, brings tables up to date, looks for new
    /// processes chosen by name. True when the agent was told to stop.
    fn turn(&mut self, cfg: &AgentConfig) -> bool {
        // The kernel wakes the agent at once for what cannot wait (a new process, an exec, a
        // mapping it has no table for, a filling ring buffer); the rest is read in batches.
        // At 19 Hz on a few CPUs a wake-up every 20 ms found about one sample, and the
        // wake-ups with their counter reads cost more than the samples. A Ray worker's task
        // label is read from its title when its samples are read, and tasks can be short:
        // while Ray workers are sampled, the loop reads as often as it used to. So are
        // Python threads' names (a new thread's first sample wakes the loop): while a new
        // thread has none yet, `threading` may register it any moment, and a short thread
        // takes its name with it when it ends.
        let ray = self.ray_seen.is_some_and(|t| t.elapsed() < RAY_LINGER);
        // So are reads handed to the workers: a new process's tables and Python
        // registration are taken on the turn after they come back.
        let reads = self.profiler.tables.reads_due();
        let mut wait = if ray || self.names_awaited || self.burst.is_some() || reads {
            SHORT_POLL
        } else {
            POLL
        };
        // So is a look at a process's asyncio objects, on its back-off: the samples taken
        // before it have no task chain.
        if let Some(at) = self.profiler.tables.python.next_async_look() {
            let until = at.saturating_duration_since(Instant::now());
            wait = wait.min(until.clamp(SHORT_POLL, POLL));
        }
        self.profiler.wait(wait);
        // Taken before the ring buffer is read: what the kernel wrote before the signal is
        // then in the last push (a signal taken after the read left out what came between).
        let stopping = signals::take().is_some();
        self.drain();
        for pid in std::mem::take(&mut self.capture.execs) {
            self.register_exec(pid);
        }
        if std::mem::take(&mut self.capture.ray_seen) {
            self.ray_seen = Some(Instant::now());
        }
        self.names_awaited = self
            .capture
            .read_awaited_names(&mut self.profiler.tables.python);
        // A process with its own copy of the GPU library (a container image's).
        if let Some(probes) = self.gpu_probes.as_mut() {
            super::gpu::attach_mapped(
                probes,
                &mut self.profiler,
                &self.capture.maps_changed,
                &self.log,
            );
        }
        self.profiler.sync(&mut self.capture);
        self.captures_turn(cfg);
        for notice in self.profiler.tables.python.take_notices() {
            (self.log)(&notice);
        }
        if self.by_name {
            self.exited.clear();
            let due = self.discovery.due(&mut self.exited);
            for &pid in &self.exited {
                self.known.exited(pid);
            }
            if due != Due::Nothing || self.known.alloc_loading() {
                scan(&mut self.profiler, cfg, &mut self.known, &due, &self.log);
            }
            self.metrics
                .process_event_overflows
                .store(self.discovery.overflows, Relaxed);
        }
        stopping
    }

    /// Node-wide, an exec is read at the process's first sample, unless the program's table
    /// is loaded already (it ran before): then it is registered now, so that its first
    /// samples unwind from the loader on, and a short process (a shell pipeline's, a
    /// compiler driver's) whose only sample is its first is complete too. At exec only the
    /// program and the loader are mapped; the libraries come at the first sample that finds
    /// one. Costs a read of one line of the maps for a program never seen.
    fn register_exec(&mut self, pid: u32) {
        let registry = &mut self.profiler.registry;
        if registry.opted_out(pid) {
            return;
        }
        let known = self
            .profiler
            .tables
            .unwinder
            .as_ref()
            .is_some_and(|u| registry.exe_key(pid).is_some_and(|k| u.has_table(&k)));
        if known && registry.exec(pid).is_ok() && self.capture.pids.insert(pid) {
            self.capture.maps_changed.push(pid);
        }
    }

    /// Reads the ring buffer into the interval's capture, and a running burst's samples into
    /// the burst's.
    fn drain(&mut self) {
        match self.burst.as_mut() {
            Some(b) => {
                let router = b.router();
                self.profiler
                    .drain_routed(&mut self.capture, &mut b.capture, |h| router.route(h));
                // Tables follow the burst's processes too.
                let changed = std::mem::take(&mut b.capture.maps_changed);
                self.capture.maps_changed.extend(changed);
            }
            None => self.profiler.drain(&mut self.capture),
        }
    }

    /// The channel from the collector, once its threads run.
    pub(super) fn set_channel(&mut self, channel: Option<Channel>) {
        self.channel = channel;
    }

    /// Ends a burst that is over (its result uploaded) and starts the requests that came.
    fn captures_turn(&mut self, cfg: &AgentConfig) {
        if self.channel.is_none() {
            return;
        }
        if let Some(b) = self.burst.as_mut()
            && b.tick(&mut self.profiler)
        {
            b.detach(&mut self.profiler);
            // Samples of the closed events may still be on their way to the ring buffer.
            std::thread::sleep(Duration::from_millis(20));
            self.drain();
            let mut b = self.burst.take().expect("checked above");
            // Its samples still waiting for their tables count in it, as they can now.
            self.profiler
                .release_held_routed(&mut self.capture, &mut b.capture);
            b.capture
                .name_late_threads(&mut self.profiler.tables.python);
            self.symbolizer.wait_for_reads_until(reads_wait_until(cfg));
            let result = b.finish(&mut self.profiler, &mut self.symbolizer);
            (self.log)(&format!(
                "capture {} done: {} samples",
                result.id, result.samples
            ));
            self.upload(result);
        }
        while let Some(request) = self
            .channel
            .as_ref()
            .and_then(|c| c.requests.try_recv().ok())
        {
            if self.burst.is_some() {
                let why = format!("node '{}' runs a capture already", cfg.node);
                let failed = super::captures::failed(
                    &request,
                    &cfg.node,
                    pyrometer_proto::capture::Failure::Internal,
                    why,
                );
                self.upload(failed);
                continue;
            }
            let sources = Sources {
                gil: cfg.gil && !self.profiler.refused(Feature::Gil),
                off_cpu: cfg.off_cpu_min_ns.is_some(),
                alloc: self.profiler.tables.alloc.is_some(),
                frequency_hz: self.profiler.frequency_hz(),
            };
            let id = request.id.clone();
            match Burst::start(request, &cfg.node, &mut self.profiler, &sources) {
                Ok(b) => {
                    (self.log)(&format!("capture {id} started"));
                    self.burst = Some(b);
                }
                Err(failed) => {
                    (self.log)(&format!("capture {id} refused: {}", failed.error));
                    self.upload(*failed);
                }
            }
        }
    }

    fn upload(&self, result: pyrometer_proto::capture::UploadRequest) {
        if let Some(c) = self.channel.as_ref()
            && c.uploads.try_send(result).is_err()
        {
            (self.log)("capture results queue full: a result was dropped");
        }
    }

    /// Copies the kernel's counters and the unwind tables' to /metrics, and says once when
    /// the node's processes need more unwind rows than it was given.
    fn publish_counters(&mut self) {
        let unwinder = self.profiler.tables.unwinder.as_ref().map(|u| u.stats());
        let c = self.profiler.sampler.counters();
        metrics::publish_counters(
            &self.metrics,
            &c,
            self.samples_total + self.capture.samples,
            unwinder,
            self.profiler.held_stats(),
        );
        super::gpu::publish_stats(&self.metrics, &self.capture);
        if let Some(u) = unwinder
            && u.tables_too_big > 0
            && !self.told_rows_full
        {
            self.told_rows_full = true;
            (self.log)(&format!(
                "unwind tables no longer fit in --unwind-rows {}: those executables are walked by frame pointers (pyrometer_agent_unwind_tables_too_big_total); a larger --unwind-rows keeps them",
                u.rows_capacity
            ));
        }
    }

    /// Ends the interval: its capture becomes a profile that is spooled (and exported), and
    /// what carries over (blocked threads, live blocks) starts the next one.
    fn push(&mut self, cfg: &AgentConfig, shared: &Shared, otlp: Option<&Exporter>) {
        if cfg.off_cpu_min_ns.is_some() {
            // Threads blocked across the push still count in it (an idle worker would
            // otherwise be missing until it wakes).
            self.profiler
                .flush_off_cpu(&mut self.capture, monotonic_now_ns());
        }
        let reported = std::mem::take(&mut self.capture.off_cpu_reported);
        // The push reports what is in use now; the blocks stay live for the next one.
        // Blocks of processes that exited are no longer in use: they are forgotten.
        let live = self.capture.alloc.as_mut().map(|a| {
            a.now_ns = monotonic_now_ns();
            a.forget_exited(Path::new("/proc"));
            a.live.clone()
        });
        self.capture
            .name_late_threads(&mut self.profiler.tables.python);
        let gpu = self.gpu_probes.is_some().then_some(&self.nvml_index);
        let next = new_capture(cfg, &self.profiler, self.selective, reported, live, gpu);
        let mut taken = std::mem::replace(&mut self.capture, next);
        // Launches whose device records have not come yet are joined in the next push.
        let gpu_records = super::gpu::end_interval(&self.metrics, &mut taken, &mut self.capture);
        let duration = self.interval_start.elapsed();
        self.interval_start = Instant::now();
        let wall = std::mem::replace(&mut self.interval_wall, SystemTime::now());
        self.samples_total += taken.samples;
        self.metrics
            .lost_bad_record
            .fetch_add(taken.bad_records, Relaxed);
        self.metrics
            .opted_out_samples
            .fetch_add(taken.opted_out, Relaxed);
        // Taken every interval, so usage does not pile up while nothing is sampled.
        let gpu_usage = self
            .poller
            .as_ref()
            .map(|p| p.state().lock().expect("not poisoned").take_process_usage());
        {
            let mut gc = self.metrics.gc.lock().expect("not poisoned");
            for (pid, pauses) in std::mem::take(&mut taken.gc_pauses) {
                let comm = self
                    .profiler
                    .registry
                    .get(pid)
                    .map(|p| p.comm.clone())
                    .unwrap_or_default();
                gc.add(pid, &comm, &pauses);
            }
            // A process's series ends a push after it.
            gc.forget_exited(Path::new("/proc"));
            gc.probed_binaries = self
                .profiler
                .tables
                .python
                .gc_probes()
                .map_or(0, |p| p.binaries.len() as u64);
        }
        let allocations = taken
            .alloc
            .as_ref()
            .is_some_and(|a| !a.live.is_empty() || a.samples > 0);
        if taken.samples > 0
            || taken.off_cpu_events > 0
            || taken.gc_events > 0
            || allocations
            || gpu_records > 0
        {
            let period_ns = self.profiler.period_ns();
            self.symbolizer.take_debug_files();
            self.symbolizer.wait_for_reads_until(reads_wait_until(cfg));
            let mut profile =
                taken.into_profile(&mut self.profiler.registry, &mut self.symbolizer, period_ns);
            if let Some(usage) = &gpu_usage {
                gpu::label_profile(&mut profile, &gpu::gpus_by_pid(usage));
            }
            let batch = Batch {
                node: &cfg.node,
                wall,
                duration,
                otlp,
                spool: cfg.collector.is_some(),
            };
            if let Err(e) = spool_batch(shared, batch, profile) {
                (self.log)(&format!("cannot spool a batch: {e}"));
            }
        }
        self.symbolizer.release_files();
        self.metrics.read_readers(
            &self.symbolizer.stats(),
            self.profiler.tables.unwinder.as_ref().map(|u| u.stats()),
            &self.profiler.tables.python.stats(),
        );
        if let Some(d) = self.symbolizer.debuginfod() {
            *self.metrics.debuginfod.lock().expect("not poisoned") = Some(d.stats());
        }
        self.metrics
            .processes_over_cpu_budget
            .store(self.cpu.went_over(), Relaxed);
        // A new interval: the processes whose work was put off for their budget take it up.
        let put_off = self.cpu.next_interval();
        self.capture.maps_changed.extend(put_off);
        // The interval's samples are symbolized: processes gone since are not needed.
        self.profiler.registry.forget_exited();
        self.symbolizer.forget_exited(&self.profiler.registry);
        // The interval's profile and symbolization scratch are freed now: hand the pages
        // back rather than keep the heap at its peak until the next push.
        // SAFETY: malloc_trim only releases free memory of the allocator.
        unsafe { libc::malloc_trim(0) };
    }
}

/// What the kernel side is loaded with for the agent.
fn sampler_config(cfg: &AgentConfig, selective: bool) -> SamplerConfig {
    SamplerConfig {
        frequency_hz: cfg.frequency,
        filter: if selective {
            Filter::Targets
        } else {
            Filter::All
        },
        ring_buffer_bytes: ring_buffer_bytes(),
        unwind_rows: cfg.unwind_rows,
        btf_path: crate::bpf::btf_path_or_default(cfg.btf_path.as_deref()),
        off_cpu_min_ns: cfg.off_cpu_min_ns,
        gil: cfg.gil,
        gc: cfg.gc,
        asyncio: cfg.asyncio,
        // Always: processes that preload the sampler library are sampled without flags
        // (their probes fire only when they sample); --alloc-pid/--alloc-comm add uprobes.
        alloc: Some(AllocConfig {
            sample_bytes: alloc_mean(cfg),
            live_entries: crate::bpf::DEFAULT_ALLOC_LIVE,
            own_targets: true,
        }),
        // Always: processes started with the GPU library are recorded without flags (its
        // probes fire only in them): every one node-wide, or those --pid and --comm choose.
        gpu_kernels: Some(GpuKernelsConfig { all: !selective }),
        dwarf: cfg.dwarf,
        debug_reject: cfg.debug_reject,
    }
}

fn alloc_mean(cfg: &AgentConfig) -> u64 {
    cfg.alloc
        .as_ref()
        .map_or(crate::bpf::DEFAULT_ALLOC_SAMPLE_BYTES, |a| a.sample_bytes)
}

/// An interval's capture. Off-CPU intervals still open and live sampled blocks carry over
/// from one interval's capture to the next. Without --alloc-* the allocation types appear
/// once a preloaded process has reported (capture.alloc_on_preload), and stay.
fn new_capture(
    cfg: &AgentConfig,
    profiler: &Profiler,
    selective: bool,
    reported: std::collections::HashMap<u32, (u64, u64, bool)>,
    live: Option<std::collections::HashMap<(u32, u64), LiveBlock>>,
    gpu: Option<&std::collections::HashMap<String, u32>>,
) -> Capture {
    let mean = alloc_mean(cfg);
    let mut c = Capture::default();
    c.gpu = gpu.map(super::gpu::capture);
    // Node-wide, most processes are never sampled; chosen ones are read at once.
    c.exec_lazily = !selective;
    c.off_cpu = cfg.off_cpu_min_ns.is_some();
    c.gc = cfg.gc;
    c.off_cpu_reported = reported;
    c.alloc_on_preload = profiler.tables.alloc.is_some().then_some(mean);
    if cfg.alloc.is_some() || live.is_some() {
        let mut a = AllocState::new(mean);
        a.live = live.unwrap_or_default();
        c.alloc = Some(a);
    }
    c
}

/// The GPU poller, when polling is on and NVML loads. A missing driver or a lost GPU never
/// stops the agent: it samples CPUs without them.
fn start_gpu(
    cfg: &AgentConfig,
    metrics: &AgentMetrics,
    log: &Log,
) -> Result<Option<Poller>, CommandError> {
    let Some((interval, lib)) = &cfg.gpu else {
        return Ok(None);
    };
    let source = match gpu::NvmlSource::open(lib) {
        Ok(s) => s,
        Err(e) => {
            log(&format!("GPU source off: {e}"));
            return Ok(None);
        }
    };
    let devices = source.devices().len();
    // /metrics shows the latest poll and labels use the per-interval usage: the agent keeps
    // no history, however long it runs.
    let p = Poller::start(source, *interval, devices.max(1))
        .map_err(|e| CommandError::Input(format!("starting the GPU poller: {e}")))?;
    let _ = metrics.gpu.set(p.state());
    log(&format!(
        "polling {devices} GPU{} every {:.3}s",
        if devices == 1 { "" } else { "s" },
        interval.as_secs_f64()
    ));
    Ok(Some(p))
}

/// What the agent keeps once attached: [`privileges::AGENT_KEEPS`], and CAP_SYS_ADMIN as
/// well where the kernel refuses uprobe perf events without it and uprobes are attached
/// after the drop (else every one of them would fail with EACCES). A forked child tries it
/// first, dropping exactly as the agent will.
fn kept_capabilities(
    run_as: Option<(u32, u32)>,
    late_uprobes: bool,
    log: &Log,
) -> Vec<privileges::Capability> {
    let mut keep = privileges::AGENT_KEEPS.to_vec();
    if !late_uprobes {
        return keep;
    }
    match crate::os::uprobe_access::refused_after_drop(run_as, &keep) {
        Ok(false) => {}
        Ok(true) => {
            log(
                "keeping CAP_SYS_ADMIN: this kernel refuses uprobes without it, and allocation, \
                 --gc or GPU kernel probes attach uprobes to processes seen after the drop",
            );
            keep.push(privileges::CAP_SYS_ADMIN);
        }
        Err(e) => log(&format!(
            "cannot check whether uprobes open after the drop ({e}): uprobes on processes \
             seen later may be refused"
        )),
    }
    keep
}
