//! On-demand captures through the collector, as real processes: a collector, two agents with
//! different node names, a 6:3:1 Python workload on the second; the capture's split, the
//! always-on profile beside it (its samples per CPU second within ±5 % of the minute
//! before), failures in one line with their exit codes, the role, and remote dumps (with
//! native frames of a sleeping process).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::captures::{
    Killed, gaps_against_sleeps, idle_gaps, numbers, one_line_failure, slices_of,
};
use pyrometer_e2e::cluster::{Agent, Collector, at_next_push, free_port, samples_of};
use pyrometer_e2e::wait::{cpu_time, wait_until};
use pyrometer_e2e::{folded_counts, privileged, pyrometer, scratch, stderr};

/// Spins half a second in `spin`, sleeps a quarter, for ever; writes how long each sleep
/// really kept it away (with the wake-up's delay, which a busy machine lengthens), in ms.
const SLEEPS: &str = "\
import sys, time
out = open(sys.argv[1], 'a', buffering=1)
def spin(s):
    end = time.perf_counter() + s
    x = 0
    while time.perf_counter() < end:
        x += 1
while True:
    spin(0.5)
    t = time.perf_counter()
    time.sleep(0.25)
    out.write('%.3f\\n' % ((time.perf_counter() - t) * 1000))
";

