//! `pyrometer top`: a live view of where the targets spend their time, like `top` for
//! functions. It samples with the same pipeline as `record` (kernel programs, unwind tables,
//! Python walker, symbolizer); every second the samples read so far become a profile whose
//! functions join a sliding window, and the screen is redrawn from it.

mod term;
mod view;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use pyrometer::bpf::{Filter, SamplerConfig};
use pyrometer::capture::Capture;
use pyrometer::procs::ProcessRegistry;
use pyrometer::python::merge::FrameView;
use pyrometer::symbolize::Symbolizer;
use pyrometer::{privileges, signals, target};

use crate::record::pipeline;
use crate::record::targets::Targets;
use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error, parse_duration};
use view::View;

#[derive(Args, Debug)]
pub struct TopArgs {
    /// Process to watch (repeatable).
    #[arg(short, long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Also watch the descendants of each --pid (or --comm match), current and future.
    #[arg(long)]
    subprocesses: bool,
    /// Watch processes whose name (comm) matches this regex, anchored, also those started
    /// later.
    #[arg(long, value_name = "REGEX", conflicts_with = "pids")]
    comm: Option<String>,
    /// Watch the whole node (every process but the idle task and pyrometer itself).
    #[arg(long, conflicts_with_all = ["pids", "comm"])]
    all: bool,
    /// Samples per second per CPU.
    #[arg(short = 'F', long, default_value_t = 99, value_parser = clap::value_parser!(u64).range(1..=10000))]
    frequency: u64,
    /// How much recent time the shares cover (whole seconds, e.g. 10s, 1m).
    #[arg(short, long, default_value = "10s", value_parser = parse_duration)]
    window: Duration,
    /// Which frames stacks of Python processes keep: `mixed`, `python` or `all` (as for
    /// `record`).
    #[arg(long, default_value = "mixed", value_parser = ["mixed", "python", "all"])]
    frames: String,
    /// How to walk user stacks: `dwarf` or `fp` (frame pointers only).
    #[arg(long, default_value = "dwarf", value_parser = ["dwarf", "fp"])]
    unwind: String,
    /// Extra directory of separate debug files; repeatable.
    #[arg(long = "debug-dir", value_name = "DIR")]
    debug_dirs: Vec<PathBuf>,
}

