//! `pyrometer record`: select targets, sample them in the kernel, symbolize, write.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Args;
use pyrometer::bpf::{Filter, Sampler, SamplerConfig};
use pyrometer::capture::{
    Activity, Capture, DEFAULT_ACTIVITY_BUCKET_NS, DEFAULT_ACTIVITY_BUCKETS,
    DEFAULT_TIMELINE_EVENTS, Timeline, monotonic_now_ns, sync_tables,
};
use pyrometer::gpu::{self, Poller};
use pyrometer::model::Profile;
use pyrometer::output::{self, OutputFormat};
use pyrometer::procs::ProcessRegistry;
use pyrometer::python::merge::FrameView;
use pyrometer::symbolize::Symbolizer;
use pyrometer::target::{self, HeldChild};
use pyrometer::{privileges, signals};

use crate::gpu::NvmlArgs;
use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error, parse_duration, resolve_format};

#[derive(Args, Debug)]
pub struct RecordArgs {
    /// Process to profile (repeatable).
    #[arg(short, long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Also profile the descendants of each --pid (or --comm match), current and future.
    #[arg(long)]
    subprocesses: bool,
    /// Profile processes whose name (comm, 15 bytes) matches this regex, anchored, including
    /// ones started during the recording; it runs until --duration or Ctrl-C.
    #[arg(long, value_name = "REGEX", conflicts_with_all = ["pids", "command"])]
    comm: Option<String>,
    /// Profile the whole node (every process but the idle task and pyrometer itself).
    #[arg(long, conflicts_with_all = ["pids", "command", "comm"])]
    all: bool,
    /// How long to record (e.g. 30s, 2m); default: until the target exits or Ctrl-C.
    #[arg(short, long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Samples per second per CPU.
    #[arg(short = 'F', long, default_value_t = 99, value_parser = clap::value_parser!(u64).range(1..=10000))]
    frequency: u64,
    /// Output file; the format follows the extension (.svg, .folded/.txt, .pb.gz/.pprof,
    /// .speedscope.json, .trace.json).
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Output format (overrides the extension): folded, svg, pprof, speedscope, chrome.
    #[arg(short, long)]
    format: Option<String>,
    /// Sample type for single-type outputs (folded, svg, speedscope): cpu, samples, or
    /// off_cpu (with --off-cpu).
    #[arg(short = 't', long = "type", value_name = "TYPE")]
    sample_type: Option<String>,
    /// Ring buffer size in MiB (a power of two); larger absorbs longer agent stalls.
    #[arg(long, default_value_t = 8, value_parser = parse_ring_mb)]
    ring_buffer_mb: u32,
    /// How to walk user stacks: `dwarf` (in-kernel unwinding with .eh_frame tables, frame
    /// pointers where a binary has no table) or `fp` (frame pointers only).
    #[arg(long, default_value = "dwarf", value_parser = ["dwarf", "fp"])]
    unwind: String,
    /// Capacity of the unwind row array shared by all tables (12 bytes a row).
    #[arg(long, default_value_t = 1 << 20, value_name = "ROWS")]
    unwind_rows: u32,
    /// Extra directory of separate debug files (build-id layout or debuglink names); repeatable.
    #[arg(long = "debug-dir", value_name = "DIR")]
    debug_dirs: Vec<PathBuf>,
    /// Write capture statistics (samples, drops, BPF and agent cost) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// Also poll the GPUs through NVML: a per-device summary at the end (with the share of
    /// on-CPU time the GPU sat idle), `gpu` and `gpu_memory` labels on the samples of
    /// processes that use a GPU, and GPU counter tracks in a Chrome trace.
    #[arg(long)]
    gpu: bool,
    #[command(flatten)]
    nvml: NvmlArgs,
    /// Also measure off-CPU time: how long target threads stay blocked (sleeping, waiting on
    /// I/O, locks, pipes), by the stack they blocked in, as the `off_cpu/nanoseconds` type.
    /// Preempted (runnable) time is not counted.
    #[arg(long)]
    off_cpu: bool,
    /// Shortest blocked interval counted with --off-cpu (e.g. 1ms, 0.5ms, 20ms): shorter ones cost
    /// nothing past the switch and are left out.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "off_cpu")]
    off_cpu_min: Option<Duration>,
    /// Also measure the GIL of Python processes: per thread, the time spent holding it and
    /// waiting for it (uprobes on take_gil/drop_gil), a table at the end, the
    /// `gil_wait/nanoseconds` type (contended waits by the stack that waited) and
    /// `gil_held/nanoseconds` (on-CPU time holding the GIL).
    #[arg(long)]
    gil: bool,
    /// Which frames stacks of Python processes keep: `mixed` (Python frames, and native ones
    /// that are not the interpreter's own: extensions, libraries, the kernel), `python`
    /// (Python frames only, like py-spy) or `all` (every native frame too).
    #[arg(long, default_value = "mixed", value_parser = ["mixed", "python", "all"])]
    frames: String,
    /// Kernel BTF to load against (default /sys/kernel/btf/vmlinux).
    #[arg(long, value_name = "FILE", hide = true)]
    btf_path: Option<PathBuf>,
    /// The command to start and profile, after `--`.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

fn parse_ring_mb(s: &str) -> Result<u32, String> {
    let v: u32 = s.parse().map_err(|_| format!("invalid number '{s}'"))?;
    if v == 0 || !v.is_power_of_two() || v > 1024 {
        return Err("ring buffer size must be a power of two between 1 and 1024 MiB".into());
    }
    Ok(v)
}

enum Targets {
    All,
    Pids(Vec<u32>),
    Command(Vec<String>),
    /// The regex as given, and anchored.
    Comm(String, regex::Regex),
}

pub fn run(args: RecordArgs) -> anyhow::Result<u8> {
    // First thing: a Ctrl-C during start-up must end the capture, not kill pyrometer.
    signals::install();
    let targets = if args.all {
        Targets::All
    } else if !args.command.is_empty() {
        if !args.pids.is_empty() {
            return Err(exit_error(
                EXIT_INPUT,
                "give either --pid or a command after --, not both",
            ));
        }
        Targets::Command(args.command.clone())
    } else if !args.pids.is_empty() {
        Targets::Pids(args.pids.clone())
    } else if let Some(re) = &args.comm {
        Targets::Comm(
            re.clone(),
            regex::Regex::new(&format!("^(?:{re})$"))
                .map_err(|e| exit_error(EXIT_INPUT, format!("invalid --comm regex '{re}': {e}")))?,
        )
    } else {
        return Err(exit_error(
            EXIT_INPUT,
            "nothing to profile: give --pid PID, --comm REGEX, --all, or a command after -- (e.g. pyrometer record -- ./prog)",
        ));
    };

    // Everything that can be wrong with the request is checked before the capture starts.
    if !args.gpu && (args.nvml.gpu_interval.is_some() || args.nvml.nvml_lib.is_some()) {
        return Err(exit_error(
            EXIT_INPUT,
            "--gpu-interval and --nvml-lib go with --gpu: add --gpu to poll the GPUs",
        ));
    }
    let format = resolve_format(
        args.output.as_ref(),
        args.format.as_deref(),
        OutputFormat::Svg,
    )?;
    let probe = Profile::with_sources(1, args.off_cpu, args.gil);
    let type_index = match &args.sample_type {
        Some(t) => probe
            .type_index(t)
            .map_err(|e| exit_error(EXIT_INPUT, e.to_string()))?,
        None => probe.single_type_default(),
    };
    let output_path = args
        .output
        .clone()
        .unwrap_or_else(|| default_output_name(&targets, format));
    let out_file = File::create(&output_path).map_err(|e| {
        exit_error(
            EXIT_INPUT,
            format!("cannot write {}: {e}", output_path.display()),
        )
    })?;
    if let Targets::Pids(pids) = &targets {
        target::check_pids(Path::new("/proc"), pids).map_err(|e| {
            let _ = std::fs::remove_file(&output_path);
            exit_error(EXIT_INPUT, e.to_string())
        })?;
    }
    let remove_output = |e: anyhow::Error| {
        let _ = std::fs::remove_file(&output_path);
        e
    };
    privileges::check(privileges::SAMPLING, privileges::effective())
        .map_err(|e| remove_output(exit_error(EXIT_PRIVILEGES, e.to_string())))?;

    let config = SamplerConfig {
        frequency_hz: args.frequency,
        filter: if matches!(targets, Targets::All) {
            Filter::All
        } else {
            Filter::Targets
        },
        ring_buffer_bytes: args.ring_buffer_mb << 20,
        unwind_rows: args.unwind_rows,
        btf_path: pyrometer::bpf::btf_path_or_default(args.btf_path.as_deref()),
        off_cpu_min_ns: args.off_cpu.then(|| {
            let min = args
                .off_cpu_min
                .unwrap_or(pyrometer::bpf::DEFAULT_OFF_CPU_MIN);
            u64::try_from(min.as_nanos()).unwrap_or(u64::MAX)
        }),
        gil: args.gil,
    };
    let mut sampler = Sampler::load(&config)
        .map_err(|e| remove_output(exit_error(EXIT_PRIVILEGES, e.to_string())))?;
    let mut unwinder = if args.unwind == "dwarf" {
        Some(
            sampler
                .unwinder()
                .map_err(|e| remove_output(exit_error(EXIT_PRIVILEGES, e.to_string())))?,
        )
    } else {
        None
    };
    let mut python = sampler
        .python_tracker()
        .map_err(|e| remove_output(exit_error(EXIT_PRIVILEGES, e.to_string())))?;
    let mut debug_dirs = args.debug_dirs.clone();
    debug_dirs.extend(
        pyrometer::symbolize::DEFAULT_DEBUG_DIRS
            .iter()
            .map(PathBuf::from),
    );
    if args.gil {
        python.enable_gil(debug_dirs.clone());
    }
    let mut registry = ProcessRegistry::new();

    let mut root_pids: Vec<u32> = Vec::new();
    let mut child: Option<Child> = None;
    let mut held: Option<HeldChild> = None;
    let mut comm_known = std::collections::HashSet::new();
    match &targets {
        Targets::All => {}
        Targets::Pids(pids) => {
            for &pid in pids {
                sampler.add_target(pid, args.subprocesses)?;
            }
            if args.subprocesses {
                for pid in target::descendants(Path::new("/proc"), pids) {
                    sampler.add_target(pid, true)?;
                }
            }
            root_pids = pids.clone();
            // Tables before the first sample, so even the first stacks unwind fully and
            // carry their Python frames.
            let mut all = pids.clone();
            if args.subprocesses {
                all.extend(target::descendants(Path::new("/proc"), pids));
            }
            for pid in all {
                if let Ok(p) = registry.observe(pid) {
                    if let Some(u) = unwinder.as_mut() {
                        let _ = u.sync_process(p);
                    }
                    python.sync(p, Some(&mut sampler));
                }
            }
        }
        Targets::Command(argv) => {
            let exe = command_path(&argv[0]);
            if let Some(u) = unwinder.as_mut() {
                prewarm_command(u, exe.as_deref());
            }
            // The GIL probes go in before the interpreter starts, so its first acquisitions
            // count; a failure is reported when the process shows up.
            if args.gil
                && let Some(interpreter) = exe
                    .as_deref()
                    .and_then(pyrometer::python::version::interpreter_binary)
            {
                let _ = python.prepare_gil(&interpreter, &mut sampler);
            }
            let h = HeldChild::spawn(argv)
                .map_err(|e| remove_output(exit_error(EXIT_INPUT, e.to_string())))?;
            sampler.add_target(h.pid(), true)?;
            held = Some(h);
        }
        Targets::Comm(_, re) => {
            for e in target::add_comm_matches(
                &mut sampler,
                unwinder.as_mut(),
                &mut registry,
                re,
                &mut comm_known,
                args.subprocesses,
            ) {
                eprintln!("pyrometer: {e}");
            }
        }
    }
    sampler
        .start(args.frequency)
        .map_err(|e| remove_output(exit_error(EXIT_PRIVILEGES, e.to_string())))?;
    if let Some(h) = held.take() {
        child = Some(h.release());
    }

    eprintln!(
        "pyrometer: sampling {} at {} Hz{}; Ctrl-C to stop",
        match &targets {
            Targets::All => "all processes".to_string(),
            Targets::Pids(p) => format!(
                "pid {}",
                p.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
            ),
            Targets::Command(c) => c[0].clone(),
            Targets::Comm(re, _) => format!("processes named '{re}'"),
        },
        args.frequency,
        args.duration
            .map(|d| format!(" for {:.1}s", d.as_secs_f64()))
            .unwrap_or_default()
    );
    let started = Instant::now();
    let cpu_at_start = self_cpu_ns();
    let wall_start = SystemTime::now();
    let progress = indicatif::ProgressBar::new_spinner();
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} recording {elapsed} {msg}")
            .expect("static template"),
    );
    // Per-sample times only when the output draws them; their number is bounded.
    let mut capture = if format.needs_timeline() {
        Capture::with_timeline(Timeline::new(
            DEFAULT_TIMELINE_EVENTS,
            monotonic_now_ns(),
            1_000_000_000 / args.frequency,
        ))
    } else {
        Capture::default()
    };
    capture.off_cpu = args.off_cpu;
    capture.gil = args.gil;
    capture.frames = FrameView::parse(&args.frames).expect("clap checked the value");
    // A missing driver turns the GPU source off, not the recording.
    let mut poller = None;
    if args.gpu
        && let Some(source) = crate::gpu::open_or_info(&args.nvml.library(), "pyrometer")
    {
        capture.activity = Some(Activity::new(
            monotonic_now_ns(),
            DEFAULT_ACTIVITY_BUCKET_NS,
            DEFAULT_ACTIVITY_BUCKETS,
        ));
        poller = Some(
            Poller::start(source, args.nvml.interval(), gpu::DEFAULT_SERIES_CAPACITY)
                .context("starting the GPU poller")?,
        );
    }
    let mut child_status = None;
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut last_alive_check = Instant::now();
    let mut last_gc = Instant::now();
    let mut last_scan = Instant::now();
    loop {
        sampler.wait(Duration::from_millis(100));
        sampler.drain_into(&mut batch);
        for rec in batch.drain(..) {
            capture.ingest(&rec, &sampler, &mut registry, &mut python);
        }
        if let Targets::Comm(_, re) = &targets
            && last_scan.elapsed() >= Duration::from_millis(500)
        {
            last_scan = Instant::now();
            for e in target::add_comm_matches(
                &mut sampler,
                unwinder.as_mut(),
                &mut registry,
                re,
                &mut comm_known,
                args.subprocesses,
            ) {
                eprintln!("pyrometer: {e}");
            }
        }
        sync_tables(
            &mut capture.maps_changed,
            &registry,
            unwinder.as_mut(),
            &mut python,
            Some(&mut sampler),
            &mut last_gc,
        );
        for notice in python.take_notices() {
            progress.suspend(|| eprintln!("pyrometer: {notice}"));
        }
        let lost = sampler.counters().ringbuf_drops;
        progress.set_message(format!("{} samples, {lost} lost", capture.samples));
        progress.tick();

        if let Some(sig) = signals::take() {
            match &child {
                // The child decides when it is done; recording ends when it exits.
                Some(c) => unsafe {
                    // SAFETY: plain kill(2) of our own child.
                    libc::kill(c.id() as i32, sig);
                },
                None => break,
            }
        }
        if let Some(c) = child.as_mut()
            && let Some(status) = c.try_wait().context("waiting for the command")?
        {
            child_status = Some(status);
            break;
        }
        if args.duration.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        if !root_pids.is_empty() && last_alive_check.elapsed() >= Duration::from_millis(200) {
            last_alive_check = Instant::now();
            let proc_root = Path::new("/proc");
            if root_pids.iter().all(|&p| !target::alive(proc_root, p)) {
                break;
            }
        }
    }
    let elapsed = started.elapsed();
    let mut gpu_state = poller.map(Poller::stop);
    let capture_cpu_ns = self_cpu_ns().saturating_sub(cpu_at_start);
    // Samples taken just before the stop may still be in flight to the ring buffer.
    std::thread::sleep(Duration::from_millis(20));
    sampler.drain_into(&mut batch);
    for rec in batch.drain(..) {
        capture.ingest(&rec, &sampler, &mut registry, &mut python);
    }
    let pending = sampler.pending_off_cpu(monotonic_now_ns());
    capture.ingest_pending(pending, &sampler, &mut registry, &mut python);
    progress.finish_and_clear();
    let counters = sampler.counters();
    let bpf_stats = sampler.program_stats();
    let gil_threads = sampler.gil_threads();
    let stopped_ns = monotonic_now_ns();
    drop(sampler);

    if let Some(mut c) = child.take() {
        // Duration ran out or Ctrl-C with a child: it keeps running, as with `perf record`.
        child_status = c.try_wait().ok().flatten().or(child_status);
    }

    let processes = capture.pids.len();
    let (py_frames_seen, py_unresolved) = (capture.py_frames_seen, capture.py_unresolved);
    let samples = capture.samples;
    let (off_cpu_events, off_cpu_ns) = (capture.off_cpu_events, capture.off_cpu_ns);
    let bad = capture.bad_records;
    let period_ns = 1_000_000_000 / i64::try_from(args.frequency).unwrap_or(99);
    let gil_table = args.gil.then(|| {
        let period = 1_000_000_000 / args.frequency;
        let rows = pyrometer::python::gil_report::rows(
            &gil_threads,
            &capture.thread_samples,
            period,
            stopped_ns,
            |pid, tid| {
                python
                    .thread_name(pid, tid)
                    .map(|n| n.to_string())
                    .or_else(|| thread_comm(pid, tid))
            },
        );
        let comm = |pid: u32| {
            registry
                .get(pid)
                .map_or_else(|| "?".to_string(), |p| p.comm.clone())
        };
        pyrometer::python::gil_report::render(&rows, elapsed.as_nanos() as u64, comm)
    });
    let gil_unavailable = python.gil_unavailable().clone();
    let (gil_wait_events, gil_wait_ns) = (capture.gil_wait_events, capture.gil_wait_ns);
    let mut symbolizer = Symbolizer::new().with_debug_dirs(debug_dirs);
    let sampled_pids = capture.pids.clone();
    let activity = capture.activity.take();
    let (mut profile, mut timeline) =
        capture.into_profile_and_timeline(&mut registry, &mut symbolizer, period_ns);
    if let Some(st) = gpu_state.as_mut() {
        // Never taken before, so this is every poll's, even those the bounded series
        // dropped. Labels only add to each sample's, so samples keep their indexes (the
        // timeline's events point at them).
        gpu::label_profile(&mut profile, &gpu::gpus_by_pid(&st.take_process_usage()));
        if let Some(t) = timeline.as_mut() {
            t.counters = st.counter_tracks();
        }
    }
    profile.duration_nanos = i64::try_from(elapsed.as_nanos()).unwrap_or(i64::MAX);
    profile.time_nanos = wall_start
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(0))
        .unwrap_or(0);
    let lost = counters.ringbuf_drops + bad;
    profile.comments.push(format!(
        "pyrometer record at {} Hz: {samples} samples, {lost} lost",
        args.frequency
    ));
    let unsymbolized = symbolizer.stats().unsymbolized;

    // An idle target still has a profile with --off-cpu: where its threads blocked.
    if samples == 0 && off_cpu_events == 0 {
        let _ = std::fs::remove_file(&output_path);
        return Err(exit_error(
            EXIT_INPUT,
            format!(
                "no samples were collected in {:.1}s (did the target use any CPU?); nothing written",
                elapsed.as_secs_f64()
            ),
        ));
    }
    let title = match &targets {
        Targets::All => "pyrometer: all processes".to_string(),
        Targets::Pids(p) => format!(
            "pyrometer: pid {}",
            p.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ),
        Targets::Command(c) => format!("pyrometer: {}", c.join(" ")),
        Targets::Comm(re, _) => format!("pyrometer: --comm '{re}'"),
    };
    let mut w = BufWriter::new(out_file);
    output::write_with_timeline(
        &profile,
        timeline.as_ref(),
        format,
        type_index,
        &title,
        &mut w,
    )
    .and_then(|()| w.flush().map_err(Into::into))
    .with_context(|| format!("writing {}", output_path.display()))?;
    if let Some(t) = timeline.as_ref().filter(|t| t.dropped > 0) {
        eprintln!(
            "pyrometer: the trace holds the first {} samples; {} later ones are only in the totals",
            t.events.len(),
            t.dropped
        );
    }

    let gpu_summaries = gpu_state.as_ref().map(|st| {
        let profiled = |pid: u32| sampled_pids.contains(&pid);
        gpu::summary::summarize(st, activity.as_ref(), Some(&profiled))
    });
    if let Some(path) = &args.stats {
        let unwinder_stats = unwinder.as_ref().map(|u| u.stats()).unwrap_or_default();
        write_stats(
            path,
            samples,
            lost,
            &counters,
            elapsed,
            bpf_stats,
            &unwinder_stats,
            capture_cpu_ns,
            gpu_summaries.as_deref(),
            (py_frames_seen, py_unresolved),
        )?;
    }
    eprintln!(
        "pyrometer: {samples} samples ({lost} lost) from {processes} process{} in {:.1}s, {unsymbolized} unsymbolized frames; wrote {}",
        if processes == 1 { "" } else { "es" },
        elapsed.as_secs_f64(),
        output_path.display()
    );
    if args.off_cpu {
        eprintln!(
            "pyrometer: off-CPU: {off_cpu_events} blocked intervals of at least {:.3}ms, {:.3}s blocked in all; dropped: {} (tracking map full), {} (ring buffer full, all records)",
            args.off_cpu_min
                .unwrap_or(pyrometer::bpf::DEFAULT_OFF_CPU_MIN)
                .as_secs_f64()
                * 1e3,
            off_cpu_ns as f64 / 1e9,
            counters.offcpu_map_full,
            counters.ringbuf_drops
        );
    }
    if let Some(table) = &gil_table {
        if table.is_empty() {
            if gil_unavailable.is_empty() {
                eprintln!("pyrometer: GIL: no Python thread took the GIL while probed");
            }
        } else {
            eprint!(
                "pyrometer: GIL over {:.1}s ({gil_wait_events} contended waits sampled with their stacks, {:.3}s; dropped: {} (stack map full), {} (thread map full)):\n{table}",
                elapsed.as_secs_f64(),
                gil_wait_ns as f64 / 1e9,
                counters.python.gil_pending_full,
                counters.python.gil_threads_full,
            );
        }
        for (pid, reason) in &gil_unavailable {
            eprintln!("pyrometer: GIL view unavailable for pid {pid}: {reason}");
        }
    }
    if counters.user_stack_errors + counters.kernel_stack_errors + capture_missing(counters) > 0 {
        eprintln!(
            "pyrometer: stack errors: {} user, {} kernel",
            counters.user_stack_errors, counters.kernel_stack_errors
        );
    }
    if let (Some(st), Some(summaries)) = (&gpu_state, &gpu_summaries) {
        eprint!(
            "pyrometer: GPUs, polled every {:.3}s:\n{}",
            args.nvml.interval().as_secs_f64(),
            gpu::summary::render(summaries)
        );
        if st.dropped > 0 {
            eprintln!(
                "pyrometer: the GPU summary covers the last {} polls; {} earlier ones were dropped",
                st.series.len(),
                st.dropped
            );
        }
    }
    let uw = counters.unwind;
    if uw.samples > 0 {
        eprintln!(
            "pyrometer: DWARF unwinding: {:.1}% of {} stacks reached the outermost frame; stopped early: {} no mapping, {} no table, {} no CFI row, {} bad CFA, {} truncated",
            100.0 * uw.complete as f64 / uw.samples as f64,
            uw.samples,
            uw.no_mapping,
            uw.no_table,
            uw.no_row,
            uw.bad_cfa,
            uw.truncated
        );
    }
    if let Some(status) = child_status
        && !status.success()
    {
        let code = status
            .code()
            .map(|c| c.clamp(1, 255) as u8)
            .unwrap_or_else(|| {
                use std::os::unix::process::ExitStatusExt;
                128u8.saturating_add(status.signal().unwrap_or(0) as u8)
            });
        eprintln!("pyrometer: the command failed ({status}); the profile was written anyway");
        return Ok(code);
    }
    Ok(0)
}

