//! Allocation profiling overhead, side by side in one run (medians of rotating rounds; the
//! programs time their own work, so start-up and symbolization are left out, and report the
//! CPU time they spent on it too: on a busy machine the wall-clock time mostly measures the
//! wait for a CPU, while the process's CPU time, which includes the probes' kernel work,
//! does not):
//! - tests/fixtures/alloctree.c (trees of small nodes built and freed: 5.2 M allocations and
//!   as many frees) alone and with libpyrometer_alloc.so preloaded but no profiler: the extra
//!   nanoseconds of an unsampled allocator call;
//! - the same under `pyrometer record --alloc` (the library, the default 512 KiB rate), and
//!   tests/fixtures/py_allocs.py (dicts, tuples and strings made and dropped, on pyenv's
//!   3.11) alone, with the library preloaded but no profiler (the pymalloc wrapper's cost),
//!   under `record --alloc` and under memray 1.x (`memray run`, from a venv
//!   under target/bench when pip can install it);
//! - the uprobe path (`PYROMETER_ALLOC_LIB` pointing nowhere), on a tenth of the work (a trap
//!   per call makes it ~200x slower), against the program alone on the same work.
//!
//! Nothing passes or fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::bench::median;

/// One run's figures, from the program's stderr: the work's wall-clock and CPU time (ns)
/// and (C) its allocator calls.
struct Run {
    elapsed: f64,
    cpu: f64,
    calls: f64,
    /// The CPU time of the program's quickest round of work (alloctree.c), when it says.
    best_round: Option<f64>,
}

fn timed(cmd: &mut Command) -> Result<Run> {
    let out = cmd.output().context("run benchmark command")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("benchmark command {cmd:?} failed: {err}");
    }
    let field = |key: &str| -> Option<f64> {
        err.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
    };
    let elapsed = field("elapsed_ns ").with_context(|| format!("no elapsed_ns in: {err}"))?;
    let cpu = field("cpu_ns ").with_context(|| format!("no cpu_ns in: {err}"))?;
    Ok(Run {
        elapsed,
        cpu,
        calls: field("calls ").unwrap_or(0.0),
        best_round: field("best_round_cpu_ns "),
    })
}

/// Each variant's wall-clock and CPU times (ns) by round.
struct Times {
    wall: Vec<Vec<f64>>,
    cpu: Vec<Vec<f64>>,
    /// The quickest round's CPU time, by run (empty when the program does not say).
    best: Vec<Vec<f64>>,
}

/// A named way to run a program.
type Variant<'a> = (&'static str, Box<dyn FnMut() -> Command + 'a>);

