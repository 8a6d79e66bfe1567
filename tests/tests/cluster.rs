//! Agents and the collector together, as real processes: a three-node cluster, collector
//! outages and SIGKILL, auth, and the Prometheus endpoints checked by promtool.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use pyrometer_e2e::cluster::{Agent, Collector, enc, free_port, promtool_check, workload};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{privileged, scratch};

fn by_node(c: &Collector) -> BTreeMap<String, i64> {
    c.totals_by("node")
}

fn sent(stats: &serde_json::Value) -> i64 {
    assert_eq!(stats["spool_samples"], 0, "batches left unsent: {stats}");
    stats["samples_pushed"].as_i64().unwrap()
}

#[test]
fn three_agents_one_cluster_flame_graph() {
    if !privileged() {
        return;
    }
    let dir = scratch("cluster3");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let nodes = ["alpha", "beta", "gamma"];
    // Long enough for any start-up; killed once the samples are in.
    let mut loads: Vec<_> = nodes
        .iter()
        .map(|n| workload(&dir, &format!("wl-{n}"), 300))
        .collect();
    let agents: Vec<Agent> = nodes
        .iter()
        .map(|n| {
            let comm = format!("^wl-{n}$");
            Agent::start(
                &dir,
                &format!("node-{n}"),
                &collector.url(),
                &["--comm", &comm],
            )
        })
        .collect();
    // Three debug-build agents start (BPF verification) on two cores: each node's first
    // second of samples (19 Hz) is in before they stop.
    collector.wait_for_nodes(&["node-alpha", "node-beta", "node-gamma"], 19);
    let stats: Vec<serde_json::Value> = agents.into_iter().map(|mut a| a.stop()).collect();
    for l in &mut loads {
        let _ = l.kill();
        let _ = l.wait();
    }

    let totals = by_node(&collector);
    for (n, s) in nodes.iter().zip(&stats) {
        let pushed = sent(s);
        assert!(pushed > 0, "node-{n} pushed nothing: {s}");
        assert_eq!(
            totals.get(&format!("node-{n}")),
            Some(&pushed),
            "{totals:?} vs {s}"
        );
    }
    assert_eq!(totals.len(), 3, "{totals:?}");
    // Each node holds only its own workload, and the cluster graph has all three.
    for n in nodes {
        let q = enc(&format!("{{node=\"node-{n}\"}}"));
        let folded = collector.get(&format!("/api/v1/profile?format=folded&query={q}"));
        assert!(!folded.is_empty());
        for line in folded.lines() {
            assert!(line.starts_with(&format!("wl-{n};")), "node-{n}: {line}");
        }
        assert!(folded.contains("leaf_a"), "{folded}");
    }
    let svg = collector.get("/api/v1/profile?format=svg");
    for n in nodes {
        assert!(
            svg.contains(&format!("wl-{n}")),
            "cluster graph lacks wl-{n}"
        );
    }
    let values = collector.get_json("/api/v1/label/node/values");
    assert_eq!(
        values["values"],
        serde_json::json!(["node-alpha", "node-beta", "node-gamma"])
    );
}

#[test]
fn collector_outage_and_sigkill_lose_and_double_nothing() {
    if !privileged() {
        return;
    }
    let dir = scratch("outage");
    let mut collector = Collector::start(&dir.join("store"), free_port(), None);
    let mut load = workload(&dir, "wl-outage", 300);
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let listen = metrics.to_string();
    let mut agent = Agent::start(
        &dir,
        "node-o",
        &collector.url(),
        &[
            "--comm",
            "^wl-outage$",
            "--push-interval",
            "300ms",
            "--metrics-listen",
            &listen,
        ],
    );
    // The agent needs a few seconds to load its BPF programs; kill only once pushes arrive.
    let ingested = "pyrometer_collector_batches_ingested_total";
    wait_until(Duration::from_secs(120), "two batches ingested", || {
        collector.metric(ingested) >= 2.0
    });
    // SIGKILL mid-ingest: batches arrive every 300 ms, so one is often in flight.
    collector.kill9();
    agent.wait_for_metric(metrics, "pyrometer_agent_push_errors_total", 1.0);
    collector.restart();
    // The store reopened after SIGKILL and answers queries.
    assert!(
        collector
            .get("/api/v1/profile?format=folded")
            .contains("wl-outage")
    );
    // Restarts in a row, each once the agent's pushes reach the new process.
    for _ in 0..3 {
        wait_until(Duration::from_secs(60), "a batch after the restart", || {
            collector.metric(ingested) >= 1.0
        });
        collector.restart();
    }
    wait_until(
        Duration::from_secs(60),
        "a batch after the restarts",
        || collector.metric(ingested) >= 1.0,
    );
    let stats = agent.stop();
    let _ = load.kill();
    let _ = load.wait();
    assert!(
        stats["push_errors"].as_i64().unwrap() > 0,
        "the outage was not noticed: {stats}"
    );
    assert_eq!(stats["samples_dropped"], 0);
    let pushed = sent(&stats);
    assert_eq!(by_node(&collector).get("node-o"), Some(&pushed), "{stats}");
    let metrics = collector.get("/metrics");
    assert!(metrics.contains("pyrometer_collector_batches_ingested_total"));
}

