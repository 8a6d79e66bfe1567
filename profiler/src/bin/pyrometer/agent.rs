//! `pyrometer agent`: the always-on node daemon. It samples (19 Hz by default), aggregates each
//! push interval into one profile, writes it to the spool, and a pusher thread sends spooled
//! batches to the collector oldest first, deleting each only once it is acknowledged.

use std::collections::HashSet;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Args;
use prost::Message;
use pyrometer::agent_metrics::{self, AgentMetrics};
use pyrometer::bpf::{Filter, Sampler, SamplerConfig};
use pyrometer::capture::Capture;
use pyrometer::gpu::{self, Poller};
use pyrometer::model::Labels;
use pyrometer::procs::ProcessRegistry;
use pyrometer::push::PushClient;
use pyrometer::spool::Spool;
use pyrometer::symbolize::Symbolizer;
use pyrometer::{privileges, signals};
use pyrometer_proto::ingest::PushRequest;
use regex::Regex;
use serde::Deserialize;

use crate::gpu::NvmlArgs;
use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error, parse_duration};

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// TOML file with the same settings as the flags (flags win), e.g. `collector = "http://c:4040"`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Process to profile (repeatable); default: every process.
    #[arg(short, long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Profile processes whose name (comm) matches this regex, including ones started later.
    #[arg(long, value_name = "REGEX")]
    comm: Option<String>,
    /// Collector to push to, e.g. http://collector:4040.
    #[arg(long, value_name = "URL")]
    collector: Option<String>,
    /// The `node` label of everything this agent pushes (default: the hostname).
    #[arg(long)]
    node_name: Option<String>,
    /// How often a profile is aggregated and pushed (default 10s).
    #[arg(long, value_parser = parse_duration)]
    push_interval: Option<Duration>,
    /// Samples per second per CPU (default 19).
    #[arg(short = 'F', long)]
    frequency: Option<u64>,
    /// Where batches wait for the collector (default /var/lib/pyrometer/spool).
    #[arg(long, value_name = "DIR")]
    spool_dir: Option<PathBuf>,
    /// Spool size limit in MiB; when full the oldest batches are dropped (default 256).
    #[arg(long, value_name = "MIB")]
    spool_max_mb: Option<u64>,
    /// File holding the collector's bearer token.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// PEM file of the CA that signed an https:// collector's certificate (default: the
    /// system's roots).
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Serve the agent's own Prometheus /metrics on this address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// On exit, write what was sampled, pushed, dropped and left spooled as JSON here.
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// How to walk user stacks: `dwarf` (in-kernel .eh_frame unwinding, frame pointers where a
    /// binary has no table; the default) or `fp` (frame pointers only).
    #[arg(long, value_parser = ["dwarf", "fp"])]
    unwind: Option<String>,
    /// Also measure off-CPU time of the targets (as `record --off-cpu`): blocked time by the
    /// stack that blocked, the `off_cpu/nanoseconds` type; a long block is reported in every
    /// push it spans, counted once.
    #[arg(long)]
    off_cpu: bool,
    /// Shortest blocked interval counted with --off-cpu (default 1ms).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    off_cpu_min: Option<Duration>,
    /// Capacity of the node's unwind row array, shared by all tables (default 1048576 rows,
    /// 16 MiB of kernel memory).
    #[arg(long, value_name = "ROWS")]
    unwind_rows: Option<u32>,
    /// Do not poll the GPUs. By default the agent polls them whenever NVML loads (and says
    /// "GPU source off" once when it does not): gauges on /metrics, and `gpu` and
    /// `gpu_memory` labels on the samples of processes that use a GPU.
    #[arg(long)]
    no_gpu: bool,
    #[command(flatten)]
    nvml: NvmlArgs,
    /// Kernel BTF to load against (default /sys/kernel/btf/vmlinux).
    #[arg(long, value_name = "FILE", hide = true)]
    btf_path: Option<PathBuf>,
}

/// The config file: the flags' long names, in kebab case.
#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileConfig {
    pid: Option<Vec<u32>>,
    comm: Option<String>,
    collector: Option<String>,
    node_name: Option<String>,
    push_interval: Option<String>,
    frequency: Option<u64>,
    spool_dir: Option<PathBuf>,
    spool_max_mb: Option<u64>,
    token_file: Option<PathBuf>,
    ca: Option<PathBuf>,
    metrics_listen: Option<SocketAddr>,
    unwind: Option<String>,
    unwind_rows: Option<u32>,
    off_cpu: Option<bool>,
    off_cpu_min: Option<String>,
    gpu: Option<bool>,
    gpu_interval: Option<String>,
    nvml_lib: Option<PathBuf>,
}

