//! Names for stripped binaries through debuginfod: elfutils' own `debuginfod` server (Debian
//! package `debuginfod`) runs on loopback over a folder holding the debug file of
//! fixtures/stripped73.c, whose binary is stripped (`strip --strip-all`), so its two static
//! functions (7:3 of the work) have no name anywhere without it. `record` and the agent
//! (pushing to a real collector) name them from the file fetched, with the right split; the
//! cache answers a second recording without the server; a 404 is asked once; the agent
//! ignores DEBUGINFOD_URLS; and a server that accepts and never answers changes neither
//! record's sample rate nor the agent's pushes and sample rate. Needs root (BPF).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pyrometer_e2e::cluster::{
    Agent, Collector, Held, enc, free_port, http_get, metric, promtool_check,
};
use pyrometer_e2e::wait::wait_for;
use pyrometer_e2e::*;
use serde_json::Value;

const HEAVY: &str = "heavy_static";
const LIGHT: &str = "light_static";

/// elfutils' debuginfod serving `folder`, its database and log under `dir`.
struct Server {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Server {
    fn start(dir: &Path, folder: &Path) -> Server {
        let bin = Path::new("/usr/bin/debuginfod");
        assert!(
            bin.exists(),
            "{} is missing: run `cargo xtask setup` (it installs Debian's debuginfod package)",
            bin.display()
        );
        let port = free_port();
        let log = dir.join("debuginfod.log");
        let child = Command::new(bin)
            .arg("-d")
            .arg(dir.join("debuginfod.sqlite"))
            .args(["-p", &port.to_string(), "-vvv", "-F"])
            .arg(folder)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // It logs each request, with its status, on stderr.
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start debuginfod");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        // Serving once its first scan has indexed the folder's debug file.
        wait_for(
            Duration::from_secs(60),
            "debuginfod to index its folder",
            || match http_get(addr, "/metrics") {
                Some((200, text)) => match metric(&text, "found_debuginfo_total{source=\"files\"}")
                {
                    Some(n) if n >= 1.0 => Ok(()),
                    other => Err(format!("{other:?}")),
                },
                other => Err(format!("{other:?}")),
            },
        );
        Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    /// Requests the server logged for `build_id`'s debug file, with their status.
    fn requests(&self, build_id: &str) -> Vec<u16> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let needle = format!("GET /buildid/{build_id}/debuginfo ");
        text.lines()
            .filter_map(|l| l.split_once(&needle))
            .filter_map(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server that accepts connections and never answers, holding them open; the count of
/// connections it accepted.
fn black_hole() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut conns = Vec::new();
        listener.set_nonblocking(true).unwrap();
        let end = Instant::now() + Duration::from_secs(120);
        while Instant::now() < end {
            match listener.accept() {
                Ok((c, _)) => {
                    count.fetch_add(1, Ordering::SeqCst);
                    conns.push(c);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    });
    (url, accepted)
}

fn build_id(path: &Path) -> String {
    let out = Command::new("readelf")
        .arg("-n")
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .expect("the fixture has a build id")
        .to_string()
}

/// `record` of `exe SECONDS` with `args`; its folded output and --stats (with the command's
/// stdout, which is stripped73's CPU time, as `workload_stdout`).
fn record(dir: &Path, name: &str, exe: &Path, seconds: &str, args: &[&str]) -> (String, Value) {
    let out = dir.join(format!("{name}.folded"));
    let stats = dir.join(format!("{name}.json"));
    let mut argv = vec![
        "record",
        "-o",
        out.to_str().unwrap(),
        "--stats",
        stats.to_str().unwrap(),
    ];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--", exe.to_str().unwrap(), seconds]);
    let run = Command::new(pyrometer_bin())
        .args(&argv)
        .env_remove("DEBUGINFOD_URLS")
        .output()
        .expect("run pyrometer");
    assert_ok(&run);
    let mut stats: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    stats["workload_stdout"] = String::from_utf8_lossy(&run.stdout).into_owned().into();
    (std::fs::read_to_string(&out).unwrap(), stats)
}

/// Samples of stacks with a frame named `function`.
fn samples_in(folded: &str, function: &str) -> u64 {
    folded
        .lines()
        .filter_map(|l| {
            let (stack, n) = l.rsplit_once(' ')?;
            stack
                .split(';')
                .any(|f| f == function)
                .then(|| n.parse::<u64>().ok())?
        })
        .sum()
}

/// heavy_static's share of the two static functions' samples.
fn heavy_share(folded: &str) -> f64 {
    let (h, l) = (samples_in(folded, HEAVY), samples_in(folded, LIGHT));
    assert!(h + l >= 500, "too few named samples ({h} + {l}):\n{folded}");
    let share = h as f64 / (h + l) as f64;
    eprintln!(
        "heavy_static: {h} samples, light_static: {l} ({:.1} %)",
        share * 100.0
    );
    share
}

fn total_samples(folded: &str) -> u64 {
    folded
        .lines()
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
        .sum()
}

#[test]
fn record_names_static_functions_from_a_loopback_debuginfod() {
    if !privileged() {
        return;
    }
    let dir = scratch("debuginfod-record");
    let server = Server::start(&dir, &fixture("debuginfod"));
    let exe = fixture("stripped73");
    let id = build_id(&exe);
    let cache = dir.join("cache");
    let cache_arg = cache.to_str().unwrap();
    let with = ["--debuginfod", &server.url, "--debuginfod-cache", cache_arg];

    // Without a server the static functions are addresses.
    let (plain, _) = record(&dir, "plain", &exe, "1", &["--no-debuginfod"]);
    assert!(
        !plain.contains(HEAVY) && plain.contains("stripped73+0x"),
        "named without its debug file:\n{plain}"
    );

    // 499 Hz: ~1500 samples in 3 s of CPU, the split's standard error 1.2 points.
    let named_args = [&with[..], &["-F", "499"]].concat();
    let (named, stats) = record(&dir, "named", &exe, "3", &named_args);
    let share = heavy_share(&named);
    assert!(
        (share - 0.7).abs() <= 0.05,
        "heavy_static {:.1} % of the two, 70 % expected:\n{named}",
        share * 100.0
    );
    assert!(named.contains(";main;run;"), "{named}");
    assert_eq!(stats["debuginfod"]["stored"], 1, "{stats}");
    let cached = cache.join(format!("{id}.debug"));
    assert!(cached.is_file(), "{} is not in the cache", cached.display());
    assert_eq!(server.requests(&id), [200]);

    // A second recording takes it from the cache: the server is not asked again.
    let (again, stats) = record(&dir, "again", &exe, "1", &with);
    assert!(again.contains(HEAVY) && again.contains(LIGHT), "{again}");
    assert_eq!(stats["debuginfod"]["hits"], 1, "{stats}");
    assert_eq!(stats["debuginfod"]["fetches"], 0, "{stats}");
    assert_eq!(server.requests(&id), [200], "the server was asked again");

    // DEBUGINFOD_URLS is honoured, as by perf and gdb; --no-debuginfod turns it off.
    let env_cache = dir.join("env-cache");
    let out = dir.join("env.folded");
    let run = Command::new(pyrometer_bin())
        .args(["record", "-o", out.to_str().unwrap(), "--debuginfod-cache"])
        .arg(&env_cache)
        .args(["--", exe.to_str().unwrap(), "0.5"])
        .env("DEBUGINFOD_URLS", &server.url)
        .output()
        .unwrap();
    assert_ok(&run);
    assert!(std::fs::read_to_string(&out).unwrap().contains(HEAVY));
    assert!(env_cache.join(format!("{id}.debug")).is_file());
}

/// A process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Over https the server's certificate is checked against the system's roots (here a test CA
/// named by SSL_CERT_FILE): trusted, the file is fetched; not trusted, it is a failure. The
/// server is openssl's own (`s_server -WWW`, serving files below its directory), as
/// elfutils' debuginfod serves plain HTTP only.
#[test]
fn record_fetches_over_https_checking_the_certificate() {
    if !privileged() {
        return;
    }
    let dir = scratch("debuginfod-https");
    pyrometer_e2e::certs::ca(&dir, "ca");
    pyrometer_e2e::certs::sign(&dir, "srv", "localhost", "ca", pyrometer_e2e::certs::SERVER);
    let exe = fixture("stripped73");
    let id = build_id(&exe);
    let www = dir.join("www");
    let at = www.join("buildid").join(&id);
    std::fs::create_dir_all(&at).unwrap();
    std::fs::copy(fixture("debuginfod/stripped73.debug"), at.join("debuginfo")).unwrap();
    let port = free_port();
    let server = Command::new("openssl")
        .args(["s_server", "-WWW", "-quiet", "-accept"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("-cert")
        .arg(dir.join("srv.pem"))
        .arg("-key")
        .arg(dir.join("srv.key"))
        .current_dir(&www)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start openssl s_server");
    let _server = Killed(server);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_for(
        Duration::from_secs(30),
        "openssl s_server to listen",
        || std::net::TcpStream::connect(addr).map(|_| ()),
    );
    let url = format!("https://localhost:{port}");
    let run = |name: &str, ca: Option<&Path>| {
        let out = dir.join(format!("{name}.folded"));
        let stats = dir.join(format!("{name}.json"));
        let mut cmd = Command::new(pyrometer_bin());
        cmd.args(["record", "-o", out.to_str().unwrap(), "--stats"])
            .arg(&stats)
            .args(["--debuginfod", &url, "--debuginfod-cache"])
            .arg(dir.join(format!("cache-{name}")))
            .args(["--", exe.to_str().unwrap(), "0.5"]);
        if let Some(ca) = ca {
            cmd.env("SSL_CERT_FILE", ca);
        }
        assert_ok(&cmd.output().unwrap());
        let stats: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
        (std::fs::read_to_string(&out).unwrap(), stats)
    };
    let (trusted, stats) = run("trusted", Some(&dir.join("ca.pem")));
    assert!(trusted.contains(HEAVY), "{trusted}");
    assert_eq!(stats["debuginfod"]["stored"], 1, "{stats}");
    // The machine's roots do not include the test CA: refused, nothing named.
    let (untrusted, stats) = run("untrusted", None);
    assert!(!untrusted.contains(HEAVY), "{untrusted}");
    assert_eq!(stats["debuginfod"]["failures"], 1, "{stats}");
    assert_eq!(stats["debuginfod"]["stored"], 0, "{stats}");
}

#[test]
fn a_build_id_the_server_lacks_is_asked_for_once() {
    if !privileged() {
        return;
    }
    let dir = scratch("debuginfod-404");
    let server = Server::start(&dir, &fixture("debuginfod"));
    // Stripped too, its debug file in a directory record is not told of: the server has none.
    let exe = fixture("cpu631-stripped");
    let id = build_id(&exe);
    let cache = dir.join("cache");
    let with = [
        "--debuginfod",
        &server.url,
        "--debuginfod-cache",
        cache.to_str().unwrap(),
    ];
    // 999 Hz: many samples of its binary even on a busy machine (its 2 s are wall time).
    let first = [&with[..], &["-F", "999"]].concat();
    let (folded, stats) = record(&dir, "first", &exe, "2", &first);
    assert!(total_samples(&folded) >= 50, "{folded}");
    assert!(!folded.contains("leaf_a"), "{folded}");
    assert_eq!(server.requests(&id), [404], "one request for every sample");
    assert!(
        stats["debuginfod"]["not_found"].as_u64().unwrap() >= 1,
        "{stats}"
    );
    assert!(cache.join(format!("{id}.missing")).is_file());
    // Remembered on disk: the next recording does not ask.
    record(&dir, "second", &exe, "1", &with);
    assert_eq!(server.requests(&id), [404], "the 404 was not remembered");
}

#[test]
fn a_server_that_never_answers_leaves_record_sampling_as_without_it() {
    if !privileged() {
        return;
    }
    let dir = scratch("debuginfod-silent-record");
    let (url, accepted) = black_hole();
    let exe = fixture("stripped73");
    // 999 Hz over 2 s of the workload's CPU: ~2000 samples a run, each count's standard
    // error ~2 %.
    let without_args = ["--no-debuginfod", "-F", "999"];
    let started = Instant::now();
    let (without, stats_without) = record(&dir, "without", &exe, "2", &without_args);
    let took_without = started.elapsed();
    let started = Instant::now();
    let cache = dir.join("cache");
    let args = [
        "--debuginfod",
        &url,
        "--debuginfod-cache",
        cache.to_str().unwrap(),
        "--debuginfod-wait",
        "2s",
        "-F",
        "999",
    ];
    let (with, stats) = record(&dir, "with", &exe, "2", &args);
    let took = started.elapsed();
    // Samples per second of the workload's CPU time: the machine's other load changes how
    // much CPU a 3 s run gets, not how densely it is sampled.
    let rate = |folded: &str, stats: &Value| {
        let text = stats["workload_stdout"].as_str().unwrap_or_default();
        let cpu = text
            .lines()
            .find_map(|l| l.strip_prefix("cpu_ns "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no cpu_ns: {text}"))
            / 1e9;
        total_samples(folded) as f64 / cpu
    };
    let (a, b) = (rate(&without, &stats_without), rate(&with, &stats));
    eprintln!("samples per CPU second: {b:.1} with a silent server, {a:.1} without");
    assert!(
        (b - a).abs() <= 0.1 * a,
        "{b:.1} samples per CPU second with a silent server, {a:.1} without"
    );
    // The end waits for the download no longer than it was told (2 s): what the run took
    // besides recording, against the same without a server.
    let besides = |took: Duration, stats: &Value| {
        took.as_secs_f64() - stats["elapsed_ns"].as_f64().unwrap() / 1e9
    };
    let (extra_with, extra_without) =
        (besides(took, &stats), besides(took_without, &stats_without));
    assert!(
        extra_with - extra_without < 2.0 + 3.0,
        "{extra_with:.1} s besides recording with a silent server, {extra_without:.1} s without"
    );
    assert_eq!(stats["debuginfod"]["stored"], 0, "{stats}");
    assert!(accepted.load(Ordering::SeqCst) >= 1, "record never asked");
    // Still waiting for its answer when record stopped waiting.
    assert_eq!(stats["debuginfod"]["pending"], 1, "{stats}");
}

/// The workload under its own name, running for `seconds`.
/// A failed assertion leaves nothing running: it is killed when dropped.
fn workload(dir: &Path, name: &str, seconds: &str) -> Killed {
    let exe = dir.join(name);
    copy_executable(&fixture("stripped73"), &exe);
    let child = Command::new(&exe)
        .arg(seconds)
        .stdout(Stdio::null())
        .spawn()
        .expect("start the workload");
    Killed(child)
}

/// The CPU time the workload printed at its end.
fn cpu_seconds(out: &std::process::Output) -> f64 {
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("cpu_ns "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no cpu_ns: {text}"))
        / 1e9
}

/// Folded stacks of node `node` in the collector.
fn folded_of(collector: &Collector, node: &str) -> String {
    let q = enc(&format!("{{node=\"{node}\"}}"));
    match collector.http_get(&format!(
        "/api/v1/profile?format=folded&query={q}&from=now-1h"
    )) {
        Some((200, body)) => body,
        _ => String::new(),
    }
}

#[test]
fn the_agent_names_static_functions_from_a_loopback_debuginfod() {
    if !privileged() {
        return;
    }
    let dir = scratch("debuginfod-agent");
    let server = Server::start(&dir, &fixture("debuginfod"));
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let load = workload(&dir, "dbgi-agent", "60");
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let cache = dir.join("cache");
    let (pid, listen) = (load.0.id().to_string(), metrics.to_string());
    let args = [
        "--pid",
        &pid,
        "-F",
        "199",
        "--metrics-listen",
        &listen,
        "--debuginfod",
        &server.url,
        "--debuginfod-cache",
        cache.to_str().unwrap(),
    ];
    // A server in the agent's environment is never used: only those it was given.
    let (env_url, env_asked) = black_hole();
    let env = [("DEBUGINFOD_URLS", env_url.as_str())];
    let mut agent = Agent::start_env(&dir, "dbgi-node", &collector.url(), &args, &env);
    agent.wait_for_metrics(metrics);
    let page = agent.wait_for_metric(
        metrics,
        "pyrometer_agent_debuginfod_total{event=\"stored\"}",
        1.0,
    );
    promtool_check("the agent's /metrics", &page);
    // Pushes after the file arrived name the static functions, 7:3 (~1500 samples: the
    // split's standard error 1.2 points).
    let folded = wait_for(
        Duration::from_secs(90),
        "named samples in the collector",
        || {
            let f = folded_of(&collector, "dbgi-node");
            if samples_in(&f, HEAVY) + samples_in(&f, LIGHT) >= 1500 {
                Ok(f)
            } else {
                Err(f)
            }
        },
    );
    let share = heavy_share(&folded);
    assert!(
        (share - 0.7).abs() <= 0.05,
        "heavy_static {:.1} % of the two in the collector, 70 % expected:\n{folded}",
        share * 100.0
    );
    drop(load);
    agent.stop();
    let id = build_id(&fixture("stripped73"));
    assert!(cache.join(format!("{id}.debug")).is_file());
    assert_eq!(server.requests(&id), [200]);
    assert_eq!(
        env_asked.load(Ordering::SeqCst),
        0,
        "DEBUGINFOD_URLS was used"
    );
}

#[test]
fn a_server_that_never_answers_leaves_the_agents_pushes_and_rate_alone() {
    if !privileged() {
        return;
    }
    let dir = scratch("debuginfod-silent-agent");
    let (url, accepted) = black_hole();
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    // Two agents side by side, each on its own workload held until the agent is attached:
    // one without a server, one with the silent one.
    let cache = dir.join("cache");
    let silent = [
        "--debuginfod",
        &url,
        "--debuginfod-cache",
        cache.to_str().unwrap(),
    ];
    let start = |node: &str, extra: &[&str]| {
        let exe = dir.join(format!("{node}-wl"));
        copy_executable(&fixture("stripped73"), &exe);
        // 2 s of CPU at 999 Hz: ~2000 samples, each count's standard error ~2 %.
        let held = Held::start(&dir, &[], &[exe.to_str().unwrap(), "2"]);
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let (pid, listen) = (held.pid().to_string(), metrics.to_string());
        let mut args = vec!["--pid", &pid, "-F", "999", "--metrics-listen", &listen];
        args.extend_from_slice(extra);
        let mut agent = Agent::start(&dir, node, &collector.url(), &args);
        agent.wait_for_metrics(metrics);
        (held, agent)
    };
    let (held_a, mut agent_a) = start("plain-node", &[]);
    let (held_b, mut agent_b) = start("silent-node", &silent);
    let timed = |held: Held| {
        std::thread::spawn(move || {
            let started = Instant::now();
            let out = held.release();
            (cpu_seconds(&out), started.elapsed().as_secs_f64())
        })
    };
    let (a, b) = (timed(held_a), timed(held_b));
    let ((cpu_a, wall_a), (cpu_b, wall_b)) = (a.join().unwrap(), b.join().unwrap());
    let (sa, sb) = (agent_a.stop(), agent_b.stop());
    let rate = |s: &Value, cpu: f64| s["samples_pushed"].as_f64().unwrap() / cpu;
    let (ra, rb) = (rate(&sa, cpu_a), rate(&sb, cpu_b));
    eprintln!("samples per CPU second: {rb:.1} with a silent server, {ra:.1} without");
    assert!(
        (rb - ra).abs() <= 0.1 * ra,
        "{rb:.1} samples per CPU second with a silent server, {ra:.1} without:\n{sa}\n{sb}"
    );
    assert!(
        accepted.load(Ordering::SeqCst) >= 1,
        "the agent never asked"
    );
    // Pushes of each workload's run, against the 1 s push interval: at least one per whole
    // second the run lasted (an interval stretched by a wait on the server would lose one;
    // the push at the agent's stop makes up for the first interval's phase), at most two
    // more (that phase, the push at the stop, and the start-up's samples before the release).
    // Counted per run rather than compared between the two: their phases differ, so two
    // runs of the same length can differ by two pushes with nothing wrong.
    for (agent, s, wall) in [
        ("without a server", &sa, wall_a),
        ("with a silent server", &sb, wall_b),
    ] {
        let pushes = s["batches_pushed"].as_f64().unwrap();
        eprintln!("{agent}: {pushes} pushes over a {wall:.1} s run");
        assert!(
            pushes >= wall.floor() && pushes <= wall.ceil() + 2.0,
            "{agent}: {pushes} pushes over a {wall:.1} s run, at a 1 s interval"
        );
    }
}
