//! On-demand capture of a running process, pyrometer against py-spy: `pyrometer record --pid P
//! --duration 1s` and `py-spy record --pid P --duration 1`, both at 99 Hz, alternating, on
//! the same CPU-bound Python process (tests/fixtures/py631.py on pyenv's 3.11). Each run's
//! wall time, its time to the line that says sampling has begun, its CPU time and its peak
//! RSS (the kernel's account at its reaping). Nothing passes or fails: it prints medians and
//! the ratios of the medians, against the targets (≤ 1.1 s wall, ≤ 2× py-spy's CPU, ≤ 30 MiB).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::median;

/// One capture: seconds from its start to its exit and to its "sampling" line, CPU seconds
/// (its own and its waited-for children's), peak RSS in MiB.
struct Quick {
    wall_s: f64,
    started_s: f64,
    cpu_s: f64,
    rss_mib: f64,
}

/// Reads `stream` to its end: when its first line containing `marker` came (since `t0`),
/// and the text.
fn watch(
    stream: impl std::io::Read + Send + 'static,
    marker: &str,
    t0: Instant,
) -> std::thread::JoinHandle<(Option<Duration>, String)> {
    let marker = marker.to_string();
    std::thread::spawn(move || {
        let (mut at, mut text) = (None, String::new());
        for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
            if at.is_none() && line.contains(&marker) {
                at = Some(t0.elapsed());
            }
            text.push_str(&line);
            text.push('\n');
        }
        (at, text)
    })
}

/// Runs `cmd`, timing the first line of its output that contains `started` (pyrometer says
/// it on stderr, py-spy on stdout) and its exit.
fn run_quick(cmd: &mut Command, started: &str) -> Result<Quick> {
    let t0 = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("run capture command")?;
    let pid = child.id() as libc::pid_t;
    let out = watch(child.stdout.take().context("stdout")?, started, t0);
    let err = watch(child.stderr.take().context("stderr")?, started, t0);
    let exit = crate::pybench::wait_with_usage(pid);
    let wall = t0.elapsed();
    let (at_out, out) = out.join().unwrap_or_default();
    let (at_err, err) = err.join().unwrap_or_default();
    let text = format!("{out}{err}");
    let at = match (at_out, at_err) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if !exit.succeeded {
        bail!("capture command failed ({}): {text}", exit.status);
    }
    let at: Duration = at.with_context(|| format!("no line with '{started}' in: {text}"))?;
    Ok(Quick {
        wall_s: wall.as_secs_f64(),
        started_s: at.as_secs_f64(),
        cpu_s: exit.cpu_s(),
        rss_mib: exit.peak_rss_mib(),
    })
}

/// Kills the workload however the section ends.
struct Workload(Child);

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn bench(root: &Path, pyrometer: &Path, pairs: usize) -> Result<()> {
    let Some((python, pyspy)) = crate::pybench::python_and_pyspy(root, "Quick capture") else {
        return Ok(());
    };
    let dir = root.join("target/bench");
    let workload = Workload(
        Command::new(&python)
            .arg(root.join("tests/fixtures/py631.py"))
            .arg("100000000")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start the Python workload")?,
    );
    let pid = workload.0.id().to_string();
    // Past the interpreter's start-up: both profilers see a process in its work loop.
    std::thread::sleep(Duration::from_secs(1));
    let ours = || {
        let mut c = Command::new(pyrometer);
        c.args([
            "record",
            "--pid",
            &pid,
            "--duration",
            "1s",
            "-F",
            "99",
            "-o",
        ])
        .arg(dir.join("quick.pb.gz"));
        c
    };
    let theirs = || {
        let mut c = Command::new(&pyspy);
        c.args(["record", "--pid", &pid, "--duration", "1", "-r", "99"])
            .args(["--format", "raw", "-o"])
            .arg(dir.join("quick-pyspy.txt"));
        c
    };
    let (mut o, mut t) = (Vec::new(), Vec::new());
    for i in 0..pairs {
        let (a, b) = if i % 2 == 0 {
            let a = run_quick(&mut ours(), "sampling")?;
            (a, run_quick(&mut theirs(), "Sampling process")?)
        } else {
            let b = run_quick(&mut theirs(), "Sampling process")?;
            (run_quick(&mut ours(), "sampling")?, b)
        };
        eprintln!(
            "pair {}/{pairs}: pyrometer {:.3}s wall, {:.3}s to sampling, {:.3}s CPU, {:.1} MiB; \
             py-spy {:.3}s wall, {:.3}s to sampling, {:.3}s CPU, {:.1} MiB",
            i + 1,
            a.wall_s,
            a.started_s,
            a.cpu_s,
            a.rss_mib,
            b.wall_s,
            b.started_s,
            b.cpu_s,
            b.rss_mib
        );
        o.push(a);
        t.push(b);
    }
    let med =
        |runs: &[Quick], f: fn(&Quick) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    println!(
        "\nQuick capture: record --pid P --duration 1s against py-spy record --duration 1, 99 Hz, {pairs} pairs (medians)"
    );
    for (what, f, unit) in [
        (
            "wall time",
            (|q: &Quick| q.wall_s) as fn(&Quick) -> f64,
            "s",
        ),
        ("to sampling", |q: &Quick| q.started_s, "s"),
        ("CPU", |q: &Quick| q.cpu_s, "s"),
        ("peak RSS", |q: &Quick| q.rss_mib, "MiB"),
    ] {
        let (a, b) = (med(&o, f), med(&t, f));
        println!(
            "  {what:<12} pyrometer {a:>8.3} {unit:<3}  py-spy {b:>8.3} {unit:<3}  ratio {:>6.2} x",
            a / b.max(1e-9)
        );
    }
    println!("  targets: wall ≤ 1.1 s, CPU ≤ 2 x py-spy's, peak RSS ≤ 30 MiB");
    Ok(())
}
