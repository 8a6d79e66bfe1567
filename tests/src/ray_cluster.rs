//! A private local Ray cluster for the real-Ray test: its own temp directory, HOME and
//! authentication token, every socket on 127.0.0.1, and nothing left running afterwards.
//!
//! Ray 2.60 turns token authentication on for `ray start --head` when `~/.ray/auth_token`
//! exists, while a driver that connects with an address does not: a token left by an earlier
//! Ray run made the driver fail with "InvalidAuthToken". Here both sides get the mode and the
//! token path explicitly, and a HOME of their own (with a stale token planted in it, so every
//! run meets the case that used to fail).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The Ray venv `cargo xtask test` makes (`target/ray-venv`, ray from the Python registry),
/// or None after recording why the test skips.
pub fn venv() -> Option<PathBuf> {
    let venv = std::env::var_os("PYROMETER_RAY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ray-venv"));
    if venv.join("bin/ray").exists() {
        Some(venv)
    } else {
        crate::skip(
            "ray-venv",
            format!(
                "no Ray at {} (cargo xtask test installs it from the Python registry)",
                venv.display()
            ),
        );
        None
    }
}

/// `ray start --head` in a session of its own, all of whose processes (GCS, raylet, agents,
/// workers) are killed on drop.
pub struct Cluster {
    session: i32,
    /// `host:port` of the GCS, for RAY_ADDRESS.
    pub address: String,
    temp: PathBuf,
    /// Kills the session if the test process dies without dropping the cluster.
    watchdog: Option<Child>,
}

impl Cluster {
    pub fn start(venv: &Path) -> Cluster {
        Cluster::start_with(venv, &[])
    }

    /// `ray start --head` with `extra` arguments (e.g. `--tracing-startup-hook=...`).
    pub fn start_with(venv: &Path, extra: &[&str]) -> Cluster {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Short: Ray's Unix socket paths under it must stay below 108 bytes.
        let temp = PathBuf::from(format!("/tmp/pyro-ray-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&temp);
        std::fs::create_dir_all(temp.join("home/.ray")).unwrap();
        // What an earlier Ray run leaves behind; RAY_AUTH_TOKEN_PATH must win over it.
        std::fs::write(
            temp.join("home/.ray/auth_token"),
            "0123456789abcdef0123456789abcdef",
        )
        .unwrap();
        std::fs::write(temp.join("auth_token"), random_token()).unwrap();
        let mut command = Command::new("setsid");
        command
            .arg(venv.join("bin/ray"))
            .args([
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                &format!("--port={port}"),
                "--num-cpus=2",
                "--include-dashboard=false",
                "--dashboard-agent-listen-port=0",
                "--disable-usage-stats",
                "--object-store-memory=100000000",
            ])
            .arg(format!("--temp-dir={}", temp.display()))
            .args(extra)
            // Without this Ray prestarts workers before the driver connects, and those keep
            // the nil job id for life.
            .env("RAY_prestart_worker_first_driver", "0")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        Self::environment(&mut command, &temp);
        let child = command.spawn().expect("ray start");
        // setsid runs `ray start` as the leader of a new session: its id is the child's pid,
        // and the daemons it starts (and their workers) stay in that session.
        let session = child.id() as i32;
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while kill -0 {} 2>/dev/null; do sleep 1; done; pkill -9 -s {session}; rm -rf {}",
                std::process::id(),
                temp.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        let cluster = Cluster {
            session,
            address: format!("127.0.0.1:{port}"),
            temp,
            watchdog,
        };
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "ray start failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    /// What every Ray process of the test needs, the cluster's and the driver's alike: a
    /// private HOME, token authentication with a private token, and loopback as the node's
    /// address (with this Ray takes 127.0.0.1 as the node IP instead of resolving it to the
    /// machine's network address, and its gRPC servers listen on loopback only).
    pub fn environment(command: &mut Command, temp: &Path) {
        command
            .env("HOME", temp.join("home"))
            .env("RAY_AUTH_MODE", "token")
            .env("RAY_AUTH_TOKEN_PATH", temp.join("auth_token"))
            .env_remove("RAY_AUTH_TOKEN")
            .env("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            .env("RAY_USAGE_STATS_ENABLED", "0");
    }

    /// Sets up `command` (a driver) to connect to this cluster.
    pub fn driver(&self, command: &mut Command) {
        Self::environment(command, &self.temp);
        command.env("RAY_ADDRESS", &self.address);
    }

    /// Processes of the cluster's session.
    pub fn members(&self) -> Vec<i32> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                    let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
                    // state ppid pgrp session
                    rest.split_whitespace().nth(3) == Some(&self.session.to_string())
                })
            })
            .collect()
    }

    /// TCP sockets the cluster's processes listen on that are not on loopback, as
    /// `local-address (pid)`.
    pub fn non_loopback_listeners(&self) -> Vec<String> {
        let mut inodes = std::collections::HashMap::new();
        for pid in self.members() {
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            for fd in fds.filter_map(Result::ok) {
                if let Some(inode) = std::fs::read_link(fd.path()).ok().and_then(|l| {
                    l.to_str()?
                        .strip_prefix("socket:[")?
                        .strip_suffix(']')?
                        .parse::<u64>()
                        .ok()
                }) {
                    inodes.insert(inode, pid);
                }
            }
        }
        let mut found = Vec::new();
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let text = std::fs::read_to_string(table).unwrap_or_default();
            for line in text.lines().skip(1) {
                let f: Vec<&str> = line.split_whitespace().collect();
                // sl local remote state ... inode (field 9); 0A is LISTEN.
                if f.len() < 10 || f[3] != "0A" {
                    continue;
                }
                let Some(&pid) = f[9].parse::<u64>().ok().and_then(|i| inodes.get(&i)) else {
                    continue;
                };
                let host = f[1].split(':').next().unwrap_or("");
                if !is_loopback(host) {
                    found.push(format!("{} ({pid})", f[1]));
                }
            }
        }
        found
    }
}

/// An address of /proc/net/tcp{,6} (hex, in the kernel's byte order) on loopback:
/// 127.0.0.0/8, ::1 or ::ffff:127.x.
fn is_loopback(hex: &str) -> bool {
    match hex.len() {
        // Little-endian IPv4: the first octet is the last byte.
        8 => hex.ends_with("7F"),
        32 => {
            hex == "00000000000000000000000001000000"
                || (hex.starts_with("0000000000000000FFFF0000") && hex.ends_with("7F"))
        }
        _ => false,
    }
}

/// 32 hex digits from the kernel's random source.
fn random_token() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("read /dev/urandom");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for _ in 0..100 {
            let members = self.members();
            if members.is_empty() {
                break;
            }
            for pid in members {
                // SAFETY: plain kill(2) of processes this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        let _ = std::fs::remove_dir_all(&self.temp);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_addresses_in_proc_net_form() {
        assert!(super::is_loopback("0100007F"));
        assert!(!super::is_loopback("020200C0"));
        assert!(!super::is_loopback("00000000"));
        assert!(super::is_loopback("0000000000000000FFFF00000100007F"));
        assert!(super::is_loopback("00000000000000000000000001000000"));
        assert!(!super::is_loopback("00000000000000000000000000000000"));
    }
}
