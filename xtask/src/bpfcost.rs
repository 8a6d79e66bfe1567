//! The kernel side's costs: the verifier table (`cargo xtask verifier`, also run by the test
//! command) and, in `cargo xtask bench`, the BPF time per sample, timed by the programs
//! themselves (`bpf_sample_ns`, `bpf_python_ns` in `record --stats`), so the figure leaves out
//! the quick exits for other processes that `kernel.bpf_stats_enabled` would count in.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::run;

/// Builds the debug `pyrometer` and prints the verifier table of the running kernel; fails
/// when a program is refused or over budget.
pub fn verifier(root: &Path) -> Result<()> {
    run(crate::cargo().args(["build", "-p", "pyrometer", "--bin", "pyrometer"]))?;
    let json = root.join("target/verifier.json");
    let status = Command::new(crate::debug_dir().join("pyrometer"))
        .arg("verifier")
        .arg("--json")
        .arg(&json)
        .status()?;
    if !status.success() {
        bail!("pyrometer verifier: a program was refused or is over budget ({status})");
    }
    println!("verifier table written to {}", json.display());
    Ok(())
}

/// `pyrometer record -F 499 --stats` with `args`; returns the stats it wrote.
pub(crate) fn record_stats(
    pyrometer: &Path,
    dir: &Path,
    args: &[&str],
) -> Result<serde_json::Value> {
    let stats = dir.join("bpfcost-stats.json");
    let out = Command::new(pyrometer)
        .args(["record", "-F", "499", "--stats"])
        .arg(&stats)
        .arg("-o")
        .arg(dir.join("bpfcost.folded"))
        .args(args)
        .output()?;
    if !out.status.success() {
        bail!(
            "pyrometer record failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_str(&std::fs::read_to_string(&stats)?)?)
}

/// A Python program whose samples carry ~30 Python frames (a 28-deep recursion under
/// `<module>` and `main`).
const DEEP_PY: &str = r#"import sys, time
def rec(n):
    if n == 0:
        x = 0
        for i in range(200000):
            x += i * i
        return x
    return rec(n - 1) + 1
def main(seconds):
    end = time.time() + seconds
    while time.time() < end:
        rec(28)
main(float(sys.argv[1]))
"#;

/// BPF time per sample at 16, 64 and ~90 native frames (DWARF), with frame pointers, and
/// the Python walk's share for a ~30-frame Python stack; medians of three runs.
pub fn bench(root: &Path, pyrometer: &Path, dir: &Path) -> Result<()> {
    let recurse = dir.join("recurse-nofp");
    run(Command::new("gcc")
        .args(["-O2", "-g", "-fomit-frame-pointer"])
        .arg(root.join("tests/fixtures/recurse.c"))
        .arg("-o")
        .arg(&recurse))?;
    let recurse_s = recurse.to_string_lossy().into_owned();
    println!();
    println!("BPF time per sample (self-timed in the sampler, 499 Hz, 2 s runs, median of 3)");
    // main + rec * depth + bottom, plus libc's start frames.
    for (label, depth, unwind) in [
        ("16 native frames, DWARF", 12u32, "dwarf"),
        ("64 native frames, DWARF", 60, "dwarf"),
        ("90 native frames, DWARF", 86, "dwarf"),
        ("16 native frames, frame pointers", 12, "fp"),
    ] {
        let depth_s = depth.to_string();
        let mut per_sample = Vec::new();
        for _ in 0..3 {
            let st = record_stats(
                pyrometer,
                dir,
                &["--unwind", unwind, "--", &recurse_s, "2", &depth_s],
            )?;
            let samples = st["kernel_samples"].as_u64().unwrap_or(0).max(1);
            per_sample.push(st["bpf_sample_ns"].as_u64().unwrap_or(0) as f64 / samples as f64);
        }
        println!(
            "  {label:<34} {:>8.0} ns",
            crate::bench::median(&mut per_sample)
        );
    }
    let python = crate::pyenv_python();
    if python.exists() {
        let script = dir.join("deep.py");
        std::fs::write(&script, DEEP_PY)?;
        let (mut total, mut walk, mut frames) = (Vec::new(), Vec::new(), 0.0);
        for _ in 0..3 {
            let st = record_stats(
                pyrometer,
                dir,
                &[
                    "--",
                    &python.to_string_lossy(),
                    &script.to_string_lossy(),
                    "2",
                ],
            )?;
            let samples = st["kernel_samples"].as_u64().unwrap_or(0).max(1) as f64;
            let walks = st["python_walks"].as_u64().unwrap_or(0).max(1) as f64;
            total.push(st["bpf_sample_ns"].as_u64().unwrap_or(0) as f64 / samples);
            walk.push(st["bpf_python_ns"].as_u64().unwrap_or(0) as f64 / walks);
            frames = st["python_frames"].as_u64().unwrap_or(0) as f64 / samples;
        }
        println!(
            "  CPython 3.11, {frames:.0} Python frames:      {:>8.0} ns a sample, of which the Python walk {:.0} ns",
            crate::bench::median(&mut total),
            crate::bench::median(&mut walk)
        );
    }
    println!();
    let status = Command::new(pyrometer).arg("verifier").status()?;
    if !status.success() {
        println!("  (a program was refused or is over budget: see the table)");
    }
    Ok(())
}
