//! `cargo xtask bench` part `agent`: the always-on footprint. The release agent samples every
//! process of the node at 19 Hz for two minutes (BENCH_AGENT_SECONDS) while one CPU burner
//! per CPU keeps the node busy, pushing to a collector on loopback; printed are its CPU share
//! of one core after start-up, over the whole run and over each half (the first minute holds
//! the one-off work for the node's binaries: their unwind tables, their symbols and debug
//! files at the first push; the second is the agent as it runs for days), and its resident
//! memory, peak and steady (the median of the second half). A figure, not a pass/fail.
//! BENCH_AGENT_COLLECTOR names a collector binary to push to instead of building the release
//! one (its own cost is not measured).
//! BENCH_AGENT_BASELINE names another `pyrometer` binary (say, a build of main) to run in
//! alternating rounds with this one (BENCH_AGENT_ROUNDS, default 1), for before/after
//! medians measured under the same neighbours.
//!
//! A second run samples only the burners (`--comm`): on a machine where other work starts
//! new programs all the time (a shared build machine), the first run mostly measures the
//! agent's work for those new programs; the second is the cost of a node whose processes
//! stay the same, as on the issue's reference node.
//!
//! A third samples only a CPython 3.11 process (pyenv's, run as `pyrochurn`) that starts a
//! 50 ms thread every 100 ms, beside the burners: each new thread's first sample wakes the
//! agent, which reads the threads' `threading` names every 20 ms until they have one. An
//! agent that kept re-reading the names of threads that had ended cost 1.3-1.5 % of a core
//! here (fixed in 37fcf3e); this run is the guard against that coming back.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The thread-churning workload of the third run.
const CHURN_PY: &str = r#"import threading, time
def work():
    t = time.thread_time()
    while time.thread_time() - t < 0.05:
        pass
k = 0
while True:
    t = threading.Thread(target=work, name="w-%d" % k)
    k += 1
    t.start()
    t.join()
    time.sleep(0.05)
"#;

