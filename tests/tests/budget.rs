//! The agent's CPU budget per process (`--process-cpu-budget-ms`): a process whose files cost
//! the agent more CPU time in a push interval than the budget is degraded until later
//! intervals' budgets have paid off what it spent over (its user stacks one `[budget]` frame)
//! and counted on `/metrics`, while a process beside it that costs the agent next to nothing
//! is served as ever. The costly process has one stack, named at the push in which its read
//! is charged: only the carried overspending can degrade it, in the intervals after.

use std::process::Command;
use std::time::Duration;

use pyrometer_e2e::cluster::{Agent, Collector, collected, free_port, workload};
use pyrometer_e2e::wait::{cpu_used, wait_until};
use pyrometer_e2e::*;

/// A perf map of some 4 MB that does not name the anonymous memory `hostile` spins in
/// (fixtures/hostile.c): each miss there has the agent read and parse it again (at most every
/// 500 ms), some 50 ms of CPU in a debug build. Not larger: a read past the symbolizer's 2 s
/// deadline (a 15 MB map on a loaded 2-core machine) leaves the process alone for a minute.
fn costly_perf_map(pid: u32) -> std::path::PathBuf {
    let path = std::path::PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let mut text = String::with_capacity(4 << 20);
    let mut i = 0u64;
    while text.len() < (4 << 20) - 64 {
        text.push_str(&format!(
            "{:x} 10 costly_jit_function_{i}\n",
            0x1000_0000 + i * 16
        ));
        i += 1;
    }
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_process_over_its_cpu_budget_is_degraded_and_counted_and_another_is_not() {
    if !privileged() {
        return;
    }
    let dir = scratch("cpu-budget");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    // The first process of the binary pays for reading it (tables, symbols); the second,
    // started once those are read, costs the agent next to nothing.
    let mut first = workload(&dir, "steady-wl", 600);
    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut agent = Agent::start(
        &dir,
        "budget",
        &collector.url(),
        &[
            "--comm",
            "steady-wl|hostile",
            "-F",
            "199",
            "--metrics-listen",
            &listen.to_string(),
            "--no-gpu",
            "--process-cpu-budget-ms",
            "20",
            // The perf map as parsed is large: the memory budget is not what is tested.
            "--process-budget-mb",
            "1024",
        ],
    );
    agent.wait_for_metrics(listen);
    wait_until(
        Duration::from_secs(60),
        "the first process's samples at the collector",
        || collected(&collector, "budget", &format!(",pid=\"{}\"", first.id())).contains("leaf_"),
    );
    let mut second = workload(&dir, "steady-wl", 600);
    let (mut costly, line) = spawn_until_line(&mut Command::new(fixture("hostile")));
    assert_eq!(line.trim(), "ready");
    let map = costly_perf_map(costly.id());
    let page = agent.wait_for_metric(
        listen,
        "pyrometer_agent_processes_over_cpu_budget_total",
        1.0,
    );
    // Some more pushes of both.
    cpu_used(second.id(), Duration::from_secs(3), Duration::from_secs(60));
    let last = pyrometer_e2e::cluster::http_get(listen, "/metrics").map(|(_, page)| page);
    agent.stop();
    let costly_profile = collected(&collector, "budget", &format!(",pid=\"{}\"", costly.id()));
    let second_profile = collected(&collector, "budget", &format!(",pid=\"{}\"", second.id()));
    for c in [&mut first, &mut second, &mut costly] {
        c.kill().ok();
        c.wait().ok();
    }
    let _ = std::fs::remove_file(&map);
    let over =
        pyrometer_e2e::cluster::metric(&page, "pyrometer_agent_processes_over_cpu_budget_total");
    let last = last.as_deref().unwrap_or_default();
    let stalled = pyrometer_e2e::cluster::metric(last, "pyrometer_agent_stalled_reads_total");
    let over_at_end =
        pyrometer_e2e::cluster::metric(last, "pyrometer_agent_processes_over_cpu_budget_total");
    eprintln!(
        "processes over the CPU budget: {over:?} when first seen, {over_at_end:?} at the end; reads that overran: {stalled:?}"
    );
    assert!(
        costly_profile.contains("[budget]"),
        "the costly process's stacks are not degraded (went over {over_at_end:?} times, reads that overran: {stalled:?}):\n{costly_profile}"
    );
    assert!(
        second_profile.contains("leaf_"),
        "the other process's functions are missing:\n{second_profile}"
    );
    assert!(
        !second_profile.contains("[budget]"),
        "the other process was degraded:\n{second_profile}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
