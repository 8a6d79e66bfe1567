//! Helpers for agent + collector tests: start the collector binary, agents, workloads with
//! distinct process names, and talk plain HTTP/1.1 to the collector.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
        let deadline = Instant::now() + Duration::from_secs(20);
        while http_get(addr, "/metrics").is_none() {
            assert!(
                Instant::now() < deadline,
                "collector did not come up on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
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

    /// GET that must succeed with 200.
    pub fn get(&self, path: &str) -> String {
        match http_get(self.addr, path) {
            Some((200, body)) => body,
            other => panic!("GET {path}: {other:?}"),
        }
    }

    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let body = self.get(path);
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// Samples of the last hour by the values of `label` (`/api/v1/profile?by=LABEL`); empty
    /// while the store has none (404).
    pub fn totals_by(&self, label: &str) -> std::collections::BTreeMap<String, i64> {
        let path = format!("/api/v1/profile?by={label}&from=now-1h&type=samples");
        match http_get(self.addr, &path) {
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
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
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
