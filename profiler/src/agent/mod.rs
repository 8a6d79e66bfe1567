//! The always-on node agent. It samples (19 Hz by default), aggregates each push interval
//! into one profile, writes it to the spool, and a pusher thread sends spooled batches to the
//! collector oldest first, deleting each only once it is acknowledged; each profile may also
//! go to an OTLP endpoint. It serves its own `/metrics`. [`run`] is the whole daemon: the
//! `pyrometer agent` command only resolves its settings into an [`AgentConfig`].

mod burst;
mod captures;
mod delivery;
mod export;
mod gc_metrics;
mod gpu;
mod metrics;
mod metrics_server;
mod node;
mod push;
pub mod remote;
pub mod remote_merge;
mod spool;
mod targets;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use regex::Regex;
use serde::Serialize;

use crate::command::CommandError;
use crate::os::signals;
use delivery::Shared;
use export::Exporter;
use node::Node;
use spool::Spool;

/// Where the agent's messages go, one line each, without a prefix (the caller adds its own).
/// Shared by the sampling loop, the pusher and the OTLP export thread.
pub type Log = Arc<dyn Fn(&str) + Send + Sync>;

/// The agent's settings, resolved from flags and the config file.
#[derive(Debug)]
pub struct AgentConfig {
    /// Processes to sample (with their children); none, with no `comm`: every process.
    pub pids: Vec<u32>,
    /// Sample the processes whose name matches (anchored), also those started later.
    pub comm: Option<Regex>,
    /// The collector to push to; None: an OTLP-only agent (then `otlp_endpoint` is set).
    pub collector: Option<String>,
    /// An OTLP gRPC endpoint each interval's profile also goes to, best effort.
    pub otlp_endpoint: Option<String>,
    /// The `node` label of everything pushed.
    pub node: String,
    /// How often a profile is aggregated and pushed.
    pub interval: Duration,
    /// Samples per second per CPU.
    pub frequency: u64,
    /// Where batches wait for the collector.
    pub spool_dir: PathBuf,
    /// The spool's size limit; the oldest batches are dropped past it.
    pub spool_max_bytes: u64,
    /// The collector's bearer token.
    pub token: Option<String>,
    /// The CA that signed an https:// collector's (or endpoint's) certificate.
    pub ca: Option<PathBuf>,
    /// The PEM client certificate and key presented to an https:// collector that
    /// authenticates agents by certificate.
    pub client_identity: Option<(PathBuf, PathBuf)>,
    /// Send the token over plain http:// to a collector on another host.
    pub insecure: bool,
    /// Serve `/metrics` here.
    pub metrics_listen: Option<SocketAddr>,
    /// Walk user stacks with DWARF tables (else frame pointers only).
    pub dwarf: bool,
    /// Capacity of the node's unwind row array.
    pub unwind_rows: u32,
    /// Inflated DWARF the symbolizer may hold at once.
    pub dwarf_budget_bytes: u64,
    /// Fetch missing debug files from these debuginfod servers (None: never; the agent uses
    /// no server it was not given, whatever its environment says).
    pub debuginfod: Option<crate::symbolize::debuginfod::DebuginfodConfig>,
    /// What may be kept for one process (its perf map as parsed, its mappings; default
    /// [`DEFAULT_PROCESS_BUDGET`]): a process over it has each of its user stacks named by
    /// one `[budget]` frame.
    pub process_budget_bytes: u64,
    /// CPU time the agent may spend on one process per push interval (its files' reads,
    /// tables, registration, symbol lookups; default [`DEFAULT_PROCESS_CPU_BUDGET`]): a
    /// process over it is left as it is and has each of its user stacks named by one
    /// `[budget]` frame until later intervals' budgets have paid off what it spent over.
    pub process_cpu_budget: std::time::Duration,
    /// The shortest blocked interval counted, when off-CPU time is measured.
    pub off_cpu_min_ns: Option<u64>,
    /// CPython's garbage-collector pauses (`--gc`): the `gc` type and `/metrics` histograms.
    pub gc: bool,
    /// The GIL probes loaded (`--gil`), for captures that ask for the GIL view: attached to
    /// a capture's processes only, while it runs.
    pub gil: bool,
    /// asyncio task stacks (`--async`): task frames and the `asyncio_task` label.
    pub asyncio: bool,
    /// GPU polling: the interval and the NVML library, or None when off.
    pub gpu: Option<(Duration, OsString)>,
    /// Allocation sampling, when some process is chosen for it.
    pub alloc: Option<AllocTargets>,
    /// Kernel BTF to load against (None: the running kernel's).
    pub btf_path: Option<PathBuf>,
    /// The user and group the agent becomes once its programs are attached (None: it stays
    /// root, with only the capabilities it keeps).
    pub run_as: Option<(u32, u32)>,
    /// Processes whose cgroup path matches are not profiled: nothing of them is read.
    pub exclude_cgroup: Option<Regex>,
    /// What a system call outside the agent's list does once it is attached.
    pub seccomp: SeccompMode,
    /// `debug_reject` bits ([`crate::command::debug_reject_bits`]): tests of the degraded
    /// paths.
    pub debug_reject: u32,
}

