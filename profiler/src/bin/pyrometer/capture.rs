//! `pyrometer capture --collector URL --node N --pid P`: an on-demand capture on any node,
//! through the collector and that node's agent; the result is written like `record`'s.
//! `pyrometer dump --collector URL --node N --pid P` uses the same channel.

use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pyrometer::agent::remote::{self, CaptureRequest, Collector, Kind, RemoteError};
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
    /// Processes by label, e.g. '{ray_actor="Trainer"}' (not supported yet: give --node and --pid).
    #[arg(long, value_name = "MATCHERS")]
    query: Option<String>,
    /// How long to sample (at most 60s).
    #[arg(short, long, value_parser = parse_duration, default_value = "5s")]
    duration: Duration,
    /// Samples per second of each thread (at most 999, above the agent's always-on rate).
    #[arg(short = 'F', long, default_value_t = 99)]
    frequency: u32,
    /// GIL wait and hold times (the node's agent must have the GIL probes loaded).
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

/// Runs `request` through the collector of `args`.
pub fn send(
    args: &CollectorArgs,
    request: CaptureRequest,
) -> anyhow::Result<remote::UploadRequest> {
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

pub fn run(args: CaptureArgs) -> anyhow::Result<u8> {
    if args.query.is_some() {
        return Err(exit_error(
            EXIT_INPUT,
            "--query is not supported yet: give --node NAME and --pid PID",
        ));
    }
    let (Some(_), Some(node)) = (&args.collector.collector, &args.collector.node) else {
        return Err(exit_error(
            EXIT_INPUT,
            "give --collector URL, --node NAME and --pid PID",
        ));
    };
    if args.pid.is_empty() {
        return Err(exit_error(
            EXIT_INPUT,
            "give --pid PID (the process on --node)",
        ));
    }
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
        node: node.clone(),
        pids: args.pid.clone(),
        duration_ms: ms as u32,
        frequency_hz: args.frequency,
        gil: args.gil,
        off_cpu: args.off_cpu,
        alloc: args.alloc,
        kind: Kind::Capture as i32,
        ..Default::default()
    };
    let result = send(&args.collector, request)?;
    write(&result, format, &output)?;
    eprintln!(
        "pyrometer: {} samples from node {} in {:.1} s; wrote {}",
        result.samples,
        node,
        result.ended_unix_ns.saturating_sub(result.started_unix_ns) as f64 / 1e9,
        output.display()
    );
    Ok(0)
}

fn write(result: &remote::UploadRequest, format: OutputFormat, path: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::create(path)
        .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
    let mut w = BufWriter::new(file);
    if format == OutputFormat::ChromeTrace {
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(&result.chrome[..])
            .read_to_end(&mut json)
            .context("the agent's timeline is not gzip")?;
        w.write_all(&json)?;
    } else {
        let profile = pyrometer::input::parse_profile(&result.pprof, "the capture")
            .context("reading the agent's profile")?;
        let title = format!("pyrometer capture on {}", result.node);
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
