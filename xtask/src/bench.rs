//! `cargo xtask bench`: whole-process overhead of `pyrometer record`, measured side by side,
//! then the Python overhead against py-spy (pybench.rs) and CPython 3.15's own sampler
//! (tachyonbench.rs), the allocation probes' cost (allocbench.rs), DWARF unwinding costs, the
//! always-on agent's footprint (agentbench.rs), the agent on a busy node (busybench.rs) and
//! the collector's ingest and query figures.
//!
//! The workload (tests/fixtures/cpu631.c) times its own work loop, so pyrometer's start-up
//! and symbolization are excluded. Runs alternate alone / under pyrometer, and the figures
//! are medians of the paired ratios. BPF cost per sample comes from the kernel's own
//! accounting (`kernel.bpf_stats_enabled`), agent CPU from getrusage at the end of `record`.
//! Nothing here passes or fails: it prints what it measured.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::run;

const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs a command and returns the workload's `elapsed_ns` line from stderr.
fn elapsed_ns(cmd: &mut Command) -> Result<f64> {
    let out = cmd.output().context("run benchmark command")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("benchmark command failed: {err}");
    }
    err.lines()
        .find_map(|l| l.strip_prefix("elapsed_ns "))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no elapsed_ns in output: {err}"))
}

/// The parts of the benchmark, in the order they run; `BENCH_ONLY=python,alloc` picks some.
const SECTIONS: [&str; 12] = [
    "cpu",
    "python",
    "quick",
    "tachyon",
    "alloc",
    "unwind",
    "bpf",
    "agent",
    "capture",
    "busy",
    "collector",
    "otel",
];

pub fn bench(root: &Path) -> Result<()> {
    let dir = root.join("target/bench");
    let workload = crate::build_release_and_workload(root, &dir)?;
    let pyrometer = crate::release_dir().join("pyrometer");
    let pairs: usize = std::env::var("BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let wanted = |section: &str| only.is_empty() || only.split(',').any(|s| s.trim() == section);
    if let Some(bad) = only
        .split(',')
        .map(str::trim)
        .find(|s| !s.is_empty() && !SECTIONS.contains(s))
    {
        bail!(
            "BENCH_ONLY: unknown section '{bad}' (one of {})",
            SECTIONS.join(", ")
        );
    }
    if wanted("cpu") {
        cpu_bench(&workload, &pyrometer, &dir, pairs)?;
    }
    if wanted("python") {
        crate::pybench::bench(root, &pyrometer, pairs)?;
    }
    if wanted("quick") {
        crate::quickbench::bench(root, &pyrometer, pairs)?;
    }
    if wanted("tachyon") {
        crate::tachyonbench::bench(root, &pyrometer, pairs)?;
    }
    if wanted("alloc") {
        crate::allocbench::bench(root, &pyrometer, pairs)?;
    }
    if wanted("unwind") {
        unwind_bench(root, &pyrometer, &dir)?;
    }
    if wanted("bpf") {
        crate::bpfcost::bench(root, &pyrometer, &dir)?;
    }
    if wanted("agent") {
        crate::agentbench::bench(root, &pyrometer)?;
    }
    if wanted("capture") {
        crate::capturebench::bench(root, &pyrometer, &workload, pairs)?;
    }
    if wanted("busy") {
        crate::busybench::bench(root, &pyrometer)?;
    }
    if wanted("collector") {
        collector_bench(root)?;
    }
    if wanted("otel") {
        crate::otelbench::bench(root, pairs)?;
    }
    Ok(())
}

/// `record`'s overhead on the C workload, and the BPF and agent cost per sample.
fn cpu_bench(workload: &Path, pyrometer: &Path, dir: &Path, pairs: usize) -> Result<()> {
    // Calibrate to about 2 s of work per run.
    let probe = elapsed_ns(Command::new(workload).args(["-r", "20"]))?;
    let rounds = ((2e9 / probe) * 20.0).max(20.0) as u64;
    let rounds_s = rounds.to_string();

    let previous = std::fs::read_to_string(STATS_SYSCTL).unwrap_or_else(|_| "0".into());
    let _ = std::fs::write(STATS_SYSCTL, "1");
    let stats_path = dir.join("stats.json");
    let (mut alone, mut under, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut bpf_ns, mut agent_ns) = (Vec::new(), Vec::new());
    let mut bpf_invocation_ns = Vec::new();
    let mut samples_total = 0u64;
    for i in 0..pairs {
        let a = elapsed_ns(Command::new(workload).args(["-r", &rounds_s]))?;
        let u = elapsed_ns(
            Command::new(pyrometer)
                .args(["record", "-F", "99", "--stats"])
                .arg(&stats_path)
                .arg("-o")
                .arg(dir.join("bench.folded"))
                .arg("--")
                .arg(workload)
                .args(["-r", &rounds_s]),
        )?;
        let stats: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&stats_path)?)?;
        let samples = stats["samples"].as_u64().unwrap_or(0).max(1);
        samples_total += samples;
        // run_time covers every tick on every CPU, most of them of other processes and
        // filtered out at once; per sample means per record written.
        let kernel_samples = stats["kernel_samples"].as_u64().unwrap_or(0);
        if let (Some(t), Some(c)) = (
            stats["bpf_run_time_ns"].as_u64(),
            stats["bpf_run_count"].as_u64(),
        ) && c > 0
            && kernel_samples > 0
        {
            bpf_ns.push(t as f64 / kernel_samples as f64);
            bpf_invocation_ns.push(t as f64 / c as f64);
        }
        if let Some(cpu) = stats["agent_capture_cpu_ns"].as_u64() {
            agent_ns.push(cpu as f64 / samples as f64);
        }
        eprintln!(
            "pair {}/{pairs}: alone {:.3}s, under pyrometer {:.3}s",
            i + 1,
            a / 1e9,
            u / 1e9
        );
        alone.push(a);
        under.push(u);
        ratios.push(u / a);
    }
    let _ = std::fs::write(STATS_SYSCTL, previous.trim());

    println!();
    println!(
        "pyrometer record overhead (cpu631, {rounds} rounds, {pairs} alternating pairs, 99 Hz)"
    );
    println!(
        "  workload alone (median)            {:>10.3} s",
        median(&mut alone) / 1e9
    );
    println!(
        "  under pyrometer record (median)    {:>10.3} s",
        median(&mut under) / 1e9
    );
    println!(
        "  slowdown (median of paired ratios) {:>10.4} x",
        median(&mut ratios)
    );
    if bpf_ns.is_empty() {
        println!("  BPF cost per sample                (kernel.bpf_stats_enabled unavailable)");
    } else {
        println!(
            "  BPF cost per sample (bpf_stats)    {:>10.0} ns",
            median(&mut bpf_ns)
        );
        println!(
            "  BPF cost per tick, all CPUs        {:>10.0} ns   (most ticks are other processes, filtered)",
            median(&mut bpf_invocation_ns)
        );
    }
    println!(
        "  agent CPU per sample (getrusage)   {:>10.0} ns   (during the capture: ring buffer, maps, tables)",
        median(&mut agent_ns)
    );
    println!(
        "  samples per run (mean)             {:>10}",
        samples_total / pairs as u64
    );
    Ok(())
}