/// Builds the unwind tables a command will need first: its executable, and the dynamic
/// loader and C library (the ones pyrometer itself maps, which a dynamically linked command on
/// this system maps too).
fn prewarm_command(unwinder: &mut pyrometer::unwinder::Unwinder, exe: Option<&Path>) {
    if let Some(exe) = exe {
        unwinder.prewarm(exe);
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut seen = std::collections::HashSet::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let name = Path::new(path)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        if (name.starts_with("libc.so") || name.starts_with("ld-linux")) && seen.insert(path) {
            unwinder.prewarm(Path::new(path));
        }
    }
}

/// The file a command name runs: as given when it has a `/`, else found along `PATH`.
fn command_path(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        Some(PathBuf::from(program))
    } else {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(program))
                .find(|p| p.is_file())
        })
    }
}

fn capture_missing(c: pyrometer::bpf::Counters) -> u64 {
    c.targets_full
}

fn default_output_name(targets: &Targets, format: OutputFormat) -> PathBuf {
    let stamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let what = match targets {
        Targets::All => "all".to_string(),
        Targets::Pids(p) => format!("pid{}", p[0]),
        Targets::Command(c) => Path::new(&c[0])
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "cmd".into()),
        Targets::Comm(re, _) => {
            let name: String = re
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
                .collect();
            format!("comm-{name}")
        }
    };
    PathBuf::from(format!("pyrometer-{what}-{stamp}.{}", format.extension()))
}

