//! `agent --comm` finds the processes it is told to by name when they start after it: by exec,
//! by renaming themselves, and as forked children that never exec. With the kernel's process
//! events (the proc connector) and, where it cannot have them (a network namespace of its
//! own), by reading every process's name.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pyrometer_e2e::cluster::{Collector, enc, free_port};
use pyrometer_e2e::{privileged, pyrometer_bin, scratch};

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

/// Samples pushed for `pid` of node `node`.
fn samples_of(collector: &Collector, node: &str, pid: u32) -> u64 {
    let q = enc(&format!("{{node=\"{node}\",pid=\"{pid}\"}}"));
    collector
        .get(&format!(
            "/api/v1/profile?format=folded&query={q}&from=now-10m"
        ))
        .lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Runs the agent (behind `prefix`, a command that puts it in a network namespace of its
/// own, where it can push nothing) with `--comm 'disc-.*'`, starts the workloads after it,
/// and, when it could push, checks that each matching one was sampled and the other was not.
/// Returns the agent's stats and stderr.
fn discovers(test: &str, prefix: &[&str]) -> (serde_json::Value, String) {
    let dir = scratch(test);
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let node = test;
    let stats = dir.join("stats.json");
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
        .arg(dir.join("spool"))
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
    std::thread::sleep(Duration::from_secs(5));
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
    if !prefix.is_empty() {
        return (stats, said);
    }
    let [late, renamed, child, other] = pids.map(|p| samples_of(&collector, node, p));
    // 5 s at 19 Hz is ~95 samples a burner with a CPU to itself; four burners share two
    // CPUs with whatever else runs, so a few are plenty to tell found from not found.
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
    // Only the processes started after it match, and it cannot push from there: what it
    // sampled is in its stats (the three matching burners share two CPUs for 5 s).
    let samples = stats["samples"].as_u64().unwrap_or(0);
    assert!(samples >= 15, "{samples} samples\n{stats}\n{said}");
}
