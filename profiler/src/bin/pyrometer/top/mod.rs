//! `pyrometer top`: a live view of where the targets spend their time, like `top` for
//! functions. The library's `Top` samples as `record` does; every second the samples read so
//! far become a profile whose functions join a sliding window, and the screen is redrawn from
//! it.

mod term;
mod view;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use pyrometer::record::Targets;
use pyrometer::top::{Top, TopConfig};

use crate::{EXIT_INPUT, exit_error, parse_duration};
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
    /// Show asyncio task stacks, as `record --async` does (CPython 3.11-3.15).
    #[arg(long = "async")]
    asyncio: bool,
}

pub fn run(args: TopArgs) -> anyhow::Result<u8> {
    pyrometer::command::install_signal_handlers();
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
    let describe = targets.describe();
    let config = TopConfig {
        targets,
        subprocesses: args.subprocesses,
        frequency: args.frequency,
        frames: args.frames.clone(),
        dwarf: args.unwind == "dwarf",
        debug_dirs: args.debug_dirs.clone(),
        asyncio: args.asyncio,
    };
    let mut top = Top::start(config, &mut |line| eprintln!("pyrometer: {line}"))
        .map_err(crate::command_error)?;
    let window = usize::try_from(args.window.as_secs().max(1)).unwrap_or(usize::MAX);
    let mut view = View::new(window);
    let terminal = term::Terminal::enter()
        .map_err(|e| exit_error(EXIT_INPUT, format!("cannot set up the terminal: {e}")))?;
    let started = Instant::now();
    let status = |view: &View, notice: &str, ended: bool, lost: u64| {
        let mut lines = vec![format!(
            "pyrometer top: {describe} at {} Hz, last {}s: {} samples, {lost} lost, {:.0}s running{}",
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
    redraw(&view, "", false, 0)?;
    watch(&mut top, &mut view, &terminal, redraw)?;
    drop(terminal);
    Ok(0)
}

/// The loop: reads samples, keys and new targets; every second the window moves on and the
/// screen is redrawn (at once on a key).
fn watch(
    top: &mut Top,
    view: &mut View,
    terminal: &term::Terminal,
    redraw: impl Fn(&View, &str, bool, u64) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let mut notice = String::new();
    let mut ended = false;
    let mut last_tick = Instant::now();
    let mut last_alive_check = Instant::now();
    loop {
        if !ended && let Some(n) = top.pump().pop() {
            notice = n;
        }
        let keys = terminal.keys(Duration::from_millis(100));
        let mut changed = !keys.is_empty();
        if keys.into_iter().any(|k| view.key(k)) || pyrometer::command::signal_received() {
            return Ok(());
        }
        for e in top.poll_comm() {
            eprintln!("pyrometer: {e}");
        }
        if !ended && last_alive_check.elapsed() >= Duration::from_millis(500) {
            last_alive_check = Instant::now();
            ended = top.targets_gone();
        }
        if last_tick.elapsed() >= Duration::from_secs(1) {
            last_tick = Instant::now();
            // Paused: the window keeps what it shows; the second's samples are let go.
            if let Some(profile) = top.take_profile(!view.paused) {
                view.push(&profile, 0);
            }
            changed = true;
        }
        if changed {
            redraw(view, &notice, ended, top.lost())?;
        }
    }
}
