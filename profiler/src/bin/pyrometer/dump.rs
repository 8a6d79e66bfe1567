//! `pyrometer dump --pid PID`: the current Python stack of every thread, like `py-spy dump`,
//! read from the process's memory without stopping it (`--native`: with native frames, each
//! thread stopped for as long as reading its registers takes).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pyrometer::dump::{self, ProcessDump, PythonError};

use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error};

#[derive(Args)]
pub struct DumpArgs {
    /// The Python process to dump (on --node with --collector; or give --query there).
    #[arg(long)]
    pid: Option<u32>,
    /// `text` (default) or `json`.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    format: String,
    /// Also show native frames (C extensions, libraries) where they run, like
    /// `py-spy dump --native`. Each thread is stopped (ptrace) just long enough to read its
    /// registers; through --collector no thread is stopped (a blocked thread's registers come
    /// from the kernel, a running one's from one perf sample).
    #[arg(long)]
    native: bool,
    /// Dump a process on another node, through the collector and that node's agent
    /// (`--collector URL --node NAME`).
    #[command(flatten)]
    remote: crate::capture::CollectorArgs,
    /// Where `/proc` is (tests, or a host's proc mounted elsewhere).
    #[arg(long, default_value = "/proc", hide = true)]
    proc_root: PathBuf,
}

pub fn run(args: DumpArgs) -> Result<u8> {
    if args.remote.collector.is_some() {
        return remote(&args);
    }
    if args.remote.query.is_some() || args.remote.node.is_some() {
        return Err(exit_error(
            EXIT_INPUT,
            "--node and --query dump through the collector: give --collector URL",
        ));
    }
    let Some(pid) = args.pid else {
        return Err(exit_error(
            EXIT_INPUT,
            "give --pid PID (the process to dump)",
        ));
    };
    let dump = dump::dump(&args.proc_root, pid, args.native).map_err(|e| {
        let code = match e {
            PythonError::Permission(_) => EXIT_PRIVILEGES,
            _ => EXIT_INPUT,
        };
        exit_error(code, e.to_string())
    })?;
    let text = if args.format == "json" {
        serde_json::to_string_pretty(&dump)? + "\n"
    } else {
        render_text(&dump)
    };
    // A reader that stops early (`| head`) is not an error.
    match std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(0),
    }
}

/// The dump of `--pid` on `--node` (or of what `--query` matches), made by that node's
/// agent.
fn remote(args: &DumpArgs) -> Result<u8> {
    let pids: Vec<u32> = args.pid.into_iter().collect();
    let (node, query) = crate::capture::target(&args.remote, &pids)?;
    let request = pyrometer::agent::remote::CaptureRequest {
        node,
        query,
        pids,
        native: args.native,
        kind: pyrometer::agent::remote::Kind::Dump as i32,
        ..Default::default()
    };
    let results = crate::capture::send(&args.remote, request)?;
    let mut text = String::new();
    for result in &results {
        let dumps: Vec<ProcessDump> = serde_json::from_str(&result.text)
            .map_err(|e| exit_error(EXIT_INPUT, format!("the agent's dump is unreadable: {e}")))?;
        if results.len() > 1 && args.format != "json" {
            text += &format!("Node {}\n\n", result.node);
        }
        for d in &dumps {
            if args.format == "json" {
                text += &(serde_json::to_string_pretty(d)? + "\n");
            } else {
                text += &render_text(d);
            }
        }
    }
    match std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(0),
    }
}

fn render_text(dump: &ProcessDump) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Process {}: {}",
        dump.pid,
        dump.command.as_deref().unwrap_or("?")
    );
    let _ = writeln!(out, "Python v{} ({})", dump.version, dump.binary);
    for t in &dump.threads {
        let _ = writeln!(out);
        let id = t
            .tid
            .map_or_else(|| format!("{:#x}", t.thread_id), |tid| tid.to_string());
        let mut state = t.state.as_str().to_string();
        if t.holds_gil {
            state.push_str(", holds GIL");
        }
        if let Some(reason) = &t.reason {
            state.push_str(": ");
            state.push_str(reason);
        }
        let name = t
            .python_name
            .as_deref()
            .or(t.name.as_deref())
            .unwrap_or("?");
        let _ = writeln!(out, "Thread {id} ({state}): \"{name}\"");
        if t.frames.is_empty() {
            let _ = writeln!(out, "    (no Python frames)");
        }
        for f in &t.frames {
            match (&f.function, &f.file) {
                (Some(func), Some(file)) => match f.line {
                    Some(line) => {
                        let _ = writeln!(out, "    {func} ({file}:{line})");
                    }
                    // A native frame without line information: its module.
                    None if f.native => {
                        let _ = writeln!(out, "    {func} ({file})");
                    }
                    None => {
                        let _ = writeln!(out, "    {func} ({file}:?)");
                    }
                },
                // A native frame without source information: its module.
                (Some(func), None) if f.native => {
                    let _ = writeln!(out, "    {func}");
                }
                _ => {
                    let _ = writeln!(out, "    <unreadable frame: changed while read>");
                }
            }
        }
        if let Some(e) = &t.native_error {
            let _ = writeln!(out, "    (native frames unavailable: {e})");
        }
        if t.truncated {
            let _ = writeln!(out, "    ... (stack cut: too deep, looping or unreadable)");
        }
    }
    out
}
