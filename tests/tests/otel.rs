//! OpenTelemetry spans on samples: python/pyrometer-otel publishes each thread's active span,
//! the kernel reads it at sample time and `record` labels the samples `trace_id`, `span_id`
//! and `span_name`. Ground truth is fixtures/otel_spans.py: heavy() and light() do 2:1 units
//! of the same loop in two spans on two threads (the CPU time each span's thread measured is
//! what the samples' split is held to), outside() runs in no span, and nested spans
//! hand the thread back to their parent when they end. Needs root (BPF) and the OpenTelemetry
//! venv (`cargo xtask test` makes it); prints `skipping: …` without them.

use std::collections::HashMap;
use std::path::Path;

use pyrometer_e2e::cluster::{Agent, Collector, Held, enc, free_port};
use pyrometer_e2e::*;

/// Records the fixture (run by `wrapper` when given, e.g. in a pid namespace of its own) into
/// `out` (pprof); the trace id, span id and CPU seconds it printed, by span name.
fn record_spans(
    out: &Path,
    python: &Path,
    wrapper: &[&str],
) -> HashMap<String, (String, String, f64)> {
    let script = pyrometer_e2e::python::source("otel_spans.py");
    let mut args = vec![
        "record",
        "-F",
        "499",
        "-o",
        out.to_str().unwrap(),
        "--split-by",
        "span",
        "--",
    ];
    // The kernel takes the span table at its first sample after the table's creation (the
    // fixed address), but only of a process `record` has registered: a second's margin for
    // that on a busy machine (these tests run side by side).
    args.extend(["env", "OTEL_SPANS_SETTLE=1"]);
    args.extend_from_slice(wrapper);
    // 90 units: ~490 samples of the two spans at 499 Hz on an idle runner (1.6 s of work),
    // where 30 gave 186 and the 2:1 split's ±8 points were only 2.3 standard errors.
    args.extend([python.to_str().unwrap(), script.to_str().unwrap(), "90"]);
    let result = pyrometer(&args);
    assert_ok(&result);
    let stdout = String::from_utf8_lossy(&result.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no span ids printed: {stdout}\n{}", stderr(&result)));
    let ids: serde_json::Value = serde_json::from_str(line).unwrap();
    ids.as_object()
        .unwrap()
        .iter()
        .map(|(name, v)| {
            let s = |k: &str| v[k].as_str().unwrap().to_string();
            let cpu = v["cpu_s"].as_f64().unwrap();
            (name.clone(), (s("trace_id"), s("span_id"), cpu))
        })
        .collect()
}

/// heavy()'s share of the CPU the two spans' threads measured: what their samples' split must
/// match. Handing the GIL over costs the waiting thread CPU as well, so the 2:1 of their
/// units held within 8 points on an idle machine only (58 % was seen on a 2-core one).
fn measured_share(heavy_cpu_s: f64, light_cpu_s: f64) -> f64 {
    assert!(
        heavy_cpu_s > 0.0 && light_cpu_s > 0.0,
        "spans measured no CPU: {heavy_cpu_s} {light_cpu_s}"
    );
    heavy_cpu_s / (heavy_cpu_s + light_cpu_s)
}

/// Samples (weighted by count) whose stack holds `function`, and how many of them carry
/// `span_id`.
fn carrying(samples: &[PprofSample], count: usize, function: &str, span_id: &str) -> (i64, i64) {
    let mut total = 0;
    let mut with = 0;
    for s in samples
        .iter()
        .filter(|s| s.functions.iter().any(|f| f == function))
    {
        total += s.values[count];
        if s.labels.get("span_id").map(String::as_str) == Some(span_id) {
            with += s.values[count];
        }
    }
    (total, with)
}

#[test]
fn span_labels_split_two_threads_two_to_one() {
    if !privileged() {
        return;
    }
    let Some(python) = otel::python() else {
        return;
    };
    span_labels_split(&python, "otel-split");
}

/// On a free-threaded build the two spans' threads run in parallel, and the package's slots
/// are written by its pure-Python path (its C fast path refuses such a build): the same
/// labels and split, and loading the package and the SDK leaves the GIL off.
fn span_labels_free_threaded(minor: u32) {
    if !privileged() {
        return;
    }
    let Some(python) = otel::free_threaded_python(minor) else {
        return;
    };
    let gil = std::process::Command::new(&python)
        .args([
            "-c",
            "import sys, opentelemetry.sdk.trace, pyrometer_otel.processor as p; \
             print(sys._is_gil_enabled(), p.FAST)",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&gil.stdout).trim(),
        "False False",
        "the GIL and the fast path after loading the package on 3.{minor}t: {}",
        String::from_utf8_lossy(&gil.stderr)
    );
    span_labels_split(&python, &format!("otel-split-3.{minor}t"));
}

#[test]
fn span_labels_split_two_threads_two_to_one_3_13t() {
    span_labels_free_threaded(13);
}

#[test]
fn span_labels_split_two_threads_two_to_one_3_14t() {
    span_labels_free_threaded(14);
}

/// heavy() and light() in two spans on two threads: each span's samples match its thread's
/// CPU, `--split-by span` writes one file a span, each function carries its innermost span,
/// and samples outside any span carry none.
fn span_labels_split(python: &Path, name: &str) {
    let dir = scratch(name);
    let out = dir.join("spans.pb.gz");
    let ids = record_spans(&out, python, &[]);
    let profile = read_pprof(&out);
    let count = pprof_type(&profile, "samples");
    let samples = pprof_samples(&profile);

    let by_span = |span: &str| -> i64 {
        samples
            .iter()
            .filter(|s| s.labels.get("span_id").map(String::as_str) == Some(span))
            .map(|s| s.values[count])
            .sum()
    };
    let heavy = by_span(&ids["heavy"].1);
    let light = by_span(&ids["light"].1);
    assert!(
        heavy + light > 100,
        "too few span samples: {heavy} + {light}"
    );
    let share = heavy as f64 / (heavy + light) as f64;
    let want = measured_share(ids["heavy"].2, ids["light"].2);
    assert!(
        (share - want).abs() <= 0.08,
        "span heavy has {:.1} % of the two spans' samples, its thread {:.1} % of their CPU \
         (± 8 pp): {heavy} vs {light}",
        share * 100.0,
        want * 100.0
    );

    // `--split-by span`: one file per span, holding that span's samples only.
    for (name, total) in [("heavy", heavy), ("light", light)] {
        let id = &ids[name].1;
        let part = dir.join(format!("spans.span-{id}.pb.gz"));
        let part_samples = pprof_samples(&read_pprof(&part));
        assert!(
            part_samples
                .iter()
                .all(|s| s.labels.get("span_id") == Some(id)),
            "{} holds another span's samples",
            part.display()
        );
        let sum: i64 = part_samples.iter().map(|s| s.values[count]).sum();
        assert_eq!(
            sum,
            total,
            "{} holds all of span {name}'s samples",
            part.display()
        );
    }

    // Each function's samples carry the span it ran in (the innermost one, the parent's again
    // once a child ended), and the span's name and trace.
    for (function, span) in [
        ("heavy", "heavy"),
        ("light", "light"),
        ("outer_before", "outer"),
        ("inner_work", "inner"),
        ("outer_after", "outer"),
    ] {
        let (total, with) = carrying(&samples, count, function, &ids[span].1);
        assert!(total > 10, "too few samples in {function}: {total}");
        assert!(
            with as f64 >= 0.95 * total as f64,
            "{with} of {total} samples in {function} carry span {span}'s id"
        );
        for s in samples
            .iter()
            .filter(|s| s.functions.iter().any(|f| f == function))
            .filter(|s| s.labels.get("span_id") == Some(&ids[span].1))
        {
            assert_eq!(s.labels.get("trace_id"), Some(&ids[span].0), "{function}");
            assert_eq!(s.labels.get("span_name").map(String::as_str), Some(span));
        }
    }
    assert_eq!(
        ids["inner"].0, ids["outer"].0,
        "a child span shares its trace"
    );
    assert_ne!(ids["heavy"].0, ids["light"].0, "two root spans, two traces");

    // Samples outside any span carry no span label at all.
    let outside: Vec<_> = samples
        .iter()
        .filter(|s| s.functions.iter().any(|f| f == "outside"))
        .collect();
    let outside_samples: i64 = outside.iter().map(|s| s.values[count]).sum();
    assert!(
        outside_samples > 10,
        "too few samples in outside(): {outside_samples}"
    );
    for s in outside {
        for key in ["trace_id", "span_id", "span_name"] {
            assert!(
                !s.labels.contains_key(key),
                "outside() sample has {key}: {s:?}"
            );
        }
    }
}

/// A process in a pid namespace of its own (as in a container) knows its threads by other ids
/// than the kernel's global ones; its slots are indexed by its own, and the kernel reads them
/// by the same. This one runs on the package's pure-Python path (the other tests on its C fast
/// path), so both write slots the kernel reads.
#[test]
fn spans_of_a_process_in_its_own_pid_namespace() {
    if !privileged() {
        return;
    }
    let Some(python) = otel::python() else {
        return;
    };
    let dir = scratch("otel-pidns");
    let out = dir.join("spans.pb.gz");
    let ids = record_spans(
        &out,
        &python,
        &["env", "PYROMETER_OTEL_PURE=1", "unshare", "--pid", "--fork"],
    );
    let profile = read_pprof(&out);
    let count = pprof_type(&profile, "samples");
    let samples = pprof_samples(&profile);
    for (function, span) in [("heavy", "heavy"), ("light", "light")] {
        let (total, with) = carrying(&samples, count, function, &ids[span].1);
        assert!(total > 10, "too few samples in {function}: {total}");
        assert!(
            with as f64 >= 0.95 * total as f64,
            "{with} of {total} samples in {function} carry span {span}'s id"
        );
    }
}

/// The agent pushes the span labels, and the collector answers `{trace_id="…"}` with that
/// trace's samples only: heavy()'s trace holds heavy() and not light(), and the two traces'
/// totals split 2:1. The same agent exports OTLP profiles to a receiver that decodes them with
/// the `opentelemetry-proto` package from the Python registry: the stacks, the same split by
/// the samples' span links, the span attributes and the resource attributes.
#[test]
fn agent_pushes_spans_to_the_collector_and_as_otlp() {
    if !privileged() {
        return;
    }
    let Some(python) = otel::python() else {
        return;
    };
    let dir = scratch("otel-agent");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    // The workload is held until the agent is attached. The agent builds the new image's
    // unwind tables at the exec, which on a busy machine delays its finding the span table:
    // the spans start 4 s after it exists.
    let script = pyrometer_e2e::python::source("otel_spans.py");
    let load = Held::start(
        &dir,
        &[("OTEL_SPANS_SETTLE", "4"), ("OTEL_SPANS_HOLD", "3")],
        &[python.to_str().unwrap(), script.to_str().unwrap(), "30"],
    );
    let load_pid = load.pid();
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let exported = dir.join("otlp.jsonl");
    let receiver = otlp_receiver(&python, &exported);
    let mut args = vec![
        "--pid".to_string(),
        load_pid.to_string(),
        "-F".into(),
        "199".into(),
        "--metrics-listen".into(),
        metrics.to_string(),
    ];
    if let Some(r) = &receiver {
        args.extend(["--otlp-endpoint".into(), format!("http://{}", r.addr)]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = Agent::start(&dir, "otel-node", &collector.url(), &args);
    agent.wait_for_metrics(metrics);
    let out = load.release();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap();
    let ids: serde_json::Value = serde_json::from_str(line).unwrap();
    // Its last interval goes with the push (and export) the agent makes when it stops.
    let stats = agent.stop();
    assert_eq!(stats["spool_samples"], 0, "batches left unsent: {stats}");
    if receiver.is_some() {
        check_otlp(&exported, &ids, load_pid, &stats);
    }

    let fetch = |span: &str| {
        let trace = ids[span]["trace_id"].as_str().unwrap();
        let q = enc(&format!("{{trace_id=\"{trace}\"}}"));
        collector.get(&format!(
            "/api/v1/profile?format=folded&query={q}&from=now-10m"
        ))
    };
    let heavy = folded_counts(&fetch("heavy"), &["heavy", "light"]);
    let light = folded_counts(&fetch("light"), &["heavy", "light"]);
    assert_eq!(heavy[1], 0, "heavy's trace holds light() samples");
    assert_eq!(light[0], 0, "light's trace holds heavy() samples");
    assert!(
        heavy[0] + light[1] > 50,
        "too few samples: {heavy:?} {light:?}"
    );
    let share = heavy[0] as f64 / (heavy[0] + light[1]) as f64;
    let cpu = |span: &str| ids[span]["cpu_s"].as_f64().unwrap();
    let want = measured_share(cpu("heavy"), cpu("light"));
    assert!(
        (share - want).abs() <= 0.08,
        "heavy's trace has {:.1} %, its thread {:.1} % of the CPU (± 8 pp): {heavy:?} {light:?}",
        share * 100.0,
        want * 100.0
    );
    // A span id selects as well: the nested "inner" span holds inner_work() only.
    let inner = ids["inner"]["span_id"].as_str().unwrap();
    let q = enc(&format!("{{span_id=\"{inner}\"}}"));
    let folded = collector.get(&format!(
        "/api/v1/profile?format=folded&query={q}&from=now-10m"
    ));
    let c = folded_counts(&folded, &["inner_work", "outer_before", "outer_after"]);
    assert!(
        c[0] > 0 && c[1] == 0 && c[2] == 0,
        "span inner: {c:?}\n{folded}"
    );
}

/// The Python OTLP receiver (fixtures/otlp_receiver.py), killed on drop.
struct Receiver {
    child: std::process::Child,
    addr: std::net::SocketAddr,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the receiver writing to `out`, or None (after saying why) without grpcio.
fn otlp_receiver(python: &Path, out: &Path) -> Option<Receiver> {
    let has_grpc = std::process::Command::new(python)
        .args(["-c", "import grpc"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_grpc {
        skip(
            "otel-venv",
            "the OTLP part: no grpcio in the OpenTelemetry venv",
        );
        return None;
    }
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut child = std::process::Command::new(python)
        .arg(pyrometer_e2e::python::source("otlp_receiver.py"))
        .arg(addr.port().to_string())
        .arg(out)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the OTLP receiver");
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening", "the receiver did not start");
    Some(Receiver { child, addr })
}

/// What the receiver decoded: samples of the workload with its stacks, the 2:1 split by span
/// link, span attributes on linked samples, none on samples outside any span, and the
/// resource attributes of the process.
fn check_otlp(exported: &Path, ids: &serde_json::Value, pid: u32, stats: &serde_json::Value) {
    let text = std::fs::read_to_string(exported)
        .unwrap_or_else(|e| panic!("no OTLP export received ({e}); agent stats {stats}"));
    let samples: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|s: &serde_json::Value| s["type"] == "samples/count")
        .collect();
    assert!(stats["otlp_exported"].as_u64().unwrap() > 0, "{stats}");
    let has = |s: &serde_json::Value, f: &str| {
        s["functions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().split(" (").next() == Some(f))
    };
    let trace = |span: &str| ids[span]["trace_id"].as_str().unwrap().to_string();
    let by_trace = |t: &str| -> i64 {
        samples
            .iter()
            .filter(|s| s["trace_id"] == t)
            .map(|s| s["value"].as_i64().unwrap())
            .sum()
    };
    let (heavy, light) = (by_trace(&trace("heavy")), by_trace(&trace("light")));
    assert!(
        heavy + light > 50,
        "too few linked samples: {heavy} + {light}"
    );
    let share = heavy as f64 / (heavy + light) as f64;
    // Seen once under a full parallel run (81 %, 188 vs 44) and not in reruns: say what a
    // skew would come from, samples of light() left unlinked or an export that failed.
    let unlinked = |f: &str| -> i64 {
        samples
            .iter()
            .filter(|s| s["trace_id"].as_str().unwrap_or("").is_empty() && has(s, f))
            .map(|s| s["value"].as_i64().unwrap())
            .sum()
    };
    let cpu = |span: &str| ids[span]["cpu_s"].as_f64().unwrap();
    let want = measured_share(cpu("heavy"), cpu("light"));
    assert!(
        (share - want).abs() <= 0.08,
        "OTLP: heavy's trace has {:.1} %, its thread {:.1} % of the CPU (± 8 pp): {heavy} vs \
         {light}; unlinked samples of heavy() {} and light() {}; agent stats {stats}",
        share * 100.0,
        want * 100.0,
        unlinked("heavy"),
        unlinked("light")
    );
    // A span is in the table from its processor's on_start to its on_end, so a sample in the
    // SDK's own start or end of the span (Span.end calling the processors, say) is linked to
    // it without heavy() on its stack: what must never be linked is other work.
    for s in samples.iter().filter(|s| s["trace_id"] == trace("heavy")) {
        assert!(
            !has(s, "light") && !has(s, "outside"),
            "heavy's trace links another span's or no span's work: {s}"
        );
        assert_eq!(s["span_id"], ids["heavy"]["span_id"], "{s}");
        assert_eq!(s["attributes"]["span_name"], "heavy", "{s}");
        assert_eq!(s["attributes"]["thread.name"], "heavy-thread", "{s}");
    }
    let outside: Vec<_> = samples.iter().filter(|s| has(s, "outside")).collect();
    // outside() runs last: its samples go in the last exports, which a receiver slowed by a
    // loaded machine may time out (best effort, counted); then there is nothing to check.
    let lost = stats["otlp_failed"].as_u64().unwrap() + stats["otlp_dropped"].as_u64().unwrap();
    if lost > 0 && outside.is_empty() {
        println!("no outside() samples exported ({lost} exports lost): {stats}");
    } else {
        assert!(
            !outside.is_empty(),
            "no outside() samples exported: {stats}"
        );
    }
    for s in outside {
        assert_eq!(s["trace_id"], "", "outside() sample has a link: {s}");
        assert!(s["attributes"].get("span_name").is_none(), "{s}");
    }
    let pid = pid.to_string();
    let ours: Vec<_> = samples
        .iter()
        .filter(|s| s["resource"]["process.pid"].as_str() == Some(pid.as_str()))
        .collect();
    assert!(!ours.is_empty(), "no resource has process.pid {pid}");
    for s in ours {
        assert_eq!(s["resource"]["host.name"], "otel-node", "{s}");
        assert!(s["resource"]["process.executable.name"].is_string(), "{s}");
        assert_eq!(s["scope"], "pyrometer");
    }
}

/// The collector accepts OTLP profiles pushes sent with the `opentelemetry-proto` package and
/// grpcio: the samples answer queries by node, process and trace like the agent's own, a
/// retried export counts once, and a request that points past its tables is refused with a
/// reason. No privileges needed.
#[test]
fn collector_accepts_otlp_pushes() {
    let Some(python) = otel::python() else {
        return;
    };
    let dir = scratch("otel-otlp-in");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let (trace, span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let addr = collector.url().trim_start_matches("http://").to_string();
    let out = std::process::Command::new(&python)
        .arg(pyrometer_e2e::python::source("otlp_send.py"))
        .args([&addr, trace, span])
        .output()
        .expect("run otlp_send.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success()
        && String::from_utf8_lossy(&out.stderr).contains("No module named 'grpc'")
    {
        skip("otel-venv", "no grpcio in the OpenTelemetry venv");
        return;
    }
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches("export ok").count(), 2, "{stdout}");
    assert!(
        stdout.contains("bad export INVALID_ARGUMENT") && stdout.contains("stack index 99"),
        "{stdout}"
    );
    let folded = |query: &str| {
        let q = enc(query);
        collector.get(&format!(
            "/api/v1/profile?format=folded&query={q}&from=now-10m"
        ))
    };
    let all = folded("{node=\"py-node\", pid=\"7\", comm=\"svc\", thread=\"worker\"}");
    assert_eq!(
        folded_counts(&all, &["heavy", "light"]),
        [200, 100],
        "{all}"
    );
    let traced = folded(&format!("{{trace_id=\"{trace}\", span_id=\"{span}\"}}"));
    assert_eq!(
        folded_counts(&traced, &["heavy", "light"]),
        [200, 0],
        "{traced}"
    );
}

/// A real local Ray cluster with Ray's tracing start-up hook set to pyrometer-otel's: two task
/// types, each under its own trace, on reused workers, and an actor's method calls under a
/// third (fixtures/ray_traced.py). Every sample in a task's or the actor method's work
/// function carries its caller's trace (the span of its invocation, on a worker that ran the
/// other type before), and the two task traces split the samples as the tasks' own measure of
/// their CPU splits (2:1 in units of work).
#[test]
fn ray_tasks_carry_their_invocations_trace() {
    use pyrometer_e2e::ray_cluster::{self, Cluster};
    if !privileged() {
        return;
    }
    let Some(venv) = ray_cluster::venv() else {
        return;
    };
    let ready = std::process::Command::new(venv.join("bin/python"))
        .args(["-c", "import pyrometer_otel.ray_hook"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ready {
        skip(
            "ray-venv",
            format!(
                "no pyrometer-otel in {} (cargo xtask test installs it)",
                venv.display()
            ),
        );
        return;
    }
    let dir = scratch("otel-ray");
    let out = dir.join("ray.pb.gz");
    let cluster = Cluster::start_with(
        &venv,
        &["--tracing-startup-hook=pyrometer_otel.ray_hook:setup_tracing"],
    );
    // 499 Hz: at 99 Hz the two task types gave ~90 samples between them, where the 2:1 split's
    // ±8 points are 1.6 standard errors (75 % was seen on an idle runner); at 499 Hz they are
    // over three.
    let mut record = std::process::Command::new(pyrometer_bin())
        .args(["record", "--comm", "ray::.*", "-F", "499", "-o"])
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("pyrometer record");
    let lines = {
        use std::io::BufRead;
        let err = record.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        rx
    };
    let mut log = Vec::new();
    loop {
        let line = lines
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("pyrometer says it is sampling");
        log.push(line.clone());
        if line.contains("sampling") {
            break;
        }
    }
    let mut driver = std::process::Command::new(venv.join("bin/python"));
    driver
        .arg(pyrometer_e2e::python::source("ray_traced.py"))
        .arg("8");
    cluster.driver(&mut driver);
    let workload = driver.output().expect("the Ray driver");
    // SAFETY: kill(2) of our own child: SIGINT ends the recording and writes the profile.
    unsafe { libc::kill(record.id() as i32, libc::SIGINT) };
    let status = record.wait().unwrap();
    log.extend(lines.try_iter());
    drop(cluster);
    let text = String::from_utf8_lossy(&workload.stdout).into_owned();
    assert!(
        workload.status.success(),
        "driver failed:\n{text}\n{}",
        String::from_utf8_lossy(&workload.stderr)
    );
    assert!(status.success(), "record: {}", log.join("\n"));
    let line = text.lines().rev().find(|l| l.starts_with('{')).unwrap();
    let ids: serde_json::Value = serde_json::from_str(line).unwrap();
    let pids = |k: &str| -> Vec<u64> {
        ids[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect()
    };
    let (alpha_pids, beta_pids) = (pids("alpha_pids"), pids("beta_pids"));
    assert!(
        alpha_pids.iter().any(|p| beta_pids.contains(p)),
        "no worker ran both task types: {ids}"
    );

    let profile = read_pprof(&out);
    let count = pprof_type(&profile, "samples");
    let samples = pprof_samples(&profile);
    let mut by_trace: HashMap<String, i64> = HashMap::new();
    for (function, task) in [
        ("alpha_work", "alpha"),
        ("beta_work", "beta"),
        ("gamma_work", "gamma"),
    ] {
        let trace = ids[task].as_str().unwrap();
        let (mut total, mut right, mut wrong) = (0, 0, 0);
        for s in samples
            .iter()
            .filter(|s| s.functions.iter().any(|f| f == function))
        {
            total += s.values[count];
            match s.labels.get("trace_id").map(String::as_str) {
                Some(t) if t == trace => right += s.values[count],
                Some(_) => wrong += s.values[count],
                None => {}
            }
        }
        assert!(total > 20, "too few samples in {function}: {total}");
        // A task switch is seen at the span's start; samples in flight across it may carry
        // the previous one. The kernel takes a worker's span table at its first sample after
        // the table's creation, unless it looked for one within the ~8 ms before: a sample
        // or so a worker may carry none.
        assert!(
            wrong as f64 <= 0.05 * total as f64,
            "{wrong} of {total} samples in {function} carry another trace than {task}"
        );
        assert!(
            right as f64 >= 0.9 * total as f64,
            "{right} of {total} samples in {function} carry trace {task}"
        );
        println!("{function}: {right} of {total} samples carry trace {task}, {wrong} another");
        *by_trace.entry(task.to_string()).or_default() += right;
    }
    // Against the CPU the tasks measured, not the 2:1 of their units: on the 2-core runner a
    // unit's CPU time varies with what shares the CPUs with it. (58 % was once seen here: the
    // workers Ray starts for the driver were found by a scan twice a second, and each lost the
    // samples of its first task; record now finds them by the kernel's process events.)
    let cpu = |task: &str| ids["cpu_s"][task].as_f64().unwrap();
    let want = cpu("alpha") / (cpu("alpha") + cpu("beta"));
    let (a, b) = (by_trace["alpha"], by_trace["beta"]);
    let share = a as f64 / (a + b) as f64;
    assert!(
        (share - want).abs() <= 0.08,
        "alpha's trace has {:.1} % of the two traces' samples, the tasks measured {:.1} % of \
         their CPU (± 8 pp): {a} vs {b}; {ids}",
        share * 100.0,
        want * 100.0
    );
    println!(
        "alpha's trace: {:.1} % of samples, {:.1} % of the measured CPU",
        share * 100.0,
        want * 100.0
    );
}

/// python/pyrometer-otel's own tests (the slots as the kernel reads them: nesting, spans
/// ended out of order or on another thread, slot owners, the header, the C fast path's bytes
/// against the pure-Python path's), with the venv's real OpenTelemetry SDK: once with the C
/// fast path (which the venv must have built) and once forced onto the pure-Python fallback.
/// No privileges needed.
#[test]
fn span_processor_publishes_what_the_kernel_reads() {
    let Some(python) = otel::python() else {
        return;
    };
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/pyrometer-otel/tests");
    for (pure, expect) in [("0", "fast"), ("1", "pure")] {
        let out = std::process::Command::new(&python)
            .args(["-m", "unittest", "discover", "-v", "-s"])
            .arg(&tests)
            .env("PYROMETER_OTEL_PURE", pure)
            .env("PYROMETER_OTEL_EXPECT", expect)
            .output()
            .expect("run the package's tests");
        let report = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{expect} path: {report}");
        assert!(
            report.contains("test_the_expected_path_is_active")
                && !report.contains("skipped 'PYROMETER_OTEL_EXPECT"),
            "{expect} path: the active path was not checked: {report}"
        );
    }
}

/// Bad input for the tracing options gets one line and exit 2: an OTLP endpoint that is not
/// http(s), an agent with neither a collector nor an OTLP endpoint, `--split-by` for a Chrome
/// trace.
#[test]
fn tracing_options_refuse_bad_input_in_one_line() {
    let dir = scratch("otel-errors");
    let spool = dir.join("spool");
    let spool = spool.to_str().unwrap();
    let trace = dir.join("x.trace.json");
    for (args, want) in [
        (
            vec![
                "agent",
                "--otlp-endpoint",
                "ftp://x:1",
                "--spool-dir",
                spool,
            ],
            "invalid --otlp-endpoint 'ftp://x:1'",
        ),
        (vec!["agent", "--spool-dir", spool], "--otlp-endpoint URL"),
        (
            vec![
                "record",
                "--split-by",
                "trace",
                "-o",
                trace.to_str().unwrap(),
                "--",
                "true",
            ],
            "--split-by writes profiles, not Chrome traces",
        ),
    ] {
        let out = pyrometer(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
