//! Helpers for agent + collector tests: start the collector binary, agents, workloads with
//! distinct process names, and talk plain HTTP/1.1 to the collector.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::wait::{wait_for, wait_until};

/// The `pyrometer-collector` binary of this workspace (`cargo xtask test` builds it; set
/// PYROMETER_COLLECTOR_BIN to test another build).
pub fn collector_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PYROMETER_COLLECTOR_BIN") {
        return PathBuf::from(p);
    }
    let bin = crate::pyrometer_bin()
        .parent()
        .expect("binary has a directory")
        .join("pyrometer-collector");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p pyrometer-collector` first (cargo xtask test does)",
        bin.display()
    );
    bin
}

/// A port that was free a moment ago (fixed, so a restarted collector gets the same one).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

pub struct Collector {
    pub child: Child,
    pub addr: SocketAddr,
    /// The store arguments (`--data-dir DIR`, or `--store URL --store-credentials FILE`).
    pub store_args: Vec<String>,
    pub token_file: Option<PathBuf>,
}

impl Collector {
    pub fn start(data_dir: &Path, port: u16, token_file: Option<&Path>) -> Collector {
        let store = vec!["--data-dir".into(), data_dir.display().to_string()];
        Collector::start_with(&store, port, token_file)
    }

    /// A collector with the store `store_args` name.
    pub fn start_with(store_args: &[String], port: u16, token_file: Option<&Path>) -> Collector {
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut cmd = Command::new(collector_bin());
        cmd.arg("--listen")
            .arg(addr.to_string())
            .args(store_args)
            .stdin(Stdio::null());
        if let Some(t) = token_file {
            cmd.arg("--token-file").arg(t);
        }
        let child = cmd.spawn().expect("start pyrometer-collector");
        let c = Collector {
            child,
            addr,
            store_args: store_args.to_vec(),
            token_file: token_file.map(Path::to_path_buf),
        };
        wait_until(
            Duration::from_secs(20),
            &format!("the collector to answer on {addr}"),
            || http_get(addr, "/metrics").is_some(),
        );
        c
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn restart(&mut self) {
        self.kill9();
        let port = self.addr.port();
        *self = Collector::start_with(
            &self.store_args.clone(),
            port,
            self.token_file.clone().as_deref(),
        );
    }

    /// The read token of the collector's token file (its first token), if it has one.
    pub fn token(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.token_file.as_ref()?).ok()?;
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))?;
        line.split_whitespace().next().map(String::from)
    }

    /// GET (with the collector's token, when it has a token file).
    pub fn http_get(&self, path: &str) -> Option<(u16, String)> {
        http_get_with(self.addr, path, self.token().as_deref())
    }

    /// GET that must succeed with 200.
    pub fn get(&self, path: &str) -> String {
        match self.http_get(path) {
            Some((200, body)) => body,
            other => panic!("GET {path}: {other:?}"),
        }
    }

    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let body = self.get(path);
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// A counter or gauge of the collector's `/metrics` (0 when it is not there).
    pub fn metric(&self, name: &str) -> f64 {
        http_get(self.addr, "/metrics")
            .and_then(|(_, text)| metric(&text, name))
            .unwrap_or(0.0)
    }

    /// Waits until the store holds at least `at_least` samples of each node of `nodes`
    /// (their agents have started and pushed); returns the totals by node.
    pub fn wait_for_nodes(
        &self,
        nodes: &[&str],
        at_least: i64,
    ) -> std::collections::BTreeMap<String, i64> {
        wait_for(
            Duration::from_secs(120),
            &format!("{at_least} samples of each of {nodes:?} in the collector"),
            || {
                let totals = self.totals_by("node");
                if nodes
                    .iter()
                    .all(|n| totals.get(*n).is_some_and(|&t| t >= at_least))
                {
                    Ok(totals)
                } else {
                    Err(totals)
                }
            },
        )
    }

    /// Samples of the last hour by the values of `label` (`/api/v1/profile?by=LABEL`); empty
    /// while the store has none (404).
    pub fn totals_by(&self, label: &str) -> std::collections::BTreeMap<String, i64> {
        let path = format!("/api/v1/profile?by={label}&from=now-1h&type=samples");
        match self.http_get(&path) {
            Some((404, _)) => return Default::default(),
            Some((200, _)) => {}
            other => panic!("GET {path}: {other:?}"),
        }
        let v = self.get_json(&path);
        v["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .map(|g| {
                (
                    g["labels"][label].as_str().unwrap().to_string(),
                    g["total"].as_i64().unwrap(),
                )
            })
            .collect()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Plain HTTP/1.1 GET: `(status, body)`, or None when nothing answers.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http_get_with(addr, path, None)
}

/// [`http_get`] with a bearer token.
pub fn http_get_with(addr: SocketAddr, path: &str, token: Option<&str>) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\n{auth}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.get(9..12)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            if n == 0 {
                break;
            }
            out.push_str(tail.get(..n)?);
            rest = tail.get(n + 2..)?;
        }
        return Some((status, out));
    }
    Some((status, body.to_string()))
}

/// Percent-encodes a query parameter value.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The folded profile the collector holds from node `node` for the last ten minutes, its
/// selector narrowed by `query` (`,pid="7"`; empty while the store holds none: a 404).
pub fn collected(collector: &Collector, node: &str, query: &str) -> String {
    let q = enc(&format!("{{node=\"{node}\"{query}}}"));
    let path = format!("/api/v1/profile?format=folded&query={q}&from=now-10m");
    match http_get(collector.addr, &path) {
        Some((200, body)) => body,
        Some((404, _)) => String::new(),
        other => panic!("GET {path}: {other:?}"),
    }
}

/// Samples the collector holds for `pid` of node `node` in the last ten minutes (none while
/// its store is empty: a 404).
pub fn samples_of(collector: &Collector, node: &str, pid: u32) -> u64 {
    collected(collector, node, &format!(",pid=\"{pid}\""))
        .lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Waits for `count` (what the collector holds of process `pid` from a node) to change — a
/// push has reached the collector — and reads the process's CPU time at once: (the new
/// count, that CPU time). A window between two such reads counts the samples and the CPU time
/// of the same span, up to the push's delay, which is alike at both ends. Polled every 20 ms
/// rather than at `wait_for`'s pace: the lag of the CPU read is the window's error.
pub fn at_next_push(what: &str, pid: u32, mut count: impl FnMut() -> u64) -> (u64, Duration) {
    let last = count();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n = count();
        if n != last {
            let cpu = crate::wait::cpu_time(pid).unwrap_or_else(|| panic!("process {pid} is gone"));
            return (n, cpu);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no push of {what} in 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the cpu631 fixture under another name (its comm), running for `seconds`.
pub fn workload(dir: &Path, name: &str, seconds: u32) -> Child {
    workload_of("cpu631", dir, name, seconds)
}

/// Starts a 6:3:1 fixture (`cpu631`, `cpu631-nofp`) under another name, for `seconds`.
pub fn workload_of(fixture: &str, dir: &Path, name: &str, seconds: u32) -> Child {
    let exe = dir.join(name);
    if !exe.exists() {
        crate::copy_executable(&crate::fixture(fixture), &exe);
    }
    Command::new(&exe)
        .arg(seconds.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("start workload")
}

pub struct Agent {
    pub child: Child,
    pub stats: PathBuf,
}

impl Agent {
    /// `pyrometer agent` at a 1 s push interval (unless `extra` sets one) with its spool and stats under `dir`.
    pub fn start(dir: &Path, node: &str, collector: &str, extra: &[&str]) -> Agent {
        Agent::start_env(dir, node, collector, extra, &[])
    }

    /// [`Agent::start`] with extra environment variables (e.g. the NVML test double's script).
    pub fn start_env(
        dir: &Path,
        node: &str,
        collector: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let spool = dir.join(format!("spool-{node}"));
        let stats = dir.join(format!("stats-{node}.json"));
        let mut cmd = Command::new(crate::pyrometer_bin());
        cmd.args(["agent", "--node-name", node, "--collector", collector]);
        if !extra.contains(&"--push-interval") {
            cmd.args(["--push-interval", "1s"]);
        }
        let child = cmd
            .arg("--spool-dir")
            .arg(&spool)
            .arg("--stats")
            .arg(&stats)
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .expect("start pyrometer agent");
        Agent { child, stats }
    }

    /// Waits until the agent serves `/metrics` on `addr` (started with `--metrics-listen`):
    /// it has loaded its programs, targeted the processes it was told to, and dropped its
    /// capabilities. Returns the first page.
    pub fn wait_for_metrics(&mut self, addr: SocketAddr) -> String {
        wait_for(
            Duration::from_secs(120),
            "the agent to serve /metrics",
            || {
                assert!(
                    self.child.try_wait().unwrap().is_none(),
                    "the agent exited during start-up"
                );
                match http_get(addr, "/metrics") {
                    Some((200, text)) => Ok(text),
                    other => Err(other),
                }
            },
        )
    }

    /// Waits until a counter of the agent's `/metrics` on `addr` reaches `at_least`; returns
    /// the page that showed it.
    pub fn wait_for_metric(&mut self, addr: SocketAddr, name: &str, at_least: f64) -> String {
        wait_for(
            Duration::from_secs(120),
            &format!("the agent's {name} to reach {at_least}"),
            || {
                assert!(self.child.try_wait().unwrap().is_none(), "the agent exited");
                let text = http_get(addr, "/metrics")
                    .map(|(_, t)| t)
                    .unwrap_or_default();
                match metric(&text, name) {
                    Some(v) if v >= at_least => Ok(text),
                    other => Err(other),
                }
            },
        )
    }

    /// SIGTERM, wait, and return the stats it wrote.
    pub fn stop(&mut self) -> serde_json::Value {
        // SAFETY: kill(2) of our own child.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let status = self.child.wait().expect("wait for the agent");
        assert!(status.success(), "agent exited with {status}");
        let text = std::fs::read_to_string(&self.stats).expect("agent wrote --stats");
        serde_json::from_str(&text).expect("stats are JSON")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // A failed assertion must not leave an agent sampling the machine.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// The value of the first sample of `name` (a metric name with its labels, or without) in a
/// Prometheus text page.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// A workload held until an agent is attached to it: a shell waits on a FIFO, then `exec`s
/// the command, so the pid the agent is told to follow is the workload's from its first
/// instruction.
pub struct Held {
    child: Option<Child>,
    fifo: PathBuf,
}

impl Held {
    /// Starts the shell that will run `argv` with `env` added, its stdout piped.
    pub fn start(dir: &Path, env: &[(&str, &str)], argv: &[&str]) -> Held {
        let fifo = dir.join(format!("go-{}", argv[0].rsplit('/').next().unwrap_or("wl")));
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path.
        let made = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(made, 0, "mkfifo {}", fifo.display());
        let quoted: Vec<String> = argv.iter().map(|a| format!("'{a}'")).collect();
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "read x < '{}'; exec {}",
                fifo.display(),
                quoted.join(" ")
            ))
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the workload shell");
        Held {
            child: Some(child),
            fifo,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("not released").id()
    }

    /// Lets the workload run and waits for it to end; panics unless it succeeded.
    pub fn release(mut self) -> Output {
        std::fs::write(&self.fifo, "go\n").unwrap();
        let out = self
            .child
            .take()
            .unwrap()
            .wait_with_output()
            .expect("wait for the workload");
        assert!(
            out.status.success(),
            "the workload failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        out
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Panics with promtool's complaints unless `promtool check metrics` accepts `text`.
pub fn promtool_check(what: &str, text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool rejects the {what} metrics:\n{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
