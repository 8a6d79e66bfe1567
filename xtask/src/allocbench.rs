//! Allocation profiling overhead: a malloc-heavy program (tests/fixtures/allocs.c, ~110k
//! allocations and as many frees of 16 B–64 KiB per run at scale 1) alone, under
//! `pyrometer record --alloc` at the default rate and at `--alloc-sample-bytes 1`, in
//! rotating triples. The program times its own work and counts its allocator calls, so the
//! per-call cost of the probes is the extra time over the calls. Nothing passes or fails.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::bench::median;

/// The work's time and allocator calls, from the program's stderr.
fn timed(cmd: &mut Command) -> Result<(f64, f64)> {
    let out = cmd.output().context("run benchmark command")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("benchmark command failed: {err}");
    }
    let field = |key: &str| -> Result<f64> {
        err.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {key}in output: {err}"))
    };
    Ok((field("elapsed_ns ")?, field("calls ")?))
}

pub fn bench(root: &Path, pyrometer: &Path, pairs: usize) -> Result<()> {
    let dir = root.join("target/bench");
    let program = dir.join("allocs");
    crate::run(
        Command::new("gcc")
            .args(["-O1", "-g", "-fno-omit-frame-pointer", "-fno-inline"])
            .arg(root.join("tests/fixtures/allocs.c"))
            .arg("-o")
            .arg(&program),
    )?;
    let scale = "1";
    let alone = || {
        let mut c = Command::new(&program);
        c.args(["totals", scale]);
        c
    };
    let under = |rate: &str| {
        let mut c = Command::new(pyrometer);
        c.args(["record", "--alloc", "--alloc-sample-bytes", rate, "-o"])
            .arg(dir.join("alloc.pb.gz"))
            .arg("--")
            .arg(&program)
            .args(["totals", scale]);
        c
    };
    let (mut t_alone, mut t_default, mut t_every) = (Vec::new(), Vec::new(), Vec::new());
    let (mut r_default, mut r_every) = (Vec::new(), Vec::new());
    let (mut per_call_default, mut per_call_every) = (Vec::new(), Vec::new());
    let mut calls = 0.0;
    for i in 0..pairs {
        let mut order = [0usize, 1, 2];
        order.rotate_left(i % 3);
        let mut got = [(0.0, 0.0); 3];
        for which in order {
            got[which] = match which {
                0 => timed(&mut alone())?,
                1 => timed(&mut under("512K"))?,
                _ => timed(&mut under("1"))?,
            };
        }
        let [(a, n), (d, _), (e, _)] = got;
        calls = n;
        eprintln!(
            "triple {}/{pairs}: alone {:.1} ms, --alloc {:.1} ms, rate 1 {:.1} ms",
            i + 1,
            a / 1e6,
            d / 1e6,
            e / 1e6
        );
        t_alone.push(a);
        t_default.push(d);
        t_every.push(e);
        r_default.push(d / a);
        r_every.push(e / a);
        per_call_default.push((d - a) / n);
        per_call_every.push((e - a) / n);
    }
    println!();
    println!(
        "Allocation profiling overhead (allocs.c, {calls:.0} allocator calls a run, {pairs} rotating triples)"
    );
    println!(
        "  program alone (median)             {:>10.1} ms",
        median(&mut t_alone) / 1e6
    );
    println!(
        "  --alloc, every 512 KiB (median)    {:>10.1} ms   slowdown {:.2} x, {:.0} ns per allocator call",
        median(&mut t_default) / 1e6,
        median(&mut r_default),
        median(&mut per_call_default)
    );
    println!(
        "  --alloc-sample-bytes 1 (median)    {:>10.1} ms   slowdown {:.2} x, {:.0} ns per allocator call",
        median(&mut t_every) / 1e6,
        median(&mut r_every),
        median(&mut per_call_every)
    );
    Ok(())
}
