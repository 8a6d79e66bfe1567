//! `pyrometer record`: select targets, sample them in the kernel, symbolize, write. The
//! recording itself is the library's (`pyrometer::record`); this is its command line, the
//! output files and what is printed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pyrometer::model::{Profile, Sources};
use pyrometer::output::{self, OutputFormat};
use pyrometer::record::{
    Observer, RecordAlloc, RecordConfig, RecordGpuKernels, Recorded, Recording, Targets,
};

use crate::gpu::NvmlArgs;
use crate::{EXIT_INPUT, exit_error, parse_bytes, parse_duration, resolve_format};

mod split;
mod summary;

#[derive(Args, Debug)]
pub struct RecordArgs {
    /// Process to profile (repeatable).
    #[arg(short, long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Also profile the descendants of each --pid (or --comm match), current and future.
    #[arg(long)]
    subprocesses: bool,
    /// Profile processes whose name (comm, 15 bytes) matches this regex, anchored, including
    /// ones that start or rename themselves during the recording; it runs until --duration or
    /// Ctrl-C.
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
    /// Sample type for single-type outputs (folded, svg, speedscope): samples (default), cpu,
    /// off_cpu (with --off-cpu), gil_wait, gil_held (with --gil), gc (with --gc), alloc_space (the default
    /// with --alloc), alloc_objects, inuse_space (the default with --leaks), inuse_objects.
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
    #[command(flatten)]
    debuginfod: crate::debuginfod::DebuginfodArgs,
    /// Use no debuginfod server, not even those of the DEBUGINFOD_URLS environment variable
    /// (which record uses when --debuginfod is not given, as perf and gdb do).
    #[arg(long, conflicts_with = "urls")]
    no_debuginfod: bool,
    /// How long the end of the recording waits for debug files still being fetched; frames
    /// of binaries whose file comes later stay unnamed (the next recording finds it cached).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    debuginfod_wait: Duration,
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
    /// GPU time by launching stack: every CUDA kernel, copy and set attributed to the stack
    /// (Python and native) that launched it, as the gpu_time/nanoseconds and
    /// gpu_launches/count types (the default type then), with `gpu`, `stream` and `nvtx`
    /// labels. A command started by record gets libpyrometer_cupti.so through CUDA's
    /// injection hook (CUDA_INJECTION64_PATH, and NVTX_INJECTION64_PATH for NVTX ranges); a
    /// --pid or --comm process must have been started with it.
    #[arg(long)]
    gpu_kernels: bool,
    /// With --gpu-kernels: take the stack of 1 in N launches per thread (256 by default); each
    /// stands for N, so totals stay unbiased. 1 takes every launch's, at a few microseconds
    /// of the launching thread's time each.
    #[arg(long, value_name = "N", requires = "gpu_kernels", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    gpu_sample_every: Option<u32>,
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
    /// Also measure CPython's garbage-collector pauses: each collection's length by the
    /// Python stack that set it off (an allocation, or gc.collect()), as the `gc/nanoseconds`
    /// type with a `gc_generation` label, and as `GC` slices in a Chrome trace. From the
    /// interpreter's gc__start/gc__done USDT probes where it has them, else uprobes on its
    /// collector function.
    #[arg(long)]
    gc: bool,
    /// Also show asyncio task stacks (CPython 3.11-3.15): a sample in a coroutine gets the
    /// chain of tasks awaiting it, root first (through await, gather and TaskGroup), each a
    /// `[task] NAME` frame above the coroutine frames it ran, read in the kernel with the
    /// frames; samples carry an `asyncio_task` label, the innermost task's name (its
    /// coroutine's qualified name for an automatic `Task-N`).
    #[arg(long = "async")]
    asyncio: bool,
    /// Also sample allocations, a sample every --alloc-sample-bytes bytes on average, as the
    /// alloc_objects, alloc_space, inuse_objects and inuse_space types (estimates). A command
    /// started by record preloads libpyrometer_alloc.so (carried inside pyrometer), which
    /// samples in process (only sampled allocations reach the kernel); a --pid process must
    /// have been started with it. Where it cannot be used, record says so and stops, unless
    /// --alloc-uprobes is given.
    #[arg(long, conflicts_with = "all")]
    alloc: bool,
    /// With --alloc or --leaks: sample the allocations of targets that cannot load the
    /// sampler library (static binaries, Go programs, --pid processes started without it)
    /// through uprobes on their allocator (malloc & co. in libc, jemalloc or tcmalloc, and
    /// CPython's pymalloc): a trap into the kernel per allocator call, a few microseconds each.
    #[arg(long)]
    alloc_uprobes: bool,
    /// Mean bytes between allocation samples (512K by default; 1 samples every allocation,
    /// exact counts at a higher cost). Accepts K, M, G suffixes.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    alloc_sample_bytes: Option<u64>,
    /// Sampled blocks tracked at once for their free (about 80 bytes each in the kernel).
    #[arg(long, value_name = "N", default_value_t = pyrometer::command::DEFAULT_ALLOC_LIVE)]
    alloc_live: u32,
    /// Find leaks: sample allocations (implies --alloc) and report what is still in use at the
    /// end, by the stack that allocated it; the default output type is inuse_space.
    #[arg(long, conflicts_with = "all")]
    leaks: bool,
    /// With --leaks: only count blocks allocated at least this long before the end (e.g. 1s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "leaks")]
    min_age: Option<Duration>,
    /// Which frames stacks of Python processes keep: `mixed` (Python frames, and native ones
    /// that are not the interpreter's own: extensions, libraries, the kernel), `python`
    /// (Python frames only, like py-spy) or `all` (every native frame too).
    #[arg(long, default_value = "mixed", value_parser = ["mixed", "python", "all"])]
    frames: String,
    /// Make the kernel refuse these stages (dwarf, off_cpu, gil, alloc): tests of the
    /// degraded paths.
    #[arg(long, hide = true, value_delimiter = ',')]
    debug_reject: Vec<String>,
    /// Kernel BTF to load against (default /sys/kernel/btf/vmlinux).
    #[arg(long, value_name = "FILE", hide = true)]
    btf_path: Option<PathBuf>,
    /// Also write one output per OpenTelemetry trace (`trace`) or span (`span`) the samples
    /// were taken in (pyrometer-otel), named after the main one: flame.svg →
    /// flame.trace-<id>.svg. Not for Chrome traces.
    #[arg(long, value_name = "KIND", value_parser = split::KINDS)]
    split_by: Option<String>,
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

/// The sample type single-type outputs show by default: what the recording is about.
fn default_type(profile: &Profile, leaks: bool, alloc: bool) -> usize {
    let wanted = if leaks {
        "inuse_space"
    } else if alloc {
        "alloc_space"
    } else {
        // With --gpu-kernels (whose types the profile has only then): the GPU time.
        "gpu_time"
    };
    profile
        .type_index(wanted)
        .unwrap_or_else(|_| profile.single_type_default())
}

/// The spinner while recording; notices are printed above it.
struct Progress(indicatif::ProgressBar);

impl Observer for Progress {
    fn notice(&mut self, line: &str) {
        self.0.suspend(|| eprintln!("pyrometer: {line}"));
    }

