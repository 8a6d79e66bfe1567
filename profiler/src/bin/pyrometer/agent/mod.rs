//! `pyrometer agent`: the always-on node daemon. It samples (19 Hz by default), aggregates each
//! push interval into one profile, writes it to the spool, and a pusher thread sends spooled
//! batches to the collector oldest first, deleting each only once it is acknowledged.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use prost::Message;
use pyrometer::agent_metrics::{self, AgentMetrics};
use pyrometer::alloc::AllocProbes;
use pyrometer::bpf::{AllocConfig, Feature, Filter, Sampler, SamplerConfig};
use pyrometer::capture::{AllocState, Capture};
use pyrometer::gpu::{self, Poller};
use pyrometer::model::Labels;
use pyrometer::procs::ProcessRegistry;
use pyrometer::push::PushClient;
use pyrometer::spool::Spool;
use pyrometer::symbolize::Symbolizer;
use pyrometer::tables::Tables;
use pyrometer::{privileges, signals};
use pyrometer_proto::ingest::PushRequest;

use crate::{EXIT_PRIVILEGES, exit_error};

mod config;
pub(crate) mod discover;
mod otlp;
mod young;

pub use config::AgentArgs;
use config::{input, resolve};

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
    // Large buffers (a binary parsed for its Python version, an encoded batch) come from
    // mmap and go back to the kernel when freed. glibc's default raises that threshold after
    // the first such free, and from then on they land in the heap, which never shrinks below
    // its high-water mark: an always-on agent would keep its worst minute's memory for good.
    // SAFETY: mallopt only tunes the allocator; no other thread runs yet.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10) };
    let mut cfg = resolve(&args)?;
    let client = cfg
        .collector
        .as_deref()
        .map(|url| {
            PushClient::new(
                url,
                cfg.token.as_deref(),
                cfg.ca.as_deref(),
                Duration::from_secs(5),
            )
        })
        .transpose()
        .map_err(|e| input(e.to_string()))?;
    let otlp_client = match &cfg.otlp_endpoint {
        Some(url) => {
            let ca = cfg.ca.as_deref().filter(|_| url.starts_with("https://"));
            Some(otlp::Exporter::client(url, ca).map_err(|e| input(otlp::endpoint_error(e)))?)
        }
        None => None,
    };
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
        ring_buffer_bytes: ring_buffer_bytes(),
        unwind_rows: cfg.unwind_rows,
        btf_path: pyrometer::bpf::btf_path_or_default(args.btf_path.as_deref()),
        off_cpu_min_ns: cfg.off_cpu_min_ns,
        gil: false,
        // Always: processes that preload the sampler library are sampled without flags
        // (their probes fire only when they sample); --alloc-pid/--alloc-comm add uprobes.
        alloc: Some(AllocConfig {
            sample_bytes: cfg
                .alloc
                .as_ref()
                .map_or(pyrometer::bpf::DEFAULT_ALLOC_SAMPLE_BYTES, |a| {
                    a.sample_bytes
                }),
            live_entries: pyrometer::bpf::DEFAULT_ALLOC_LIVE,
            own_targets: true,
        }),
        dwarf: cfg.dwarf,
        debug_reject: crate::debug_reject_bits(&args.debug_reject)?,
    })
    .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    // What the kernel refused is off from here on; each says so once, and /metrics says
    // which features the agent runs without.
    for refusal in sampler.refusals() {
        eprintln!("pyrometer agent: {refusal}");
    }
    if sampler.refused(Feature::Alloc) {
        cfg.alloc = None;
    }
    if sampler.refused(Feature::OffCpu) {
        cfg.off_cpu_min_ns = None;
    }
    for &pid in &cfg.pids {
        sampler
            .add_target(pid, true)
            .with_context(|| format!("adding pid {pid}"))?;
    }
    let unwinder = if sampler.dwarf() {
        Some(
            sampler
                .unwinder()
                .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?,
        )
    } else {
        None
    };
    let python = sampler
        .python_tracker()
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    let debug_dirs: Vec<PathBuf> = pyrometer::symbolize::DEFAULT_DEBUG_DIRS
        .iter()
        .map(PathBuf::from)
        .collect();
    let alloc_probes = (!sampler.refused(Feature::Alloc)).then(|| {
        // Uprobes on allocator functions only for the processes chosen with --alloc-pid or
        // --alloc-comm; every other process is only checked for the preloaded library.
        let mut probes = AllocProbes::new(debug_dirs.clone()).only_chosen();
        attach_own_library(&mut probes, &mut sampler);
        probes
    });
    let mut tables = Tables::new(unwinder, python, alloc_probes);
    let mut registry = ProcessRegistry::new();
    let mut known = Known::default();
    // Opened while the agent still has CAP_NET_ADMIN, which subscribing needs.
    let by_name = cfg.comm.is_some() || cfg.alloc.as_ref().is_some_and(|a| a.comm.is_some());
    let mut discovery = discover::Discovery::new(
        by_name
            .then(|| discover::open_events("pyrometer agent"))
            .flatten(),
    );
    let mut exited = Vec::new();
    let due = discovery.due(&mut exited);
    scan(
        &mut sampler,
        &mut tables,
        &mut registry,
        &cfg,
        &mut known,
        &due,
    );
    // Tables for the processes already known, so their first samples unwind fully; with
    // neither --pid nor --comm, new processes get theirs when their first sample arrives.
    for &pid in &cfg.pids {
        if let Ok(p) = registry.observe(pid) {
            tables.sync_process(p, &mut sampler);
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
    let mut symbolizer = Symbolizer::new()
        .with_debug_dirs(debug_dirs)
        .with_dwarf_budget(cfg.dwarf_budget_bytes);
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
    let _ = metrics.refused.set(
        sampler
            .refusals()
            .iter()
            .map(|r| (r.feature.key(), r.program.clone()))
            .collect(),
    );
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
    // Without a collector (an OTLP-only agent) nothing is spooled or pushed.
    let pusher = match client {
        Some(client) => {
            let shared = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("pusher".into())
                    .spawn(move || pusher(shared, client))?,
            )
        }
        None => None,
    };
    // Threads start only after the capabilities were dropped (they are per thread).
    let mut exporter = match (otlp_client, &cfg.otlp_endpoint) {
        (Some(client), Some(url)) => Some(otlp::Exporter::start(client, url)?),
        _ => None,
    };
    eprintln!(
        "pyrometer agent: node {} (agent id {agent_id}), {} Hz, pushing every {:.1}s to {}",
        cfg.node,
        cfg.frequency,
        cfg.interval.as_secs_f64(),
        match (&cfg.collector, &cfg.otlp_endpoint) {
            (Some(c), Some(o)) => format!("{c} and OTLP {o}"),
            (Some(c), None) => c.clone(),
            (None, Some(o)) => format!("OTLP {o} only"),
            (None, None) => unreachable!("resolve requires one"),
        }
    );

    let period_ns = 1_000_000_000 / cfg.frequency as i64;
    let off_cpu = cfg.off_cpu_min_ns.is_some();
    let alloc_mean = cfg
        .alloc
        .as_ref()
        .map_or(pyrometer::bpf::DEFAULT_ALLOC_SAMPLE_BYTES, |a| {
            a.sample_bytes
        });
    let alloc_chosen = cfg.alloc.is_some();
    let alloc_off = tables.alloc.is_none();
    // Off-CPU intervals still open and live sampled blocks carry over from one interval's
    // capture to the next. Without --alloc-* the allocation types appear once a preloaded
    // process has reported (capture.alloc_on_preload), and stay.
    let new_capture = |reported, live: Option<_>| {
        let mut c = Capture::default();
        // Node-wide, most processes are never sampled; chosen ones are read at once.
        c.exec_lazily = !selective;
        c.off_cpu = off_cpu;
        c.off_cpu_reported = reported;
        c.alloc_on_preload = (!alloc_off).then_some(alloc_mean);
        if alloc_chosen || live.is_some() {
            let mut a = AllocState::new(alloc_mean);
            a.live = live.unwrap_or_default();
            c.alloc = Some(a);
        }
        c
    };
    let mut capture = new_capture(Default::default(), None);
    let mut interval_start = Instant::now();
    let mut interval_wall = SystemTime::now();
    let mut last_counters: Option<Instant> = None;
    let mut told_rows_full = false;
    let mut young = young::Young::default();
    let mut ray_seen: Option<Instant> = None;
    let proc_root = std::path::Path::new("/proc");
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut samples_total = 0u64;
    let mut names_awaited = false;
    loop {
        // The kernel wakes the agent at once for what cannot wait (a new process, an exec, a
        // mapping it has no table for, a filling ring buffer); the rest is read in batches.
        // At 19 Hz on a few CPUs a wake-up every 20 ms found about one sample, and the
        // wake-ups with their counter reads cost more than the samples. A Ray worker's task
        // label is read from its title when its samples are read, and tasks can be short:
        // while Ray workers are sampled, the loop reads as often as it used to. So are
        // Python threads' names (a new thread's first sample wakes the loop): while a new
        // thread has none yet, `threading` may register it any moment, and a short thread
        // takes its name with it when it ends.
        let ray = ray_seen.is_some_and(|t| t.elapsed() < RAY_LINGER);
        sampler.wait(if ray || names_awaited {
            SHORT_POLL
        } else {
            POLL
        });
        // Taken before the ring buffer is read: what the kernel wrote before the signal is
        // then in the last push (a signal taken after the read left out what came between).
        let stopping = signals::take().is_some();
        sampler.drain_into(&mut batch);
        if batch.iter().any(|r| {
            pyrometer_ebpf::RawSample::parse(r).is_ok_and(|s| s.header.comm.starts_with(b"ray::"))
        }) {
            ray_seen = Some(Instant::now());
        }
        for rec in batch.drain(..) {
            capture.ingest(&rec, &sampler, &mut registry, &mut tables.python);
        }
        names_awaited = capture.read_awaited_names(&mut tables.python);
        for pid in capture.execs.drain(..) {
            young.exec(pid);
        }
        if !selective {
            young.filter(&mut capture.maps_changed, proc_root);
        }
        tables.sync(&mut capture.maps_changed, &registry, &mut sampler);
        for notice in tables.python.take_notices() {
            eprintln!("pyrometer agent: {notice}");
        }
        if by_name {
            exited.clear();
            let due = discovery.due(&mut exited);
            // A pid that exited may come back as another process, to be looked at again.
            for pid in &exited {
                known.targets.remove(pid);
                known.alloc.remove(pid);
            }
            if due != discover::Due::Nothing {
                scan(
                    &mut sampler,
                    &mut tables,
                    &mut registry,
                    &cfg,
                    &mut known,
                    &due,
                );
            }
            metrics
                .process_event_overflows
                .store(discovery.overflows, Relaxed);
        }
        let push_due = stopping || interval_start.elapsed() >= cfg.interval;
        // Some 25 map reads, a system call each: every few seconds, and with each push so
        // that /metrics agrees with what was pushed.
        if push_due || last_counters.is_none_or(|t| t.elapsed() >= COUNTERS_EVERY) {
            last_counters = Some(Instant::now());
            let unwinder = tables.unwinder.as_ref().map(|u| u.stats());
            publish_counters(
                &sampler,
                &metrics,
                samples_total + capture.samples,
                unwinder,
            );
            // Once: the node's processes need more unwind rows than it was given.
            if let Some(u) = unwinder
                && u.tables_too_big > 0
                && !told_rows_full
            {
                told_rows_full = true;
                eprintln!(
                    "pyrometer agent: unwind tables no longer fit in --unwind-rows {}: those executables are walked by frame pointers (pyrometer_agent_unwind_tables_too_big_total); a larger --unwind-rows keeps them",
                    u.rows_capacity
                );
            }
        }
        if push_due {
            if off_cpu {
                // Threads blocked across the push still count in it (an idle worker would
                // otherwise be missing until it wakes).
                let pending = sampler.pending_off_cpu(pyrometer::capture::monotonic_now_ns());
                capture.ingest_pending(pending, &sampler, &mut registry, &mut tables.python);
            }
            let reported = std::mem::take(&mut capture.off_cpu_reported);
            // The push reports what is in use now; the blocks stay live for the next one.
            // Blocks of processes that exited are no longer in use: they are forgotten.
            let live = capture.alloc.as_mut().map(|a| {
                a.now_ns = pyrometer::capture::monotonic_now_ns();
                a.forget_exited(Path::new("/proc"));
                a.live.clone()
            });
            capture.name_late_threads(&mut tables.python);
            let taken = std::mem::replace(&mut capture, new_capture(reported, live));
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
            let allocations = taken
                .alloc
                .as_ref()
                .is_some_and(|a| !a.live.is_empty() || a.samples > 0);
            if taken.samples > 0 || taken.off_cpu_events > 0 || allocations {
                let mut profile = taken.into_profile(&mut registry, &mut symbolizer, period_ns);
                if let Some(usage) = &gpu_usage {
                    gpu::label_profile(&mut profile, &gpu::gpus_by_pid(usage));
                }
                let batch = Batch {
                    node: &cfg.node,
                    wall,
                    duration,
                    otlp: exporter.as_ref(),
                    spool: cfg.collector.is_some(),
                };
                if let Err(e) = spool_batch(&shared, batch, profile) {
                    eprintln!("pyrometer agent: cannot spool a batch: {e:#}");
                }
            }
            symbolizer.release_files();
            metrics
                .dwarf_skipped_files
                .store(symbolizer.stats().dwarf_skipped_files, Relaxed);
            // The interval's samples are symbolized: processes gone since are not needed.
            registry.forget_exited();
            symbolizer.forget_exited(&registry);
            young.forget_exited(proc_root);
            // The interval's profile and symbolization scratch are freed now: hand the pages
            // back rather than keep the heap at its peak until the next push.
            // SAFETY: malloc_trim only releases free memory of the allocator.
            unsafe { libc::malloc_trim(0) };
        }
        if stopping {
            break;
        }
    }
    drop(sampler);
    drop(poller);
    {
        // Under the lock: the pusher reads the flag under it before it sleeps untimed, so
        // the wake-up cannot fall between its check and its sleep.
        let _spool = shared.spool.lock().expect("not poisoned");
        shared.stop.store(true, Relaxed);
    }
    shared.wake.notify_all();
    if let Some(p) = pusher {
        let _ = p.join();
    }
    if let Some(x) = exporter.as_mut() {
        x.finish();
    }

    let spool = shared.spool.lock().expect("not poisoned");
    let m = &metrics;
    let mut summary = serde_json::json!({
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
        "process_events": by_name && discovery.event_driven(),
        "process_event_overflows": discovery.overflows,
        "symbolized_without_dwarf": m.dwarf_skipped_files.load(Relaxed),
    });
    if let Some(x) = &exporter {
        let c = &x.counts;
        summary["otlp_exported"] = c.exported.load(Relaxed).into();
        summary["otlp_failed"] = c.failed.load(Relaxed).into();
        summary["otlp_dropped"] = c.dropped.load(Relaxed).into();
    }
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

/// Copies the kernel's counters and the unwind tables' to /metrics.
fn publish_counters(
    sampler: &Sampler,
    metrics: &AgentMetrics,
    samples: u64,
    unwinder: Option<pyrometer::unwinder::UnwinderStats>,
) {
    let c = sampler.counters();
    metrics.samples.store(samples, Relaxed);
    metrics.lost_ring_buffer.store(c.ringbuf_drops, Relaxed);
    metrics
        .user_stack_errors
        .store(c.user_stack_errors, Relaxed);
    metrics
        .kernel_stack_errors
        .store(c.kernel_stack_errors, Relaxed);
    let u = c.unwind;
    metrics.unwind_walks.store(u.samples, Relaxed);
    metrics.unwind_row_hits.store(u.row_hits, Relaxed);
    metrics.unwind_row_searches.store(u.row_searches, Relaxed);
    for (slot, v) in metrics.unwind_stopped.iter().zip([
        u.no_mapping,
        u.no_table,
        u.no_row,
        u.bad_cfa,
        u.truncated,
        u.by_frame_pointers(),
    ]) {
        slot.store(v, Relaxed);
    }
    if let Some(t) = unwinder {
        metrics
            .unwind_tables_too_big
            .store(t.tables_too_big, Relaxed);
        metrics
            .unwind_mappings_dropped
            .store(t.mappings_dropped, Relaxed);
        metrics.unwind_rows_used.store(t.rows_used, Relaxed);
        metrics.unwind_rows_capacity.store(t.rows_capacity, Relaxed);
    }
}

/// Attaches the allocation probes to the sampler library this agent hands out (an installed
/// copy, else the one it carries, written to its cache directory), so the
/// processes that preload it are sampled from their first allocation, started before the
/// agent or after it. Other copies (a container's) are probed when a process mapping one is
/// seen.
fn attach_own_library(probes: &mut AllocProbes, sampler: &mut Sampler) {
    let lib = match pyrometer::alloc::preload::library() {
        Ok(lib) => lib,
        Err(e) => {
            eprintln!(
                "pyrometer agent: {e}: processes that preload a copy are probed when they are seen"
            );
            return;
        }
    };
    match probes.preload.attach_file(&lib, sampler) {
        Ok(()) => eprintln!(
            "pyrometer agent: sampling the allocations of processes that preload {}",
            lib.display()
        ),
        Err(e) => eprintln!("pyrometer agent: cannot probe {}: {e}", lib.display()),
    }
}

/// Samples the allocations of the chosen processes not probed yet: the --alloc-pid ones and
/// those whose comm matches --alloc-comm (again every scan, for processes started later).
fn add_alloc_targets(
    sampler: &mut Sampler,
    tables: &mut Tables,
    registry: &mut ProcessRegistry,
    alloc: &config::AllocTargets,
    known: &mut Known,
    due: &discover::Due,
) {
    let mut pids: Vec<u32> = Vec::new();
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
            discover::Due::Nothing => Vec::new(),
            discover::Due::All => pyrometer::target::new_comm_matches(re, &mut known.alloc),
            discover::Due::These(candidates) => {
                pyrometer::target::comm_matches_among(re, candidates, &mut known.alloc)
            }
        });
    }
    for pid in pids {
        if let Err(e) = sampler.add_alloc_target(pid) {
            eprintln!("pyrometer agent: cannot sample the allocations of pid {pid}: {e}");
            continue;
        }
        let Ok(p) = registry.observe(pid) else {
            continue;
        };
        if let Some(probes) = tables.alloc.as_mut() {
            probes.choose(pid);
            probes.sync(p, sampler);
            if probes.has_allocator(pid) {
                eprintln!(
                    "pyrometer agent: sampling the allocations of pid {pid} ({})",
                    p.comm
                );
            } else {
                let why = probes.unprobed_reason(pid, &p.comm, p.exe.as_deref());
                eprintln!("pyrometer agent: {why}");
            }
        }
    }
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

