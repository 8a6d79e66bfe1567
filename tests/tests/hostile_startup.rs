//! The agent's start beside a process whose files never answer: a Python process named as
//! the agent's `--comm` asks, already running when the agent starts, whose interpreter runs
//! from a FUSE file system that serves Debian's `python3.11` until it stalls and whose mount
//! is then taken out of the mount table (so the agent does not know the file for FUSE). The
//! agent reads the processes it finds at start-up on its workers, after its privilege drop,
//! each read up to its deadline: it starts, samples and pushes the normal process beside it,
//! and counts the stuck reads. Read on the agent's own thread, the first read of the stuck
//! binary would hold its start for good.

use std::time::Duration;

use pyrometer_e2e::cluster::{Agent, Collector, collected, free_port, metric, workload};
use pyrometer_e2e::fuse::{StuckFs, StuckRun, stuck_python};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::*;

#[test]
fn a_process_found_at_start_with_a_stuck_binary_does_not_hold_the_agents_start() {
    if !privileged() {
        return;
    }
    let py = pyrometer_e2e::python::debian();
    if !py.present() {
        return;
    }
    let dir = scratch("hostile-stuck-start");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let mut steady = workload(&dir, "steady-wl", 600);

    let script = "import ctypes\n\
        libc = ctypes.CDLL(None)\n\
        libc.prctl(15, b'stuckstart', 0, 0, 0)\n\
        print('named', flush=True)\n\
        def stuck_spin():\n    while True:\n        pass\n\
        stuck_spin()\n";
    let (fs, child, line) = stuck_python(&dir, &py.path, script);
    assert_eq!(line.trim(), "named");
    let mut run = StuckRun {
        fs: Some(fs),
        child,
        agent: None,
    };

    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let agent = Agent::start(
        &dir,
        "stuck-start",
        &collector.url(),
        &[
            "--comm",
            "steady-wl|stuckstart",
            "-F",
            "199",
            "--metrics-listen",
            &listen.to_string(),
            "--no-gpu",
        ],
    );
    let agent = run.agent.insert(agent);
    agent.wait_for_metrics(listen);
    // Sampling starts once the processes found at start-up are read: the steady process's
    // functions at the collector say the start went through.
    let steady_query = format!(",pid=\"{}\"", steady.id());
    wait_until(
        Duration::from_secs(60),
        "the steady process's functions at the collector",
        || collected(&collector, "stuck-start", &steady_query).contains("leaf_"),
    );
    let page = agent.wait_for_metric(listen, "pyrometer_agent_stalled_reads_total", 1.0);
    let taken = run.fs.as_ref().map_or(0, StuckFs::reads);
    eprintln!(
        "stalled reads: {:?}; reads the file system took: {taken}",
        metric(&page, "pyrometer_agent_stalled_reads_total")
    );
    assert!(taken >= 1, "the agent never read the stalled file");
    let _ = steady.kill();
    let _ = steady.wait();
    drop(run);
    let _ = std::fs::remove_dir_all(&dir);
}
