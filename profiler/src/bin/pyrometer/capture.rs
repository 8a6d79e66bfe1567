//! `pyrometer capture --collector URL --node N --pid P`: an on-demand capture on any node,
//! through the collector and that node's agent; the result is written like `record`'s.
//! `pyrometer dump --collector URL --node N --pid P` uses the same channel.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pyrometer::agent::remote::{self, CaptureRequest, Collector, Kind, RemoteError};
use pyrometer::agent::remote_merge;
use pyrometer::output::{self, OutputFormat};

use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error, parse_duration, resolve_format};

/// Where the collector is and how to reach it.
#[derive(Args, Debug, Clone)]
pub struct CollectorArgs {
    /// The collector, e.g. https://collector:4040.
    #[arg(long, value_name = "URL")]
    pub collector: Option<String>,
    /// The node whose agent runs the request (the agent's --node).
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
    /// Processes by label instead of --node and --pid, e.g. '{ray_actor="Trainer"}': the
    /// collector finds them in its agents' recent pushes, on every node (--node narrows it).
    #[arg(long, value_name = "MATCHERS")]
    pub query: Option<String>,
    /// A file holding a token with the `capture` role.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The CA that signed the collector's certificate (https://).
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// Send the token over plain http:// to another host.
    #[arg(long)]
    pub insecure: bool,
}

#[derive(Args, Debug)]
pub struct CaptureArgs {
    #[command(flatten)]
    collector: CollectorArgs,
    /// The process to capture, on --node (repeatable).
    #[arg(short, long, value_name = "PID")]
    pid: Vec<u32>,
    /// How long to sample (at most 60s).
    #[arg(short, long, value_parser = parse_duration, default_value = "5s")]
    duration: Duration,
    /// Samples per second of each thread (at most 999, above the agent's always-on rate).
    #[arg(short = 'F', long, default_value_t = 99)]
    frequency: u32,
    /// GIL wait and hold times: the `gil_wait` and `gil_held` types and the per-thread table
    /// (the node's agent must run with --gil).
    #[arg(long)]
    gil: bool,
    /// Off-CPU time (the node's agent must run with --off-cpu).
    #[arg(long)]
    off_cpu: bool,
    /// Allocations (the node's agent must run with --alloc).
    #[arg(long)]
    alloc: bool,
    /// Output file; the format follows the extension (.svg, .folded, .pb.gz, .speedscope.json,
    /// .trace.json for the Chrome timeline).
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Output format (overrides the extension): folded, svg, pprof, speedscope, chrome.
    #[arg(short, long)]
    format: Option<String>,
}

fn token(args: &CollectorArgs) -> anyhow::Result<Option<String>> {
    let Some(path) = &args.token_file else {
        return Ok(None);
    };
    let t = std::fs::read_to_string(path).map_err(|e| {
        exit_error(
            EXIT_INPUT,
            format!("cannot read the token file {}: {e}", path.display()),
        )
    })?;
    Ok(Some(t.trim().to_string()).filter(|t| !t.is_empty()))
}

fn exit_of(e: RemoteError) -> anyhow::Error {
    let code = match e {
        RemoteError::Input(_) => EXIT_INPUT,
        RemoteError::Privileges(_) => EXIT_PRIVILEGES,
        // The message says the node's agent is away; the project has no other code for it.
        RemoteError::Offline(_) | RemoteError::Other(_) => EXIT_INPUT,
    };
    exit_error(code, e.to_string())
}

/// Runs `request` through the collector of `args`: one result per node it went to.
pub fn send(
    args: &CollectorArgs,
    request: CaptureRequest,
) -> anyhow::Result<Vec<remote::UploadRequest>> {
    let token = token(args)?;
    let url = args.collector.as_deref().expect("checked by the caller");
    let collector = Collector {
        url,
        token: token.as_deref(),
        ca: args.ca.as_deref(),
        insecure: args.insecure,
    };
    remote::run(&collector, request, &mut |line| {
        eprintln!("pyrometer: {line}")
    })
    .map_err(exit_of)
}

