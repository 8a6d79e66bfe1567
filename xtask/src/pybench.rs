//! Python profiling overhead, pyrometer against py-spy: the same CPU-bound pure-Python workload
//! (tests/fixtures/py631.py on pyenv's 3.11) alone, under `pyrometer record` and under
//! `py-spy record`, both at 99 Hz, in rotating triples. The workload times its own work loop
//! (start-up, attach and symbolization are excluded), and each profiler's own CPU time is its
//! process's (with waited-for children) minus the CPU the workload reports for itself.
//! Nothing passes or fails: it prints medians of the paired ratios.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::bench::median;

/// py-spy from the Python registry, pinned.
const PYSPY_PACKAGES: &[&str] = &["py-spy==0.4.3"];

/// One run: the workload's loop time and CPU, and the whole command's CPU.
pub(crate) struct Run {
    pub(crate) elapsed_ns: f64,
    pub(crate) workload_cpu_ns: f64,
    pub(crate) total_cpu_ns: f64,
}

/// Runs `cmd` (whose stderr carries the workload's `elapsed_ns` and `cpu_ns` lines) and
/// measures the CPU of it and everything it waited for.
pub(crate) fn run_timed(cmd: &mut Command) -> Result<Run> {
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("run benchmark command")?;
    let pid = child.id() as libc::pid_t;
    let stderr = child.stderr;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut e) = stderr {
            use std::io::Read;
            let _ = e.read_to_string(&mut text);
        }
        text
    });
    let exit = wait_with_usage(pid);
    let err = reader.join().unwrap_or_default();
    if !exit.succeeded {
        bail!("benchmark command failed ({}): {err}", exit.status);
    }
    let field = |key: &str| -> Result<f64> {
        err.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {key}in output: {err}"))
    };
    Ok(Run {
        elapsed_ns: field("elapsed_ns ")?,
        workload_cpu_ns: field("cpu_ns ")?,
        total_cpu_ns: exit.cpu_s() * 1e9,
    })
}

/// How a child ended, with the CPU time and memory of it and everything it waited for.
pub(crate) struct Exited {
    pub(crate) succeeded: bool,
    pub(crate) status: i32,
    usage: libc::rusage,
}

impl Exited {
    pub(crate) fn cpu_s(&self) -> f64 {
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        secs(self.usage.ru_utime) + secs(self.usage.ru_stime)
    }

    pub(crate) fn peak_rss_mib(&self) -> f64 {
        self.usage.ru_maxrss as f64 / 1024.0
    }
}

/// Waits for our own child `pid`, which nothing else waits for.
pub(crate) fn wait_with_usage(pid: libc::pid_t) -> Exited {
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for a child of this process, which nothing else waits for.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    Exited {
        succeeded: r == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        status,
        usage,
    }
}

/// pyenv's 3.11 and py-spy (from the Python registry, in `target/bench-venv`) for the
/// section `section`; None, with the section's skip line printed, when either is missing.
pub(crate) fn python_and_pyspy(root: &Path, section: &str) -> Option<(PathBuf, PathBuf)> {
    let python = crate::pyenv_python();
    if !python.exists() {
        println!("\n{section}: skipped ({} is missing)", python.display());
        return None;
    }
    match crate::python_venv(root, "bench-venv", PYSPY_PACKAGES) {
        Ok(venv) => Some((python, venv.join("bin/py-spy"))),
        Err(e) => {
            println!("\n{section}: skipped (py-spy could not be installed: {e:#})");
            None
        }
    }
}