/// The longest the sampling loop sleeps between two reads of the ring buffer. Nothing read
/// here is late at a second: the kernel wakes the loop at once for what is (see the loop),
/// and samples wait for the push anyway. Each wake-up costs a context switch and the loop's
/// bookkeeping, which at 19 Hz cost more than the samples it found.
const POLL: Duration = Duration::from_secs(1);

/// The poll while Ray workers are sampled (and how long after the last of their samples),
/// or while new Python threads await their names.
const SHORT_POLL: Duration = Duration::from_millis(20);
const RAY_LINGER: Duration = Duration::from_secs(5);

/// How often the kernel's counters are copied to /metrics between pushes (Prometheus
/// scrapes every 15-60 s).
const COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// Processes already chosen (until they exit): as sampling targets, and for allocation
/// sampling.
#[derive(Default)]
struct Known {
    targets: HashSet<u32>,
    alloc: HashSet<u32>,
    /// The `--alloc-pid` processes were added (once: a chosen pid that exits is not
    /// chosen again when the number comes back).
    alloc_pids_added: bool,
}

/// Adds the processes chosen by name (`--comm`, `--alloc-comm`) among those `due`, and the
/// `--alloc-pid` ones on the first call.
fn scan(
    sampler: &mut Sampler,
    tables: &mut Tables,
    registry: &mut ProcessRegistry,
    cfg: &config::Config,
    known: &mut Known,
    due: &discover::Due,
) {
    if let Some(re) = &cfg.comm {
        let errors = discover::add_comm_matches(
            due,
            sampler,
            tables,
            registry,
            re,
            &mut known.targets,
            false,
        );
        for e in errors {
            eprintln!("pyrometer agent: {e}");
        }
    }
    if let Some(a) = &cfg.alloc {
        add_alloc_targets(sampler, tables, registry, a, known, due);
    }
}

/// Where and when one interval's profile was taken, and where else it goes.
struct Batch<'a> {
    node: &'a str,
    wall: SystemTime,
    duration: Duration,
    otlp: Option<&'a otlp::Exporter>,
    /// Whether it goes to the spool (and the collector): false for an OTLP-only agent.
    spool: bool,
}

fn spool_batch(
    shared: &Shared,
    batch: Batch<'_>,
    mut profile: pyrometer::model::Profile,
) -> anyhow::Result<()> {
    let Batch {
        node,
        wall,
        duration,
        otlp,
        spool: to_spool,
    } = batch;
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
    if let Some(exporter) = otlp {
        exporter.export(&profile, node);
    }
    if !to_spool {
        return Ok(());
    }
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
                    // Until a batch is spooled or the agent stops (both notify): a timed
                    // wait woke the agent twice a second for nothing.
                    drop(
                        shared
                            .wake
                            .wait_while(spool, |s| s.is_empty() && !shared.stop.load(Relaxed))
                            .expect("not poisoned"),
                    );
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