    fn progress(&mut self, samples: u64, lost: u64) {
        self.0
            .set_message(format!("{samples} samples, {lost} lost"));
        self.0.tick();
    }
}

/// Notices before the spinner: one line each.
fn notice(line: &str) {
    eprintln!("pyrometer: {line}");
}

/// The checked request: where the profile goes, in which format and type.
struct Output {
    path: PathBuf,
    file: File,
    format: OutputFormat,
    type_index: usize,
}

impl Output {
    /// Deletes the output file (the recording failed before writing it).
    fn remove(&self, e: anyhow::Error) -> anyhow::Error {
        let _ = std::fs::remove_file(&self.path);
        e
    }
}

pub fn run(args: RecordArgs) -> anyhow::Result<u8> {
    // First thing: a Ctrl-C during start-up must end the capture, not kill pyrometer.
    pyrometer::command::install_signal_handlers();
    let targets = Targets::from_args(args.all, &args.pids, args.comm.as_deref(), &args.command)
        .map_err(crate::command_error)?;
    let out = check_request(&args, &targets)?;
    let config = config(&args, targets)?;
    let title = config.targets.title();
    let describe = config.targets.describe();
    let mut recording =
        Recording::open(config, &mut notice).map_err(|e| out.remove(crate::command_error(e)))?;
    let type_index = fallback_type(&args, &recording, out.type_index);
    recording
        .start(&mut notice)
        .map_err(|e| out.remove(crate::command_error(e)))?;
    eprintln!(
        "pyrometer: sampling {describe} at {} Hz{}; Ctrl-C to stop",
        args.frequency,
        args.duration
            .map(|d| format!(" for {:.1}s", d.as_secs_f64()))
            .unwrap_or_default()
    );
    let progress = indicatif::ProgressBar::new_spinner();
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} recording {elapsed} {msg}")
            .expect("static template"),
    );
    let mut observer = Progress(progress);
    recording.run(&mut observer).map_err(crate::command_error)?;
    let recorded = recording.finish();
    observer.0.finish_and_clear();
    write(&args, out, type_index, &title, recorded)
}

