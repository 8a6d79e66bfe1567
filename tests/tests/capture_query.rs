//! On-demand captures by label (`pyrometer capture --query`), as real processes: a
//! collector and two agents with different node names; a real Ray cluster whose actor runs
//! 6:3:1 work with known sleeps, captured and dumped by its `ray_actor` label; one query over
//! processes on both nodes giving one Chrome trace on the wall clock; and the captures kept
//! across a restart of the collector.

#[allow(dead_code)]
#[path = "../../collector/tests/chromium/mod.rs"]
mod chromium;

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::captures::{
    Killed, gaps_against_sleeps, idle_gaps, numbers, one_line_failure, slices_of,
};
use pyrometer_e2e::cluster::{Agent, Collector, enc, free_port};
use pyrometer_e2e::ray_cluster::{self, Cluster};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{folded_counts, privileged, pyrometer, scratch, stderr};

/// The capture panel's flame graph: the summed widths of the actor's three functions, once
/// drawn.
const WIDTHS: &str = r##"(() => {
    const out = {};
    for (const b of document.querySelectorAll("#cap-flame .frame")) {
        const w = b.getBoundingClientRect().width;
        const name = b.dataset.name.split(" (")[0];
        out[name] = (out[name] || 0) + w;
    }
    const st = document.getElementById("cap-status");
    if (st.className === "failed") return { failed: st.textContent };
    const names = ["work_six", "work_three", "work_one"];
    if (!names.every(n => out[n])) return null;
    return { work_six: out.work_six, work_three: out.work_three, work_one: out.work_one,
        status: st.textContent };
})()"##;

/// The capture panel's flame graph over two nodes: each node frame's width and the
/// processes under it, once both are drawn.
const NODE_WIDTHS: &str = r##"(() => {
    const st = document.getElementById("cap-status");
    if (st.className === "failed") return { failed: st.textContent };
    const root = capFlame.root;
    const nodes = ["node-a", "node-b"];
    if (!root || !nodes.every(n => root.children.has(n))) return null;
    const out = { status: st.textContent };
    for (const n of nodes) {
        let width = 0;
        for (const b of document.querySelectorAll("#cap-flame .frame")) {
            if (b.dataset.name === n) width += b.getBoundingClientRect().width;
        }
        if (!width) return null;
        out[n] = { width, processes: [...root.children.get(n).children.keys()] };
    }
    return out;
})()"##;

