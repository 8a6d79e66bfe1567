//! The always-on agent and the preloaded sampler library: with no allocation flags it samples
//! every process that preloads libpyrometer_alloc.so, started after it, and forgets one that
//! exits. Needs root (BPF, uprobes).

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pyrometer_e2e::alloc::fixture_totals;
use pyrometer_e2e::cluster::{Collector, enc, free_port, http_get};
use pyrometer_e2e::{fixture, privileged, pyrometer_bin, scratch};

/// Kills a child if an assertion fails, so it does not go on running.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Bytes of a sample type in the workload's folded stacks (process `preload-wl`, the first
/// frame) whose frames include `function`. Other tests running beside this one preload the
/// library into their own copies of the fixture, which the node-wide agent samples too.
fn sum(folded: &str, function: &str) -> f64 {
    folded
        .lines()
        .filter(|l| l.split(';').next() == Some("preload-wl"))
        .filter(|l| l.split(';').any(|f| f.split(' ').next() == Some(function)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Bytes of a sample type in folded stacks of processes named `comm` (the first frame).
fn of_comm(folded: &str, comm: &str) -> f64 {
    folded
        .lines()
        .filter(|l| l.split(';').next() == Some(comm))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Started after the agent, a C program that preloads the library (leak_1k keeps 200 MiB,
/// tidy frees as much) is in the agent's pushes: each function's allocations within ±20 %,
/// and leak_1k's blocks in use while it lived. After it exited, a later 10-second bucket has
/// nothing of it in use, while a second copy started then, which holds its leak, is there.
#[test]
fn the_agent_samples_preloaded_processes_and_forgets_exited_ones() {
    if !privileged() {
        return;
    }
    let dir = scratch("agent-alloc-preload");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    // The set-up a node would have: the library written out with `install-preload`, the
    // agent told where (it probes that copy at start), the program preloading it.
    let library = pyrometer_e2e::alloc::install_preload(&dir.join("lib"));
    let mut agent = Killed(
        Command::new(pyrometer_bin())
            .env("PYROMETER_ALLOC_LIB", &library)
            .args(["agent", "--node-name", "preload-node", "--collector"])
            .arg(collector.url())
            // CPU samples of the fixture only (not of the whole busy machine, which keeps a
            // debug build's agent behind); no allocation flags.
            .args(["--comm", "preload-.*"])
            .args(["--push-interval", "1s", "--spool-dir"])
            .arg(dir.join("spool"))
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start pyrometer agent"),
    );
    let err = agent.0.stderr.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen: Vec<String> = Vec::new();
    while !seen.iter().any(|l| l.contains("pushing every")) {
        let line = lines
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("{e}: {seen:?}"));
        seen.push(line);
    }
    assert!(
        seen.iter().any(|l| l.contains(&format!(
            "sampling the allocations of processes that preload {}",
            library.display()
        ))),
        "{seen:?}"
    );
    let folded = |ty: &str, from: &str| {
        let path = format!(
            "/api/v1/profile?format=folded&type={ty}&query={}&from={from}",
            enc("{node=\"preload-node\"}")
        );
        // Nothing pushed yet is a 404: the same as nothing there.
        match http_get(collector.addr, &path) {
            Some((200, body)) => body,
            _ => String::new(),
        }
    };
    // Polls until `check` holds of the folded profile, up to two minutes (the agent works on a
    // busy machine: records are read late, pushes queue).
    let wait_for = |ty: &str, from: &str, check: &dyn Fn(&str) -> bool| -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let f = folded(ty, from);
            if check(&f) || Instant::now() > deadline {
                return f;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    let exe = dir.join("preload-wl");
    pyrometer_e2e::copy_executable(&fixture("allocs"), &exe);
    // Alive for several pushes after its work, holding its leak.
    let workload = Command::new(&exe)
        .args(["leak", "8"])
        .env("LD_PRELOAD", &library)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let while_alive = wait_for("inuse_space", "now-10m", &|f| sum(f, "leak_1k") > 0.0);
    seen.extend(lines.try_iter());
    assert!(
        sum(&while_alive, "leak_1k") > 0.0,
        "leak_1k in use while it lives:\n{while_alive}\nagent: {seen:#?}"
    );
    let out = workload.wait_with_output().unwrap();
    assert!(out.status.success());
    let exited = unix_now();
    let truth = fixture_totals(&out.stdout);
    let complete = |f: &str| {
        ["leak_1k", "tidy"]
            .iter()
            .all(|&name| sum(f, name) >= 0.8 * truth[name].1)
    };
    let space = wait_for("alloc_space", "now-10m", &complete);
    for f in ["leak_1k", "tidy"] {
        let (got, want) = (sum(&space, f), truth[f].1);
        assert!(
            (got - want).abs() <= 0.2 * want,
            "{f}: {got:.0} bytes pushed, {want:.0} allocated:\n{space}"
        );
    }
    // Started now, a second copy holds its leak (until killed below): the positive control of
    // the buckets after the first one exited.
    let live_exe = dir.join("preload-live");
    pyrometer_e2e::copy_executable(&fixture("allocs"), &live_exe);
    let control = Killed(
        Command::new(&live_exe)
            .args(["leak", "120"])
            .env("LD_PRELOAD", &library)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The first bucket that starts a second after the exit: the Python leak is there (the
    // agent pushed into it), the exited program's is not.
    let bucket = format!("{:.0}", ((exited + 1.0) / 10.0).ceil() * 10.0);
    let after = wait_for("inuse_space", &bucket, &|f| {
        of_comm(f, "preload-live") > 100e6
    });
    assert!(
        of_comm(&after, "preload-live") > 100e6,
        "the living copy's leak is in the later bucket:\n{after}"
    );
    assert_eq!(
        of_comm(&after, "preload-wl"),
        0.0,
        "the exited process is forgotten:\n{after}"
    );
    drop(control);
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    let status = agent.0.wait().unwrap();
    seen.extend(lines.try_iter());
    assert!(status.success(), "agent ended with {status}: {seen:#?}");
}