/// Everything that can be wrong with the request, checked before the capture starts; the
/// output file is created (and deleted again if the recording fails).
fn check_request(args: &RecordArgs, targets: &Targets) -> anyhow::Result<Output> {
    let alloc = args.alloc || args.leaks;
    if !args.gpu && args.nvml.gpu_interval.is_some()
        || !args.gpu && !args.gpu_kernels && args.nvml.nvml_lib.is_some()
    {
        return Err(exit_error(
            EXIT_INPUT,
            "--gpu-interval and --nvml-lib go with --gpu (--nvml-lib also with --gpu-kernels): add --gpu to poll the GPUs",
        ));
    }
    if !alloc && (args.alloc_sample_bytes.is_some() || args.alloc_uprobes) {
        return Err(exit_error(
            EXIT_INPUT,
            "--alloc-sample-bytes and --alloc-uprobes go with --alloc or --leaks",
        ));
    }
    let format = resolve_format(
        args.output.as_ref(),
        args.format.as_deref(),
        OutputFormat::Svg,
    )?;
    let sources = Sources {
        off_cpu: args.off_cpu,
        gil: args.gil,
        alloc,
        gpu_kernels: args.gpu_kernels,
        gc: args.gc,
    };
    if args.split_by.is_some() && format == OutputFormat::ChromeTrace {
        return Err(exit_error(
            EXIT_INPUT,
            "--split-by writes profiles, not Chrome traces: choose another format".to_string(),
        ));
    }
    let probe = Profile::with_sources(1, sources);
    let type_index = match &args.sample_type {
        Some(t) => probe
            .type_index(t)
            .map_err(|e| exit_error(EXIT_INPUT, e.to_string()))?,
        None => default_type(&probe, args.leaks, alloc),
    };
    let path = args
        .output
        .clone()
        .unwrap_or_else(|| targets.default_output_name(format));
    let file = File::create(&path)
        .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
    let out = Output {
        path,
        file,
        format,
        type_index,
    };
    targets
        .check()
        .map_err(|e| out.remove(crate::command_error(e)))?;
    Ok(out)
}

/// The servers of --debuginfod, else of DEBUGINFOD_URLS unless --no-debuginfod.
fn debuginfod_config(
    args: &RecordArgs,
) -> anyhow::Result<Option<pyrometer::command::debuginfod::DebuginfodConfig>> {
    let d = &args.debuginfod;
    let env = std::env::var("DEBUGINFOD_URLS").ok();
    let urls = match (&env, d.urls.is_empty(), args.no_debuginfod) {
        (_, _, true) => Vec::new(),
        (Some(list), true, false) => vec![list.clone()],
        _ => d.urls.clone(),
    };
    let from = if d.urls.is_empty() {
        "DEBUGINFOD_URLS"
    } else {
        "--debuginfod"
    };
    d.resolve(from, &urls, None, None)
}

/// The library's settings from the flags.
fn config(args: &RecordArgs, targets: Targets) -> anyhow::Result<RecordConfig> {
    let alloc = args.alloc || args.leaks;
    Ok(RecordConfig {
        targets,
        subprocesses: args.subprocesses,
        duration: args.duration,
        frequency: args.frequency,
        ring_buffer_bytes: args.ring_buffer_mb << 20,
        dwarf: args.unwind == "dwarf",
        unwind_rows: args.unwind_rows,
        debug_dirs: args.debug_dirs.clone(),
        debuginfod: debuginfod_config(args)?,
        debuginfod_wait: args.debuginfod_wait,
        gpu: args
            .gpu
            .then(|| (args.nvml.interval(), args.nvml.library())),
        off_cpu: args.off_cpu.then(|| {
            args.off_cpu_min
                .unwrap_or(pyrometer::command::DEFAULT_OFF_CPU_MIN)
        }),
        gil: args.gil,
        gc: args.gc,
        asyncio: args.asyncio,
        gpu_kernels: args.gpu_kernels.then(|| RecordGpuKernels {
            sample_every: args.gpu_sample_every,
            nvml_lib: args.nvml.library(),
        }),
        alloc: alloc.then(|| RecordAlloc {
            sample_bytes: args
                .alloc_sample_bytes
                .unwrap_or(pyrometer::command::DEFAULT_ALLOC_SAMPLE_BYTES),
            live: args.alloc_live,
            leaks: args.leaks,
            min_age: args.min_age,
            uprobes: args.alloc_uprobes,
        }),
        frames: args.frames.clone(),
        timeline: resolve_format(
            args.output.as_ref(),
            args.format.as_deref(),
            OutputFormat::Svg,
        )?
        .needs_timeline(),
        debug_reject: crate::debug_reject_bits(&args.debug_reject)?,
        btf_path: args.btf_path.clone(),
    })
}

