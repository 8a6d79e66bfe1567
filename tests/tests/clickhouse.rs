//! Stateless collectors on one ClickHouse, as real processes: two `pyrometer-collector`s
//! share a private clickhouse-server, two real agents push to different collectors, each
//! profiling its own 6:3:1 workload; ClickHouse is killed and restarted mid-run. Either
//! collector then answers for both nodes, with the known split and every pushed sample
//! stored exactly once.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use pyrometer_e2e::clickhouse_server::ClickHouse;
use pyrometer_e2e::cluster::{Agent, Collector, enc, free_port, http_get, metric, workload};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{privileged, scratch};

fn leaf_shares(c: &Collector, node: &str) -> BTreeMap<String, f64> {
    let q = enc(&format!("{{node=\"{node}\"}}"));
    let folded = c.get(&format!("/api/v1/profile?format=folded&query={q}"));
    let mut leaves: BTreeMap<String, f64> = BTreeMap::new();
    for line in folded.lines() {
        let (stack, n) = line.rsplit_once(' ').unwrap();
        let n: f64 = n.parse().unwrap();
        if let Some(leaf) = stack.split(';').find(|f| f.starts_with("leaf_")) {
            *leaves.entry(leaf.to_string()).or_default() += n;
        }
    }
    let total: f64 = leaves.values().sum();
    assert!(total >= 100.0, "{node}: too few leaf samples: {folded}");
    leaves.values_mut().for_each(|v| *v /= total);
    leaves
}

/// Samples per node; empty while the store holds nothing (404).
fn by_node(c: &Collector) -> BTreeMap<String, i64> {
    c.totals_by("node")
}

/// Workload processes, killed when dropped (also when an assertion fails).
struct Workloads(Vec<std::process::Child>);

impl Drop for Workloads {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn two_collectors_one_clickhouse_two_agents_and_an_outage() {
    if !privileged() {
        return;
    }
    let dir = scratch("clickhouse-e2e");
    let mut clickhouse = ClickHouse::start(&dir.join("clickhouse"));
    let store = vec![
        "--store".to_string(),
        clickhouse.url("pyrometer"),
        "--store-credentials".to_string(),
        clickhouse.credentials_file().display().to_string(),
    ];
    let collectors = [
        Collector::start_with(&store, free_port(), None),
        Collector::start_with(&store, free_port(), None),
    ];
    let nodes = ["node-a", "node-b"];
    let loads = Workloads(
        ["wl-cha", "wl-chb"]
            .iter()
            .map(|n| workload(&dir, n, 300))
            .collect(),
    );
    let metrics: Vec<SocketAddr> = nodes
        .iter()
        .map(|_| SocketAddr::from(([127, 0, 0, 1], free_port())))
        .collect();
    let mut agents: Vec<Agent> = nodes
        .iter()
        .zip(["^wl-cha$", "^wl-chb$"])
        .zip(&collectors)
        .zip(&metrics)
        .map(|(((node, comm), c), m)| {
            let listen = m.to_string();
            Agent::start(
                &dir,
                node,
                &c.url(),
                &[
                    "--comm",
                    comm,
                    "--push-interval",
                    "500ms",
                    "-F",
                    "199",
                    "--metrics-listen",
                    &listen,
                ],
            )
        })
        .collect();
    // Both agents pushing (BPF loading takes seconds on a busy machine), enough samples in
    // for the split to show.
    collectors[0].wait_for_nodes(&nodes, 150);
    // ClickHouse goes away mid-run: pushes are refused as retryable (each agent sees it) and
    // queries answer 503.
    clickhouse.kill();
    for (a, m) in agents.iter_mut().zip(&metrics) {
        a.wait_for_metric(*m, "pyrometer_agent_push_errors_total", 1.0);
    }
    let (code, body) = http_get(collectors[1].addr, "/api/v1/profile?format=folded").unwrap();
    assert_eq!(code, 503, "{body}");
    let pushed = |a: SocketAddr| {
        http_get(a, "/metrics")
            .and_then(|(_, t)| metric(&t, "pyrometer_agent_batches_pushed_total"))
            .unwrap_or(0.0)
    };
    let before: Vec<f64> = metrics.iter().map(|&m| pushed(m)).collect();
    clickhouse.resume();
    // The agents' spools drain into the store again: pushes succeed, nothing is left over.
    for ((a, &m), before) in agents.iter_mut().zip(&metrics).zip(before) {
        a.wait_for_metric(m, "pyrometer_agent_batches_pushed_total", before + 1.0);
        wait_until(
            Duration::from_secs(120),
            "the agent's spool drained",
            || {
                http_get(m, "/metrics")
                    .and_then(|(_, t)| metric(&t, "pyrometer_agent_spool_batches"))
                    == Some(0.0)
            },
        );
    }
    let stats: Vec<serde_json::Value> = agents.iter_mut().map(Agent::stop).collect();
    drop(loads);
    for (node, s) in nodes.iter().zip(&stats) {
        assert!(s["push_errors"].as_i64().unwrap() > 0, "{node}: {s}");
        assert_eq!(s["samples_dropped"], 0, "{node}: {s}");
        assert_eq!(s["spool_samples"], 0, "{node} left batches unsent: {s}");
    }
    for c in &collectors {
        let totals = by_node(c);
        for (node, s) in nodes.iter().zip(&stats) {
            assert_eq!(
                totals.get(*node),
                Some(&s["samples_pushed"].as_i64().unwrap()),
                "{node} on {}: {totals:?} vs {s}",
                c.addr
            );
        }
        for node in nodes {
            let shares = leaf_shares(c, node);
            for (leaf, want) in [("leaf_a", 0.6), ("leaf_b", 0.3), ("leaf_c", 0.1)] {
                let got = shares.get(leaf).copied().unwrap_or(0.0);
                assert!(
                    (got - want).abs() < 0.1,
                    "{node} on {}: {leaf} {got:.2}, want {want} ({shares:?})",
                    c.addr
                );
            }
        }
    }
    let metrics = collectors[1].get("/metrics");
    assert!(
        metrics.contains("pyrometer_collector_queries_store_unavailable_total 1"),
        "{metrics}"
    );
}
