//! CPython 3.15's own sampler ("Tachyon", `python3.15 -m profiling.sampling`) side by side with
//! `pyrometer record`: the same fixed-work workload (tests/fixtures/py631.py, 6:3:1) on Debian
//! forky's python3.15 in the forky root (`cargo xtask forky-root`), alone, under Tachyon and under
//! pyrometer, each profiler at 1 kHz and 10 kHz, the five runs of a round in a rotating order.
//!
//! Per profiler and rate: the 6:3:1 split's largest error (percentage points), the target's
//! slowdown (the workload's own work-loop time against the run alone in the same round, median of
//! the paired ratios), the profiler's CPU (the whole command's CPU with its children, minus the
//! workload's own and minus what the launcher and interpreter start-up cost alone), and the
//! fraction of intended samples (samples in the work / rate × work-loop time). Tachyon samples
//! wall time of the main thread; pyrometer samples CPU time (`cpu-clock`), which on a busy
//! machine is less than wall time, so its fraction is of the time the work ran. The machine's
//! load average is printed before and after: the figures are only as quiet as the machine was.
//! Nothing passes or fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::bench::median;
use crate::pybench::{Run, run_timed};

/// The profilers and rates measured, in the order of a round before rotation.
const CONFIGS: [(Profiler, u32); 4] = [
    (Profiler::Tachyon, 1000),
    (Profiler::Pyrometer, 1000),
    (Profiler::Tachyon, 10_000),
    (Profiler::Pyrometer, 10_000),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Profiler {
    Tachyon,
    Pyrometer,
}

impl Profiler {
    fn name(self) -> &'static str {
        match self {
            Profiler::Tachyon => "Tachyon",
            Profiler::Pyrometer => "pyrometer",
        }
    }
}

/// One configuration's measurements over the rounds.
#[derive(Default)]
struct Series {
    ratios: Vec<f64>,
    cpu_ns: Vec<f64>,
    split_pp: Vec<f64>,
    fraction: Vec<f64>,
}

/// forky's python3.15 in its root, as the tests start it: a private mount namespace with its own
/// /proc, /tmp and the workspace bound at their own paths, then `chroot`.
fn in_forky(root: &Path, forky: &Path) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
        .arg(
            "r=$1; w=$2; shift 2; mount -t proc proc \"$r/proc\" || exit 125; \
             for d in /tmp \"$w\"; do mkdir -p \"$r$d\" && mount --bind \"$d\" \"$r$d\" || exit 125; done; \
             exec chroot \"$r\" /usr/bin/python3.15 \"$@\"",
        )
        .arg("sh")
        .arg(forky)
        .arg(root);
    c
}

