//! `cargo xtask bench` part `capture`: what an on-demand capture through the collector costs
//! the node, against `pyrometer record` of the same process at the same rate, side by side.
//! A release agent samples the 6:3:1 workload (`cpu631`, alone under its own name, so the
//! always-on part of the agent's cost is small) at 19 Hz and pushes to a collector on
//! loopback. Then, in alternating pairs (BENCH_PAIRS, at most 5):
//!
//! - a capture: `pyrometer capture --collector … --node bench --pid W --duration 5s -F 999`;
//!   its cost to the node is the agent's CPU time from the request to the answer, less what
//!   the agent spent over a window as long just before (its always-on work);
//! - a record: `pyrometer record --pid W --duration 5 -F 999`, its whole CPU time (getrusage
//!   at its exit, start-up included: loading and verifying its programs is part of what a
//!   record costs, and the agent had paid it once, long before).
//!
//! Printed are the medians and their ratio, and the samples each wrote (the same rate should
//! give about the same count). The capture client's own CPU is not counted: it runs where the
//! user is, not on the node.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::agentbench::{Children, cpu_ns, start_agent};
use crate::bench::median;

/// Seconds each capture and record samples.
const SECONDS: u64 = 5;

pub fn bench(root: &Path, pyrometer: &Path, workload: &Path, pairs: usize) -> Result<()> {
    let pairs = pairs.clamp(1, 5);
    let collector_bin = crate::agentbench::collector_bin(pyrometer)?;
    let dir = root.join("target/bench/capture");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // The workload under a name of its own, for the agent's --comm.
    let target_bin = dir.join("pyrocapture");
    std::fs::copy(workload, &target_bin).context("copying the workload")?;
    let mut children = Children(Vec::new());
    let (collector, port) =
        crate::agentbench::start_collector(&collector_bin, &dir.join("collector"))?;
    children.0.push(collector);
    let url = format!("http://127.0.0.1:{port}");
    children.0.push(
        Command::new(&target_bin)
            .arg("3600")
            .spawn()
            .context("starting the workload")?,
    );
    let target = children.0.last().expect("the workload").id().to_string();
    let (agent, _) = start_agent(
        pyrometer,
        &[
            "-F",
            "19",
            "--node-name",
            "bench",
            "--comm",
            "^pyrocapture$",
        ],
        port,
        &dir,
    )?;
    let agent_pid = agent.id();
    children.0.push(agent);
    // The agent polls for capture requests once it has pushed.
    std::thread::sleep(Duration::from_secs(3));

    let (mut captured, mut recorded) = (Vec::new(), Vec::new());
    let (mut capture_samples, mut record_samples) = (Vec::new(), Vec::new());
    for i in 0..pairs {
        // The capture, and the agent's always-on work over a window as long before it.
        let folded = dir.join("capture.folded");
        let idle0 = (cpu_ns(agent_pid)?, Instant::now());
        std::thread::sleep(Duration::from_secs(SECONDS + 1));
        let idle = (cpu_ns(agent_pid)? - idle0.0, idle0.1.elapsed());
        let c0 = (cpu_ns(agent_pid)?, Instant::now());
        let out = Command::new(pyrometer)
            .args(["capture", "--collector", &url, "--node", "bench", "--pid"])
            .arg(&target)
            .args(["--duration", &format!("{SECONDS}s"), "-F", "999", "-o"])
            .arg(&folded)
            .output()
            .context("pyrometer capture")?;
        let during = (cpu_ns(agent_pid)? - c0.0, c0.1.elapsed());
        if !out.status.success() {
            bail!("capture: {}", String::from_utf8_lossy(&out.stderr));
        }
        let always_on = idle.0 as f64 * during.1.as_secs_f64() / idle.1.as_secs_f64();
        let extra_s = (during.0 as f64 - always_on).max(0.0) / 1e9;
        capture_samples.push(folded_samples(&folded)? as f64);

        // The record, its own CPU time.
        let rec_out = dir.join("record.folded");
        let child = Command::new(pyrometer)
            .args(["record", "--pid"])
            .arg(&target)
            .args(["--duration", &SECONDS.to_string(), "-F", "999", "-o"])
            .arg(&rec_out)
            .stderr(Stdio::null())
            .spawn()
            .context("pyrometer record")?;
        let exit = crate::pybench::wait_with_usage(child.id() as libc::pid_t);
        if !exit.succeeded {
            bail!("pyrometer record --pid {target} failed ({})", exit.status);
        }
        record_samples.push(folded_samples(&rec_out)? as f64);
        eprintln!(
            "pair {}/{pairs}: capture {:.0} ms of the agent's CPU ({:.0} samples), record {:.0} ms ({:.0} samples)",
            i + 1,
            extra_s * 1e3,
            capture_samples[i],
            exit.cpu_s() * 1e3,
            record_samples[i]
        );
        captured.push(extra_s);
        recorded.push(exit.cpu_s());
    }
    let (c, r) = (median(&mut captured), median(&mut recorded));
    println!();
    println!(
        "on-demand capture vs record (cpu631, {SECONDS} s at 999 Hz, {pairs} alternating pairs)"
    );
    println!(
        "  capture: the agent's extra CPU (median)   {:>8.0} ms   {:>6.0} samples",
        c * 1e3,
        median(&mut capture_samples)
    );
    println!(
        "  record --pid: its CPU (median)            {:>8.0} ms   {:>6.0} samples",
        r * 1e3,
        median(&mut record_samples)
    );
    println!("  capture / record                          {:>8.2}", c / r);
    Ok(())
}

/// The samples in a folded file (the counts at the ends of its lines).
fn folded_samples(path: &Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
        .sum())
}
