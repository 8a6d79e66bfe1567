//! A private ClickHouse server for one test: Debian's clickhouse-server started by hand with
//! its own config and data directory, HTTP on a free loopback port, no system service. Stopped
//! (and its directory removed) when dropped. Shared by the collector's tests and the e2e tests.

// Each user (collector tests, e2e tests, the store benchmark) needs only part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::certs;

pub const SERVER: &str = "/usr/sbin/clickhouse-server";
pub const USER: &str = "pyrometer";
pub const PASSWORD: &str = "ch-test-password";

pub struct ClickHouse {
    child: Option<Child>,
    dir: PathBuf,
    pub port: u16,
    /// The HTTPS port, when started with [`ClickHouse::start_https`].
    pub https_port: Option<u16>,
}

impl ClickHouse {
    /// Starts a server in `dir` (emptied first). Panics with what to install when Debian's
    /// clickhouse-server is missing: `cargo xtask deps` installs it.
    pub fn start(dir: &Path) -> ClickHouse {
        Self::start_with(dir, false)
    }

    /// [`ClickHouse::start`] also serving HTTPS, with a certificate for 127.0.0.1 signed by a
    /// CA made for the test (its PEM: [`ClickHouse::ca`]).
    pub fn start_https(dir: &Path) -> ClickHouse {
        Self::start_with(dir, true)
    }

    /// The CA that signed the HTTPS certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn start_with(dir: &Path, https: bool) -> ClickHouse {
        assert!(
            Path::new(SERVER).exists(),
            "{SERVER} is missing: install Debian's clickhouse-server (cargo xtask deps does)"
        );
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let free = || {
            TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .unwrap()
                .port()
        };
        let port = free();
        let https_port = https.then(free);
        let tls = match https_port {
            Some(p) => {
                certs::ca(dir, "ca");
                certs::sign(dir, "server", "localhost", "ca", certs::SERVER);
                format!(
                    "<https_port>{p}</https_port>
    <openSSL><server>
        <certificateFile>{d}/server.pem</certificateFile>
        <privateKeyFile>{d}/server.key</privateKeyFile>
        <verificationMode>none</verificationMode>
        <loadDefaultCAFile>false</loadDefaultCAFile>
    </server></openSSL>",
                    d = dir.display()
                )
            }
            None => String::new(),
        };
        std::fs::write(
            dir.join("config.xml"),
            format!(
                r#"<?xml version="1.0"?>
<yandex>
    <logger><level>warning</level><log>{d}/server.log</log><errorlog>{d}/error.log</errorlog></logger>
    <http_port>{port}</http_port>
    {tls}
    <listen_host>127.0.0.1</listen_host>
    <path>{d}/data/</path>
    <tmp_path>{d}/tmp/</tmp_path>
    <user_files_path>{d}/user_files/</user_files_path>
    <format_schema_path>{d}/format_schemas/</format_schema_path>
    <users_config>{d}/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <mark_cache_size>67108864</mark_cache_size>
    <uncompressed_cache_size>67108864</uncompressed_cache_size>
</yandex>
"#,
                d = dir.display()
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("users.xml"),
            format!(
                r#"<?xml version="1.0"?>
<yandex>
    <profiles><default><max_threads>2</max_threads></default></profiles>
    <users>
        <{USER}>
            <password>{PASSWORD}</password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </{USER}>
    </users>
    <quotas><default></default></quotas>
</yandex>
"#
            ),
        )
        .unwrap();
        let mut ch = ClickHouse {
            child: None,
            dir: dir.to_path_buf(),
            port,
            https_port,
        };
        ch.resume();
        ch
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `clickhouse://127.0.0.1:PORT/DB`
    pub fn url(&self, db: &str) -> String {
        format!("clickhouse://127.0.0.1:{}/{db}", self.port)
    }

    /// Writes a credentials file for the test user and returns its path.
    pub fn credentials_file(&self) -> PathBuf {
        let path = self.dir.join("credentials");
        std::fs::write(&path, format!("{USER}:{PASSWORD}\n")).unwrap();
        path
    }

    /// SIGKILL: the server stops mid-whatever, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port and data, and waits until it answers.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new(SERVER)
            .arg(format!(
                "--config-file={}",
                self.dir.join("config.xml").display()
            ))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start clickhouse-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.ping() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
                panic!("clickhouse-server exited with {status}:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "clickhouse-server did not answer on {}",
                self.addr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(&self.addr(), Duration::from_secs(1)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.1 200") && answer.contains("Ok.")
    }
}

impl Drop for ClickHouse {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl ClickHouse {
    /// Runs one SQL statement as the test user (through curl) and returns the answer.
    pub fn sql(&self, sql: &str) -> String {
        let out = Command::new("curl")
            .args(["-sS", "--fail-with-body", "-u"])
            .arg(format!("{USER}:{PASSWORD}"))
            .arg("--data-binary")
            .arg(sql)
            .arg(format!("http://127.0.0.1:{}/", self.port))
            .output()
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{sql}: {text}");
        text
    }
}

impl ClickHouse {
    /// The server's process id (0 while stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }
}