pub fn run(args: TopArgs) -> anyhow::Result<u8> {
    signals::install();
    // The view needs a terminal; say so before anything is loaded.
    if !term::stdout_is_terminal() {
        return Err(exit_error(
            EXIT_INPUT,
            "stdout is not a terminal: `pyrometer top` draws a live view; to write a profile to a file use `pyrometer record` (e.g. pyrometer record --pid 1234 --duration 10s -o profile.svg)",
        ));
    }
    let targets = Targets::from_args(args.all, &args.pids, args.comm.as_deref(), &[])
        .map_err(|_| {
            exit_error(
                EXIT_INPUT,
                "nothing to watch: give --pid PID, --comm REGEX or --all (e.g. pyrometer top --pid 1234)",
            )
        })?;
    if let Targets::Pids(pids) = &targets {
        target::check_pids(Path::new("/proc"), pids)
            .map_err(|e| exit_error(EXIT_INPUT, e.to_string()))?;
    }
    privileges::check(privileges::SAMPLING, privileges::effective())
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    let config = SamplerConfig {
        frequency_hz: args.frequency,
        filter: if matches!(targets, Targets::All) {
            Filter::All
        } else {
            Filter::Targets
        },
        ring_buffer_bytes: 8 << 20,
        unwind_rows: 1 << 20,
        btf_path: pyrometer::bpf::btf_path_or_default(None),
        off_cpu_min_ns: None,
        gil: false,
        alloc: None,
        dwarf: args.unwind == "dwarf",
        debug_reject: 0,
    };
    let mut debug_dirs = args.debug_dirs.clone();
    debug_dirs.extend(
        pyrometer::symbolize::DEFAULT_DEBUG_DIRS
            .iter()
            .map(PathBuf::from),
    );
    let (mut sampler, mut tables) = pipeline::open(&config, &debug_dirs)?;
    let mut registry = ProcessRegistry::new();
    let mut comm_finder = match &targets {
        Targets::Comm(_, re) => Some(crate::record::CommFinder::new(re, args.subprocesses)),
        _ => None,
    };
    let mut root_pids = Vec::new();
    match &targets {
        Targets::Pids(pids) => {
            pipeline::add_pids(
                &mut sampler,
                &mut tables,
                &mut registry,
                pids,
                args.subprocesses,
            )?;
            root_pids = pids.clone();
        }
        Targets::Comm(..) => {
            if let Some(f) = comm_finder.as_mut() {
                f.poll(&mut sampler, &mut tables, &mut registry);
            }
        }
        Targets::All | Targets::Command(_) => {}
    }
    sampler
        .start(args.frequency)
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;

    let frames = FrameView::parse(&args.frames).expect("clap checked the value");
    let new_capture = || {
        let mut c = Capture::default();
        c.frames = frames;
        c
    };
    let window = usize::try_from(args.window.as_secs().max(1)).unwrap_or(usize::MAX);
    let mut view = View::new(window);
    let mut symbolizer = Symbolizer::new().with_debug_dirs(debug_dirs);
    let period_ns = 1_000_000_000 / i64::try_from(args.frequency).unwrap_or(99);
    let mut capture = new_capture();
    let mut batch = Vec::new();
    let mut notice = String::new();
    let mut ended = false;
    let started = Instant::now();
    let mut last_tick = Instant::now();
    let mut last_alive_check = Instant::now();

    let terminal = term::Terminal::enter()
        .map_err(|e| exit_error(EXIT_INPUT, format!("cannot set up the terminal: {e}")))?;
    let status = |view: &View, notice: &str, ended: bool, lost: u64| {
        let mut lines = vec![format!(
            "pyrometer top: {} at {} Hz, last {}s: {} samples, {lost} lost, {:.0}s running{}",
            targets.describe(),
            args.frequency,
            window,
            view.samples(),
            started.elapsed().as_secs_f64(),
            if ended { "   (targets exited)" } else { "" }
        )];
        if !notice.is_empty() {
            lines.push(notice.to_string());
        }
        lines
    };
    let redraw = |view: &View, notice: &str, ended: bool, lost: u64| {
        let (rows, cols) = terminal.size();
        terminal.draw(&view.render(&status(view, notice, ended, lost), rows), cols)
    };
    redraw(&view, &notice, ended, 0)?;
    loop {
        if !ended {
            for n in pipeline::pump(
                &mut sampler,
                &mut tables,
                &mut registry,
                &mut capture,
                &mut batch,
                Duration::ZERO,
            ) {
                notice = n;
            }
        }
        let keys = terminal.keys(Duration::from_millis(100));
        let mut changed = !keys.is_empty();
        if keys.into_iter().any(|k| view.key(k)) || signals::take().is_some() {
            break;
        }
        if let Some(f) = comm_finder.as_mut() {
            f.poll(&mut sampler, &mut tables, &mut registry);
        }
        if !ended
            && !root_pids.is_empty()
            && last_alive_check.elapsed() >= Duration::from_millis(500)
        {
            last_alive_check = Instant::now();
            ended = root_pids
                .iter()
                .all(|&p| !target::alive(Path::new("/proc"), p));
        }
        if last_tick.elapsed() >= Duration::from_secs(1) {
            last_tick = Instant::now();
            capture.name_late_threads(&mut tables.python);
            let taken = std::mem::replace(&mut capture, new_capture());
            // Paused: the window keeps what it shows; the second's samples are let go.
            if !view.paused {
                let profile = taken.into_profile(&mut registry, &mut symbolizer, period_ns);
                view.push(&profile, 0);
            }
            changed = true;
        }
        if changed {
            let lost = sampler.counters().ringbuf_drops;
            redraw(&view, &notice, ended, lost)?;
        }
    }
    drop(terminal);
    Ok(0)
}
