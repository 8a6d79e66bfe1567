//! Free-threaded CPython (3.13t and 3.14t, `--disable-gil`, built by `cargo xtask
//! free-threaded`): four Python threads run in parallel, and `record` splits them by the CPU
//! time each used (the fixture's own thread_time) with their `threading` names; the GIL view says the build has none, or that it runs
//! with its GIL on under `PYTHON_GIL=1`. Ground truth is fixtures/ft_threads.py: four(),
//! three(), two() and one() do 4:3:2:1 units of the same loop on four threads started together,
//! each prints its thread's CPU time, and the fixture measures the cores its process used
//! while all four ran. The frames
//! themselves (6:3:1, native extensions), `dump` and `top` are checked with the other
//! interpreters (pyframes, python, top). Needs root (BPF); a missing build is a skip in the
//! ledger. Runs alone (.config/nextest.toml): the cores it measures are the machine's two; when
//! other processes took more than 0.2 of them during the run (a shared machine), the cores
//! check is a skip with the figures (which CI does not allow), the split is still checked.

use std::path::Path;

use pyrometer_e2e::python::{Interpreter, free_threaded, source};
use pyrometer_e2e::*;

/// `record -F 499 --gil -o OUT -- PYTHON ft_threads.py UNITS`, with `env` before the
/// interpreter; its stderr (the fixture's included).
fn record_threads(python: &Interpreter, out: &Path, env: &[&str], units: &str) -> String {
    let script = source("ft_threads.py");
    let mut args = vec![
        "record",
        "-F",
        "499",
        "--gil",
        "-o",
        out.to_str().unwrap(),
        "--",
    ];
    if !env.is_empty() {
        args.push("env");
        args.extend_from_slice(env);
    }
    args.extend([
        python.path.to_str().unwrap(),
        script.to_str().unwrap(),
        units,
    ]);
    let result = pyrometer(&args);
    assert_ok(&result);
    stderr(&result)
}

/// The cores the fixture says its process used while its four threads ran.
fn cores(label: &str, err: &str) -> f64 {
    err.lines()
        .find_map(|l| l.strip_prefix("cores "))
        .unwrap_or_else(|| panic!("{label}: the fixture printed no cores line:\n{err}"))
        .trim()
        .parse()
        .expect("a number")
}

/// CPU time the whole machine spent busy (`/proc/stat`), and that this test's finished
/// children (`record` and the workload it ran) spent, in seconds.
fn cpu_seconds() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("cpu "))
        .expect("a cpu line")
        .split_whitespace()
        .map(|v| v.parse().expect("a number"))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
    let busy = ticks.iter().take(8).sum::<f64>() - ticks[3] - ticks[4];
    // SAFETY: rusage is plain integers, for which all zeroes is a value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct it is given and nothing else.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (busy / hz, secs(usage.ru_utime) + secs(usage.ru_stime))
}