struct Config {
    pids: Vec<u32>,
    comm: Option<Regex>,
    collector: String,
    node: String,
    interval: Duration,
    frequency: u64,
    spool_dir: PathBuf,
    spool_max_bytes: u64,
    token: Option<String>,
    ca: Option<PathBuf>,
    metrics_listen: Option<SocketAddr>,
    dwarf: bool,
    unwind_rows: u32,
    /// The shortest blocked interval counted, when off-CPU time is measured.
    off_cpu_min_ns: Option<u64>,
    /// GPU polling: the interval and the NVML library, or None when off.
    gpu: Option<(Duration, OsString)>,
}

fn input(msg: impl Into<String>) -> anyhow::Error {
    exit_error(EXIT_INPUT, msg)
}

fn resolve(args: &AgentArgs) -> anyhow::Result<Config> {
    let file: FileConfig = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| input(format!("cannot read {}: {e}", path.display())))?;
            toml::from_str(&text)
                .map_err(|e| input(format!("{}: {}", path.display(), e.message())))?
        }
        None => FileConfig::default(),
    };
    let pids = if args.pids.is_empty() {
        file.pid.unwrap_or_default()
    } else {
        args.pids.clone()
    };
    let comm = match args.comm.clone().or(file.comm) {
        Some(re) => Some(
            Regex::new(&format!("^(?:{re})$"))
                .map_err(|e| input(format!("invalid --comm regex '{re}': {e}")))?,
        ),
        None => None,
    };
    let collector = args.collector.clone().or(file.collector).ok_or_else(|| {
        input("no collector: give --collector http://HOST:4040 (or `collector` in --config)")
    })?;
    let interval = match (args.push_interval, file.push_interval) {
        (Some(d), _) => d,
        (None, Some(s)) => parse_duration(&s).map_err(|e| input(format!("push-interval: {e}")))?,
        (None, None) => Duration::from_secs(10),
    };
    let frequency = args.frequency.or(file.frequency).unwrap_or(19);
    if !(1..=10_000).contains(&frequency) {
        return Err(input("frequency must be between 1 and 10000 Hz"));
    }
    let token = match args.token_file.clone().or(file.token_file) {
        Some(path) => {
            let t = std::fs::read_to_string(&path).map_err(|e| {
                input(format!(
                    "cannot read the token file {}: {e}",
                    path.display()
                ))
            })?;
            Some(t.trim().to_string()).filter(|t| !t.is_empty())
        }
        None => None,
    };
    let node = match args.node_name.clone().or(file.node_name) {
        Some(n) if !n.is_empty() => n,
        _ => hostname(),
    };
    let gpu = if args.no_gpu || file.gpu == Some(false) {
        None
    } else {
        let interval = match (args.nvml.gpu_interval, file.gpu_interval) {
            (Some(d), _) => d,
            (None, Some(s)) => {
                crate::gpu::parse_interval(&s).map_err(|e| input(format!("gpu-interval: {e}")))?
            }
            (None, None) => crate::gpu::DEFAULT_INTERVAL,
        };
        // Flag, then environment, then the file: as for every other setting, the most
        // local wins.
        let lib = match (&args.nvml.nvml_lib, file.nvml_lib) {
            (Some(_), _) | (None, None) => args.nvml.library(),
            (None, Some(path)) => std::env::var_os("PYROMETER_NVML_LIB")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| path.into_os_string()),
        };
        Some((interval, lib))
    };
    Ok(Config {
        gpu,
        pids,
        comm,
        collector,
        node,
        interval,
        frequency,
        spool_dir: args
            .spool_dir
            .clone()
            .or(file.spool_dir)
            .unwrap_or_else(|| PathBuf::from("/var/lib/pyrometer/spool")),
        spool_max_bytes: args.spool_max_mb.or(file.spool_max_mb).unwrap_or(256) << 20,
        token,
        ca: args.ca.clone().or(file.ca),
        metrics_listen: args.metrics_listen.or(file.metrics_listen),
        dwarf: match args.unwind.clone().or(file.unwind).as_deref() {
            None | Some("dwarf") => true,
            Some("fp") => false,
            Some(other) => {
                return Err(input(format!("unwind must be dwarf or fp, not '{other}'")));
            }
        },
        unwind_rows: args.unwind_rows.or(file.unwind_rows).unwrap_or(1 << 20),
        off_cpu_min_ns: if args.off_cpu || file.off_cpu == Some(true) {
            let min = match (args.off_cpu_min, file.off_cpu_min) {
                (Some(d), _) => d,
                (None, Some(s)) => {
                    parse_duration(&s).map_err(|e| input(format!("off-cpu-min: {e}")))?
                }
                (None, None) => pyrometer::bpf::DEFAULT_OFF_CPU_MIN,
            };
            Some(u64::try_from(min.as_nanos()).unwrap_or(u64::MAX))
        } else {
            None
        },
    })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// What the sampling loop and the pusher thread share.