/// Variants of one program run in rotating order, `rounds` times: each variant's times by
/// round, and the calls the program reported.
fn rotate(variants: &mut [Variant<'_>], rounds: usize) -> Result<(Times, f64)> {
    let n = variants.len();
    let mut times = Times {
        wall: vec![Vec::new(); n],
        cpu: vec![Vec::new(); n],
        best: vec![Vec::new(); n],
    };
    let mut calls = 0.0;
    for round in 0..rounds {
        for k in 0..n {
            let i = (k + round) % n;
            let run = timed(&mut (variants[i].1)())?;
            times.wall[i].push(run.elapsed);
            times.cpu[i].push(run.cpu);
            if let Some(b) = run.best_round {
                times.best[i].push(b);
            }
            calls = run.calls;
        }
        eprintln!(
            "round {}/{rounds}: {}",
            round + 1,
            variants
                .iter()
                .enumerate()
                .map(|(i, (name, _))| format!(
                    "{name} {:.1} ms (CPU {:.1} ms)",
                    times.wall[i][round] / 1e6,
                    times.cpu[i][round] / 1e6
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok((times, calls))
}

/// The median over rounds of `f(variant's time, baseline's time)`: paired, so a round the
/// busy machine slowed down counts once.
fn paired(times: &[Vec<f64>], variant: usize, f: impl Fn(f64, f64) -> f64) -> f64 {
    let mut v: Vec<f64> = times[variant]
        .iter()
        .zip(&times[0])
        .map(|(&t, &base)| f(t, base))
        .collect();
    median(&mut v)
}

/// The median time of a variant, in ms.
fn ms(times: &[Vec<f64>], variant: usize) -> f64 {
    let mut t = times[variant].clone();
    median(&mut t) / 1e6
}

/// memray in a venv of `python` under target/bench, installed by pip on first use; the
/// reason when it cannot be.
fn memray(dir: &Path, python: &Path) -> std::result::Result<PathBuf, String> {
    let venv = dir.join("memray-venv-pyenv");
    let bin = venv.join("bin/python");
    let has = |b: &Path| {
        Command::new(b)
            .args(["-c", "import memray"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if bin.exists() && has(&bin) {
        return Ok(bin);
    }
    let ok = Command::new(python)
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "memray"])
            .status()
            .is_ok_and(|s| s.success());
    if ok && has(&bin) {
        Ok(bin)
    } else {
        Err("pip could not install memray".into())
    }
}

/// alloctree.c's rounds of work: the whole run, and a tenth of it for the uprobe path.
const TREE_ROUNDS: usize = 10;

pub fn bench(root: &Path, pyrometer: &Path, pairs: usize) -> Result<()> {
    let dir = root.join("target/bench");
    let tree = dir.join("alloctree");
    crate::run(
        Command::new("gcc")
            .args(["-O2", "-g", "-fno-omit-frame-pointer"])
            .arg(root.join("tests/fixtures/alloctree.c"))
            .arg("-o")
            .arg(&tree),
    )?;
    // The library the binary carries, written out as a set-up that preloads it would have it.
    let lib_dir = dir.join("preload");
    crate::run(
        Command::new(pyrometer)
            .arg("install-preload")
            .arg(&lib_dir)
            .stdout(std::process::Stdio::null()),
    )?;
    let library = lib_dir.join("libpyrometer_alloc.so");
    // pyenv's 3.11 (pymalloc's functions out of line, as in most builds), as the Python bench.
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let python = Path::new(&home).join(".pyenv/versions/3.11.7/bin/python3.11");
    if !python.exists() {
        bail!(
            "{} is missing (the Python part of the bench needs it)",
            python.display()
        );
    }
    let script = root.join("tests/fixtures/py_allocs.py");
    let out = dir.join("alloc.pb.gz");
    // `record --alloc -- ARGV`, through the library or (uprobes, asked for) without it.
    let record = |argv: &[&std::ffi::OsStr], uprobes: bool| {
        let mut c = Command::new(pyrometer);
        c.args(["record", "--alloc", "-o"]).arg(&out);
        if uprobes {
            c.arg("--alloc-uprobes")
                .env("PYROMETER_ALLOC_LIB", "/nonexistent/libpyrometer_alloc.so");
        }
        c.arg("--").args(argv);
        c
    };
    let plain = |argv: &[&std::ffi::OsStr]| {
        let mut c = Command::new(argv[0]);
        c.args(&argv[1..]);
        c
    };
    // With the library preloaded and no profiler: what an unsampled allocator call costs.
    let preloaded = |argv: &[&std::ffi::OsStr]| {
        let mut c = plain(argv);
        c.env("LD_PRELOAD", &library);
        c
    };
    let full_rounds = TREE_ROUNDS.to_string();
    let (tree_os, full, tenth) = (tree.as_os_str(), full_rounds.as_ref(), "1".as_ref());

    let mut c_variants: Vec<Variant<'_>> = vec![
        ("alone", Box::new(|| plain(&[tree_os, full]))),
        ("preloaded", Box::new(|| preloaded(&[tree_os, full]))),
        (
            "record --alloc",
            Box::new(|| record(&[tree_os, full], false)),
        ),
    ];
    let (c, calls) = rotate(&mut c_variants, pairs)?;
    let mut c_uprobe: Vec<Variant<'_>> = vec![
        ("alone (1/10)", Box::new(|| plain(&[tree_os, tenth]))),
        (
            "uprobes (1/10)",
            Box::new(|| record(&[tree_os, tenth], true)),
        ),
    ];
    let (cu, _) = rotate(&mut c_uprobe, pairs.min(3))?;

    let (py_os, script_os) = (python.as_os_str(), script.as_os_str());
    let memray_bin = memray(&dir, &python);
    let mut py_variants: Vec<Variant<'_>> = vec![
        ("alone", Box::new(|| plain(&[py_os, script_os]))),
        ("preloaded", Box::new(|| preloaded(&[py_os, script_os]))),
        (
            "record --alloc",
            Box::new(|| record(&[py_os, script_os], false)),
        ),
    ];
    if let Ok(m) = &memray_bin {
        let capture = dir.join("memray.bin");
        py_variants.push((
            "memray run",
            Box::new(move || {
                let mut c = Command::new(m);
                c.args(["-m", "memray", "run", "-q", "-f", "-o"])
                    .arg(&capture)
                    .arg(script_os);
                c
            }),
        ));
    }
    let (py, _) = rotate(&mut py_variants, pairs)?;
    let (pu_script, tenth_py) = (script_os, "6".as_ref());
    let mut py_uprobe: Vec<Variant<'_>> = vec![
        (
            "alone (1/10)",
            Box::new(|| plain(&[py_os, pu_script, tenth_py])),
        ),
        (
            "uprobes (1/10)",
            Box::new(|| record(&[py_os, pu_script, tenth_py], true)),
        ),
    ];
    let (pu, _) = rotate(&mut py_uprobe, pairs.min(3))?;

    let measured = Measured {
        c: &c,
        c_uprobe: &cu,
        py: &py,
        py_uprobe: &pu,
        calls,
    };
    report(
        &measured,
        pairs,
        memray_bin.as_ref().map(|_| ()).map_err(String::as_str),
    );
    Ok(())
}

/// The four rotations' times: alloctree.c and py_allocs.py, in process and through uprobes.
struct Measured<'a> {
    c: &'a Times,
    c_uprobe: &'a Times,
    py: &'a Times,
    py_uprobe: &'a Times,
    /// alloctree.c's allocator calls.
    calls: f64,
}

/// Prints the table of what was measured (`memray`: whether it was, or why not).
fn report(m: &Measured<'_>, pairs: usize, memray: std::result::Result<(), &str>) {
    let Measured {
        c,
        c_uprobe: cu,
        py,
        py_uprobe: pu,
        calls,
    } = *m;
    let ratio = |t: f64, base: f64| t / base;
    // A variant's figure by wall clock and by CPU time, side by side.
    let both = |t: &Times, i: usize, f: &dyn Fn(f64, f64) -> f64| {
        (paired(&t.wall, i, f), paired(&t.cpu, i, f))
    };
    let per_call = |t: f64, base: f64| (t - base) / calls;
    println!();
    println!(
        "Allocation profiling overhead ({pairs} rotating rounds; medians of per-round ratios to the program alone; the programs time their own work, by wall clock and by their CPU time)"
    );
    println!(
        "  alloctree.c ({calls:.0} allocator calls)  alone {:>8.1} ms (CPU {:.1} ms)",
        ms(&c.wall, 0),
        ms(&c.cpu, 0)
    );
    let (wall, cpu) = both(c, 1, &per_call);
    println!(
        "    libpyrometer_alloc.so preloaded, no profiler   {:>8.1} ms   {wall:+.1} ns per allocator call (CPU {cpu:+.1} ns)",
        ms(&c.wall, 1),
    );
    let (wall, cpu) = both(c, 2, &ratio);
    println!(
        "    record --alloc (in process, every 512 KiB)      {:>8.1} ms   slowdown {wall:.2} x (CPU {cpu:.2} x)",
        ms(&c.wall, 2),
    );
    if c.best.iter().all(|b| b.len() == pairs) {
        println!(
            "    quickest of its {TREE_ROUNDS} rounds (CPU): alone {:.2} ms, preloaded {:+.1} ns per call, record --alloc {:.2} x",
            ms(&c.best, 0),
            paired(&c.best, 1, |t, base| (t - base)
                / (calls / TREE_ROUNDS as f64)),
            paired(&c.best, 2, ratio),
        );
    }
    let (wall, cpu) = both(cu, 1, &ratio);
    println!(
        "    record --alloc through uprobes (1/10 of the work) {:>6.1} ms   slowdown {wall:.1} x (CPU {cpu:.1} x)",
        ms(&cu.wall, 1),
    );
    println!(
        "  py_allocs.py (CPython 3.11.7)  alone {:>8.1} ms (CPU {:.1} ms)",
        ms(&py.wall, 0),
        ms(&py.cpu, 0)
    );
    let (wall, cpu) = both(py, 1, &ratio);
    println!(
        "    libpyrometer_alloc.so preloaded, no profiler   {:>8.1} ms   slowdown {wall:.2} x (CPU {cpu:.2} x)",
        ms(&py.wall, 1),
    );
    let (wall, cpu) = both(py, 2, &ratio);
    println!(
        "    record --alloc (in process, every 512 KiB)      {:>8.1} ms   slowdown {wall:.2} x (CPU {cpu:.2} x)",
        ms(&py.wall, 2),
    );
    match memray {
        Ok(()) => {
            let (wall, cpu) = both(py, 3, &ratio);
            println!(
                "    memray run (every allocation)                   {:>8.1} ms   slowdown {wall:.2} x (CPU {cpu:.2} x)",
                ms(&py.wall, 3),
            )
        }
        Err(why) => println!("    memray run: not measured ({why})"),
    }
    let (wall, cpu) = both(pu, 1, &ratio);
    println!(
        "    record --alloc through uprobes (1/10 of the work) {:>6.1} ms   slowdown {wall:.1} x (CPU {cpu:.1} x)",
        ms(&pu.wall, 1),
    );
}