/// The node and query of a request from `args`, checked: `--node` with `--pid`, or
/// `--query` (with `--node` to narrow it) without.
pub fn target(args: &CollectorArgs, pids: &[u32]) -> anyhow::Result<(String, String)> {
    if args.collector.is_none() {
        return Err(exit_error(
            EXIT_INPUT,
            "give --collector URL, and --node NAME with --pid PID or --query MATCHERS",
        ));
    }
    match (&args.query, &args.node) {
        (Some(_), _) if !pids.is_empty() => {
            Err(exit_error(EXIT_INPUT, "give --query or --pid, not both"))
        }
        (Some(q), node) if q.trim().is_empty() => Err(exit_error(
            EXIT_INPUT,
            format!(
                "--query '{q}': give label matchers, e.g. '{{ray_actor=\"Trainer\"}}'{}",
                node.as_ref().map_or("", |_| " (or --pid with --node)")
            ),
        )),
        (Some(q), node) => Ok((node.clone().unwrap_or_default(), q.clone())),
        (None, Some(_)) if pids.is_empty() => Err(exit_error(
            EXIT_INPUT,
            "give --pid PID (the process on --node), or --query MATCHERS",
        )),
        (None, Some(node)) => Ok((node.clone(), String::new())),
        (None, None) => Err(exit_error(
            EXIT_INPUT,
            "give --node NAME and --pid PID, or --query MATCHERS",
        )),
    }
}

pub fn run(args: CaptureArgs) -> anyhow::Result<u8> {
    let (node, query) = target(&args.collector, &args.pid)?;
    let ms = args.duration.as_millis();
    if ms == 0 || ms > u128::from(remote::MAX_DURATION_MS) {
        return Err(exit_error(
            EXIT_INPUT,
            format!(
                "--duration {}: a capture lasts up to {} s",
                args.duration.as_secs_f64(),
                remote::MAX_DURATION_MS / 1000
            ),
        ));
    }
    let format = resolve_format(
        args.output.as_ref(),
        args.format.as_deref(),
        OutputFormat::Svg,
    )?;
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("pyrometer-capture{}", format.extension())));
    let request = CaptureRequest {
        node,
        query,
        pids: args.pid.clone(),
        duration_ms: ms as u32,
        frequency_hz: args.frequency,
        gil: args.gil,
        off_cpu: args.off_cpu,
        alloc: args.alloc,
        kind: Kind::Capture as i32,
        ..Default::default()
    };
    let results = send(&args.collector, request)?;
    write(&results, format, &output)?;
    for r in &results {
        eprintln!(
            "pyrometer: {} samples from node {} in {:.1} s",
            r.samples,
            r.node,
            r.ended_unix_ns.saturating_sub(r.started_unix_ns) as f64 / 1e9,
        );
        // With --gil: the node's GIL table, as `record --gil` prints it.
        if !r.text.is_empty() {
            eprint!("pyrometer: node {}: {}", r.node, r.text);
        }
    }
    eprintln!("pyrometer: wrote {}", output.display());
    Ok(0)
}

fn write(
    results: &[remote::UploadRequest],
    format: OutputFormat,
    path: &Path,
) -> anyhow::Result<()> {
    let file = std::fs::File::create(path)
        .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
    let mut w = BufWriter::new(file);
    let nodes: Vec<&str> = results.iter().map(|r| r.node.as_str()).collect();
    if format == OutputFormat::ChromeTrace {
        let doc = remote_merge::timelines(results)?;
        serde_json::to_writer(&mut w, &doc)?;
    } else {
        let profile = remote_merge::profiles(results)?;
        let title = format!("pyrometer capture on {}", nodes.join(", "));
        output::write(
            &profile,
            format,
            profile.single_type_default(),
            &title,
            &mut w,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