struct Shared {
    spool: Mutex<Spool>,
    wake: Condvar,
    stop: AtomicBool,
    metrics: Arc<AgentMetrics>,
}

impl Shared {
    fn update_spool_gauges(&self, spool: &Spool) {
        self.metrics
            .spool_batches
            .store(spool.len() as u64, Relaxed);
        self.metrics.spool_bytes.store(spool.size_bytes(), Relaxed);
    }
}

pub fn run(args: AgentArgs) -> anyhow::Result<u8> {
    // First thing: a SIGTERM during start-up (BPF verification takes a while) must stop the
    // agent cleanly, not kill it.
    signals::install();
    let cfg = resolve(&args)?;
    let client = PushClient::new(
        &cfg.collector,
        cfg.token.as_deref(),
        cfg.ca.as_deref(),
        Duration::from_secs(5),
    )
    .map_err(|e| input(e.to_string()))?;
    let spool = Spool::open(&cfg.spool_dir, cfg.spool_max_bytes, &cfg.node)
        .map_err(|e| input(e.to_string()))?;
    privileges::check(privileges::SAMPLING, privileges::effective())
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    let selective = !cfg.pids.is_empty() || cfg.comm.is_some();
    let mut sampler = Sampler::load(&SamplerConfig {
        frequency_hz: cfg.frequency,
        filter: if selective {
            Filter::Targets
        } else {
            Filter::All
        },
        ring_buffer_bytes: 8 << 20,
        unwind_rows: cfg.unwind_rows,
        btf_path: pyrometer::bpf::btf_path_or_default(args.btf_path.as_deref()),
        off_cpu_min_ns: cfg.off_cpu_min_ns,
        gil: false,
    })
    .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    for &pid in &cfg.pids {
        sampler
            .add_target(pid, true)
            .with_context(|| format!("adding pid {pid}"))?;
    }
    let mut unwinder = if cfg.dwarf {
        Some(
            sampler
                .unwinder()
                .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?,
        )
    } else {
        None
    };
    let mut python = sampler
        .python_tracker()
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    let mut registry = ProcessRegistry::new();
    let mut known: HashSet<u32> = HashSet::new();
    if let Some(re) = &cfg.comm {
        add_matching(
            &mut sampler,
            unwinder.as_mut(),
            &mut registry,
            re,
            &mut known,
        );
    }
    // Tables for the processes already known, so their first samples unwind fully; with
    // neither --pid nor --comm, new processes get theirs when their first sample arrives.
    for &pid in &cfg.pids {
        if let Ok(p) = registry.observe(pid) {
            if let Some(u) = unwinder.as_mut() {
                let _ = u.sync_process(p);
            }
            python.sync(p, None);
        }
    }
    sampler
        .start(cfg.frequency)
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;

    let metrics_listener = match cfg.metrics_listen {
        Some(addr) => Some(
            std::net::TcpListener::bind(addr)
                .map_err(|e| input(format!("cannot serve metrics on {addr}: {e}")))?,
        ),
        None => None,
    };
    let mut symbolizer = Symbolizer::new().with_debug_dirs(
        pyrometer::symbolize::DEFAULT_DEBUG_DIRS
            .iter()
            .map(PathBuf::from)
            .collect(),
    );
    // Kernel symbol addresses read as zeros without CAP_SYSLOG, which goes with the drop.
    if !symbolizer.kernel_available() || symbolizer.kernel_restricted() {
        eprintln!(
            "pyrometer agent: kernel symbols unreadable (/proc/kallsyms): kernel frames stay addresses"
        );
    }
    // Everything privileged is open now. Before the first thread starts, so that every
    // thread runs with the reduced sets.
    let kept = privileges::drop_all_but(privileges::AGENT_KEEPS).map_err(|e| {
        exit_error(
            EXIT_PRIVILEGES,
            format!("cannot drop capabilities after attaching: {e}"),
        )
    })?;
    eprintln!(
        "pyrometer agent: capabilities reduced to {}",
        privileges::names(kept).join(", ")
    );

    let metrics = Arc::new(AgentMetrics::default());
    // A missing driver or a lost GPU never stops the agent: it samples CPUs without them.
    let poller = match &cfg.gpu {
        Some((interval, lib)) => match crate::gpu::open_or_info(lib, "pyrometer agent") {
            Some(source) => {
                let devices = source.devices().len();
                // /metrics shows the latest poll and labels use the per-interval usage:
                // the agent keeps no history, however long it runs.
                let p = Poller::start(source, *interval, devices.max(1))
                    .context("starting the GPU poller")?;
                let _ = metrics.gpu.set(p.state());
                eprintln!(
                    "pyrometer agent: polling {devices} GPU{} every {:.3}s",
                    if devices == 1 { "" } else { "s" },
                    interval.as_secs_f64()
                );
                Some(p)
            }
            None => None,
        },
        None => None,
    };
    if let Some(listener) = metrics_listener {
        let bound = agent_metrics::serve_on(listener, metrics.clone())
            .map_err(|e| input(format!("cannot serve metrics: {e}")))?;
        eprintln!("pyrometer agent: metrics on http://{bound}/metrics");
    }
    let agent_id = spool.agent_id().to_string();
    let shared = Arc::new(Shared {
        spool: Mutex::new(spool),
        wake: Condvar::new(),
        stop: AtomicBool::new(false),
        metrics: metrics.clone(),
    });
    shared.update_spool_gauges(&shared.spool.lock().expect("not poisoned"));
    let pusher = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("pusher".into())
            .spawn(move || pusher(shared, client))?
    };
    eprintln!(
        "pyrometer agent: node {} (agent id {agent_id}), {} Hz, pushing every {:.1}s to {}",
        cfg.node,
        cfg.frequency,
        cfg.interval.as_secs_f64(),
        cfg.collector
    );

    let period_ns = 1_000_000_000 / cfg.frequency as i64;
    let off_cpu = cfg.off_cpu_min_ns.is_some();
    let new_capture = |reported| {
        let mut c = Capture::default();
        c.off_cpu = off_cpu;
        c.off_cpu_reported = reported;
        c
    };
    let mut capture = new_capture(Default::default());
    let mut interval_start = Instant::now();
    let mut interval_wall = SystemTime::now();
    let mut last_scan = Instant::now();
    let mut last_gc = Instant::now();
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut samples_total = 0u64;
    loop {
        sampler.wait(Duration::from_millis(100));
        sampler.drain_into(&mut batch);
        for rec in batch.drain(..) {
            capture.ingest(&rec, &sampler, &mut registry, &mut python);
        }
        pyrometer::capture::sync_tables(
            &mut capture.maps_changed,
            &registry,
            unwinder.as_mut(),
            &mut python,
            None,
            &mut last_gc,
        );
        for notice in python.take_notices() {
            eprintln!("pyrometer agent: {notice}");
        }
        let stopping = signals::take().is_some();
        if let Some(re) = &cfg.comm
            && last_scan.elapsed() >= Duration::from_millis(500)
        {
            last_scan = Instant::now();
            add_matching(
                &mut sampler,
                unwinder.as_mut(),
                &mut registry,
                re,
                &mut known,
            );
        }
        let c = sampler.counters();
        metrics
            .samples
            .store(samples_total + capture.samples, Relaxed);
        metrics.lost_ring_buffer.store(c.ringbuf_drops, Relaxed);
        metrics
            .user_stack_errors
            .store(c.user_stack_errors, Relaxed);
        metrics
            .kernel_stack_errors
            .store(c.kernel_stack_errors, Relaxed);
        let u = c.unwind;
        metrics.unwind_walks.store(u.samples, Relaxed);
        for (slot, v) in metrics.unwind_stopped.iter().zip([
            u.no_mapping,
            u.no_table,
            u.no_row,
            u.bad_cfa,
            u.truncated,
        ]) {
            slot.store(v, Relaxed);
        }
        if stopping || interval_start.elapsed() >= cfg.interval {
            if off_cpu {
                // Threads blocked across the push still count in it (an idle worker would
                // otherwise be missing until it wakes).
                let pending = sampler.pending_off_cpu(pyrometer::capture::monotonic_now_ns());
                capture.ingest_pending(pending, &sampler, &mut registry, &mut python);
            }
            let reported = std::mem::take(&mut capture.off_cpu_reported);
            let taken = std::mem::replace(&mut capture, new_capture(reported));
            let duration = interval_start.elapsed();
            interval_start = Instant::now();
            let wall = std::mem::replace(&mut interval_wall, SystemTime::now());
            samples_total += taken.samples;
            metrics
                .lost_bad_record
                .fetch_add(taken.bad_records, Relaxed);
            // Taken every interval, so usage does not pile up while nothing is sampled.
            let gpu_usage = poller
                .as_ref()
                .map(|p| p.state().lock().expect("not poisoned").take_process_usage());
            if taken.samples > 0 || taken.off_cpu_events > 0 {
                let mut profile = taken.into_profile(&mut registry, &mut symbolizer, period_ns);
                if let Some(usage) = &gpu_usage {
                    gpu::label_profile(&mut profile, &gpu::gpus_by_pid(usage));
                }
                if let Err(e) = spool_batch(&shared, &cfg.node, profile, wall, duration) {
                    eprintln!("pyrometer agent: cannot spool a batch: {e:#}");
                }
            }
        }
        if stopping {
            break;
        }
    }
    drop(sampler);
    drop(poller);
    shared.stop.store(true, Relaxed);
    shared.wake.notify_all();
    let _ = pusher.join();

    let spool = shared.spool.lock().expect("not poisoned");
    let m = &metrics;
    let summary = serde_json::json!({
        "agent_id": agent_id,
        "node": cfg.node,
        "samples": m.samples.load(Relaxed),
        "batches_spooled": m.batches_spooled.load(Relaxed),
        "batches_pushed": m.batches_pushed.load(Relaxed),
        "samples_pushed": m.samples_pushed.load(Relaxed),
        "batches_dropped": m.batches_dropped.load(Relaxed),
        "samples_dropped": m.samples_dropped.load(Relaxed),
        "push_errors": m.push_errors.load(Relaxed),
        "spool_batches": spool.len(),
        "spool_samples": spool.samples(),
    });
    eprintln!(
        "pyrometer agent: {} samples, {} pushed, {} dropped, {} left in the spool",
        m.samples.load(Relaxed),
        m.samples_pushed.load(Relaxed),
        m.samples_dropped.load(Relaxed),
        spool.samples()
    );
    if let Some(path) = &args.stats {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(0)
}