/// A capture from the web UI's panel, the page opened on `query` (which the panel takes as its
/// label query), lasting `seconds`: the page and what `drawn` (a JavaScript expression)
/// answered once the flame graph was there; a screenshot in `target/tmp/capture-query/SHOT`.
fn panel_capture(
    url: &str,
    query: &str,
    dir: &Path,
    seconds: u32,
    drawn: &str,
    shot: &str,
) -> (chromium::Chromium, serde_json::Value) {
    let mut page =
        chromium::Chromium::launch(&format!("{url}/?query={}", enc(query)), dir, 1400, 900);
    page.open_capture_panel(
        "the panel with the page's query",
        &format!(
            r#"document.getElementById("cap-query").value === {} ? true : null"#,
            serde_json::Value::from(query)
        ),
    );
    page.eval(&format!(
        r#"document.getElementById("cap-duration").value = "{seconds}";
           document.getElementById("cap-start").click()"#
    ));
    let v = page.wait_for("the capture's flame graph", drawn);
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("capture-query");
    std::fs::create_dir_all(&shots).unwrap();
    page.screenshot(&shots.join(shot));
    println!("screenshot: {}", shots.join(shot).display());
    (page, v)
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// The values the collector holds for label `name` in the last five minutes.
fn label_values(collector: &Collector, name: &str) -> Vec<String> {
    match collector.http_get(&format!("/api/v1/label/{name}/values?from=now-5m")) {
        Some((200, body)) => serde_json::from_str::<serde_json::Value>(&body).unwrap()["values"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    }
}

/// A Ray actor running 6:3:1 work between sleeps on node-b, found by its `ray_actor` label:
/// a 5 s capture at 999 Hz answers within 10 s of its end with the split within ±5 points,
/// its timeline's idle gaps are the sleeps the actor measured (±50 ms), a dump by the same
/// query shows its Python stack within 2 s, and a query that matches nothing fails in one
/// line. The web UI's capture panel does the same from the page's query (checked in
/// headless Chromium, screenshot in `target/tmp/capture-query/ray-actor.png`).
#[test]
fn capture_and_dump_a_ray_actor_by_its_label() {
    if !privileged() {
        return;
    }
    let Some(venv) = ray_cluster::venv() else {
        return;
    };
    let dir = scratch("capture-query-ray");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let url = collector.url();
    let cluster = Cluster::start(&venv);
    let sleeps = dir.join("sleeps.txt");
    let mut driver = Command::new(venv.join("bin/python"));
    driver
        .arg(fixture("ray_actor631.py"))
        .arg(&sleeps)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    cluster.driver(&mut driver);
    let mut driver = Killed(driver.spawn().expect("the Ray driver"));
    let mut ready = String::new();
    std::io::BufReader::new(driver.0.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    let actor_pid: u32 = ready
        .split_whitespace()
        .find_map(|f| f.strip_prefix("actor_pid="))
        .unwrap_or_else(|| panic!("the driver said {ready:?}"))
        .parse()
        .unwrap();
    // Each agent samples its own processes, as two nodes' agents would; node-b's runs the
    // actor.
    let _a = Agent::start(&dir, "node-a", &url, &["--comm", "^capture-none$"]);
    let pid_arg = actor_pid.to_string();
    let _b = Agent::start(&dir, "node-b", &url, &["--pid", &pid_arg]);
    wait_until(
        Duration::from_secs(120),
        "node-b's pushes of the actor's ray_actor label",
        || label_values(&collector, "ray_actor").contains(&"Loader".to_string()),
    );
    let query = r#"{ray_actor="Loader"}"#;

    let folded = dir.join("actor.folded");
    let started = Instant::now();
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--query",
        query,
        "--duration",
        "5s",
        "-F",
        "999",
        "-o",
        folded.to_str().unwrap(),
    ]);
    let took = started.elapsed();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        took < Duration::from_secs(15),
        "a 5 s capture answered {took:?} after its request"
    );
    assert!(
        stderr(&out).contains("from node node-b"),
        "{}",
        stderr(&out)
    );
    let text = std::fs::read_to_string(&folded).unwrap();
    let counts = folded_counts(&text, &["work_six", "work_three", "work_one"]);
    let sum: u64 = counts.iter().sum();
    println!("the CLI's capture: {counts:?}");
    assert!(sum > 300, "{counts:?} samples of the work in a 5 s capture");
    for (i, (f, want)) in [("work_six", 0.6), ("work_three", 0.3), ("work_one", 0.1)]
        .into_iter()
        .enumerate()
    {
        let got = counts[i] as f64 / sum as f64;
        assert!(
            (got - want).abs() <= 0.05,
            "{f}: {got:.3} of the capture, want {want} ± 0.05 ({counts:?})"
        );
    }

    // Its timeline: the gaps between the actor's on-CPU slices are its sleeps.
    let trace = dir.join("actor.trace.json");
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--query",
        query,
        "--duration",
        "4s",
        "-F",
        "999",
        "-o",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    // The sleeps are 250 ms; a preemption on a busy machine is rarely this long.
    let gaps: Vec<f64> = idle_gaps(&slices_of(&doc, actor_pid), 150.0)
        .iter()
        .map(|(a, b)| (b - a) / 1000.0)
        .collect();
    assert!(gaps.len() >= 3, "gaps {gaps:?}");
    let slept = numbers(&sleeps);
    // Aligned where they agree best, each gap within 50 ms of its sleep.
    let worst = gaps_against_sleeps(&gaps, &slept);
    assert!(
        worst <= 50.0,
        "idle gaps (ms) {gaps:?} against the sleeps {slept:?}: {worst:.1} ms apart at best"
    );

    // A dump by the same query: the actor's Python stack, within 2 s.
    let started = Instant::now();
    let out = pyrometer(&["dump", "--collector", &url, "--query", query]);
    let took = started.elapsed();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("Process {actor_pid}")) && text.contains("ray_actor631.py"),
        "dump:\n{text}"
    );
    assert!(
        took < Duration::from_secs(2),
        "the remote dump took {took:?}"
    );

    // The same from the web UI: the page's query (the label picker's Ray actor) becomes the
    // capture panel's label query; the capture's flame graph keeps the split. 5 s, as above:
    // a window cuts rounds (work, then a 250 ms sleep) at both ends, and in 3 s on a slow
    // machine (six rounds) one extra `work_six` alone moves the split by 4 points.
    let (page, v) = panel_capture(&url, query, &dir, 5, WIDTHS, "ray-actor.png");
    println!("the web UI's capture: {v}");
    assert!(v["failed"].is_null(), "the capture failed: {v}");
    assert!(
        v["status"]
            .as_str()
            .unwrap_or_default()
            .starts_with("done: "),
        "{v}"
    );
    let w = |n: &str| v[n].as_f64().unwrap();
    let all = w("work_six") + w("work_three") + w("work_one");
    for (name, want) in [("work_six", 0.6), ("work_three", 0.3), ("work_one", 0.1)] {
        let got = w(name) / all;
        assert!(
            (got - want).abs() <= 0.05,
            "{name}: {got:.3} of the width, want {want}: {v}"
        );
    }
    drop(page);

    // A query that matches nothing fails in one line.
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--query",
        r#"{ray_actor="Nobody"}"#,
        "--duration",
        "1s",
    ]);
    one_line_failure(&out, 2, "no process matches");
    drop(driver);
    drop(cluster);
}