fn check_four_threads(python: &Interpreter) {
    if !privileged() || !python.present() {
        return;
    }
    let label = &python.label;
    let dir = scratch(&format!("free-threaded-{label}"));
    let out = dir.join("threads.pb.gz");
    let (machine_before, ours_before) = cpu_seconds();
    let started = std::time::Instant::now();
    let err = record_threads(python, &out, &[], "60");
    let wall = started.elapsed().as_secs_f64();
    let (machine_after, ours_after) = cpu_seconds();
    // The cores other processes took meanwhile: the runner gives this test both of its cores
    // (it runs alone), a machine shared with other work may not.
    let others = ((machine_after - machine_before) - (ours_after - ours_before)) / wall;

    // No GIL: four runnable threads keep both of the machine's cores busy.
    let used = cores(label, &err);
    if used < 1.8 && others > 0.2 {
        skip(
            &format!("idle-cores:{label}"),
            format!(
                "{label}: four threads used {used:.2} cores while other processes took \
                 {others:.2} of the machine's: the parallelism check needs an idle 2-core \
                 machine"
            ),
        );
    } else {
        assert!(
            used >= 1.8,
            "{label}: four threads used {used:.2} cores together (want ≥ 1.8 of 2; other \
             processes took {others:.2})\n{err}"
        );
    }
    let pid_line = err
        .lines()
        .find(|l| l.starts_with("pyrometer: GIL: pid "))
        .unwrap_or_else(|| panic!("{label}: no GIL line:\n{err}"));
    assert!(
        pid_line.ends_with("): free-threaded: no GIL"),
        "{label}: {pid_line}"
    );
    assert!(
        !err.contains("GIL over"),
        "{label}: no GIL table for a build without one:\n{err}"
    );

    // The split follows each thread's CPU time, and each function's samples carry its thread's name.
    let profile = read_pprof(&out);
    let count = pprof_type(&profile, "samples");
    let samples = pprof_samples(&profile);
    let names = ["four", "three", "two", "one"];
    let mut by_function = [0i64; 4];
    let mut named = [0i64; 4];
    for s in &samples {
        let Some(i) = names
            .iter()
            .position(|n| s.functions.iter().any(|f| f == n))
        else {
            continue;
        };
        by_function[i] += s.values[count];
        let thread = format!("{}-thread", names[i]);
        if s.labels.get("thread") == Some(&thread) {
            named[i] += s.values[count];
        }
        assert!(
            s.functions.iter().any(|f| f == "Thread._bootstrap"),
            "{label}: {} does not reach its thread's start: {:?}",
            names[i],
            s.functions
        );
    }
    let total: i64 = by_function.iter().sum();
    assert!(
        total > 300,
        "{label}: only {total} samples in the four functions"
    );
    // Each thread's own CPU time is the ground truth: without a GIL, the same unit of work
    // costs threads running at once different CPU time.
    let cpu: Vec<f64> = names
        .iter()
        .map(|n| {
            let prefix = format!("thread {n} cpu ");
            err.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("{label}: no CPU time of {n}'s thread:\n{err}"))
        })
        .collect();
    let cpu_total: f64 = cpu.iter().sum();
    for i in 0..4 {
        let want = cpu[i] / cpu_total;
        let share = by_function[i] as f64 / total as f64;
        assert!(
            (share - want).abs() <= 0.05,
            "{label}: {} has {:.1} % of the samples, its thread {:.1} % of the CPU time \
             (± 5 pp): samples {by_function:?}, CPU {cpu:?}",
            names[i],
            share * 100.0,
            want * 100.0
        );
        assert!(
            named[i] * 10 >= by_function[i] * 9,
            "{label}: {} of {}'s {} samples carry its thread's name",
            named[i],
            names[i],
            by_function[i]
        );
    }
    println!("{label}: {used:.2} cores, four/three/two/one {by_function:?}");
}

#[test]
fn four_threads_run_in_parallel_3_13t() {
    check_four_threads(&free_threaded(13));
}

#[test]
fn four_threads_run_in_parallel_3_14t() {
    check_four_threads(&free_threaded(14));
}

/// `PYTHON_GIL=1` turns a free-threaded build's GIL on: the threads take turns (about one
/// core), and the GIL view says the GIL was on rather than that there is none.
fn check_gil_enabled(python: &Interpreter) {
    if !privileged() || !python.present() {
        return;
    }
    let label = &python.label;
    let dir = scratch(&format!("free-threaded-gil-{label}"));
    let out = dir.join("threads.folded");
    let err = record_threads(python, &out, &["PYTHON_GIL=1"], "20");
    let used = cores(label, &err);
    assert!(
        used <= 1.3,
        "{label}: with PYTHON_GIL=1 the threads took {used:.2} cores"
    );
    assert!(
        err.contains("): free-threaded build with its GIL enabled (PYTHON_GIL=1"),
        "{label}: the GIL line:\n{err}"
    );
    assert!(!err.contains("free-threaded: no GIL"), "{label}:\n{err}");
}

#[test]
fn python_gil_1_is_reported_3_13t() {
    check_gil_enabled(&free_threaded(13));
}

#[test]
fn python_gil_1_is_reported_3_14t() {
    check_gil_enabled(&free_threaded(14));
}
