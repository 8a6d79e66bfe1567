//! The agent on its own terms: configured from a TOML file, running as nobody with only the
//! capabilities it needs once attached, and unwinding stacks without frame pointers in the kernel.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::cluster::{
    Agent, Collector, Held, enc, free_port, http_get, metric, samples_of, workload_of,
};
use pyrometer_e2e::wait::wait_for;
use pyrometer_e2e::{folded_counts, privileged, pyrometer, pyrometer_bin, scratch, stderr};

/// CAP_DAC_READ_SEARCH (2), CAP_SYS_PTRACE (19), CAP_PERFMON (38), CAP_BPF (39).
const KEPT: u64 = (1 << 2) | (1 << 19) | (1 << 38) | (1 << 39);
/// Kept as well where the kernel refuses uprobes without it (the agent says so).
const CAP_SYS_ADMIN: u64 = 1 << 21;

fn caps(status: &str, field: &str) -> u64 {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in {status}"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}

/// The capability sets of every thread of `pid`.
fn thread_caps(pid: u32) -> Vec<(String, [u64; 5])> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let name = status.lines().next()?.to_string();
            Some((
                name,
                ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"].map(|f| caps(&status, f)),
            ))
        })
        .collect()
}

/// Kills the agent if an assertion fails, so it does not go on sampling the machine.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn config_file_capability_drop_and_dwarf_stacks() {
    if !privileged() {
        return;
    }
    let dir = scratch("agent-config");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "collector = \"{}\"\nnode-name = \"from-toml\"\ncomm = \"nofp-wl\"\n\
             push-interval = \"1s\"\nfrequency = 49\nunwind = \"dwarf\"\n\
             spool-dir = \"{}\"\ndwarf-mb = 64\n",
            collector.url(),
            dir.join("spool").display()
        ),
    )
    .unwrap();
    let stats = dir.join("stats.json");
    let mut agent = Killed(
        Command::new(pyrometer_bin())
            .args(["agent", "--config"])
            .arg(&config)
            .arg("--stats")
            .arg(&stats)
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(dir.join("agent.log")).unwrap())
            .spawn()
            .expect("start pyrometer agent"),
    );
    let pid = agent.0.id();
    // It says before dropping whether it keeps CAP_SYS_ADMIN for uprobes opened later (its
    // allocation probes are always on); a process started later proves it needed no more.
    let kept = || {
        let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
        KEPT | if log.contains("keeping CAP_SYS_ADMIN") {
            CAP_SYS_ADMIN
        } else {
            0
        }
    };

    // Attached (BPF verification takes a while on a loaded machine): every thread holds
    // exactly the kept capabilities, in no inheritable or ambient set either.
    let deadline = Instant::now() + Duration::from_secs(120);
    let threads = loop {
        let t = thread_caps(pid);
        if t.len() >= 2 && t.iter().all(|(_, c)| c[2] == kept()) {
            break t;
        }
        assert!(
            agent.0.try_wait().unwrap().is_none(),
            "agent exited during start-up"
        );
        assert!(
            Instant::now() < deadline,
            "capabilities never dropped: {t:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let kept = kept();
    for (name, [inh, prm, eff, bnd, amb]) in &threads {
        assert_eq!(
            (*inh, *prm, *eff, *bnd, *amb),
            (0, kept, kept, kept, 0),
            "{name}"
        );
    }
    // And as nobody (the default run-as user), real, effective, saved and file-system ids
    // alike, with no supplementary group left from root.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |f: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(f))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    assert_eq!(field("Uid:"), ["65534"; 4], "{status}");
    assert_eq!(field("Gid:"), ["65534"; 4], "{status}");
    assert!(field("Groups:").is_empty(), "{status}");
    // Under its seccomp filter (mode 2), in kill mode by default: a system call outside its
    // list would have ended it, and this test with it.
    assert_eq!(field("Seccomp:"), ["2"], "{status}");
    assert_eq!(field("NoNewPrivs:"), ["1"], "{status}");

    // A process started after the drop is still found, sampled and unwound from DWARF.
    let mut load = workload_of("cpu631-nofp", &dir, "nofp-wl", 30);
    let q = enc("{node=\"from-toml\",comm=\"nofp-wl\"}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let folded = loop {
        // 404 until the first batch is stored.
        let f = http_get(
            collector.addr,
            &format!("/api/v1/profile?format=folded&query={q}"),
        )
        .filter(|(code, _)| *code == 200)
        .map(|(_, body)| body)
        .unwrap_or_default();
        let leaf_samples: i64 = f
            .lines()
            .filter(|l| l.contains("leaf_"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
            .sum();
        if leaf_samples >= 200 {
            break f;
        }
        assert!(Instant::now() < deadline, "too few samples pushed: {f}");
        std::thread::sleep(Duration::from_millis(500));
    };
    let _ = load.kill();
    let _ = load.wait();
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    assert!(agent.0.wait().unwrap().success());

    let (mut leaf, mut complete) = (0i64, 0i64);
    for line in folded.lines().filter(|l| l.contains("leaf_")) {
        let (stack, n) = line.rsplit_once(' ').unwrap();
        let n: i64 = n.parse().unwrap();
        leaf += n;
        if stack.contains(";main;") && stack.contains(";work;") {
            complete += n;
        }
    }
    // Without frame pointers (-O2 -fomit-frame-pointer) only the DWARF walk gets past the leaf.
    assert!(
        complete as f64 >= 0.95 * leaf as f64,
        "{complete} of {leaf} leaf samples reach main:\n{folded}"
    );
    // Kernel symbols were loaded while the agent could still read their addresses.
    assert!(
        !folded.contains(";0xffffffff"),
        "kernel frames left as addresses:\n{folded}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(s["node"], "from-toml", "{s}");
    // `dwarf-mb = 64`: the DWARF of the C library's debug file (libc6-dbg, on this machine
    // kind) fits, so no binary is named from its symbol table only; by default (0) it is.
    assert_eq!(
        s["symbolized_without_dwarf"].as_u64(),
        Some(0),
        "a binary read without its DWARF: {s}"
    );
}

#[test]
fn config_file_errors_name_the_file_and_key() {
    let dir = scratch("agent-config-errors");
    let config = dir.join("bad.toml");
    std::fs::write(
        &config,
        "collector = \"http://127.0.0.1:1\"\npush-intervall = \"1s\"\n",
    )
    .unwrap();
    let out = pyrometer(&["agent", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("bad.toml") && err.contains("push-intervall"),
        "{err}"
    );
    let out = pyrometer(&[
        "agent",
        "--config",
        dir.join("absent.toml").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
    std::fs::write(
        &config,
        "collector = \"http://127.0.0.1:1\"\nunwind = \"lbr\"\n",
    )
    .unwrap();
    let out = pyrometer(&["agent", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("unwind must be dwarf or fp"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn off_cpu_across_pushes_is_counted_once() {
    if !privileged() {
        return;
    }
    let dir = scratch("agent-offcpu");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    // The workload is held until the agent is attached, so that its waiter thread blocks
    // while targeted.
    let exe = dir.join("ocpu-wl");
    pyrometer_e2e::copy_executable(&pyrometer_e2e::fixture("offcpu"), &exe);
    let load = Held::start(&dir, &[], &[exe.to_str().unwrap(), "4"]);
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (pid, listen) = (load.pid().to_string(), metrics.to_string());
    let args = ["--off-cpu", "--pid", &pid, "--metrics-listen", &listen];
    let mut agent = Agent::start(&dir, "offcpu-node", &collector.url(), &args);
    agent.wait_for_metrics(metrics);
    let out = load.release();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let waited: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("waited "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("fixture printed no wait time: {stdout}"));
    // Its last interval goes with the push the agent makes when it stops.
    let s = agent.stop();
    assert_eq!(s["spool_samples"], 0, "batches left unsent: {s}");

    let q = enc("{node=\"offcpu-node\"}");
    let folded = collector.get(&format!(
        "/api/v1/profile?format=folded&type=off_cpu&query={q}"
    ));
    let in_wait: f64 = folded
        .lines()
        .filter(|l| l.contains(";wait_pipe"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        / 1e9;
    // Blocked for ~4 s across four or more 1 s pushes: counted once, not once a push.
    assert!(
        (in_wait - waited).abs() <= 0.2 * waited,
        "wait_pipe blocked {in_wait:.3}s, the fixture waited {waited:.3}s:\n{folded}"
    );
    assert!(s["batches_pushed"].as_u64().unwrap() >= 4, "{s}");
}

/// `--alloc-comm`: the agent probes the allocator of a process chosen by name, and its pushes
/// carry the allocations (each function's estimate within ±20 % of what it allocated) and
/// what is in use at the push (the leaked blocks, not the freed ones).
#[test]
fn allocations_of_a_chosen_process_are_pushed() {
    alloc_comm_case("agent-alloc", false);
}

/// The same for a process started once the agent runs as nobody with its reduced capabilities
/// and its seccomp filter: its uprobes are opened after the drop (some kernels refuse a uprobe
/// without CAP_SYS_ADMIN, which the agent then keeps).
#[test]
fn allocations_of_a_process_started_after_the_drop_are_pushed() {
    alloc_comm_case("agent-alloc-late", true);
}

fn alloc_comm_case(name: &str, late: bool) {
    // Its own command name: the two cases may run at once, and each agent would sample the
    // other's workload too.
    let comm = if late { "alloc-late-wl" } else { "alloc-wl" };
    if !privileged() {
        return;
    }
    use std::io::{BufRead, Write};
    let dir = scratch(name);
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    // The fixture waits for a line before it allocates, so the probes are in first.
    let exe = dir.join(comm);
    pyrometer_e2e::copy_executable(&pyrometer_e2e::fixture("allocs"), &exe);
    let start_workload = || {
        Command::new(&exe)
            .args(["pause", "leak"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let early = (!late).then(start_workload);
    let mut agent = Killed(
        Command::new(pyrometer_bin())
            .args(["agent", "--node-name", "alloc-node", "--collector"])
            .arg(collector.url())
            .args(["--comm", comm, "--alloc-comm", comm])
            .args(["--push-interval", "1s", "--spool-dir"])
            .arg(dir.join("spool"))
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start pyrometer agent"),
    );
    // Its stderr is read to the end on a thread of its own: a closed pipe would end the agent.
    let err = agent.0.stderr.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let mut wait_for = |what: &str| {
        while !seen.last().is_some_and(|l: &String| l.contains(what)) {
            let line = lines
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("{e} waiting for {what:?}: {seen:?}"));
            assert!(
                !line.contains("cannot probe its allocator"),
                "{line}: {seen:?}"
            );
            seen.push(line);
        }
    };
    let mut workload = match early {
        Some(w) => w,
        None => {
            wait_for("seccomp filter installed");
            start_workload()
        }
    };
    wait_for(&format!(
        "sampling the allocations of pid {}",
        workload.id()
    ));
    workload.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let out = workload.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let allocated = |f: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{f} ")))
            .and_then(|rest| rest.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or_else(|| panic!("no {f} in {text}"))
    };
    // Its last interval goes with the push the agent makes when it stops.
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    assert!(agent.0.wait().unwrap().success());
    let q = enc(&format!("{{node=\"alloc-node\",comm=\"{comm}\"}}"));
    let folded = |ty: &str| {
        collector.get(&format!(
            "/api/v1/profile?format=folded&type={ty}&query={q}&from=now-10m"
        ))
    };
    let sum = |folded: &str, f: &str| -> f64 {
        folded
            .lines()
            .filter(|l| l.split(';').any(|frame| frame.split(' ').next() == Some(f)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let space = folded("alloc_space");
    for f in ["leak_1k", "tidy"] {
        let (got, want) = (sum(&space, f), allocated(f));
        assert!(
            (got - want).abs() <= 0.2 * want,
            "{f}: {got:.0} bytes pushed, {want:.0} allocated:\n{space}"
        );
    }
    // In use at each push: the leaked blocks; of tidy's at most one caught between its
    // allocation and its free when a push was taken.
    let inuse = folded("inuse_space");
    let (leaked, tidy) = (sum(&inuse, "leak_1k"), sum(&inuse, "tidy"));
    assert!(leaked > 0.0, "{inuse}");
    assert!(
        tidy <= 0.05 * leaked,
        "tidy {tidy}, leak_1k {leaked}:\n{inuse}"
    );
}

/// Python threads that live less than the agent's poll keep their `threading` names: the
/// kernel side wakes the agent at a new thread's first sample, and the agent reads the names
/// again every 20 ms until `threading` has registered it. Reading samples once a second, it
/// found most of fixtures/short_threads.py's 150 ms threads gone, their samples under the
/// command name "python".
#[test]
fn short_python_threads_keep_their_names() {
    if !privileged() {
        return;
    }
    let python = pyrometer_e2e::python::pyenv("3.12.1");
    if !python.exists() {
        pyrometer_e2e::skip("python:3.12", format!("{} is missing", python.display()));
        return;
    }
    let dir = scratch("agent-short-threads");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let script = pyrometer_e2e::python::source("short_threads.py");
    let load = Held::start(
        &dir,
        &[],
        &[
            python.to_str().unwrap(),
            script.to_str().unwrap(),
            "8",
            "150",
        ],
    );
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let pid = load.pid().to_string();
    let listen = metrics.to_string();
    let args = ["--pid", &pid, "-F", "199", "--metrics-listen", &listen];
    let mut agent = Agent::start(&dir, "short-node", &collector.url(), &args);
    agent.wait_for_metrics(metrics);
    let out = load.release();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let cpu: serde_json::Value = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("fixture printed no CPU times: {stdout}"));
    // Its last interval goes with the push the agent makes when it stops.
    let stats = agent.stop();
    assert_eq!(stats["spool_samples"], 0, "batches left unsent: {stats}");

    let burn = |selector: &str| -> u64 {
        let q = enc(&format!("{{node=\"short-node\", {selector}}}"));
        let folded = collector.get(&format!(
            "/api/v1/profile?format=folded&query={q}&from=now-10m"
        ));
        folded_counts(&folded, &["burn"])[0]
    };
    let all = burn("thread=~\".*\"");
    let named = burn("thread=~\"short-.*\"");
    assert!(
        all >= 80,
        "too few samples in burn(): {all}; agent stats {stats}"
    );
    // A thread's first sample can come before `threading` registers it (it then goes
    // under the command name); 20 ms re-reads leave a sample or so a thread.
    assert!(
        named as f64 >= 0.9 * all as f64,
        "{named} of {all} samples in burn() carry a short-* thread name; agent stats {stats}"
    );
    for k in 0..8 {
        let name = format!("short-{k}");
        assert!(cpu[&name].as_f64().is_some(), "{name} did not run: {cpu}");
        let n = burn(&format!("thread=\"{name}\""));
        assert!(
            n > 0,
            "no samples named {name}: {named} of {all} named; {stats}"
        );
    }
    println!("{named} of {all} samples in burn() carry their thread's name");
}

/// `agent --gc`: per process, a histogram of CPython's garbage-collection pauses on
/// `/metrics`, whose count and sum match what the process measured with `gc.callbacks`, and
/// the `gc` type pushed by the stack that set each collection off.
#[test]
fn gc_pauses_on_metrics_and_pushed() {
    if !privileged() {
        return;
    }
    let python = pyrometer_e2e::python::pyenv("3.11.7");
    if !python.exists() {
        pyrometer_e2e::skip("python:3.11", format!("{} is missing", python.display()));
        return;
    }
    let dir = scratch("agent-gc");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let script = pyrometer_e2e::python::source("gc_pauses.py");
    let signals = dir.join("signals");
    std::fs::create_dir_all(&signals).unwrap();
    // Running (its interpreter mapped) before the agent starts: the agent probes the
    // interpreters of the processes it targets at start, while it is still privileged.
    // A failed check lets the fixture go rather than wait for ever.
    struct Stop(std::path::PathBuf);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, "");
        }
    }
    let _stop = Stop(signals.join("stop"));
    let load = Command::new(&python)
        .arg(&script)
        .args(["100000", "5"])
        .arg(&signals)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    pyrometer_e2e::wait::wait_for(Duration::from_secs(60), "the fixture to run", || {
        if signals.join("ready").exists() {
            Ok(())
        } else {
            Err(())
        }
    });
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let pid = load.id().to_string();
    let listen = metrics.to_string();
    let args = ["--gc", "--pid", &pid, "--metrics-listen", &listen];
    let mut agent = Agent::start(&dir, "gc-node", &collector.url(), &args);
    agent.wait_for_metrics(metrics);
    agent.wait_for_metric(metrics, "pyrometer_agent_gc_probed_binaries", 1.0);
    std::fs::write(signals.join("start"), "").unwrap();
    // The fixture prints its measures, then waits for `stop` while the agent pushes them.
    let labels = format!("pid=\"{pid}\",comm=\"python3.11\"");
    let count = format!("pyrometer_agent_gc_pause_seconds_count{{{labels}}}");
    agent.wait_for_metric(metrics, &count, 5.0);
    std::fs::write(signals.join("stop"), "").unwrap();
    let out = load.wait_with_output().unwrap();
    assert!(out.status.success(), "the fixture failed: {}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let doc: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("fixture printed no pauses: {stdout}"));
    let pauses = doc["pauses"].as_array().unwrap();
    let measured_ns: u64 = pauses.iter().map(|p| p["ns"].as_u64().unwrap()).sum();
    // The metrics as they stand once the fixture's collections are all pushed: its pauses
    // and the few of its start-up (before its callback was installed).
    let page = agent.wait_for_metric(metrics, &count, pauses.len() as f64);
    pyrometer_e2e::cluster::promtool_check("agent /metrics", &page);
    // The Python tracker's own counters: the fixture registered, its code objects read.
    let tracker = |name: &str| {
        metric(&page, name).unwrap_or_else(|| panic!("no {name} on /metrics:\n{page}"))
    };
    assert!(
        tracker("pyrometer_agent_python_processes_total") >= 1.0,
        "{page}"
    );
    assert!(
        tracker("pyrometer_agent_python_code_reads_total") >= 1.0,
        "{page}"
    );
    tracker("pyrometer_agent_python_unreadable_frames_total");
    let n = metric(&page, &count).unwrap();
    let sum = metric(
        &page,
        &format!("pyrometer_agent_gc_pause_seconds_sum{{{labels}}}"),
    )
    .unwrap();
    let measured = measured_ns as f64 / 1e9;
    assert!(
        (sum - measured).abs() <= 0.1 * measured,
        "{n} pauses, {sum:.4}s on /metrics; gc.callbacks measured {} pauses, {measured:.4}s\n{page}",
        pauses.len()
    );
    let full = format!("pyrometer_agent_gc_pause_seconds_bucket{{{labels},le=\"+Inf\"}}");
    assert_eq!(metric(&page, &full), Some(n), "{page}");
    let stats = agent.stop();
    assert_eq!(stats["spool_samples"], 0, "batches left unsent: {stats}");
    let q = enc("{node=\"gc-node\"}");
    let folded = collector.get(&format!(
        "/api/v1/profile?format=folded&type=gc&query={q}&from=now-10m"
    ));
    let total: f64 = folded
        .lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let under: f64 = folded
        .lines()
        .filter(|l| l.contains("full_collections"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        total > 0.0 && under >= 0.9 * total,
        "{under} of {total} ns of gc under full_collections:\n{folded}"
    );
}

/// The agent under its seccomp filter, in kill mode, through what interrupts its system calls
/// on a real node: stops and continues (`kill -STOP`, a debugger, a cgroup freezer) landing on
/// threads asleep in futex, epoll, poll, nanosleep and reads, which the kernel resumes with
/// `restart_syscall` or the call again; a collector that goes away and comes back (refused
/// connections, spooling, resending); /metrics scrapes throughout. A call outside its list
/// would end it with SIGSYS; it must keep pushing and stop cleanly on SIGTERM.
#[test]
fn stops_and_a_collector_restart_under_the_seccomp_filter() {
    if !privileged() {
        return;
    }
    let dir = scratch("agent-stops");
    let mut collector = Collector::start(&dir.join("store"), free_port(), None);
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let listen = metrics.to_string();
    let args = [
        "--comm",
        "stops-wl",
        "--off-cpu",
        "--gc",
        "-F",
        "49",
        "--metrics-listen",
        &listen,
    ];
    let mut agent = Agent::start(&dir, "stops-node", &collector.url(), &args);
    agent.wait_for_metrics(metrics);
    let mut load = workload_of("cpu631", &dir, "stops-wl", 120);
    let samples = |c: &Collector| samples_of(c, "stops-node", load.id());
    wait_for(
        Duration::from_secs(60),
        "the first push",
        || match samples(&collector) {
            0 => Err(0),
            n => Ok(n),
        },
    );
    let pid = agent.child.id() as i32;
    let mut exited = None;
    for i in 0u64..120 {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(1 + (i * 7) % 40));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(5 + (i * 13) % 60));
        if i % 10 == 0 {
            let _ = http_get(metrics, "/metrics");
        }
        match i {
            40 => collector.kill9(),
            80 => collector.restart(),
            _ => {}
        }
        exited = agent.child.try_wait().unwrap();
        if exited.is_some() {
            break;
        }
    }
    assert!(
        exited.is_none(),
        "the agent ended during the stops: {exited:?} (signal 31 is SIGSYS: a system call \
         outside its seccomp list; the kernel logs which as type=1326)"
    );
    // Still pushing after all of it, the batches spooled while the collector was down
    // included.
    let before = samples(&collector);
    wait_for(
        Duration::from_secs(60),
        "a push after the stops",
        || match samples(&collector) {
            n if n > before => Ok(n),
            n => Err(n),
        },
    );
    let _ = load.kill();
    let _ = load.wait();
    let s = agent.stop();
    assert_eq!(s["spool_samples"], 0, "batches left unsent: {s}");
}
