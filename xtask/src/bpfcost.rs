//! The kernel side's costs: the verifier table (`cargo xtask verifier`, also run by the test
//! command) and, in `cargo xtask bench`, the BPF time per sample, timed by the programs
//! themselves (`bpf_sample_ns`, `bpf_python_ns` in `record --stats`), so the figure leaves out
//! the quick exits for other processes that `kernel.bpf_stats_enabled` would count in.

use std::path::{Path, PathBuf};
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

/// The same depth through 28 distinct functions: every frame has its own code object, so
/// nothing a walk learnt from the frame before (the code object's first line) applies.
const DISTINCT_PY: &str = r#"import sys, time
def f28(n):
    x = 0
    for i in range(200000):
        x += i * i
    return x
for k in range(27, -1, -1):
    exec(f"def f{k}(n):\n    return f{k + 1}(n) + 1")
def main(seconds):
    end = time.time() + seconds
    while time.time() < end:
        f0(0)
main(float(sys.argv[1]))
"#;

/// A C program whose stack is `main`, 86 distinct functions with frames of 16 to 128 bytes,
/// and a CPU-burning leaf: ~90 native frames over a few pages of stack, each frame with its
/// own unwind row, where `recurse.c` repeats one 16-byte frame (the best case for the
/// unwinder's row lookups and its page-at-a-time stack reads).
fn distinct_c() -> String {
    const FUNCTIONS: usize = 86;
    let mut c = String::from(
        "#include <stdlib.h>\n#include <time.h>\nstatic volatile unsigned long sink;\n\
         __attribute__((noinline)) void bottom(void) {\n    unsigned long x = sink;\n    \
         for (int i = 0; i < 2000000; i++)\n        x = x * 6364136223846793005UL + 1;\n    \
         sink = x;\n}\n",
    );
    for k in (0..FUNCTIONS).rev() {
        let callee = if k + 1 == FUNCTIONS {
            "bottom".to_string()
        } else {
            format!("f{}", k + 1)
        };
        // A volatile local array sizes the frame; the add after the call keeps it from being
        // a tail call.
        let pad = 8 + (k * 7 % 8) * 16;
        c.push_str(&format!(
            "__attribute__((noinline)) void f{k}(void) {{\n    volatile char pad[{pad}];\n    \
             pad[0] = {k};\n    {callee}();\n    sink += pad[0];\n}}\n"
        ));
    }
    c.push_str(
        "int main(int argc, char **argv) {\n    double seconds = argc > 1 ? atof(argv[1]) : 2.0;\n    \
         struct timespec t;\n    clock_gettime(CLOCK_MONOTONIC, &t);\n    \
         double end = t.tv_sec + t.tv_nsec / 1e9 + seconds, now;\n    do {\n        f0();\n        \
         clock_gettime(CLOCK_MONOTONIC, &t);\n        now = t.tv_sec + t.tv_nsec / 1e9;\n    \
         } while (now < end);\n    return 0;\n}\n",
    );
    c
}

/// One line of the table: what to record and how to read the result.
struct Case {
    label: &'static str,
    args: Vec<String>,
    python: bool,
}

/// ns a sample and, for Python cases, the Python walk's ns a walk and frames a sample.
fn measure(pyrometer: &Path, dir: &Path, case: &Case) -> Result<(f64, f64, f64)> {
    let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
    let st = record_stats(pyrometer, dir, &args)?;
    let samples = st["kernel_samples"].as_u64().unwrap_or(0).max(1) as f64;
    let walks = st["python_walks"].as_u64().unwrap_or(0).max(1) as f64;
    Ok((
        st["bpf_sample_ns"].as_u64().unwrap_or(0) as f64 / samples,
        st["bpf_python_ns"].as_u64().unwrap_or(0) as f64 / walks,
        st["python_frames"].as_u64().unwrap_or(0) as f64 / samples,
    ))
}