#[test]
fn pushes_need_the_token() {
    if !privileged() {
        return;
    }
    let dir = scratch("auth");
    let token = dir.join("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "not-it\n").unwrap();
    let collector = Collector::start(&dir.join("store"), free_port(), Some(&token));
    let mut load = workload(&dir, "wl-auth", 300);
    let url = collector.url();
    let addrs: Vec<SocketAddr> = (0..3)
        .map(|_| SocketAddr::from(([127, 0, 0, 1], free_port())))
        .collect();
    let listen: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    let agent = |node: &str, listen: &str, token: Option<&std::path::Path>| {
        let mut args = vec!["--comm", "^wl-auth$", "--metrics-listen", listen];
        if let Some(t) = token {
            args.extend(["--token-file", t.to_str().unwrap()]);
        }
        Agent::start(&dir, node, &url, &args)
    };
    let mut none = agent("node-none", &listen[0], None);
    let mut bad = agent("node-bad", &listen[1], Some(&wrong));
    let mut good = agent("node-good", &listen[2], Some(&token));
    // Each refused agent was refused, and holds what it sampled; the other's samples are in.
    for (a, addr) in [(&mut none, addrs[0]), (&mut bad, addrs[1])] {
        a.wait_for_metric(addr, "pyrometer_agent_push_errors_total", 1.0);
        a.wait_for_metric(addr, "pyrometer_agent_spool_batches", 1.0);
    }
    collector.wait_for_nodes(&["node-good"], 19);
    let (none, bad, good) = (none.stop(), bad.stop(), good.stop());
    let _ = load.kill();
    let _ = load.wait();
    for refused in [&none, &bad] {
        assert_eq!(refused["samples_pushed"], 0, "{refused}");
        assert!(refused["spool_samples"].as_i64().unwrap() > 0, "{refused}");
    }
    let totals = by_node(&collector);
    assert_eq!(totals.keys().collect::<Vec<_>>(), vec!["node-good"]);
    assert_eq!(totals["node-good"], sent(&good));
    let metrics = collector.get("/metrics");
    let refused: u64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("pyrometer_collector_pushes_refused_total{reason=\"unauthenticated\"} ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(refused >= 2, "{metrics}");
    let text = format!("{none}{bad}");
    assert!(!text.contains("s3cret"));
}

#[test]
fn metrics_pass_promtool() {
    if !privileged() {
        return;
    }
    if Command::new("promtool").arg("--version").output().is_err() {
        pyrometer_e2e::skip(
            "tool:promtool",
            "promtool not installed (cargo xtask test installs Debian's prometheus)",
        );
        return;
    }
    let dir = scratch("promtool");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let mut load = workload(&dir, "wl-metrics", 300);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut agent = Agent::start(
        &dir,
        "node-m",
        &collector.url(),
        &["--comm", "^wl-metrics$", "--metrics-listen", &listen],
    );
    // Start-up takes seconds on a loaded machine: wait until something was pushed.
    let agent_metrics = agent.wait_for_metric(
        listen.parse().unwrap(),
        "pyrometer_agent_samples_pushed_total",
        1.0,
    );
    let stats = agent.stop();
    let _ = load.kill();
    let _ = load.wait();
    assert!(agent_metrics.contains("pyrometer_agent_samples_pushed_total"));
    // The unwind row array as the node sees it: the default capacity, some rows in use (the
    // workload's and the C library's tables), and every stop reason named.
    let value = |name: &str| -> f64 {
        agent_metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing: {agent_metrics}"))
    };
    assert_eq!(value("pyrometer_agent_unwind_rows_capacity"), 1048576.0);
    assert!(value("pyrometer_agent_unwind_rows_used") > 0.0);
    assert_eq!(value("pyrometer_agent_unwind_tables_too_big_total"), 0.0);
    assert!(
        agent_metrics.contains("pyrometer_agent_unwind_stopped_total{reason=\"frame_pointers\"}"),
        "{agent_metrics}"
    );
    promtool_check("agent", &agent_metrics);
    assert!(sent(&stats) > 0);
    let _ = collector.get("/api/v1/profile?format=folded");
    promtool_check("collector", &collector.get("/metrics"));
}
