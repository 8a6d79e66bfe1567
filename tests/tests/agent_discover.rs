//! `agent --comm` finds the processes it is told to by name when they start after it: by exec,
//! by renaming themselves, and as forked children that never exec. With the kernel's process
//! events (the proc connector) and, where it cannot have them (a network namespace of its
//! own), by reading every process's name.

use std::collections::HashMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use prost::Message;
use pyrometer_e2e::cluster::{Collector, free_port, samples_of};
use pyrometer_e2e::wait::wait_for;
use pyrometer_e2e::{pprof_samples, pprof_type, privileged, pyrometer_bin, scratch};
use pyrometer_proto::ingest::PushRequest;

/// Kills the processes it holds when dropped, on assertion failures too.
struct Kill(Vec<Child>);

impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Samples by pid in the batches an agent left in its spool (it could not push them).
fn spooled_samples(spool: &std::path::Path) -> HashMap<u32, i64> {
    let mut by_pid = HashMap::new();
    let Ok(entries) = std::fs::read_dir(spool) else {
        return by_pid;
    };
    for e in entries.flatten() {
        // Written aside (`.tmp-NAME.batch`) and renamed: a batch under its own name is whole.
        let aside = e.file_name().to_string_lossy().starts_with('.');
        if aside || e.path().extension().is_none_or(|x| x != "batch") {
            continue;
        }
        // A full spool deletes its oldest batches: one listed may be gone by now.
        let Ok(bytes) = std::fs::read(e.path()) else {
            continue;
        };
        let push = PushRequest::decode(&bytes[..]).expect("a spooled batch decodes");
        let profile = push.profile.expect("a batch holds a profile");
        let count = pprof_type(&profile, "samples");
        for s in pprof_samples(&profile) {
            let pid = s
                .labels
                .get("pid")
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            *by_pid.entry(pid).or_default() += s.values[count];
        }
    }
    by_pid
}