/// A thread's kernel name, when it still exists.
fn thread_comm(pid: u32, tid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// CPU time (user + system) this process has used so far.
fn self_cpu_ns() -> u64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(usage.ru_utime) + us(usage.ru_stime)) * 1000
}

#[allow(clippy::too_many_arguments)]
fn write_stats(
    path: &Path,
    samples: u64,
    lost: u64,
    counters: &pyrometer::bpf::Counters,
    elapsed: Duration,
    bpf: Option<pyrometer::bpf::ProgramStats>,
    unwinder: &pyrometer::unwinder::UnwinderStats,
    capture_cpu_ns: u64,
    gpus: Option<&[gpu::summary::DeviceSummary]>,
    (py_frames_seen, py_unresolved): (u64, u64),
) -> anyhow::Result<()> {
    let cpu_ns = self_cpu_ns();
    let mut json = serde_json::json!({
        "samples": samples,
        "lost": lost,
        "kernel_samples": counters.samples,
        "ringbuf_drops": counters.ringbuf_drops,
        "user_stack_errors": counters.user_stack_errors,
        "kernel_stack_errors": counters.kernel_stack_errors,
        "user_stack_truncated": counters.user_stack_truncated,
        "elapsed_ns": elapsed.as_nanos() as u64,
        "agent_cpu_ns": cpu_ns,
        "agent_capture_cpu_ns": capture_cpu_ns,
        "bpf_run_time_ns": bpf.map(|b| b.run_time_ns),
        "bpf_run_count": bpf.map(|b| b.run_count),
        "unwind_samples": counters.unwind.samples,
        "unwind_complete": counters.unwind.complete,
        "unwind_no_mapping": counters.unwind.no_mapping,
        "unwind_no_table": counters.unwind.no_table,
        "unwind_no_row": counters.unwind.no_row,
        "unwind_bad_cfa": counters.unwind.bad_cfa,
        "unwind_truncated": counters.unwind.truncated,
        "unwind_tables_built": unwinder.tables_built,
        "unwind_tables_failed": unwinder.tables_failed,
        "unwind_tables_evicted": unwinder.tables_evicted,
        "unwind_rows_used": unwinder.rows_used,
        "unwind_rows_capacity": unwinder.rows_capacity,
        "unwind_table_bytes": unwinder.rows_used * 12,
        "unwind_build_ns": unwinder.build_ns,
        "offcpu_kernel_events": counters.offcpu_events,
        "offcpu_map_full": counters.offcpu_map_full,
        "python_frames": py_frames_seen,
        "python_frames_unresolved": py_unresolved,
        "python_walks": counters.python.walks,
        "python_no_thread": counters.python.no_thread,
        "python_truncated": counters.python.truncated,
        "python_read_errors": counters.python.read_errors,
        "python_tstate_searches": counters.python.tstate_searches,
    });
    if let Some(g) = gpus {
        json["gpus"] = gpu::summary::to_json(g);
    }
    std::fs::write(path, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", path.display()))
}