/// Kills and reaps the children it holds when dropped, on error paths too.
pub(crate) struct Children(pub(crate) Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn bench(root: &Path, pyrometer: &Path) -> Result<()> {
    let seconds: u64 = std::env::var("BENCH_AGENT_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let collector_bin = collector_bin(pyrometer)?;
    let dir = root.join("target/bench/agent");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // The burners run a copy of sh with a name of their own, for `--comm`.
    let burner = dir.join("pyroburn");
    std::fs::copy("/bin/sh", &burner).context("copying /bin/sh for the CPU burners")?;
    // The churning Python process runs under a name of its own too (a symlink: the
    // interpreter finds its library through the link's target).
    let python = crate::pyenv_python();
    let churn = if python.exists() {
        let link = dir.join("pyrochurn");
        std::os::unix::fs::symlink(&python, &link)
            .context("linking pyrochurn to pyenv's python3.11")?;
        let script = dir.join("churn.py");
        std::fs::write(&script, CHURN_PY)?;
        Some((link, script))
    } else {
        println!(
            "  (no {}: the thread-churn run is left out)",
            python.display()
        );
        None
    };
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Before/after on a shared machine: the two binaries alternate, round after round, so a
    // neighbour's build weighs on both alike; medians are printed.
    let baseline = std::env::var_os("BENCH_AGENT_BASELINE").map(std::path::PathBuf::from);
    let rounds: usize = std::env::var("BENCH_AGENT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let mut binaries = Vec::new();
    if let Some(b) = &baseline {
        binaries.push(("baseline", b.as_path()));
    }
    binaries.push(("this build", pyrometer));
    println!();
    type Case<'a> = (&'a str, &'a [&'a str], Option<&'a (PathBuf, PathBuf)>);
    let mut cases: Vec<Case> = vec![
        ("every process", &[], None),
        ("the burners only (--comm)", &["--comm", "pyroburn"], None),
    ];
    if let Some(churn) = &churn {
        cases.push((
            "a Python 3.11 process starting a 50 ms thread every 100 ms only (--comm)",
            &["--comm", "pyrochurn"],
            Some(churn),
        ));
    }
    for (what, args, workload) in cases {
        let mut runs: Vec<Vec<Footprint>> = binaries.iter().map(|_| Vec::new()).collect();
        for _ in 0..rounds {
            for (i, (_, bin)) in binaries.iter().enumerate() {
                runs[i].push(run_agent(
                    &dir,
                    bin,
                    &collector_bin,
                    &burner,
                    seconds,
                    args,
                    workload.map(|(link, script)| (link.as_path(), script.as_path())),
                )?);
            }
        }
        for ((name, _), runs) in binaries.iter().zip(runs) {
            let label = if baseline.is_some() {
                format!(", {name}")
            } else {
                String::new()
            };
            print_footprint(&format!("{what}{label}"), seconds, cpus, &runs);
        }
    }
    Ok(())
}

/// BENCH_AGENT_COLLECTOR, else the release collector, built beside `pyrometer`.
pub(crate) fn collector_bin(pyrometer: &Path) -> Result<PathBuf> {
    Ok(match std::env::var_os("BENCH_AGENT_COLLECTOR") {
        Some(path) => PathBuf::from(path),
        None => {
            crate::run(crate::cargo().args([
                "build",
                "--release",
                "-p",
                "pyrometer-collector",
                "--bin",
                "pyrometer-collector",
            ]))?;
            pyrometer.with_file_name("pyrometer-collector")
        }
    })
}

/// One line of what was run, one of the medians over the rounds (with each round's CPU
/// share when there were several).
fn print_footprint(what: &str, seconds: u64, cpus: usize, runs: &[Footprint]) {
    let med = |f: &dyn Fn(&Footprint) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        crate::bench::median(&mut v)
    };
    println!(
        "agent footprint: {seconds} s at 19 Hz, {what}, {cpus} CPUs busy ({cpus} burners); \
         start-up {:.1} s; load average {:.1}{}",
        med(&|r| r.startup_s),
        med(&|r| r.load),
        if runs.len() > 1 {
            format!("; medians of {} alternating rounds", runs.len())
        } else {
            String::new()
        }
    );
    println!(
        "  CPU {:.3} % of one core ({:.3} % in the first half, {:.3} % in the second); RSS peak \
         {:.1} MB (start-up included), steady {:.1} MB; {} samples, {} pushed",
        med(&|r| r.cpu) * 100.0,
        med(&|r| r.cpu_first_half) * 100.0,
        med(&|r| r.cpu_second_half) * 100.0,
        med(&|r| r.peak_kb as f64) / 1024.0,
        med(&|r| r.steady_kb) / 1024.0,
        med(&|r| r.stats["samples"].as_f64().unwrap_or(0.0)),
        med(&|r| r.stats["samples_pushed"].as_f64().unwrap_or(0.0)),
    );
    if runs.len() > 1 {
        let each: Vec<String> = runs
            .iter()
            .map(|r| {
                format!(
                    "{:.3} ({:.3} + {:.3})",
                    r.cpu * 100.0,
                    r.cpu_first_half * 100.0,
                    r.cpu_second_half * 100.0
                )
            })
            .collect();
        println!(
            "  CPU of each round, whole (first half + second half), %: {}",
            each.join(", ")
        );
    }
}

struct Footprint {
    startup_s: f64,
    /// The 1-minute load average at the end of the run.
    load: f64,
    cpu: f64,
    /// The CPU share over the first half of the run: start-up's tail and the first push.
    cpu_first_half: f64,
    /// The CPU share over the second half of the run: without the first push's work
    /// (parsing the symbols and debug files of the node's long-running binaries once).
    cpu_second_half: f64,
    peak_kb: u64,
    steady_kb: f64,
    stats: serde_json::Value,
}

fn run_agent(
    dir: &Path,
    pyrometer: &Path,
    collector_bin: &Path,
    burner: &Path,
    seconds: u64,
    extra: &[&str],
    workload: Option<(&Path, &Path)>,
) -> Result<Footprint> {
    let _ = std::fs::remove_dir_all(dir.join("collector"));
    let _ = std::fs::remove_dir_all(dir.join("spool"));
    let mut children = Children(Vec::new());
    let (collector, port) = start_collector(collector_bin, &dir.join("collector"))?;
    children.0.push(collector);
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    for _ in 0..cpus {
        children.0.push(
            Command::new(burner)
                .args(["-c", "while :; do :; done"])
                .spawn()
                .context("starting a CPU burner")?,
        );
    }
    if let Some((python, script)) = workload {
        children.0.push(
            Command::new(python)
                .arg(script)
                .spawn()
                .context("starting the thread-churning Python process")?,
        );
    }
    let mut args = vec!["-F", "19", "--node-name", "bench"];
    args.extend_from_slice(extra);
    let (agent, startup_s) = start_agent(pyrometer, &args, port, dir)?;
    let pid = agent.id();
    children.0.push(agent);
    let cpu0 = cpu_ns(pid)?;
    let t0 = Instant::now();
    let mut rss_kb = Vec::new();
    let mut half: Option<(u64, Instant)> = None;
    while t0.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(1));
        rss_kb.push(status_kb(pid, "VmRSS:")?);
        if half.is_none() && t0.elapsed() >= Duration::from_secs(seconds) / 2 {
            half = Some((cpu_ns(pid)?, Instant::now()));
        }
    }
    let cpu1 = cpu_ns(pid)?;
    let cpu = (cpu1 - cpu0) as f64 / t0.elapsed().as_nanos() as f64;
    let (cpu_half, t_half) = half.unwrap_or((cpu0, t0));
    let cpu_first_half =
        (cpu_half - cpu0) as f64 / t_half.duration_since(t0).as_nanos().max(1) as f64;
    let cpu_second_half = (cpu1 - cpu_half) as f64 / t_half.elapsed().as_nanos().max(1) as f64;
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN);
    let peak_kb = status_kb(pid, "VmHWM:")?;
    let mut steady: Vec<f64> = rss_kb[rss_kb.len() / 2..]
        .iter()
        .map(|&k| k as f64)
        .collect();
    let steady_kb = crate::bench::median(&mut steady);
    // SAFETY: kill(2) of our own child: SIGTERM makes it push what it has and write --stats.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let agent = children.0.last_mut().expect("the agent");
    let _ = agent.wait();
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("stats.json"))?)?;
    Ok(Footprint {
        startup_s,
        load,
        cpu,
        cpu_first_half,
        cpu_second_half,
        peak_kb,
        steady_kb,
        stats,
    })
}

