//! `pyrometer record`: select targets, sample them in the kernel, symbolize, write.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Args;
use pyrometer::alloc::preload;
use pyrometer::bpf::{AllocConfig, Feature, Filter, Sampler, SamplerConfig};
use pyrometer::capture::{
    Activity, AllocState, Capture, DEFAULT_ACTIVITY_BUCKET_NS, DEFAULT_ACTIVITY_BUCKETS,
    DEFAULT_TIMELINE_EVENTS, Timeline, monotonic_now_ns,
};
use pyrometer::gpu::{self, Poller};
use pyrometer::model::{Profile, Sources};
use pyrometer::output::{self, OutputFormat};
use pyrometer::procs::ProcessRegistry;
use pyrometer::python::merge::FrameView;
use pyrometer::symbolize::Symbolizer;
use pyrometer::tables::Tables;
use pyrometer::target::{self, HeldChild};
use pyrometer::{privileges, signals};

use crate::gpu::NvmlArgs;
use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error, parse_bytes, parse_duration, resolve_format};

pub mod pipeline;
mod split;
mod summary;
pub mod targets;

use summary::{AllocReport, GilReport, RunReport, leak_sites, self_cpu_ns, thread_comm};
use targets::{Targets, command_path, prewarm_command};

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
    /// off_cpu (with --off-cpu), gil_wait, gil_held (with --gil), alloc_space (the default
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
    #[arg(long, value_name = "N", default_value_t = pyrometer::bpf::DEFAULT_ALLOC_LIVE)]
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

/// Finds the processes `--comm` names as they appear, for `record` and `top`: from the
/// kernel's process events (a process started, exec'd or renamed itself), looked at on every
/// turn of the capture loop, so a process is a target within milliseconds of taking the name
/// (a Ray worker takes `ray::IDLE` after it starts, and its first task may follow at once);
/// without the events (another network namespace), by reading every process's name twice a
/// second. The 500 ms scan alone lost a new worker's first ~250 ms of samples on average.
pub struct CommFinder {
    re: regex::Regex,
    follow_children: bool,
    discovery: crate::agent::discover::Discovery,
    known: std::collections::HashSet<u32>,
    exited: Vec<u32>,
}

impl CommFinder {
    pub fn new(re: &regex::Regex, follow_children: bool) -> Self {
        let events = crate::agent::discover::open_events("pyrometer");
        Self {
            re: re.clone(),
            follow_children,
            discovery: crate::agent::discover::Discovery::new(events),
            known: std::collections::HashSet::new(),
            exited: Vec::new(),
        }
    }

    /// Adds the processes that took a matching name since the last call (every process on
    /// the first call), each after its tables are up to date; says which could not be added.
    pub fn poll(
        &mut self,
        sampler: &mut Sampler,
        tables: &mut Tables,
        registry: &mut ProcessRegistry,
    ) {
        self.exited.clear();
        let due = self.discovery.due(&mut self.exited);
        // A pid that exited may come back as another process, to be looked at again.
        for pid in &self.exited {
            self.known.remove(pid);
        }
        let errors = crate::agent::discover::add_comm_matches(
            &due,
            sampler,
            tables,
            registry,
            &self.re,
            &mut self.known,
            self.follow_children,
        );
        for e in errors {
            eprintln!("pyrometer: {e}");
        }
    }
}

/// The sample type single-type outputs show by default: what the recording is about.
/// Whether `path` is an ELF file (not a `#!` script).
fn is_elf(path: &std::path::Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| &magic == b"\x7fELF")
}

fn default_type(profile: &Profile, leaks: bool, alloc: bool) -> usize {
    let wanted = if leaks {
        "inuse_space"
    } else if alloc {
        "alloc_space"
    } else {
        return profile.single_type_default();
    };
    profile
        .type_index(wanted)
        .unwrap_or_else(|_| profile.single_type_default())
}

/// How long record waits for a command it preloaded the sampler library into to reach the
/// library's constructor (the command waits up to 2 s more for the answer). A command that
/// never loads the library (a set-user-ID program ignores LD_PRELOAD) costs this once.
const STARTUP_HOLD_WAIT: Duration = Duration::from_secs(1);