/// The processes whose allocations are sampled, and the mean bytes between samples.
#[derive(Debug)]
pub struct AllocTargets {
    /// Chosen by pid.
    pub pids: Vec<u32>,
    /// Chosen by name (anchored), also those started later.
    pub comm: Option<Regex>,
    /// Mean bytes between samples.
    pub sample_bytes: u64,
}

pub use crate::os::seccomp::Mode as SeccompMode;

/// The user and group the agent becomes once attached unless told otherwise (nobody).
pub const DEFAULT_RUN_AS: (u32, u32) = crate::os::privileges::UNPRIVILEGED;

/// What the agent keeps for one process at most unless told otherwise: 24 MiB.
pub const DEFAULT_PROCESS_BUDGET: u64 = crate::symbolize::DEFAULT_PROCESS_BUDGET;

/// CPU time the agent spends on one process per push interval at most, by default: a fifth
/// of a CPU over the default 10 s interval. Building the tables of a process that maps
/// hundreds of libraries at once costs more; it is spread over intervals then.
pub const DEFAULT_PROCESS_CPU_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// What the agent did, for its last line and `--stats`.
#[derive(Debug, Serialize)]
pub struct AgentSummary {
    /// The agent's id (kept in the spool across restarts).
    pub agent_id: String,
    /// The `node` label.
    pub node: String,
    /// Samples read from the kernel.
    pub samples: u64,
    /// Batches written to the spool.
    pub batches_spooled: u64,
    /// Batches the collector acknowledged.
    pub batches_pushed: u64,
    /// Samples in acknowledged batches.
    pub samples_pushed: u64,
    /// Batches deleted unsent, and their samples.
    pub batches_dropped: u64,
    /// Samples in dropped batches.
    pub samples_dropped: u64,
    /// Push attempts that failed.
    pub push_errors: u64,
    /// Batches left in the spool, and their samples.
    pub spool_batches: usize,
    /// Samples left in the spool.
    pub spool_samples: u64,
    /// Whether the kernel's process events drove discovery by name.
    pub process_events: bool,
    /// Times process events were lost.
    pub process_event_overflows: u64,
    /// Binaries symbolized from their symbol table only (DWARF over budget).
    pub symbolized_without_dwarf: u64,
    /// OTLP requests exported, failed and dropped (with `--otlp-endpoint`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_exported: Option<u64>,
    /// See `otlp_exported`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_failed: Option<u64>,
    /// See `otlp_exported`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_dropped: Option<u64>,
}