/// Ingest rate, bytes per sample and query latency of the collector's stores, SQLite and
/// ClickHouse (a private clickhouse-server the benchmark starts) side by side on the same
/// synthetic cluster (collector/benches/store.rs, sized by BENCH_NODES, BENCH_BUCKETS,
/// BENCH_ROWS).
fn collector_bench(root: &Path) -> Result<()> {
    println!();
    run(Command::new("cargo").current_dir(root).args([
        "bench",
        "-q",
        "-p",
        "pyrometer-collector",
        "--bench",
        "store",
    ]))
}

/// DWARF unwinding: BPF cost per sample by stack depth, table build time and size for libc
/// and libpython, and the table memory a node-wide capture uses.
fn unwind_bench(root: &Path, pyrometer: &Path, dir: &Path) -> Result<()> {
    let recurse = dir.join("recurse-nofp");
    run(Command::new("gcc")
        .args(["-O2", "-g", "-fomit-frame-pointer"])
        .arg(root.join("tests/fixtures/recurse.c"))
        .arg("-o")
        .arg(&recurse))?;
    let previous = std::fs::read_to_string(STATS_SYSCTL).unwrap_or_else(|_| "0".into());
    let _ = std::fs::write(STATS_SYSCTL, "1");
    let record_stats = |args: &[&str]| crate::bpfcost::record_stats(pyrometer, dir, args);
    println!();
    println!("DWARF unwinding (recurse.c -O2 -fomit-frame-pointer, 499 Hz, 2 s each)");
    // The stack is main + rec * depth + bottom, plus libc's start frames.
    for depth in [12u32, 60, 124] {
        let depth_s = depth.to_string();
        let recurse_s = recurse.to_string_lossy().into_owned();
        let mut per_sample = Vec::new();
        let mut complete = 0.0;
        for _ in 0..3 {
            let st = record_stats(&["--", &recurse_s, "2", &depth_s])?;
            let samples = st["kernel_samples"].as_u64().unwrap_or(0).max(1);
            if let Some(t) = st["bpf_sample_ns"].as_u64() {
                per_sample.push(t as f64 / samples as f64);
            }
            let walked = st["unwind_samples"].as_u64().unwrap_or(0).max(1);
            complete = st["unwind_complete"].as_u64().unwrap_or(0) as f64 / walked as f64;
        }
        if per_sample.is_empty() {
            println!(
                "  {:>3}-frame stacks: (kernel.bpf_stats_enabled unavailable)",
                depth + 4
            );
        } else {
            println!(
                "  {:>3}-frame stacks: BPF cost per sample {:>8.0} ns (median of 3), {:.1}% complete",
                depth + 4,
                median(&mut per_sample),
                complete * 100.0
            );
        }
    }
    let _ = std::fs::write(STATS_SYSCTL, previous.trim());

    println!();
    println!("Unwind table build (pyrometer-unwind, best of 5)");
    for path in [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0",
    ] {
        let Ok(bytes) = std::fs::read(path) else {
            println!("  {path}: not present");
            continue;
        };
        let mut best = f64::INFINITY;
        let mut rows = 0;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            let table = pyrometer_unwind::build_table(&bytes)
                .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            best = best.min(t0.elapsed().as_secs_f64());
            rows = table.rows.len();
        }
        println!(
            "  {path}: {:.1} ms, {rows} rows, {} KiB in the kernel (16-byte slots)",
            best * 1e3,
            rows * 16 / 1024
        );
    }

    let st = record_stats(&["--all", "--duration", "3s"])?;
    println!();
    println!(
        "Node-wide capture (--all, 3 s): {} tables, {} rows, {:.1} MiB of unwind tables; {} samples",
        st["unwind_tables_built"].as_u64().unwrap_or(0),
        st["unwind_rows_used"].as_u64().unwrap_or(0),
        st["unwind_rows_used"].as_u64().unwrap_or(0) as f64 * 16.0 / (1 << 20) as f64,
        st["samples"].as_u64().unwrap_or(0)
    );
    Ok(())
}
