//! The `pyrometer-collector` binary of this build on a free loopback port, over a private
//! SQLite directory or a private ClickHouse server: for tests that measure the process (its
//! RSS, its restart), send it signals, or read its `/metrics`.

// Each test binary uses part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::Kind;
use super::clickhouse_server::ClickHouse;

pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    /// The arguments beyond `--listen` (kept for restarts).
    args: Vec<String>,
    /// The token reads and pushes send, if any.
    pub token: Option<String>,
    pub clickhouse: Option<ClickHouse>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

impl Server {
    /// The collector over a fresh store of `kind` in `dir`, with `extra` arguments.
    pub fn start(kind: Kind, dir: &Path, extra: &[String], token: Option<&str>) -> Server {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        let mut args: Vec<String> = Vec::new();
        let clickhouse = match kind {
            Kind::Sqlite => {
                args.extend(["--data-dir".into(), dir.join("data").display().to_string()]);
                None
            }
            Kind::ClickHouse => {
                let server = ClickHouse::start(&dir.join("clickhouse"));
                args.extend([
                    "--store".into(),
                    server.url("adversarial"),
                    "--store-credentials".into(),
                    server.credentials_file().display().to_string(),
                ]);
                Some(server)
            }
        };
        args.extend(extra.iter().cloned());
        let mut s = Server {
            child: Command::new("true").spawn().unwrap(),
            addr: SocketAddr::from(([127, 0, 0, 1], free_port())),
            dir: dir.to_path_buf(),
            args,
            token: token.map(String::from),
            clickhouse,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let _ = self.child.wait();
        self.child = Command::new(env!("CARGO_BIN_EXE_pyrometer-collector"))
            .arg("--listen")
            .arg(self.addr.to_string())
            .args(&self.args)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start pyrometer-collector");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.get("/metrics").is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the collector exited with {status}");
            }
            assert!(Instant::now() < deadline, "the collector never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process and starts it again on the same port and store; how long until it
    /// answered.
    pub fn restart(&mut self) -> Duration {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let started = Instant::now();
        self.spawn();
        started.elapsed()
    }

    /// Resident memory of the process, in bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            * 1024
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None)) && self.get("/metrics").is_some()
    }

    /// GET with the server's token: `(status, body)`, or None when nothing answers.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.addr, path, self.token.as_deref())
    }

    /// A metric's value from `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").expect("metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP/1.1 GET: `(status, body)`, or None when nothing answers within 30 s.
pub fn http_get(addr: SocketAddr, path: &str, token: Option<&str>) -> Option<(u16, String)> {
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
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some((status, body.to_string()));
    }
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
    Some((status, out))
}