/// The node daemon: samples until SIGTERM or SIGINT, pushing every interval; returns what it
/// did. Errors before sampling starts are the request's ([`CommandError::Input`]) or the
/// kernel's ([`CommandError::Kernel`]).
pub fn run(mut cfg: AgentConfig, log: Log) -> Result<AgentSummary, CommandError> {
    // First thing: a SIGTERM during start-up (BPF verification takes a while) must stop the
    // agent cleanly, not kill it.
    signals::install();
    // Large buffers (a binary parsed for its Python version, an encoded batch) come from
    // mmap and go back to the kernel when freed. glibc's default raises that threshold after
    // the first such free, and from then on they land in the heap, which never shrinks below
    // its high-water mark: an always-on agent would keep its worst minute's memory for good.
    // SAFETY: mallopt only tunes the allocator; no other thread runs yet.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10) };
    let (client, otlp_client) = delivery::clients(&cfg)?;
    let spool = Spool::open(&cfg.spool_dir, cfg.spool_max_bytes, &cfg.node)
        .map_err(|e| CommandError::Input(e.to_string()))?;
    if let Some((uid, gid)) = cfg.run_as {
        hand_over(&cfg.spool_dir, uid, gid)?;
    }
    crate::command::check_sampling_privileges()?;
    let mut node = Node::open(&mut cfg, log.clone())?;
    let metrics = node.metrics.clone();
    let agent_id = spool.agent_id().to_string();
    let shared = Arc::new(Shared {
        spool: Mutex::new(spool),
        wake: Condvar::new(),
        stop: Default::default(),
        metrics: metrics.clone(),
        log: log.clone(),
    });
    shared.update_spool_gauges(&shared.spool.lock().expect("not poisoned"));
    // Without a collector (an OTLP-only agent) nothing is spooled or pushed.
    let pusher = match client {
        Some(client) => {
            let shared = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("pusher".into())
                    .spawn(move || delivery::pusher(shared, client))
                    .map_err(|e| CommandError::Input(format!("cannot start the pusher: {e}")))?,
            )
        }
        None => None,
    };
    // Threads start only after the capabilities were dropped (they are per thread).
    let mut exporter = match (otlp_client, &cfg.otlp_endpoint) {
        (Some(client), Some(url)) => Some(
            Exporter::start(client, url, log.clone())
                .map_err(|e| CommandError::Input(format!("cannot start the OTLP export: {e}")))?,
        ),
        _ => None,
    };
    log(&format!(
        "node {} (agent id {agent_id}), {} Hz, pushing every {:.1}s to {}",
        cfg.node,
        cfg.frequency,
        cfg.interval.as_secs_f64(),
        match (&cfg.collector, &cfg.otlp_endpoint) {
            (Some(c), Some(o)) => format!("{c} and OTLP {o}"),
            (Some(c), None) => c.clone(),
            (None, Some(o)) => format!("OTLP {o} only"),
            (None, None) => unreachable!("resolve requires one"),
        }
    ));
    node.set_channel(captures::start(&cfg, log.clone())?);
    node.run(&cfg, &shared, exporter.as_ref());
    let process_events = (
        node.by_name && node.discovery.event_driven(),
        node.discovery.overflows,
    );
    drop(node);
    shared.stop();
    if let Some(p) = pusher {
        let _ = p.join();
    }
    if let Some(x) = exporter.as_mut() {
        x.finish();
    }
    let spool = shared.spool.lock().expect("not poisoned");
    let m = &metrics;
    let otlp = exporter.as_ref().map(|x| &x.counts);
    Ok(AgentSummary {
        agent_id,
        node: cfg.node.clone(),
        samples: m.samples.load(Relaxed),
        batches_spooled: m.batches_spooled.load(Relaxed),
        batches_pushed: m.batches_pushed.load(Relaxed),
        samples_pushed: m.samples_pushed.load(Relaxed),
        batches_dropped: m.batches_dropped.load(Relaxed),
        samples_dropped: m.samples_dropped.load(Relaxed),
        push_errors: m.push_errors.load(Relaxed),
        spool_batches: spool.len(),
        spool_samples: spool.samples(),
        process_events: process_events.0,
        process_event_overflows: process_events.1,
        symbolized_without_dwarf: m.dwarf_skipped_files.load(Relaxed),
        otlp_exported: otlp.map(|c| c.exported.load(Relaxed)),
        otlp_failed: otlp.map(|c| c.failed.load(Relaxed)),
        otlp_dropped: otlp.map(|c| c.dropped.load(Relaxed)),
    })
}

/// Gives the spool to the user the agent becomes, so that it can go on writing there: the
/// directory and what is in it (the agent's own files, not followed if links).
fn hand_over(dir: &std::path::Path, uid: u32, gid: u32) -> Result<(), CommandError> {
    let chown = |p: &std::path::Path| {
        std::os::unix::fs::lchown(p, Some(uid), Some(gid)).map_err(|e| {
            CommandError::Input(format!(
                "cannot give {} to uid {uid} (the agent's run-as user): {e}",
                p.display()
            ))
        })
    };
    chown(dir)?;
    let entries = std::fs::read_dir(dir)
        .map_err(|e| CommandError::Input(format!("cannot read {}: {e}", dir.display())))?;
    for entry in entries.flatten() {
        chown(&entry.path())?;
    }
    Ok(())
}