/// Runs the agent (behind `prefix`, a command that puts it in a network namespace of its
/// own, where it can push nothing and keeps its batches in its spool) with `--comm
/// 'disc-.*'`, starts the workloads after it, waits until each matching one has samples
/// pushed (or spooled), and checks that the other one has none. Returns the agent's stats
/// and stderr.
fn discovers(test: &str, prefix: &[&str]) -> (serde_json::Value, String) {
    let dir = scratch(test);
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let node = test;
    let stats = dir.join("stats.json");
    let spool = dir.join("spool");
    let (program, args) = match prefix.split_first() {
        Some((p, rest)) => (p.to_string(), rest.to_vec()),
        None => (pyrometer_bin().display().to_string(), Vec::new()),
    };
    let mut cmd = Command::new(program);
    cmd.args(args);
    if !prefix.is_empty() {
        cmd.arg(pyrometer_bin());
    }
    let mut agent = cmd
        .args(["agent", "--node-name", node, "--no-gpu", "--collector"])
        .arg(collector.url())
        .args(["--comm", "disc-.*", "--push-interval", "1s", "--spool-dir"])
        .arg(&spool)
        .arg("--stats")
        .arg(&stats)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pyrometer agent");
    let err = agent.stderr.take().unwrap();
    let mut procs = Kill(vec![agent]);
    // Its stderr is read on a thread of its own to the end: a closed pipe would end it.
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut said = Vec::new();
    while !said.iter().any(|l: &String| l.contains("pushing every")) {
        said.push(
            lines
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("{e}: the agent said {said:?}")),
        );
    }
    // Started after the agent: a program whose name matches from its exec, one that renames
    // itself to a matching name, the forked child of a matching shell (never exec'd: it has
    // the shell's name), and a burner whose name does not match.
    let sh = |name: &str| {
        let exe = dir.join(name);
        pyrometer_e2e::copy_executable(std::path::Path::new("/bin/sh"), &exe);
        exe
    };
    let burn = "while :; do :; done";
    let late = Command::new(sh("disc-late"))
        .args(["-c", burn])
        .spawn()
        .unwrap();
    let renamed = Command::new("python3")
        .args([
            "-c",
            "import ctypes\nctypes.CDLL(None).prctl(15, b'disc-renamed', 0, 0, 0)\nwhile True: pass",
        ])
        .spawn()
        .unwrap();
    let mut forker = Command::new(sh("disc-forker"))
        .args(["-c", &format!("({burn}) & echo $!; wait")])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(forker.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let child: u32 = first
        .trim()
        .parse()
        .expect("the shell printed its child's pid");
    let other = Command::new(sh("nodisc-burn"))
        .args(["-c", burn])
        .spawn()
        .unwrap();
    let pids = [late.id(), renamed.id(), child, other.id()];
    procs.0.extend([late, renamed, forker, other]);
    // The child of the forker is not its own Child: killed through its pid at the end.
    // 19 Hz on burners that share two CPUs with whatever else runs: a few samples each are
    // plenty to tell found from not found.
    let matching = [pids[0], pids[1], pids[2]];
    let found = |samples: &dyn Fn(u32) -> i64| -> Result<(), Vec<i64>> {
        let n: Vec<i64> = matching.iter().map(|&p| samples(p)).collect();
        if n.iter().all(|&k| k >= 5) {
            Ok(())
        } else {
            Err(n)
        }
    };
    wait_for(
        Duration::from_secs(120),
        "5 samples of each matching process",
        || {
            if prefix.is_empty() {
                found(&|p| samples_of(&collector, node, p) as i64)
            } else {
                let spooled = spooled_samples(&spool);
                found(&|p| spooled.get(&p).copied().unwrap_or(0))
            }
        },
    );
    // SAFETY: kill(2) of our own child (the agent), which pushes what it has on SIGTERM.
    unsafe { libc::kill(procs.0[0].id() as i32, libc::SIGTERM) };
    let status = procs.0[0].wait().unwrap();
    // SAFETY: kill(2) of the forker's child, a grandchild of this test still running.
    unsafe { libc::kill(child as i32, libc::SIGKILL) };
    let mut rest = Vec::new();
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(10)) {
        rest.push(l);
    }
    said.extend(rest);
    let said = said.join("\n");
    assert!(status.success(), "agent: {status}\n{said}");
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let [late, renamed, child, other] = if prefix.is_empty() {
        pids.map(|p| samples_of(&collector, node, p) as i64)
    } else {
        let spooled = spooled_samples(&spool);
        pids.map(|p| spooled.get(&p).copied().unwrap_or(0))
    };
    for (what, n) in [
        ("exec'd as disc-late", late),
        ("renamed to disc-renamed", renamed),
        ("forked by disc-forker", child),
    ] {
        assert!(n >= 5, "the process {what}: {n} samples\n{said}");
    }
    assert_eq!(other, 0, "nodisc-burn does not match disc-.*\n{said}");
    (stats, said)
}

#[test]
fn processes_chosen_by_name_are_found_from_process_events() {
    if !privileged() {
        return;
    }
    let (stats, said) = discovers("agent-discover-events", &[]);
    assert_eq!(stats["process_events"], true, "{stats}\n{said}");
}

#[test]
fn in_a_network_namespace_processes_chosen_by_name_are_found_by_scanning() {
    if !privileged() {
        return;
    }
    if Command::new("unshare").arg("--version").output().is_err() {
        pyrometer_e2e::skip("tool:unshare", "unshare (util-linux) is not installed");
        return;
    }
    // The kernel sends process events only to the initial network namespace.
    let (stats, said) = discovers("agent-discover-scan", &["unshare", "--net", "--"]);
    assert_eq!(stats["process_events"], false, "{stats}\n{said}");
    assert!(
        said.contains("process events") && said.contains("every 500 ms instead"),
        "the fallback is said once:\n{said}"
    );
    // It could push nothing from there: what it sampled stayed in its spool.
    assert_eq!(stats["samples_pushed"], 0, "{stats}\n{said}");
    assert!(
        stats["spool_samples"].as_u64().unwrap_or(0) >= 15,
        "{stats}\n{said}"
    );
}