pub fn bench(root: &Path, pyrometer: &Path, pairs: usize) -> Result<()> {
    let Some((python, pyspy)) = python_and_pyspy(root, "Python overhead") else {
        return Ok(());
    };
    let script = root.join("tests/fixtures/py631.py");
    let dir = root.join("target/bench");

    // Calibrate to about 3 s of work per run.
    let probe = run_timed(Command::new(&python).arg(&script).arg("10"))?;
    let rounds = ((3e9 / probe.elapsed_ns) * 10.0).max(10.0) as u64;
    let rounds_s = rounds.to_string();
    let alone = || {
        let mut c = Command::new(&python);
        c.arg(&script).arg(&rounds_s);
        c
    };
    let stats = dir.join("py-stats.json");
    let under_pyrometer = || {
        let mut c = Command::new(pyrometer);
        c.args(["record", "-F", "99", "--stats"])
            .arg(&stats)
            .arg("-o")
            .arg(dir.join("py-pyrometer.folded"))
            .arg("--")
            .arg(&python)
            .arg(&script)
            .arg(&rounds_s);
        c
    };
    let under_pyspy = || {
        let mut c = Command::new(&pyspy);
        c.args(["record", "-r", "99", "--format", "raw", "-o"])
            .arg(dir.join("py-pyspy.txt"))
            .arg("--")
            .arg(&python)
            .arg(&script)
            .arg(&rounds_s);
        c
    };

    let (mut t_alone, mut t_ours, mut t_spy) = (Vec::new(), Vec::new(), Vec::new());
    let (mut r_ours, mut r_spy) = (Vec::new(), Vec::new());
    let (mut cpu_ours, mut cpu_spy) = (Vec::new(), Vec::new());
    let mut capture_ours = Vec::new();
    for i in 0..pairs {
        // Rotate the order so drift in the machine's state favours no one.
        let mut runs: [(usize, Option<Run>); 3] = [(0, None), (1, None), (2, None)];
        runs.rotate_left(i % 3);
        for (which, slot) in runs.iter_mut() {
            let mut cmd = match which {
                0 => alone(),
                1 => under_pyrometer(),
                _ => under_pyspy(),
            };
            *slot = Some(run_timed(&mut cmd)?);
        }
        runs.sort_by_key(|(w, _)| *w);
        let [(_, Some(a)), (_, Some(p)), (_, Some(s))] = runs else {
            unreachable!("every run filled");
        };
        eprintln!(
            "triple {}/{pairs}: alone {:.3}s, pyrometer {:.3}s, py-spy {:.3}s",
            i + 1,
            a.elapsed_ns / 1e9,
            p.elapsed_ns / 1e9,
            s.elapsed_ns / 1e9
        );
        r_ours.push(p.elapsed_ns / a.elapsed_ns);
        r_spy.push(s.elapsed_ns / a.elapsed_ns);
        cpu_ours.push((p.total_cpu_ns - p.workload_cpu_ns).max(0.0));
        let st: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats)?)?;
        if let Some(ns) = st["agent_capture_cpu_ns"].as_f64() {
            capture_ours.push(ns);
        }
        cpu_spy.push((s.total_cpu_ns - s.workload_cpu_ns).max(0.0));
        t_alone.push(a.elapsed_ns);
        t_ours.push(p.elapsed_ns);
        t_spy.push(s.elapsed_ns);
    }
    let seconds = median(&mut t_alone) / 1e9;
    println!();
    println!(
        "Python overhead (py631.py on CPython 3.11.7, {rounds} rounds, {pairs} rotating triples, 99 Hz)"
    );
    println!("  workload alone (median)            {seconds:>10.3} s");
    println!(
        "  under pyrometer record (median)    {:>10.3} s",
        median(&mut t_ours) / 1e9
    );
    println!(
        "  under py-spy record (median)       {:>10.3} s",
        median(&mut t_spy) / 1e9
    );
    println!(
        "  slowdown, pyrometer                {:>10.4} x   (median of paired ratios)",
        median(&mut r_ours)
    );
    println!(
        "  slowdown, py-spy                   {:>10.4} x",
        median(&mut r_spy)
    );
    println!(
        "  profiler CPU, pyrometer            {:>10.3} s   (whole run, median)",
        median(&mut cpu_ours) / 1e9
    );
    println!(
        "  profiler CPU, py-spy               {:>10.3} s",
        median(&mut cpu_spy) / 1e9
    );
    if !capture_ours.is_empty() {
        println!(
            "  pyrometer CPU while sampling       {:>10.3} s   (without start-up: BPF load, tables)",
            median(&mut capture_ours) / 1e9
        );
    }
    Ok(())
}
