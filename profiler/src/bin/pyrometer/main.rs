//! The `pyrometer` command line: `record` samples processes with eBPF and writes a profile,
//! `report` converts or summarizes a profile file, `diff` compares two, `gpu` polls the GPUs
//! alone, `dump` prints a Python process's thread stacks, `top` shows the busiest functions
//! live, `agent` is the node daemon, `install-preload` writes out the allocation sampler
//! library it carries.

mod agent;
mod capture;
mod completions;
mod debuginfod;
mod diff;
#[cfg(test)]
mod doc_examples;
mod dump;
mod gpu;
mod install_preload;
mod record;
mod report;
mod top;
mod verifier;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit codes (README "Exit codes"): 1 is reserved for `diff` finding a regression.
pub const EXIT_INPUT: u8 = 2;
pub const EXIT_PRIVILEGES: u8 = 3;

#[derive(Parser)]
#[command(
    name = "pyrometer",
    version,
    about = "Sampling profiler for Python, native and GPU workloads"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sample processes (or the whole node) and write a flame graph, folded stacks or pprof.
    Record(Box<record::RecordArgs>),
    /// Convert a pprof or folded profile into another format, or print its top functions.
    Report(report::ReportArgs),
    /// Run as the node daemon: sample continuously and push profiles to a collector.
    Agent(Box<agent::AgentArgs>),
    /// Capture a process on any node through the collector and that node's agent, and write
    /// the result like `record`.
    Capture(Box<capture::CaptureArgs>),
    /// Compare two profiles: which functions grew or shrank; exit 1 on a regression.
    Diff(diff::DiffArgs),
    /// Poll the GPUs through NVML (no BPF, no root): print a summary, write a CSV series.
    Gpu(gpu::GpuArgs),
    /// Print the current Python stack of every thread of a process (no BPF, never stops it).
    Dump(dump::DumpArgs),
    /// Load every BPF program in every configuration on this kernel and print what the
    /// verifier spent on each; exit 1 when one is refused or over budget.
    Verifier(verifier::VerifierArgs),
    /// A live view of the functions the targets spend their time in, refreshed every second.
    Top(top::TopArgs),
    /// Write the allocation sampler library this binary carries (libpyrometer_alloc.so) into
    /// a directory, for processes to preload: systemd units, container images, Ray workers.
    InstallPreload(install_preload::InstallPreloadArgs),
    /// Print a shell completion script: `pyrometer completions bash > /etc/bash_completion.d/pyrometer`.
    Completions(completions::CompletionsArgs),
    /// Write the man pages into a directory (run by `cargo xtask test`).
    #[command(hide = true)]
    Man(completions::ManArgs),
}

/// An error that knows its exit code; everything else exits with EXIT_INPUT.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

pub fn exit_error(code: u8, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Exit {
        code,
        message: message.into(),
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Record(args) => record::run(*args),
        Command::Report(args) => report::run(args),
        Command::Agent(args) => agent::run(*args),
        Command::Capture(args) => capture::run(*args),
        Command::Diff(args) => diff::run(args),
        Command::Gpu(args) => gpu::run(args),
        Command::Dump(args) => dump::run(args),
        Command::Verifier(args) => verifier::run(args),
        Command::Top(args) => top::run(args),
        Command::InstallPreload(args) => install_preload::run(args),
        Command::Completions(args) => completions::run(args),
        Command::Man(args) => completions::man(args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            let code = err.downcast_ref::<Exit>().map_or(EXIT_INPUT, |e| e.code);
            // One line: the outermost context, then its causes.
            let mut line = err.to_string();
            for cause in err.chain().skip(1) {
                let cause = cause.to_string();
                if !line.contains(&cause) {
                    line.push_str(": ");
                    line.push_str(&cause);
                }
            }
            eprintln!("pyrometer: {line}");
            ExitCode::from(code)
        }
    }
}

/// `--debug-reject` names as `debug_reject` bits.
pub fn debug_reject_bits(names: &[String]) -> anyhow::Result<u32> {
    pyrometer::command::debug_reject_bits(names).map_err(command_error)
}

/// A library command's error with its exit code: 3 for missing privileges or kernel
/// support, 2 for the rest.
pub fn command_error(e: pyrometer::command::CommandError) -> anyhow::Error {
    use pyrometer::command::CommandError;
    match e {
        CommandError::Kernel(m) => exit_error(EXIT_PRIVILEGES, m),
        CommandError::Input(m) => exit_error(EXIT_INPUT, m),
    }
}

/// `524288`, `512K`, `1M`, `2G` (powers of 1024), at least 1.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.as_bytes().last() {
        Some(b'k' | b'K') => (&t[..t.len() - 1], 10),
        Some(b'm' | b'M') => (&t[..t.len() - 1], 20),
        Some(b'g' | b'G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let v: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size '{s}' (e.g. 512K, 1M, 1)"))?;
    if v == 0 {
        return Err("a size must be at least 1 byte".into());
    }
    v.checked_mul(1 << shift)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

/// Parses `30s`, `1.5m`, `500ms`, `2h` or a plain number of seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration '{s}': expected e.g. 30s, 500ms, 2m"))?;
    let secs = match unit {
        "" | "s" => value,
        "ms" => value / 1e3,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("invalid duration unit '{unit}': use ms, s, m or h")),
    };
    if !secs.is_finite() || secs <= 0.0 {
        return Err(format!("duration must be positive: '{s}'"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// The output path and format: `--format` wins, else the extension, else `default`.
pub fn resolve_format(
    output: Option<&PathBuf>,
    format: Option<&str>,
    default: pyrometer::output::OutputFormat,
) -> anyhow::Result<pyrometer::output::OutputFormat> {
    if let Some(f) = format {
        return f
            .parse()
            .map_err(|e: pyrometer::output::OutputError| exit_error(EXIT_INPUT, e.to_string()));
    }
    Ok(output
        .and_then(|p| pyrometer::output::OutputFormat::from_path(p))
        .unwrap_or(default))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn durations() {
        assert_eq!(parse_bytes("512K"), Ok(512 * 1024));
        assert_eq!(parse_bytes("1"), Ok(1));
        assert_eq!(parse_bytes("2m"), Ok(2 << 20));
        assert!(parse_bytes("0").is_err() && parse_bytes("x").is_err());
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("3x").is_err());
        assert!(parse_duration("0").is_err());
    }

    /// Every `pyrometer ...` example in the README and the book parses with this CLI.
    #[test]
    fn documented_examples_parse() {
        let root = doc_examples::workspace_root();
        let examples = doc_examples::examples(&root, "pyrometer");
        // The quick starts alone have more; fewer means the extraction broke.
        assert!(
            examples.len() >= 15,
            "only {} examples found",
            examples.len()
        );
        let failures: Vec<String> = examples
            .iter()
            .filter_map(|e| {
                let err = Cli::try_parse_from(&e.args).err()?;
                let first = err
                    .to_string()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                Some(format!("{}: `{}`: {first}", e.location, e.args.join(" ")))
            })
            .collect();
        assert!(
            failures.is_empty(),
            "examples that do not parse (write them with concrete values):\n{}",
            failures.join("\n")
        );
    }
}