/// Adds processes whose comm matches and that were not seen before.
fn add_matching(
    sampler: &mut Sampler,
    unwinder: Option<&mut pyrometer::unwinder::Unwinder>,
    registry: &mut ProcessRegistry,
    re: &Regex,
    known: &mut HashSet<u32>,
) {
    for e in pyrometer::target::add_comm_matches(sampler, unwinder, registry, re, known, false) {
        eprintln!("pyrometer agent: {e}");
    }
}

fn spool_batch(
    shared: &Shared,
    node: &str,
    mut profile: pyrometer::model::Profile,
    wall: SystemTime,
    duration: Duration,
) -> anyhow::Result<()> {
    // Thread ids would multiply the collector's label sets without helping a cluster view;
    // the thread name stays.
    for s in &mut profile.samples {
        s.labels = s
            .labels
            .iter()
            .filter(|(k, _)| *k != "tid")
            .fold(Labels::new(), |l, (k, v)| l.with(k, v.clone()));
    }
    profile.time_nanos = wall
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    profile.duration_nanos = duration.as_nanos() as i64;
    let samples: u64 = profile
        .samples
        .iter()
        .map(|s| s.values.first().copied().unwrap_or(0).max(0) as u64)
        .sum();
    let mut spool = shared.spool.lock().expect("not poisoned");
    let seq = spool.next_seq()?;
    let req = PushRequest {
        agent_id: spool.agent_id().to_string(),
        sequence: seq,
        node: node.to_string(),
        profile: Some(pyrometer::output::pprof::to_pprof(&profile)),
    };
    let dropped = spool.add(seq, samples, &req.encode_to_vec())?;
    let m = &shared.metrics;
    m.batches_spooled.fetch_add(1, Relaxed);
    m.batches_dropped.fetch_add(dropped.batches, Relaxed);
    m.samples_dropped.fetch_add(dropped.samples, Relaxed);
    shared.update_spool_gauges(&spool);
    drop(spool);
    shared.wake.notify_all();
    Ok(())
}