/// The sampler library a command gets preloaded, with its probes attached. Where it cannot
/// be used: None (uprobes on the allocator, said in one line) with --alloc-uprobes, else
/// the error that says why and what to do.
fn preload_library(
    probes: &mut pyrometer::alloc::AllocProbes,
    exe: &Path,
    sampler: &mut Sampler,
    uprobes_allowed: bool,
) -> anyhow::Result<Option<PathBuf>> {
    match probes.preload_command(exe, sampler) {
        Ok(lib) => Ok(Some(lib)),
        Err(why) if uprobes_allowed => {
            eprintln!("pyrometer: {}", preload::uprobes_note(&why));
            Ok(None)
        }
        Err(why) => Err(exit_error(EXIT_INPUT, preload::uprobes_refusal(&why))),
    }
}

pub fn run(args: RecordArgs) -> anyhow::Result<u8> {
    // First thing: a Ctrl-C during start-up must end the capture, not kill pyrometer.
    signals::install();
    let targets = Targets::from_args(args.all, &args.pids, args.comm.as_deref(), &args.command)?;
    let alloc = args.alloc || args.leaks;

    // Everything that can be wrong with the request is checked before the capture starts.
    if !args.gpu && (args.nvml.gpu_interval.is_some() || args.nvml.nvml_lib.is_some()) {
        return Err(exit_error(
            EXIT_INPUT,
            "--gpu-interval and --nvml-lib go with --gpu: add --gpu to poll the GPUs",
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
    let output_path = args
        .output
        .clone()
        .unwrap_or_else(|| targets.default_output_name(format));
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

    let sample_bytes = args
        .alloc_sample_bytes
        .unwrap_or(pyrometer::bpf::DEFAULT_ALLOC_SAMPLE_BYTES);
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
        alloc: alloc.then_some(AllocConfig {
            sample_bytes,
            live_entries: args.alloc_live,
            own_targets: false,
        }),
        dwarf: args.unwind == "dwarf",
        debug_reject: crate::debug_reject_bits(&args.debug_reject)?,
    };
    let mut debug_dirs = args.debug_dirs.clone();
    debug_dirs.extend(
        pyrometer::symbolize::DEFAULT_DEBUG_DIRS
            .iter()
            .map(PathBuf::from),
    );
    let (mut sampler, mut tables) = pipeline::open(&config, &debug_dirs).map_err(remove_output)?;
    if !args.alloc_uprobes {
        tables.alloc = tables.alloc.take().map(|a| a.preload_only());
    }
    // What the kernel refused is off from here on (pipeline::open said so, once each).
    let gil_on = args.gil && !sampler.refused(Feature::Gil);
    let off_cpu_on = args.off_cpu && !sampler.refused(Feature::OffCpu);
    let alloc = alloc && !sampler.refused(Feature::Alloc);
    // The profile holds the types of what runs: a type asked for whose source the kernel
    // refused falls back to the default (the line above said why).
    let type_index = if sampler.refusals().is_empty() {
        type_index
    } else {
        let probe = Profile::with_sources(
            1,
            Sources {
                off_cpu: off_cpu_on,
                gil: gil_on,
                alloc,
            },
        );
        match args.sample_type.as_deref().map(|t| probe.type_index(t)) {
            Some(Ok(index)) => index,
            Some(Err(_)) => {
                let index = default_type(&probe, args.leaks && alloc, alloc);
                eprintln!(
                    "pyrometer: writing {} samples instead of {}",
                    probe.sample_types[index].name,
                    args.sample_type.as_deref().unwrap_or_default()
                );
                index
            }
            None => default_type(&probe, args.leaks && alloc, alloc),
        }
    };
    let mut registry = ProcessRegistry::new();

    let mut root_pids: Vec<u32> = Vec::new();
    let mut child: Option<Child> = None;
    let mut held: Option<HeldChild> = None;
    let mut startup_hold: Option<pyrometer::target::StartupHold> = None;
    // The command's pid and when its maps were read at the handshake, for the capture.
    let mut held_maps_read: Option<(u32, u64)> = None;
    let mut comm_finder = match &targets {
        Targets::Comm(_, re) => Some(CommFinder::new(re, args.subprocesses)),
        _ => None,
    };
    match &targets {
        Targets::All => {}
        Targets::Pids(pids) => {
            pipeline::add_pids(
                &mut sampler,
                &mut tables,
                &mut registry,
                pids,
                args.subprocesses,
            )?;
            root_pids = pids.clone();
            if let Some(a) = &tables.alloc {
                for &pid in pids.iter().filter(|&&pid| !a.is_preloaded(pid)) {
                    let why = preload::not_loaded(pid);
                    if !args.alloc_uprobes {
                        let refusal = preload::uprobes_refusal(&why);
                        return Err(remove_output(exit_error(EXIT_INPUT, refusal)));
                    }
                    if a.has_allocator(pid) {
                        eprintln!("pyrometer: {}", preload::uprobes_note(&why));
                    }
                }
            }
            if let Some(a) = &tables.alloc
                && let Some(&pid) = pids.iter().find(|&&pid| !a.has_allocator(pid))
            {
                let p = registry.get(pid);
                let comm = p.map_or("?", |p| p.comm.as_str());
                let exe = p.and_then(|p| p.exe.as_deref());
                let why = a.unprobed_reason(pid, comm, exe);
                return Err(remove_output(exit_error(EXIT_INPUT, why)));
            }
        }
        Targets::Command(argv) => {
            let exe = command_path(&argv[0]);
            if let Some(u) = tables.unwinder.as_mut() {
                prewarm_command(u, exe.as_deref());
            }
            let interpreter = exe
                .as_deref()
                .and_then(pyrometer::python::version::interpreter_binary);
            if let Some(interpreter) = &interpreter {
                tables.python.prewarm(interpreter);
            }
            // The GIL probes go in before the interpreter starts, so its first acquisitions
            // count; a failure is reported when the process shows up.
            if gil_on && let Some(interpreter) = &interpreter {
                let _ = tables.python.prepare_gil(interpreter, &mut sampler);
            }
            // Allocations are sampled in the command's own process when it can preload the
            // sampler library (anything dynamically linked); uprobes on its allocator
            // otherwise.
            let preload = match (tables.alloc.as_mut(), exe.as_deref()) {
                (Some(a), Some(exe)) => preload_library(a, exe, &mut sampler, args.alloc_uprobes)
                    .map_err(remove_output)?,
                _ => None,
            };
            let env = preload.as_deref().map(|lib| {
                vec![
                    (
                        "LD_PRELOAD",
                        preload::ld_preload(lib, std::env::var_os("LD_PRELOAD")),
                    ),
                    (preload::MEAN_ENV, sample_bytes.to_string().into()),
                ]
            });
            startup_hold = preload
                .as_ref()
                .and_then(|_| pyrometer::target::StartupHold::new().ok());
            let h = HeldChild::spawn_holding(
                argv,
                env.as_deref().unwrap_or_default(),
                startup_hold.as_ref().and_then(|s| s.child_fd()),
            )
            .map_err(|e| remove_output(exit_error(EXIT_INPUT, e.to_string())))?;
            if let Some(s) = startup_hold.as_mut() {
                s.spawned();
            }
            sampler.add_target(h.pid(), true)?;
            if let (Some(a), Some(lib)) = (tables.alloc.as_mut(), preload.as_deref()) {
                a.mark_preloaded(h.pid());
                if let Some(u) = tables.unwinder.as_mut() {
                    u.prewarm(lib);
                }
            }
            // Likewise the allocation probes, on the objects the command will map; a command
            // with no allocator to probe (static and stripped) is refused before it runs. A
            // script (`#!`) maps its interpreter, not itself: its processes are probed as they
            // show up.
            if let (Some(a), Some(exe)) =
                (tables.alloc.as_mut(), exe.as_deref().filter(|e| is_elf(e)))
                && preload.is_none()
            {
                let mut objects = vec![exe.to_path_buf()];
                objects.extend(pyrometer::elfsyms::preloaded_libraries());
                objects.extend(pyrometer::elfsyms::needed_libraries(exe));
                a.prepare(h.pid(), &objects, &mut sampler);
                if !a.has_allocator(h.pid()) {
                    let name = exe
                        .file_name()
                        .map_or_else(|| argv[0].clone(), |n| n.to_string_lossy().into_owned());
                    let why = a.unprobed_reason(h.pid(), &name, Some(exe));
                    return Err(remove_output(exit_error(EXIT_INPUT, why)));
                }
            }
            held = Some(h);
        }
        Targets::Comm(..) => {
            if let Some(f) = comm_finder.as_mut() {
                f.poll(&mut sampler, &mut tables, &mut registry);
            }
        }
    }
    sampler
        .start(args.frequency)
        .map_err(|e| remove_output(exit_error(EXIT_PRIVILEGES, e.to_string())))?;
    if let Some(h) = held.take() {
        let pid = h.pid();
        child = Some(h.release());
        // The sampler library holds the command between the loader's work and its main: its
        // libraries are mapped, so their tables go in before it runs (see StartupHold).
        if let Some(mut hold) = startup_hold.take()
            && hold.wait_ready(STARTUP_HOLD_WAIT)
        {
            let read_at = monotonic_now_ns();
            if let Ok(p) = registry.exec(pid) {
                tables.sync_process(p, &mut sampler);
                held_maps_read = Some((pid, read_at));
            }
            hold.release();
        }
    }

    eprintln!(
        "pyrometer: sampling {} at {} Hz{}; Ctrl-C to stop",
        targets.describe(),
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
    capture.maps_read_after_exec.extend(held_maps_read);
    capture.off_cpu = off_cpu_on;
    capture.gil = gil_on;
    capture.frames = FrameView::parse(&args.frames).expect("clap checked the value");
    if alloc {
        let mut state = AllocState::new(sample_bytes);
        state.min_age_ns = args
            .min_age
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        capture.alloc = Some(state);
    }
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
    // The GIL table's preempted column: each Python thread's run-queue delay, read while the
    // threads live (a `-- CMD`'s are gone by the time the table is made).
    let mut run_delays = gil_on.then(pyrometer::python::run_delay::RunDelays::default);
    let mut last_delay_poll: Option<Instant> = None;
    loop {
        if let Some(d) = run_delays.as_mut()
            && last_delay_poll.is_none_or(|t| t.elapsed() >= Duration::from_millis(50))
        {
            last_delay_poll = Some(Instant::now());
            for pid in tables.python.pids() {
                d.poll(pid);
            }
        }
        let notices = pipeline::pump(
            &mut sampler,
            &mut tables,
            &mut registry,
            &mut capture,
            &mut batch,
            Duration::from_millis(10),
        );
        for notice in notices {
            progress.suspend(|| eprintln!("pyrometer: {notice}"));
        }
        if let Some(f) = comm_finder.as_mut() {
            f.poll(&mut sampler, &mut tables, &mut registry);
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
    if let Some(d) = run_delays.as_mut() {
        for pid in tables.python.pids() {
            d.poll(pid);
        }
    }
    let mut gpu_state = poller.map(Poller::stop);
    let capture_cpu_ns = self_cpu_ns().saturating_sub(cpu_at_start);
    // Samples taken just before the stop may still be in flight to the ring buffer.
    std::thread::sleep(Duration::from_millis(20));
    sampler.drain_into(&mut batch);
    for rec in batch.drain(..) {
        capture.ingest(&rec, &sampler, &mut registry, &mut tables.python);
    }
    let pending = sampler.pending_off_cpu(monotonic_now_ns());
    capture.ingest_pending(pending, &sampler, &mut registry, &mut tables.python);
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
    let py_frames = (capture.py_frames_seen, capture.py_unresolved);
    let samples = capture.samples;
    let (off_cpu_events, off_cpu_ns) = (capture.off_cpu_events, capture.off_cpu_ns);
    let bad = capture.bad_records;
    let period_ns = 1_000_000_000 / i64::try_from(args.frequency).unwrap_or(99);
    let gil = gil_on.then(|| {
        let python = &mut tables.python;
        let rows = pyrometer::python::gil_report::rows(
            &gil_threads,
            &capture.thread_samples,
            period_ns.unsigned_abs(),
            stopped_ns,
            |pid, tid| {
                python
                    .thread_name(pid, tid)
                    .map(|n| n.to_string())
                    .or_else(|| thread_comm(pid, tid))
            },
            |pid, tid| run_delays.as_ref()?.preempted_ns(pid, tid),
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
            .iter()
            .map(|(&p, comm)| (p, comm.clone()))
            .collect();
        GilReport {
            free_threaded,
            table: pyrometer::python::gil_report::render(&rows, elapsed.as_nanos() as u64, comm),
            unavailable,
            wait_events: capture.gil_wait_events,
            wait_ns: capture.gil_wait_ns,
        }
    });
    let mut alloc_report = capture.alloc.as_mut().map(|a| {
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
    if let (Some(report), Some(probes)) = (alloc_report.as_mut(), tables.alloc.as_ref()) {
        report.live_dropped = capture.alloc_live_dropped;
        report.uprobes = probes.attached;
        report.preload_libraries = probes.preload.len();
        let mut pids: Vec<u32> = capture.pids.iter().copied().collect();
        pids.sort_unstable();
        for pid in pids {
            if probes.has_allocator(pid) {
                continue;
            }
            let p = registry.get(pid);
            let comm = p.map_or("?", |p| p.comm.as_str());
            report.unprobed.push(probes.unprobed_reason(
                pid,
                comm,
                p.and_then(|p| p.exe.as_deref()),
            ));
        }
    }
    let mut symbolizer = Symbolizer::new().with_debug_dirs(debug_dirs);
    let sampled_pids = capture.pids.clone();
    let activity = capture.activity.take();
    capture.name_late_threads(&mut tables.python);
    let (mut profile, mut timeline) =
        capture.into_profile_and_timeline(&mut registry, &mut symbolizer, period_ns);
    if alloc {
        profile.default_type = default_type(&profile, args.leaks, true);
    }
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
    if let Some(report) = alloc_report.as_mut()
        && args.leaks
    {
        report.leaks = Some((args.min_age.unwrap_or_default(), leak_sites(&profile, 10)));
    }

    // An idle target still has a profile with --off-cpu: where its threads blocked.
    let allocations = alloc_report.as_ref().map_or(0, |a| a.samples);
    if samples == 0 && off_cpu_events == 0 && allocations == 0 {
        let _ = std::fs::remove_file(&output_path);
        return Err(exit_error(
            EXIT_INPUT,
            format!(
                "no samples were collected in {:.1}s (did the target use any CPU?); nothing written",
                elapsed.as_secs_f64()
            ),
        ));
    }
    let mut w = BufWriter::new(out_file);
    output::write_with_timeline(
        &profile,
        timeline.as_ref(),
        format,
        type_index,
        &targets.title(),
        &mut w,
    )
    .and_then(|()| w.flush().map_err(Into::into))
    .with_context(|| format!("writing {}", output_path.display()))?;
    if let Some(kind) = &args.split_by {
        let (files, left_out) = split::write(
            &profile,
            kind,
            &output_path,
            format,
            type_index,
            &targets.title(),
        )?;
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

    let gpu_summaries = gpu_state.as_ref().map(|st| {
        let profiled = |pid: u32| sampled_pids.contains(&pid);
        gpu::summary::summarize(st, activity.as_ref(), Some(&profiled))
    });
    let report = RunReport {
        samples,
        lost,
        processes,
        elapsed,
        unsymbolized,
        output: output_path.clone(),
        counters,
        off_cpu: off_cpu_on.then(|| {
            (
                off_cpu_events,
                off_cpu_ns,
                args.off_cpu_min
                    .unwrap_or(pyrometer::bpf::DEFAULT_OFF_CPU_MIN),
            )
        }),
        gil,
        alloc: alloc_report,
        py_frames,
    };
    if let Some(path) = &args.stats {
        let unwinder_stats = tables
            .unwinder
            .as_ref()
            .map(|u| u.stats())
            .unwrap_or_default();
        report.write_stats(
            path,
            bpf_stats,
            &unwinder_stats,
            capture_cpu_ns,
            gpu_summaries.as_deref(),
        )?;
    }
    report.print();
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
        let by_frame_pointers = uw.by_frame_pointers();
        eprintln!(
            "pyrometer: DWARF unwinding: {:.1}% of {} stacks reached the outermost frame; stopped early: {} no mapping, {} no table, {} no CFI row, {} bad CFA, {} truncated, {} ended by frame pointers",
            100.0 * uw.complete as f64 / uw.samples as f64,
            uw.samples,
            uw.no_mapping,
            uw.no_table,
            uw.no_row,
            uw.bad_cfa,
            uw.truncated,
            by_frame_pointers
        );
    }
    if let Some(st) = tables.unwinder.as_ref().map(|u| u.stats())
        && (st.tables_too_big > 0 || st.mappings_dropped > 0)
    {
        let mut parts = Vec::new();
        if st.tables_too_big > 0 {
            let what = if st.tables_too_big == 1 {
                "1 executable's table".to_string()
            } else {
                format!("{} executables' tables", st.tables_too_big)
            };
            parts.push(format!(
                "{what} did not fit in --unwind-rows {} (a larger value keeps them)",
                st.rows_capacity
            ));
        }
        if st.mappings_dropped > 0 {
            parts.push(format!(
                "{} executable mappings beyond {} in one process were left out",
                st.mappings_dropped,
                pyrometer_ebpf::MAX_MAPPINGS
            ));
        }
        eprintln!(
            "pyrometer: unwind tables: {}; their frames are walked by frame pointers",
            parts.join(", and ")
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