fn stamper(dir: &Path, name: &str) -> Killed {
    Killed(
        Command::new(pyrometer_e2e::python::pyenv("3.11.7"))
            .arg(fixture("stamper.py"))
            .arg(name)
            .arg(dir.join(format!("{name}.txt")))
            .stdout(Stdio::null())
            .spawn()
            .expect("start stamper.py"),
    )
}

/// One query over processes on two nodes: one Chrome trace with a process track per node,
/// whose idle gaps, moved onto the wall clock by the origin the agents reported, end when
/// each process stamped its wake-up with its own wall clock (±50 ms). The collector, restarted on
/// the same directory, still has both captures and their results.
#[test]
fn a_query_over_two_nodes_gives_one_timeline_on_the_wall_clock_kept_across_a_restart() {
    if !privileged() {
        return;
    }
    let dir = scratch("capture-query-cluster");
    let mut collector = Collector::start(&dir.join("store"), free_port(), None);
    let url = collector.url();
    let (one, two) = (stamper(&dir, "stamp-one"), stamper(&dir, "stamp-two"));
    let (pid_one, pid_two) = (one.0.id(), two.0.id());
    let _a = Agent::start(&dir, "node-a", &url, &["--pid", &pid_one.to_string()]);
    let _b = Agent::start(&dir, "node-b", &url, &["--pid", &pid_two.to_string()]);
    wait_until(
        Duration::from_secs(120),
        "both stampers in the agents' pushes",
        || {
            let comms = label_values(&collector, "comm");
            comms.contains(&"stamp-one".to_string()) && comms.contains(&"stamp-two".to_string())
        },
    );
    let trace = dir.join("cluster.trace.json");
    let out = pyrometer(&[
        "capture",
        "--collector",
        &url,
        "--query",
        r#"{comm=~"stamp-.*"}"#,
        "--duration",
        "4s",
        "-F",
        "999",
        "-o",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let body = std::fs::read(&trace).unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let origin_ns = doc["otherData"]["origin_unix_ns"]
        .as_u64()
        .expect("the trace's wall-clock origin");
    let processes: Vec<&str> = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    for (node, name, pid) in [
        ("node-a", "stamp-one", pid_one),
        ("node-b", "stamp-two", pid_two),
    ] {
        assert!(
            processes.contains(&format!("{node}: {name}").as_str()),
            "{processes:?}"
        );
        // The gaps on the wall clock, against the sleeps the process stamped.
        // The sleeps are 200 ms; a preemption on a busy machine is rarely this long.
        let gaps: Vec<(f64, f64)> = idle_gaps(&slices_of(&doc, pid), 150.0)
            .iter()
            .map(|(a, b)| {
                let wall = |us: f64| origin_ns as f64 / 1e9 + us / 1e6;
                (wall(*a), wall(*b))
            })
            .collect();
        assert!(gaps.len() >= 3, "{node}: gaps {gaps:?}");
        let stamped: Vec<(f64, f64)> = std::fs::read_to_string(dir.join(format!("{name}.txt")))
            .unwrap()
            .lines()
            .filter_map(|l| {
                let (a, b) = l.split_once(' ')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .collect();
        // A gap ends when the process wakes from its sleep: within 50 ms of the stamped end
        // on the wall clock. It begins when the process last ran, which is the sleep's start
        // or, when the machine preempted it near the end of its spin, earlier (it was off
        // the CPU since, as the trace shows): never more than 50 ms after the stamped start.
        for (start, end) in &gaps {
            let nearest = stamped
                .iter()
                .min_by(|a, b| (end - a.1).abs().total_cmp(&(end - b.1).abs()))
                .unwrap();
            assert!(
                (end - nearest.1).abs() <= 0.050 && *start <= nearest.0 + 0.050,
                "{node}: the gap {start:.3}..{end:.3} against the stamped sleep {:.3}..{:.3} \
                 (all: {stamped:?})",
                nearest.0,
                nearest.1
            );
        }
    }

    // Both captures, and their results, outlive a restart of the collector.
    let list = collector.get_json("/api/v1/captures");
    let ids: Vec<String> = list["captures"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] == "done")
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{list}");
    let results: Vec<String> = ids
        .iter()
        .map(|id| {
            collector.get(&format!(
                "/api/v1/captures/{}/result?format=chrome",
                enc(id)
            ))
        })
        .collect();

    // The same query from the web UI: one flame graph, each node's capture under its name
    // with its own process, in equal parts (both run the same spin and sleep; a 3 s window
    // cuts their 0.5 s rounds at both ends, hence ±15 points).
    let query = r#"{comm=~"stamp-.*"}"#;
    let (page, v) = panel_capture(&url, query, &dir, 3, NODE_WIDTHS, "two-nodes.png");
    println!("the web UI's capture over two nodes: {v}");
    assert!(v["failed"].is_null(), "the capture failed: {v}");
    let status = v["status"].as_str().unwrap_or_default();
    assert!(
        status.starts_with("done: ") && status.contains(" on 2 nodes "),
        "{v}"
    );
    for (node, process) in [("node-a", "stamp-one"), ("node-b", "stamp-two")] {
        let under = v[node]["processes"].as_array().unwrap();
        assert!(
            under.len() == 1 && under[0].as_str().unwrap().contains(process),
            "{node}: processes {under:?}"
        );
    }
    let (a, b) = (
        v["node-a"]["width"].as_f64().unwrap(),
        v["node-b"]["width"].as_f64().unwrap(),
    );
    assert!(
        (a / (a + b) - 0.5).abs() <= 0.15,
        "node-a has {a:.0} px of {:.0}: {v}",
        a + b
    );
    drop(page);

    collector.restart();
    for (id, result) in ids.iter().zip(&results) {
        let c = collector.get_json(&format!("/api/v1/captures/{}", enc(id)));
        assert_eq!(c["state"], "done", "{c}");
        assert!(c["samples"].as_u64().unwrap_or(0) > 0, "{c}");
        let again = collector.get(&format!(
            "/api/v1/captures/{}/result?format=chrome",
            enc(id)
        ));
        assert_eq!(&again, result, "capture {id}'s timeline after the restart");
    }
    drop(one);
    drop(two);
}