/// How long the pusher keeps trying after the agent was told to stop; what is left stays in
/// the spool for the next start.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

fn pusher(shared: Arc<Shared>, mut client: PushClient) {
    let m = shared.metrics.clone();
    let mut backoff = Duration::from_millis(200);
    let mut stop_at: Option<Instant> = None;
    let mut last_error = String::new();
    static LOGGED: AtomicU64 = AtomicU64::new(0);
    loop {
        if shared.stop.load(Relaxed) && stop_at.is_none() {
            stop_at = Some(Instant::now() + DRAIN_DEADLINE);
        }
        if stop_at.is_some_and(|t| Instant::now() >= t) {
            return;
        }
        let next = {
            let mut spool = shared.spool.lock().expect("not poisoned");
            match spool.take_oldest() {
                Ok(Some(n)) => Some(n),
                Ok(None) => {
                    if stop_at.is_some() {
                        return;
                    }
                    let _ = shared
                        .wake
                        .wait_timeout(spool, Duration::from_millis(500))
                        .expect("not poisoned");
                    None
                }
                Err(e) => {
                    eprintln!("pyrometer agent: {e}");
                    None
                }
            }
        };
        let Some((entry, body)) = next else { continue };
        let started = Instant::now();
        let result = client.push(body);
        let mut spool = shared.spool.lock().expect("not poisoned");
        match result {
            Ok(_) => {
                if let Err(e) = spool.acknowledged(entry.seq) {
                    eprintln!("pyrometer agent: {e}");
                }
                m.push_ns
                    .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
                m.batches_pushed.fetch_add(1, Relaxed);
                m.samples_pushed.fetch_add(entry.samples, Relaxed);
                backoff = Duration::from_millis(200);
                if !last_error.is_empty() {
                    eprintln!("pyrometer agent: collector reachable again");
                    last_error.clear();
                }
            }
            Err(e) if e.is_permanent() => {
                // Retrying the same bytes cannot succeed; keeping them would block the spool.
                eprintln!("pyrometer agent: batch {} dropped: {e}", entry.seq);
                let _ = spool.acknowledged(entry.seq);
                m.batches_dropped.fetch_add(1, Relaxed);
                m.samples_dropped.fetch_add(entry.samples, Relaxed);
            }
            Err(e) => {
                spool.release();
                m.push_errors.fetch_add(1, Relaxed);
                let msg = e.to_string();
                if msg != last_error && LOGGED.fetch_add(1, Relaxed) < 100 {
                    eprintln!("pyrometer agent: push failed, keeping the batch spooled: {msg}");
                }
                last_error = msg;
                shared.update_spool_gauges(&spool);
                let _ = shared
                    .wake
                    .wait_timeout_while(spool, backoff, |_| !shared.stop.load(Relaxed))
                    .expect("not poisoned");
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        }
        shared.update_spool_gauges(&spool);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentArgs,
    }

    fn resolve_with(config: &str, flags: &[&str]) -> anyhow::Result<Config> {
        let dir = std::env::temp_dir().join(format!("pyrometer-agent-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{}.toml", flags.len() + config.len()));
        std::fs::write(&path, format!("collector = \"http://c:4040\"\n{config}")).unwrap();
        let mut argv = vec!["agent", "--config", path.to_str().unwrap()];
        argv.extend_from_slice(flags);
        resolve(&Cli::parse_from(argv).agent)
    }

    #[test]
    fn gpu_settings_from_file_and_flags() {
        let on = resolve_with("", &[]).unwrap();
        assert_eq!(on.gpu.unwrap().0, Duration::from_secs(1), "on by default");
        assert!(resolve_with("gpu = false", &[]).unwrap().gpu.is_none());
        assert!(resolve_with("", &["--no-gpu"]).unwrap().gpu.is_none());
        let (interval, _) = resolve_with("gpu-interval = \"250ms\"", &[])
            .unwrap()
            .gpu
            .unwrap();
        assert_eq!(interval, Duration::from_millis(250));
        let (interval, lib) = resolve_with(
            "gpu-interval = \"250ms\"\nnvml-lib = \"/file/lib.so\"",
            &["--gpu-interval", "2s", "--nvml-lib", "/flag/lib.so"],
        )
        .unwrap()
        .gpu
        .unwrap();
        assert_eq!(interval, Duration::from_secs(2), "flags win");
        assert_eq!(lib, OsString::from("/flag/lib.so"));
        let err = resolve_with("gpu-interval = \"1ms\"", &[]).err().unwrap();
        assert!(err.to_string().contains("gpu-interval"), "{err}");
    }
}