pub fn bench(root: &Path, pyrometer: &Path, rounds: usize) -> Result<()> {
    let forky = crate::forky::dir(root).join("root");
    if !forky.join("usr/bin/python3.15").exists() {
        println!(
            "\nTachyon side by side: skipped ({} has no python3.15: cargo xtask forky-root)",
            forky.display()
        );
        return Ok(());
    }
    let script = root.join("tests/fixtures/py631.py");
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let load_before = loadavg();

    // Calibrate to about 0.6 s of work alone.
    let probe = run_timed(in_forky(root, &forky).arg(&script).arg("10"))?;
    let work_rounds = ((0.6e9 / probe.elapsed_ns) * 10.0).max(4.0) as u64;
    let work_rounds_s = work_rounds.to_string();

    let out_of = |p: Profiler, rate: u32| -> PathBuf {
        dir.join(format!("tachyon-{}-{rate}.folded", p.name().to_lowercase()))
    };
    let command = |p: Option<(Profiler, u32)>| -> Command {
        match p {
            None => {
                let mut c = in_forky(root, &forky);
                c.arg(&script).arg(&work_rounds_s);
                c
            }
            Some((Profiler::Tachyon, rate)) => {
                let mut c = in_forky(root, &forky);
                c.args(["-m", "profiling.sampling", "run", "-r"])
                    .arg(rate.to_string())
                    .args(["--collapsed", "-o"])
                    .arg(out_of(Profiler::Tachyon, rate))
                    .arg(&script)
                    .arg(&work_rounds_s);
                c
            }
            Some((Profiler::Pyrometer, rate)) => {
                let mut c = Command::new(pyrometer);
                c.args(["record", "-F"])
                    .arg(rate.to_string())
                    .arg("-o")
                    .arg(out_of(Profiler::Pyrometer, rate))
                    .arg("--")
                    .args(launcher_args(root, &forky))
                    .arg(&script)
                    .arg(&work_rounds_s);
                c
            }
        }
    };

    let mut series: Vec<Series> = CONFIGS.iter().map(|_| Series::default()).collect();
    let mut alone_ns = Vec::new();
    let mut alone_other_cpu = Vec::new();
    let mut rounds_ran = Vec::new();
    for round in 0..rounds {
        // None is the run alone; the order rotates so drift favours no one.
        let mut order: Vec<Option<usize>> = std::iter::once(None)
            .chain((0..CONFIGS.len()).map(Some))
            .collect();
        let turn = round % order.len();
        order.rotate_left(turn);
        let mut runs: Vec<(Option<usize>, Run)> = Vec::new();
        for which in order {
            let run = run_timed(&mut command(which.map(|i| CONFIGS[i])))
                .with_context(|| format!("round {}: {which:?}", round + 1))?;
            runs.push((which, run));
        }
        let alone = runs
            .iter()
            .find(|(w, _)| w.is_none())
            .map(|(_, r)| r)
            .context("the run alone")?;
        alone_ns.push(alone.elapsed_ns);
        alone_other_cpu.push((alone.total_cpu_ns - alone.workload_cpu_ns).max(0.0));
        let mut line = format!(
            "round {}/{rounds}: alone {:.3}s",
            round + 1,
            alone.elapsed_ns / 1e9
        );
        for (which, run) in &runs {
            let Some(i) = *which else { continue };
            let (p, rate) = CONFIGS[i];
            let s = &mut series[i];
            s.ratios.push(run.elapsed_ns / alone.elapsed_ns);
            s.cpu_ns
                .push((run.total_cpu_ns - run.workload_cpu_ns).max(0.0));
            let counts = split(&out_of(p, rate))?;
            let work: f64 = counts.iter().sum();
            if work > 0.0 {
                let err = counts
                    .iter()
                    .zip([0.6, 0.3, 0.1])
                    .map(|(c, want)| (c / work - want).abs() * 100.0)
                    .fold(0.0, f64::max);
                s.split_pp.push(err);
            }
            s.fraction
                .push(work / (f64::from(rate) * run.elapsed_ns / 1e9));
            line.push_str(&format!(
                ", {} {}k {:.3}s",
                p.name(),
                rate / 1000,
                run.elapsed_ns / 1e9
            ));
        }
        eprintln!("{line}");
        rounds_ran.push(round);
    }
    let start_cpu = median(&mut alone_other_cpu);
    println!();
    println!(
        "Tachyon side by side (py631.py on forky's python3.15, {work_rounds} rounds ≈ {:.2} s of work alone, {} rotating rounds)",
        median(&mut alone_ns) / 1e9,
        rounds_ran.len()
    );
    println!("  load average before {load_before}, after {}", loadavg());
    println!(
        "  {:<18} {:>9} {:>14} {:>13} {:>11}",
        "", "slowdown", "profiler CPU", "split error", "of samples"
    );
    for (i, (p, rate)) in CONFIGS.iter().enumerate() {
        let s = &mut series[i];
        let (lo, hi) = range(&s.ratios);
        println!(
            "  {:<18} {:>7.3} x {:>11.0} ms {:>10.1} pp {:>10.0} %   (slowdown {lo:.3}-{hi:.3})",
            format!("{} {} kHz", p.name(), rate / 1000),
            median(&mut s.ratios),
            (median(&mut s.cpu_ns) - start_cpu).max(0.0) / 1e6,
            if s.split_pp.is_empty() {
                f64::NAN
            } else {
                median(&mut s.split_pp)
            },
            median(&mut s.fraction) * 100.0,
        );
    }
    println!(
        "  (medians; profiler CPU is beyond the workload's own and the {:.0} ms start-up costs alone)",
        start_cpu / 1e6
    );
    Ok(())
}

/// The launcher command line `in_forky` runs, as arguments for `record --`.
fn launcher_args(root: &Path, forky: &Path) -> Vec<std::ffi::OsString> {
    let c = in_forky(root, forky);
    std::iter::once(c.get_program().to_os_string())
        .chain(c.get_args().map(|a| a.to_os_string()))
        .collect()
}

/// Samples under six(), three() and one() in a folded or collapsed file (pyrometer's frames are
/// `six (FILE:LINE)`, Tachyon's `FILE:six:LINE`).
fn split(path: &Path) -> Result<[f64; 3]> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut counts = [0.0; 3];
    for line in text.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(n) = n.trim().parse::<f64>() else {
            continue;
        };
        let is = |name: &str, f: &str| {
            f.starts_with(&format!("{name} (")) || f.contains(&format!(":{name}:"))
        };
        for (i, name) in ["six", "three", "one"].iter().enumerate() {
            if stack.split(';').any(|f| is(name, f)) {
                counts[i] += n;
                break;
            }
        }
    }
    Ok(counts)
}

fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_reads_both_profilers_frames() {
        let dir = std::env::temp_dir().join(format!("tachyon-split-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ours = dir.join("ours.folded");
        std::fs::write(
            &ours,
            "python3.15;<module> (/w/py631.py:32);six (/w/py631.py:18);unit (/w/py631.py:13) 6\n\
             python3.15;<module> (/w/py631.py:33);three (/w/py631.py:22) 3\n\
             python3.15;one (/w/py631.py:26) 1\npython3.15;_start 5\n",
        )
        .unwrap();
        assert_eq!(split(&ours).unwrap(), [6.0, 3.0, 1.0]);
        let theirs = dir.join("theirs.txt");
        std::fs::write(
            &theirs,
            "tid:1;<frozen runpy>:_run_code:87;py631.py:<module>:32;py631.py:six:18;py631.py:unit:13 60\n\
             tid:1;py631.py:<module>:34;py631.py:one:26 10\n",
        )
        .unwrap();
        assert_eq!(split(&theirs).unwrap(), [60.0, 0.0, 10.0]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