/// BPF time per sample at 16, 64 and ~90 native frames (DWARF), with frame pointers, and
/// for ~30-frame Python stacks with the Python walk's share; medians of three runs
/// (BENCH_PAIRS others: five for a before/after). With
/// `BENCH_BASELINE=PATH` (another build's `pyrometer`, e.g. one built from `main`), every
/// run is made with both binaries, alternating which goes first, and both columns printed:
/// on a shared machine only figures taken side by side compare.
pub fn bench(root: &Path, pyrometer: &Path, dir: &Path) -> Result<()> {
    let baseline = std::env::var_os("BENCH_BASELINE").map(PathBuf::from);
    if let Some(b) = &baseline
        && !b.is_file()
    {
        bail!(
            "BENCH_BASELINE: {} is not a file (give the path of another build's pyrometer)",
            b.display()
        );
    }
    let recurse = dir.join("recurse-nofp");
    run(Command::new("gcc")
        .args(["-O2", "-g", "-fomit-frame-pointer"])
        .arg(root.join("tests/fixtures/recurse.c"))
        .arg("-o")
        .arg(&recurse))?;
    let recurse_s = recurse.to_string_lossy().into_owned();
    // main + rec * depth + bottom, plus libc's start frames.
    let mut cases: Vec<Case> = [
        ("16 native frames, DWARF", 12u32, "dwarf"),
        ("64 native frames, DWARF", 60, "dwarf"),
        ("90 native frames, DWARF", 86, "dwarf"),
        ("16 native frames, frame pointers", 12, "fp"),
    ]
    .into_iter()
    .map(|(label, depth, unwind)| Case {
        label,
        args: [
            "--unwind",
            unwind,
            "--",
            &recurse_s,
            "2",
            &depth.to_string(),
        ]
        .map(String::from)
        .to_vec(),
        python: false,
    })
    .collect();
    let distinct_src = dir.join("distinct.c");
    std::fs::write(&distinct_src, distinct_c())?;
    let distinct = dir.join("distinct-nofp");
    run(Command::new("gcc")
        .args(["-O2", "-g", "-fomit-frame-pointer"])
        .arg(&distinct_src)
        .arg("-o")
        .arg(&distinct))?;
    cases.insert(
        3,
        Case {
            label: "90 native frames, distinct functions, DWARF",
            args: ["--unwind", "dwarf", "--", &distinct.to_string_lossy(), "2"]
                .map(String::from)
                .to_vec(),
            python: false,
        },
    );
    let python = crate::pyenv_python();
    if python.exists() {
        for (label, name, text) in [
            ("CPython 3.11, recursion", "deep.py", DEEP_PY),
            (
                "CPython 3.11, distinct functions",
                "distinct.py",
                DISTINCT_PY,
            ),
        ] {
            let script = dir.join(name);
            std::fs::write(&script, text)?;
            cases.push(Case {
                label,
                args: vec![
                    "--".into(),
                    python.to_string_lossy().into_owned(),
                    script.to_string_lossy().into_owned(),
                    "2".into(),
                ],
                python: true,
            });
        }
    } else {
        println!("  (no {}: the Python lines are left out)", python.display());
    }
    let rounds: usize = std::env::var("BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let mut bins = vec![pyrometer.to_path_buf()];
    bins.extend(baseline.clone());
    println!();
    println!(
        "BPF time per sample (self-timed in the sampler, 499 Hz, 2 s runs, median of {rounds})"
    );
    if baseline.is_some() {
        println!("  {:<52} {:>10} {:>10}", "", "this build", "baseline");
    }
    for case in &cases {
        // Per binary: ns a sample, ns a Python walk, Python frames a sample.
        let mut runs: Vec<[Vec<f64>; 3]> = bins.iter().map(|_| Default::default()).collect();
        for round in 0..rounds {
            let mut order: Vec<usize> = (0..bins.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let (sample, walk, frames) = measure(&bins[i], dir, case)?;
                runs[i][0].push(sample);
                runs[i][1].push(walk);
                runs[i][2].push(frames);
            }
        }
        let column = |runs: &mut [[Vec<f64>; 3]], k: usize| -> String {
            runs.iter_mut()
                .map(|r| format!(" {:>7.0} ns", crate::bench::median(&mut r[k])))
                .collect()
        };
        if case.python {
            let frames = crate::bench::median(&mut runs[0][2]);
            let label = format!("{}, {frames:.0} Python frames", case.label);
            println!("  {label:<52}{}", column(&mut runs, 0));
            println!(
                "  {:<52}{}",
                "    of which the Python walk",
                column(&mut runs, 1)
            );
        } else {
            println!("  {:<52}{}", case.label, column(&mut runs, 0));
        }
    }
    println!();
    let status = Command::new(pyrometer).arg("verifier").status()?;
    if !status.success() {
        println!("  (a program was refused or is over budget: see the table)");
    }
    Ok(())
}
