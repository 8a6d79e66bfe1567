//! `cargo xtask bench` part `busy`: the always-on agent (defaults: 19 Hz, every process) on a
//! node that keeps starting processes, as a build farm or a Ray node does: gcc compiling a
//! generated C file in a loop (a new stripped `cc1` without frame pointers every few seconds,
//! with its `gcc` driver and `as`), a CPython process that uses 2 s of CPU and starts again,
//! 40 idle Python processes, and about 20 short processes a second (`/bin/true` from a shell
//! loop). Printed: the agent's CPU share of one core after start-up, its peak RSS, the node's
//! new processes over the run (from `/proc/stat`, so other work on the machine counts too)
//! and the agent's CPU per new process, and the load average. BENCH_BUSY_SECONDS sets the
//! length (60 by default). A figure, not a pass/fail.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::agentbench::{collector_bin, cpu_ns, start_agent, status_kb};

const IDLE_PYTHONS: usize = 40;

/// A C file that keeps cc1 busy for a second or so at -O2.
fn generated_c() -> String {
    let mut s = String::from("unsigned long sink;\n");
    for i in 0..1500 {
        s.push_str(&format!(
            "unsigned long f{i}(unsigned long x) {{ for (int k = 0; k < {n}; k++) \
             {{ x = x * 6364136223846793005UL + {i}; if (x % 7 == {m}) x ^= x >> 3; }} \
             sink += x; return x; }}\n",
            n = i % 13 + 1,
            m = i % 7
        ));
    }
    s
}

/// Kills and reaps the children it holds when dropped, on error paths too.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // The loops' shells: their process groups, so the compilers and sleeps they
            // started go too.
            // SAFETY: kill(2) of a process group this bench started.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `sh -c SCRIPT` in a process group of its own.
fn shell(script: &str, dir: &Path) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting sh -c '{script}'"))
}

/// Processes the node has started since boot.
fn forks() -> Result<u64> {
    std::fs::read_to_string("/proc/stat")?
        .lines()
        .find_map(|l| l.strip_prefix("processes ")?.trim().parse().ok())
        .context("no 'processes' line in /proc/stat")
}

pub fn bench(root: &Path, pyrometer: &Path) -> Result<()> {
    let seconds: u64 = std::env::var("BENCH_BUSY_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let collector_bin = collector_bin(pyrometer)?;
    let dir = root.join("target/bench/busy");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("gen.c"), generated_c())?;
    let python = ["/usr/bin/python3", "/usr/bin/python3.11"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .context("no /usr/bin/python3 for the busy-node bench")?;
    let mut children = Children(Vec::new());
    let (collector, port) =
        crate::agentbench::start_collector(&collector_bin, &dir.join("collector"))?;
    children.0.push(collector);
    children.0.push(shell(
        "while :; do gcc -O2 -c gen.c -o gen.o; sleep 1; done",
        &dir,
    )?);
    children.0.push(shell(
        &format!(
            "while :; do {python} -c 'import time\nt = time.process_time()\n\
             while time.process_time() - t < 2: sum(range(1000))'; sleep 1; done"
        ),
        &dir,
    )?);
    for _ in 0..IDLE_PYTHONS {
        children.0.push(
            Command::new(python)
                .args(["-c", "import time\nwhile True: time.sleep(1)"])
                .spawn()
                .context("starting an idle python")?,
        );
    }
    children
        .0
        .push(shell("while :; do /bin/true; sleep 0.05; done", &dir)?);
    let (agent, startup_s) = start_agent(pyrometer, &["--node-name", "busy"], port, &dir)?;
    let pid = agent.id();
    children.0.push(agent);
    let (cpu0, forks0, t0) = (cpu_ns(pid)?, forks()?, Instant::now());
    std::thread::sleep(Duration::from_secs(seconds));
    let (cpu1, forks1, wall) = (cpu_ns(pid)?, forks()?, t0.elapsed());
    let peak_kb = status_kb(pid, "VmHWM:")?;
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    // SAFETY: kill(2) of our own child: SIGTERM makes it push what it has and write --stats.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = children.0.last_mut().expect("the agent").wait();
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("stats.json"))?)?;
    let cpu = cpu1.saturating_sub(cpu0);
    let new = forks1.saturating_sub(forks0).max(1);
    println!(
        "busy node: {seconds} s at the agent's defaults (19 Hz, every process), gcc -O2 in a \
         loop, a restarting CPython, {IDLE_PYTHONS} idle Pythons, ~20 short processes a \
         second; start-up {startup_s:.1} s; load average {load:.1}"
    );
    println!(
        "  CPU {:.3} % of one core; RSS peak {:.1} MB; {new} new processes on the node \
         ({:.1}/s), {:.0} µs of agent CPU per new process; {} samples",
        cpu as f64 / wall.as_nanos() as f64 * 100.0,
        peak_kb as f64 / 1024.0,
        new as f64 / wall.as_secs_f64(),
        cpu as f64 / 1e3 / new as f64,
        stats["samples"].as_u64().unwrap_or(0),
    );
    Ok(())
}