/// The profile holds the types of what runs: a type asked for whose source the kernel
/// refused falls back to the default (the refusal was said above).
fn fallback_type(args: &RecordArgs, recording: &Recording, type_index: usize) -> usize {
    if !recording.refused_any() {
        return type_index;
    }
    let sources = recording.sources();
    let probe = Profile::with_sources(1, sources);
    let leaks = args.leaks && sources.alloc;
    match args.sample_type.as_deref().map(|t| probe.type_index(t)) {
        Some(Ok(index)) => index,
        Some(Err(_)) => {
            let index = default_type(&probe, leaks, sources.alloc);
            eprintln!(
                "pyrometer: writing {} samples instead of {}",
                probe.sample_types[index].name,
                args.sample_type.as_deref().unwrap_or_default()
            );
            index
        }
        None => default_type(&probe, leaks, sources.alloc),
    }
}

/// Writes the outputs and prints the report; the exit code is the command's when it failed.
fn write(
    args: &RecordArgs,
    out: Output,
    type_index: usize,
    title: &str,
    recorded: Recorded,
) -> anyhow::Result<u8> {
    let Recorded {
        profile,
        timeline,
        mut report,
        child_status,
        gpu_polls,
    } = recorded;
    // An idle target still has a profile with --off-cpu: where its threads blocked.
    let allocations = report.alloc.as_ref().map_or(0, |a| a.samples);
    let off_cpu_events = report.off_cpu.map_or(0, |o| o.0);
    let gpu_records = report.gpu_kernels.as_ref().map_or(0, |g| g.records);
    if report.samples == 0 && off_cpu_events == 0 && allocations == 0 && gpu_records == 0 {
        let _ = std::fs::remove_file(&out.path);
        return Err(exit_error(
            EXIT_INPUT,
            format!(
                "no samples were collected in {:.1}s (did the target use any CPU?); nothing written",
                report.elapsed.as_secs_f64()
            ),
        ));
    }
    let mut w = BufWriter::new(out.file);
    output::write_with_timeline(
        &profile,
        timeline.as_ref(),
        out.format,
        type_index,
        title,
        &mut w,
    )
    .and_then(|()| w.flush().map_err(Into::into))
    .with_context(|| format!("writing {}", out.path.display()))?;
    if let Some(kind) = &args.split_by {
        let (files, left_out) =
            split::write(&profile, kind, &out.path, out.format, type_index, title)?;
        eprintln!(
            "pyrometer: wrote {} file(s) split by {kind}{}",
            files.len(),
            match left_out {
                0 => String::new(),
                n => format!(" ({n} more left out: at most {})", split::MAX_SPLIT_FILES),
            }
        );
    }
    if let Some(t) = timeline.as_ref().filter(|t| t.dropped > 0) {
        eprintln!(
            "pyrometer: the trace holds the first {} samples; {} later ones are only in the totals",
            t.events.len(),
            t.dropped
        );
    }
    report.output = out.path.clone();
    if let Some(path) = &args.stats {
        std::fs::write(path, serde_json::to_string_pretty(&report.stats_json())?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    summary::print(&report);
    if let Some(g) = &report.gpu_kernels {
        eprint!("{}", g.text);
    }
    if let (Some(summaries), Some((polls, dropped))) = (&report.gpus, gpu_polls) {
        eprint!(
            "pyrometer: GPUs, polled every {:.3}s:\n{}",
            args.nvml.interval().as_secs_f64(),
            pyrometer::gpu::summary::render(summaries)
        );
        if dropped > 0 {
            eprintln!(
                "pyrometer: the GPU summary covers the last {polls} polls; {dropped} earlier ones were dropped"
            );
        }
    }
    summary::print_unwinding(&report);
    Ok(child_exit_code(child_status))
}

/// The command's failure as record's exit code (0 when it succeeded or was not waited for).
fn child_exit_code(status: Option<std::process::ExitStatus>) -> u8 {
    let Some(status) = status.filter(|s| !s.success()) else {
        return 0;
    };
    let code = status
        .code()
        .map(|c| c.clamp(1, 255) as u8)
        .unwrap_or_else(|| {
            use std::os::unix::process::ExitStatusExt;
            128u8.saturating_add(status.signal().unwrap_or(0) as u8)
        });
    eprintln!("pyrometer: the command failed ({status}); the profile was written anyway");
    code
}
