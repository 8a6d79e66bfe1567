//! A kernel that refuses one stage costs that stage only. `--debug-reject STAGE` makes the
//! kernel refuse it for real (the program reads past its stack frame, which every verifier
//! refuses; without the flag the verifier prunes that read as dead code): the capture must
//! say so in one line naming the feature, the program, the kernel and the verifier log's
//! file, and still hold the 6:3:1 CPU split of `fixtures/cpu631`. Needs root.

use std::path::Path;
use std::time::{Duration, Instant};

use pyrometer_e2e::cluster::{Agent, Collector, enc, free_port, http_get};
use pyrometer_e2e::*;

/// Runs `record` of cpu631 for 3 s with `extra`; returns stderr, after checking success and
/// the 6:3:1 split (within 10 pp: a few hundred samples on a busy machine).
fn record_cpu631(dir: &Path, extra: &[&str]) -> String {
    let out_path = dir.join("out.folded");
    let fixture = fixture("cpu631").to_string_lossy().into_owned();
    let mut args = vec!["record", "-F", "499", "-o", out_path.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", &fixture, "3"]);
    let out = pyrometer(&args);
    assert_ok(&out);
    let stacks = read_folded(&out_path);
    let shares = relative_shares(&stacks, &["leaf_a", "leaf_b", "leaf_c"]);
    for (leaf, want) in [("leaf_a", 0.6), ("leaf_b", 0.3), ("leaf_c", 0.1)] {
        assert!(
            (shares[leaf] - want).abs() <= 0.10,
            "{leaf}: {:.1} % of CPU samples with {extra:?}, expected {:.0} % ({shares:?})",
            shares[leaf] * 100.0,
            want * 100.0
        );
    }
    stderr(&out)
}

/// The one line saying `what` is off; checks it names the program, the kernel and a log
/// file holding the verifier's reason.
fn refusal_line(err: &str, what: &str, program: &str) {
    let lines: Vec<&str> = err.lines().filter(|l| l.contains(what)).collect();
    assert_eq!(lines.len(), 1, "expected one '{what}' line:\n{err}");
    let line = lines[0];
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert!(
        line.contains(&format!(
            "Linux {} refused the BPF program {program} (",
            kernel.trim()
        )),
        "{line}"
    );
    let log = line
        .split("verifier log: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no log path in: {line}"));
    let text = std::fs::read_to_string(log.trim()).expect("the verifier log file exists");
    assert!(text.contains("invalid read from stack"), "{text}");
    let _ = std::fs::remove_file(log.trim());
}

#[test]
fn each_refused_optional_stage_is_switched_off_and_cpu_samples_go_on() {
    if !privileged() {
        return;
    }
    let dir = scratch("degrade-optional");
    let mut stages = vec![
        (
            "--off-cpu",
            "off_cpu",
            "off-CPU time off",
            "on_sched_switch",
        ),
        ("--gil", "gil", "GIL view off", "gil_take_enter"),
        ("--gc", "gc", "GC pauses off", "gc_start"),
        // The task walk is part of the sampler's Python walk: the sampler is loaded again
        // without it.
        (
            "--async",
            "async",
            "asyncio task stacks off",
            "on_cpu_clock",
        ),
        (
            "--alloc",
            "alloc",
            "allocation profiling off",
            "alloc_return",
        ),
    ];
    // --gpu-kernels needs the GPU library, built where the CUDA headers were fetched.
    if pyrometer_e2e::gpu_kernels::standin().is_some() {
        stages.push((
            "--gpu-kernels",
            "gpu_kernels",
            "GPU kernels by stack off",
            "gpu_launch",
        ));
    }
    for (flag, stage, what, program) in stages {
        let err = record_cpu631(&dir, &[flag, "--debug-reject", stage]);
        refusal_line(&err, what, program);
    }
}

#[test]
fn a_refused_dwarf_walk_falls_back_to_frame_pointers() {
    if !privileged() {
        return;
    }
    let dir = scratch("degrade-dwarf");
    let err = record_cpu631(&dir, &["--debug-reject", "dwarf"]);
    refusal_line(
        &err,
        "DWARF unwinding off (stacks from frame pointers)",
        "on_cpu_clock",
    );
    // Frame pointers: no DWARF summary line.
    assert!(!err.contains("DWARF unwinding: "), "{err}");
}

#[test]
fn no_sampler_at_all_exits_3_in_one_line() {
    if !privileged() {
        return;
    }
    let dir = scratch("degrade-sampler");
    let fixture = fixture("cpu631").to_string_lossy().into_owned();
    let out_path = dir.join("out.folded");
    let out = pyrometer(&[
        "record",
        "--debug-reject",
        "sampler",
        "-o",
        out_path.to_str().unwrap(),
        "--",
        &fixture,
        "1",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("refused the BPF program on_cpu_clock"),
        "{err}"
    );
    assert!(err.contains("nothing can be sampled"), "{err}");
    assert!(!out_path.exists(), "an output was written");
}

/// The agent runs without a refused stage, says which on /metrics, and pushes CPU samples.
#[test]
fn the_agent_reports_refused_features_on_metrics() {
    if !privileged() {
        return;
    }
    let dir = scratch("degrade-agent");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let mut load = cluster::workload(&dir, "degrade-wl", 30);
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let mut agent = Agent::start(
        &dir,
        "degrade-node",
        &collector.url(),
        &[
            "--comm",
            "^degrade-wl$",
            "--off-cpu",
            "--debug-reject",
            "off_cpu",
            "--metrics-listen",
            &metrics_addr,
        ],
    );
    let want = "pyrometer_agent_feature_refused{feature=\"off_cpu\",program=\"on_sched_switch\"} 1";
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let got = http_get(metrics_addr.parse().unwrap(), "/metrics").map(|(_, b)| b);
        if let Some(body) = got.filter(|b| b.contains(want)) {
            break body;
        }
        assert!(
            agent.child.try_wait().unwrap().is_none(),
            "the agent exited"
        );
        assert!(Instant::now() < deadline, "no refused feature on /metrics");
        std::thread::sleep(Duration::from_millis(300));
    };
    cluster::promtool_check("agent", &metrics);
    // CPU samples still reach the collector.
    let q = enc("{node=\"degrade-node\"}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let path = format!("/api/v1/profile?format=folded&query={q}");
        let folded = http_get(collector.addr, &path).map(|(_, body)| body);
        if folded.as_deref().is_some_and(|f| f.contains("leaf_a")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no CPU samples pushed: {folded:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    agent.stop();
    let _ = load.kill();
    let _ = load.wait();
}
