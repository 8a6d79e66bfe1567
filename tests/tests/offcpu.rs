//! `pyrometer record --off-cpu` end to end, against `fixtures/offcpu.c`: a worker thread that
//! alternates ~100 ms of CPU (`busy`) with 200 ms asleep (`nap`), and a thread blocked in
//! `wait_pipe` for the whole run. The fixture prints how many naps it took and how long the
//! pipe wait lasted, so the expected blocked times come from the run itself, not from
//! assumptions about a loaded machine's speed. Needs root; without it each test prints
//! `skipping: <reason>`.

use std::path::Path;

use pyrometer_e2e::*;

fn run_fixture(out_path: &Path, extra: &[&str], seconds: &str) -> (u32, f64) {
    let fixture = fixture("offcpu").to_string_lossy().into_owned();
    let mut args = vec!["record"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["-o", out_path.to_str().unwrap(), "--", &fixture, seconds]);
    let out = pyrometer(&args);
    assert_ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| -> String {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("fixture printed no '{name}': {stdout}"))
            .trim()
            .to_string()
    };
    (
        field("naps ").parse().expect("nap count"),
        field("waited ").parse().expect("wait seconds"),
    )
}

/// Blocked nanoseconds of the folded stacks that contain `function`.
fn blocked_in(stacks: &[FoldedStack], function: &str) -> u64 {
    stacks
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == function))
        .map(|s| s.count)
        .sum()
}

#[test]
fn off_cpu_time_by_blocking_stack() {
    if !privileged() {
        return;
    }
    let dir = scratch("offcpu-folded");
    let out_path = dir.join("out.folded");
    let (naps, waited) = run_fixture(&out_path, &["--off-cpu", "--type", "off_cpu"], "3");
    let stacks = read_folded(&out_path);
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    let nap = blocked_in(&stacks, "nap") as f64 / 1e9;
    let pipe = blocked_in(&stacks, "wait_pipe") as f64 / 1e9;
    let busy = blocked_in(&stacks, "busy") as f64 / 1e9;
    let slept = f64::from(naps) * 0.2;
    let report = format!(
        "nap {nap:.3}s (slept {slept:.3}s in {naps} naps), wait_pipe {pipe:.3}s (waited {waited:.3}s), busy {busy:.3}s, total {:.3}s",
        total as f64 / 1e9
    );
    assert!(naps >= 3, "the worker barely ran: {report}");
    assert!(
        (pipe - waited).abs() <= 0.2 * waited,
        "wait_pipe's blocked time is not the pipe wait: {report}"
    );
    assert!(
        (nap - slept).abs() <= 0.2 * slept,
        "nap's blocked time is not its sleep: {report}"
    );
    // busy() never blocks (clock_gettime is a vDSO call); preemption is not off-CPU time.
    assert!(
        busy <= 0.05 * (nap + pipe),
        "busy holds off-CPU time: {report}"
    );
    let nap_kernel = stacks.iter().any(|s| {
        s.frames.iter().any(|f| f == "nap")
            && s.frames
                .iter()
                .any(|f| f.ends_with("_[k]") && f.contains("nanosleep"))
    });
    assert!(nap_kernel, "no nanosleep kernel frames under nap: {report}");
    assert!(
        !stacks
            .iter()
            .any(|s| s.frames.iter().any(|f| f.contains("bpf_prog"))),
        "the BPF program's own frames leaked into the stacks"
    );
}

fn sample_types(path: &Path) -> Vec<String> {
    let p = read_pprof(path);
    p.sample_type
        .iter()
        .map(|t| {
            format!(
                "{}/{}",
                p.str(t.r#type).unwrap_or("?"),
                p.str(t.unit).unwrap_or("?")
            )
        })
        .collect()
}

#[test]
fn pprof_carries_off_cpu_only_when_asked() {
    if !privileged() {
        return;
    }
    let dir = scratch("offcpu-pprof");
    let with = dir.join("with.pb.gz");
    run_fixture(&with, &["--off-cpu"], "1");
    let types = sample_types(&with);
    assert!(
        types.iter().any(|t| t == "off_cpu/nanoseconds"),
        "types: {types:?}"
    );
    assert!(
        types.iter().any(|t| t == "cpu/nanoseconds"),
        "types: {types:?}"
    );

    let without = dir.join("without.pb.gz");
    run_fixture(&without, &[], "1");
    let types = sample_types(&without);
    assert_eq!(types, ["samples/count", "cpu/nanoseconds"]);
}

/// A thread blocked when the recording stops is still reported, up to the stop: an idle
/// worker must not give an empty profile.
#[test]
fn still_blocked_threads_are_reported_at_the_end() {
    if !privileged() {
        return;
    }
    let dir = scratch("offcpu-pending");
    let out_path = dir.join("out.folded");
    run_fixture(
        &out_path,
        &["--off-cpu", "--type", "off_cpu", "--duration", "1.5s"],
        "3",
    );
    let pipe = blocked_in(&read_folded(&out_path), "wait_pipe") as f64 / 1e9;
    // Blocked from 0.5 s into the run until the stop at 1.5 s; the bounds allow for a slow start.
    assert!((0.3..=1.6).contains(&pipe), "wait_pipe blocked {pipe:.3}s");
}

#[test]
fn off_cpu_type_needs_the_flag() {
    let dir = scratch("offcpu-type");
    let out_path = dir.join("out.folded");
    let fixture = fixture("offcpu").to_string_lossy().into_owned();
    let out = pyrometer(&[
        "record",
        "--type",
        "off_cpu",
        "-o",
        out_path.to_str().unwrap(),
        "--",
        &fixture,
        "1",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("off_cpu"), "{}", stderr(&out));
}

/// The Chrome trace draws blocked intervals as slices of their own on the thread's track.
#[test]
fn chrome_trace_has_off_cpu_slices() {
    if !privileged() {
        return;
    }
    let dir = scratch("offcpu-chrome");
    let out_path = dir.join("out.trace.json");
    run_fixture(&out_path, &["--off-cpu"], "1");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let in_stack = |e: &&serde_json::Value, f: &str| {
        e["args"]["stack"]
            .as_array()
            .is_some_and(|s| s.iter().any(|x| x == f))
    };
    let pipe = events
        .iter()
        .find(|e| {
            e["cat"] == "off_cpu"
                && e["name"].as_str().unwrap_or("").starts_with("off-CPU: ")
                && in_stack(e, "wait_pipe")
        })
        .unwrap_or_else(|| panic!("no off-CPU slice in wait_pipe: {doc}"));
    assert!(pipe["dur"].as_f64().unwrap() > 500_000.0, "{pipe}");
    // The worker's on-CPU slices are still there.
    assert!(
        events
            .iter()
            .any(|e| e["cat"] == "cpu" && in_stack(&e, "busy"))
    );
}