/// Starts `collector_bin` on a free loopback port with its store in `data_dir` (its output
/// dropped); the collector and the port.
pub(crate) fn start_collector(collector_bin: &Path, data_dir: &Path) -> Result<(Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(collector_bin)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", collector_bin.display()))?;
    Ok((child, port))
}

/// Starts `pyrometer agent --no-gpu ARGS` pushing to the collector on `port`, its spool and
/// `--stats` file in `dir`, and waits until its start-up (BPF verification, the first scan) is
/// over, when it says where it pushes; its stderr is drained from then on. Returns the agent
/// and its start-up time in seconds.
pub(crate) fn start_agent(
    pyrometer: &Path,
    args: &[&str],
    port: u16,
    dir: &Path,
) -> Result<(Child, f64)> {
    let mut agent = Command::new(pyrometer)
        .args(["agent", "--no-gpu"])
        .args(args)
        .arg("--collector")
        .arg(format!("http://127.0.0.1:{port}"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .arg("--stats")
        .arg(dir.join("stats.json"))
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the agent")?;
    let stderr = agent.stderr.take().expect("piped");
    let mut lines = BufReader::new(stderr).lines();
    let started = Instant::now();
    loop {
        let line = match lines.next().transpose() {
            Ok(Some(line)) => line,
            failed => {
                let _ = agent.kill();
                let _ = agent.wait();
                failed?;
                bail!("the agent exited during start-up");
            }
        };
        if line.contains("pushing every") {
            break;
        }
    }
    let startup_s = started.elapsed().as_secs_f64();
    std::thread::spawn(move || lines.for_each(drop));
    Ok((agent, startup_s))
}

/// CPU time of every thread of `pid` (schedstat's on-CPU nanoseconds; the clock-tick
/// counters of /proc/PID/stat are too coarse for a tenth of a percent over a minute).
pub(crate) fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let text = std::fs::read_to_string(e?.path().join("schedstat")).unwrap_or_default();
        total += text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(total)
}

pub(crate) fn status_kb(pid: u32, key: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("the agent (pid {pid}) is gone"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {key} in /proc/{pid}/status"))
}