fn py631(rounds: u32) -> Killed {
    let python = pyrometer_e2e::python::pyenv("3.11.7");
    Killed(
        Command::new(python)
            .arg(pyrometer_e2e::python::source("py631.py"))
            .arg(rounds.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start py631.py"),
    )
}

/// utime + stime of a process, in clock ticks.
fn kill(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

#[test]
fn capture_through_the_collector_on_another_node() {
    if !privileged() {
        return;
    }
    let dir = scratch("capture");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let url = collector.url();
    let work = py631(100_000);
    let pid = work.0.id();
    let sleeper_py = dir.join("sleeps.py");
    std::fs::write(&sleeper_py, SLEEPS).unwrap();
    let sleeper = Killed(
        Command::new(pyrometer_e2e::python::pyenv("3.11.7"))
            .arg(&sleeper_py)
            .arg(dir.join("sleeps.txt"))
            .stdout(Stdio::null())
            .spawn()
            .expect("start sleeps.py"),
    );
    let sleeper_arg = sleeper.0.id().to_string();
    // Asleep in a system call for good, under a Python function: its native frames can be
    // read without stopping it.
    let napper = Killed(
        Command::new(pyrometer_e2e::python::pyenv("3.11.7"))
            .args(["-c", "import time\ndef nap():\n    time.sleep(600)\nnap()"])
            .stdout(Stdio::null())
            .spawn()
            .expect("start the napper"),
    );
    let napper_arg = napper.0.id().to_string();
    // Running on a CPU in a C library under a Python function once told to (a line on its
    // stdin), so it takes no CPU from the rest of the test before: its native frames come
    // from one perf sample of it.
    let mut cruncher = Killed(
        Command::new(pyrometer_e2e::python::pyenv("3.11.7"))
            .args([
                "-c",
                "import os, sys, zlib\ndata = os.urandom(1 << 20)\ndef crunch():\n    while True:\n        zlib.compress(data, 9)\nsys.stdin.readline()\ncrunch()",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start the cruncher"),
    );
    let cruncher_arg = cruncher.0.id().to_string();
    // Node-wide agents would sample each other and every build on a busy machine; each
    // samples its own processes, as two nodes' agents would.
    let mut a = Agent::start(&dir, "node-a", &url, &["--comm", "^capture-none$"]);
    let pid_arg = pid.to_string();
    let mut b = Agent::start(
        &dir,
        "node-b",
        &url,
        &[
            "--pid",
            &pid_arg,
            "--pid",
            &sleeper_arg,
            "--pid",
            &napper_arg,
            "--pid",
            &cruncher_arg,
        ],
    );
    wait_until(
        Duration::from_secs(120),
        "node-b's always-on samples of the workload",
        || samples_of(&collector, "node-b", pid) > 40,
    );
    // The always-on samples per CPU second of the workload over the minute of pushes before the
    // capture (the rate against its CPU time: on a busy machine it gets less than a core).
    let (before0, cpu0) = at_next_push("node-b's always-on samples of the workload", pid, || {
        samples_of(&collector, "node-b", pid)
    });
    std::thread::sleep(Duration::from_secs(60));
    let (before1, cpu1) = at_next_push("node-b's always-on samples of the workload", pid, || {
        samples_of(&collector, "node-b", pid)
    });

    let folded = dir.join("capture.folded");
    let cpu_before = cpu_time(pid).expect("the workload runs");
    let started = Instant::now();
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--node",
        "node-b",
        "--pid",
        &pid.to_string(),
        "--duration",
        "5s",
        "-F",
        "999",
        "-o",
        folded.to_str().unwrap(),
    ]);
    let took = started.elapsed();
    let cpu_after = cpu_time(pid).expect("the workload runs");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        took < Duration::from_secs(15),
        "a 5 s capture answered after {took:?}"
    );
    // The same from the push before the capture to one at least 3 s after its end.
    std::thread::sleep(Duration::from_secs(3));
    let (during, cpu2) = at_next_push("node-b's always-on samples of the workload", pid, || {
        samples_of(&collector, "node-b", pid)
    });

    let text = std::fs::read_to_string(&folded).unwrap();
    let total: u64 = text
        .lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    // One CPU-bound thread, 999 Hz, 5 s: some 5000 samples on a quiet machine, as many as the
    // CPU time it gets on a busy one (a quarter of a CPU was seen), never more.
    let cpu_s = cpu_after.saturating_sub(cpu_before).as_secs_f64();
    assert!(total > 400, "{total} samples in a 5 s capture at 999 Hz");
    assert!(
        total as f64 <= 999.0 * cpu_s * 1.1,
        "{total} samples, more than 999 Hz of the {cpu_s:.2} CPU seconds the process had"
    );
    let counts = folded_counts(&text, &["six", "three", "one"]);
    let sum: u64 = counts.iter().sum();
    let shares: Vec<f64> = counts.iter().map(|&c| c as f64 / sum as f64).collect();
    for (i, (f, want)) in [("six", 0.6), ("three", 0.3), ("one", 0.1)]
        .into_iter()
        .enumerate()
    {
        let got = shares[i];
        assert!(
            (got - want).abs() <= 0.05,
            "{f}: {got:.3} of the capture, want {want} ± 0.05 ({shares:?})"
        );
    }
    // The always-on profile during the capture is as before it, within ±5 %: samples the
    // capture took from it would lower its rate, the capture's 999 Hz samples leaking into it
    // would raise it fifty-fold.
    let per_cpu_s = |samples: u64, cpu: Duration| samples as f64 / cpu.as_secs_f64().max(1e-3);
    let rate_before = per_cpu_s(before1 - before0, cpu1 - cpu0);
    let rate_during = per_cpu_s(during - before1, cpu2 - cpu1);
    eprintln!(
        "always-on samples per CPU second: {rate_before:.2} before, {rate_during:.2} over the capture"
    );
    assert!(
        (rate_during - rate_before).abs() <= 0.05 * rate_before,
        "always-on samples per CPU second: {rate_before:.2} before ({} samples in {:?}), \
         {rate_during:.2} over the capture ({} samples in {:?})",
        before1 - before0,
        cpu1 - cpu0,
        during - before1,
        cpu2 - cpu1
    );

    // The Chrome timeline of a process that sleeps 250 ms between half-second spins: its
    // track's gaps are the sleeps.
    let trace = dir.join("capture.trace.json");
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--node",
        "node-b",
        "--pid",
        &sleeper_arg,
        "--duration",
        "4s",
        "-F",
        "999",
        "-o",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&trace).unwrap()).expect("a JSON trace");
    let gaps: Vec<f64> = idle_gaps(&slices_of(&doc, sleeper.0.id()), 100.0)
        .iter()
        .map(|(a, b)| (b - a) / 1000.0)
        .collect();
    assert!(gaps.len() >= 3, "gaps {gaps:?}");
    // The capture's gaps are a run of the workload's own measured sleeps: aligned where
    // they agree best, each within 50 ms of its sleep.
    let slept = numbers(&dir.join("sleeps.txt"));
    let worst = gaps_against_sleeps(&gaps, &slept);
    assert!(
        worst <= 50.0,
        "idle gaps (ms) {gaps:?} against the sleeps {slept:?}: {worst:.1} ms apart at best"
    );

    // A remote dump shows the workload's Python stack within 2 s.
    let remote_dump = |pid: &str, extra: &[&str]| {
        let mut args = vec![
            "dump",
            "--collector",
            &url,
            "--node",
            "node-b",
            "--pid",
            pid,
        ];
        args.extend_from_slice(extra);
        pyrometer(&args)
    };
    let started = Instant::now();
    let out = remote_dump(&pid_arg, &[]);
    let took = started.elapsed();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("unit") && text.contains("py631.py"),
        "dump:\n{text}"
    );
    assert!(
        took < Duration::from_secs(2),
        "the remote dump took {took:?}"
    );

    // A remote dump with --native of `pid` (named `what`): its text, printed with its time.
    let native_dump = |pid: &str, what: &str| {
        let started = Instant::now();
        let out = remote_dump(pid, &["--native"]);
        println!(
            "remote dump --native of the {what}: {:?}",
            started.elapsed()
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        println!("{text}");
        text
    };

    // With --native: the napper's stack, native frames (libc's sleep) under its Python ones,
    // read by the agent without stopping it.
    let text = native_dump(&napper_arg, "napper");
    let nap = text
        .find("nap (")
        .unwrap_or_else(|| panic!("no nap frame:\n{text}"));
    let sleep = text
        .find("clock_nanosleep")
        .unwrap_or_else(|| panic!("no native sleep:\n{text}"));
    assert!(
        sleep < nap && !text.contains("native frames unavailable"),
        "the native sleep is not above nap():\n{text}"
    );

    // A thread running on a CPU, in zlib: one perf sample of it gives its registers and
    // stack top, and the walk goes from zlib's deflate to its Python caller.
    let mut go = cruncher.0.stdin.take().expect("the cruncher's stdin");
    std::io::Write::write_all(&mut go, b"go\n").unwrap();
    let crunching = cpu_time(cruncher.0.id()).expect("the cruncher runs");
    wait_until(Duration::from_secs(30), "the cruncher crunching", || {
        cpu_time(cruncher.0.id()).is_some_and(|t| t > crunching + Duration::from_millis(300))
    });
    let text = native_dump(&cruncher_arg, "cruncher");
    let deflate = text
        .find("deflate")
        .unwrap_or_else(|| panic!("no zlib frame:\n{text}"));
    assert!(
        text.find("crunch (").is_some_and(|c| deflate < c) && !text.contains("unavailable"),
        "the running cruncher's native frames:\n{text}"
    );

    // A dead pid and an unknown node: one line, exit 2.
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--node",
        "node-b",
        "--pid",
        "4194300",
        "--duration",
        "1s",
    ]);
    one_line_failure(&out, 2, "no process 4194300 on node 'node-b'");
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--node",
        "node-z",
        "--pid",
        "1",
        "--duration",
        "1s",
    ]);
    one_line_failure(&out, 2, "no agent serves node 'node-z'");

    // An agent gone: its node is offline once it has not polled for 15 s.
    kill(std::mem::replace(
        &mut a.child,
        Command::new("true").spawn().unwrap(),
    ));
    std::thread::sleep(Duration::from_secs(16));
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--node",
        "node-a",
        "--pid",
        "1",
        "--duration",
        "1s",
    ]);
    one_line_failure(&out, 2, "the agent of node 'node-a' is offline");

    drop(work);
    drop(sleeper);
    drop(napper);
    drop(cruncher);
    kill(std::mem::replace(
        &mut b.child,
        Command::new("true").spawn().unwrap(),
    ));
}

#[test]
fn a_token_without_the_capture_role_is_refused() {
    if !privileged() {
        return;
    }
    let dir = scratch("capture-role");
    let tokens = dir.join("tokens");
    std::fs::write(
        &tokens,
        "tok-reader-0123456789 default read\ntok-capture-0123456789 default capture\n",
    )
    .unwrap();
    let collector = Collector::start(&dir.join("store"), free_port(), Some(&tokens));
    let url = collector.url();
    let reader = dir.join("reader");
    std::fs::write(&reader, "tok-reader-0123456789").unwrap();
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--token-file",
        reader.to_str().unwrap(),
        "--node",
        "n",
        "--pid",
        "1",
    ]);
    one_line_failure(&out, 3, "may not request captures");
    // The capture role passes the check (and meets a node no agent serves).
    let capturer = dir.join("capturer");
    std::fs::write(&capturer, "tok-capture-0123456789").unwrap();
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--token-file",
        capturer.to_str().unwrap(),
        "--node",
        "n",
        "--pid",
        "1",
    ]);
    one_line_failure(&out, 2, "no agent serves node 'n'");
}
