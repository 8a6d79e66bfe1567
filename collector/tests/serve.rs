//! The collector binary's safe defaults and its connection handling: it refuses to listen
//! beyond loopback without credentials (unless told `--insecure`), keeps its store readable
//! by itself alone, reads its token file again on SIGHUP (keeping the old tokens when the new
//! file is broken), closes connections beyond `--max-connections` and those that do not send
//! a request within the header timeout, and answers with security headers.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::binary::{Server, http_get};
use common::{Kind, call, hostile, now_s, wait_until};
use pyrometer_proto::ingest::PUSH_PATH;

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("pyrometer-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn beyond_loopback_needs_credentials_or_insecure() {
    let dir = scratch("listen");
    let out = Command::new(env!("CARGO_BIN_EXE_pyrometer-collector"))
        .args(["--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.join("data"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--token-file") && err.contains("--insecure") && err.lines().count() == 1,
        "{err}"
    );
    // With --insecure it serves.
    let mut child = Command::new(env!("CARGO_BIN_EXE_pyrometer-collector"))
        .args(["--listen", "0.0.0.0:0", "--insecure", "--data-dir"])
        .arg(dir.join("data"))
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stderr = child.stderr.take().unwrap();
    let mut byte = [0u8];
    while !line.ends_with('\n') && stderr.read(&mut byte).unwrap_or(0) == 1 {
        line.push(byte[0] as char);
    }
    assert!(line.contains("listening on 0.0.0.0:"), "{line}");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_file_is_read_again_on_sighup_and_the_store_is_private() {
    let dir = scratch("sighup");
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "first-token-0123456789\n").unwrap();
    let args = vec!["--token-file".to_string(), tokens.display().to_string()];
    let data = dir.join("collector");
    let mut server = tokio::task::spawn_blocking(move || {
        Server::start(Kind::Sqlite, &data, &args, Some("first-token-0123456789"))
    })
    .await
    .unwrap();
    let push = |token: &'static str, seq: u64| {
        call(
            server.addr,
            Some(token),
            PUSH_PATH,
            hostile::simple("a", seq, "app", 1, now_s()),
        )
    };
    push("first-token-0123456789", 1).await.unwrap();
    // The store's files are the collector's alone.
    for entry in std::fs::read_dir(server.dir.join("data")).unwrap() {
        let entry = entry.unwrap();
        let mode = entry.metadata().unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{}: {mode:o}", entry.path().display());
    }
    std::fs::write(&tokens, "second-token-012345678  default  push,read\n").unwrap();
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGHUP) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while push("second-token-012345678", 2).await.is_err() {
        assert!(Instant::now() < deadline, "the new token never worked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let e = push("first-token-0123456789", 3).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    // Reads, /metrics among them, need the new token too.
    server.token = Some("second-token-012345678".into());
    // A broken file leaves the tokens in force.
    std::fs::write(&tokens, "broken line with four words\n").unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGHUP) };
    let reloads = "pyrometer_collector_token_file_reloads_total";
    wait_until(Duration::from_secs(10), "the broken file read", || {
        server.metric(&format!("{reloads}{{result=\"error\"}}")) >= 1.0
    })
    .await;
    assert_eq!(server.metric(&format!("{reloads}{{result=\"ok\"}}")), 1.0);
    push("second-token-012345678", 4).await.unwrap();
    assert!(server.alive());
}

/// Reads one answer (or the close) from `s`; true when the collector closed it.
fn closed(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(_) => return false,
        }
    }
}

#[test]
fn connections_beyond_the_limit_or_without_a_request_are_closed() {
    let dir = scratch("conns");
    let args: Vec<String> = [
        "--max-connections",
        "40",
        "--header-timeout",
        "2",
        "--idle-timeout",
        "3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let server = Server::start(Kind::Sqlite, &dir.join("c"), &args, None);
    // Forty connections that say nothing hold every slot...
    let mut quiet: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(server.addr).unwrap())
        .collect();
    // ...so the next, accepted after them (the kernel queues connections in the order they
    // arrive), is closed on arrival and counted...
    let mut extra = TcpStream::connect(server.addr).unwrap();
    assert!(
        closed(&mut extra, Duration::from_secs(2)),
        "kept past the limit"
    );
    // ...and each quiet one is closed once its first request is overdue.
    let started = Instant::now();
    for s in &mut quiet {
        assert!(
            closed(s, Duration::from_secs(10)),
            "a silent connection was kept"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(server.metric("pyrometer_collector_connections_refused_total") >= 1.0);
    // A keep-alive connection idle past the timeout is closed too.
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        .unwrap();
    assert!(closed(&mut s, Duration::from_secs(10)));
    // Answers carry the security headers.
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    let head = page.split("\r\n\r\n").next().unwrap().to_ascii_lowercase();
    for h in [
        "content-security-policy: default-src 'self'",
        "frame-ancestors 'none'",
        "x-content-type-options: nosniff",
        "x-frame-options: deny",
    ] {
        assert!(head.contains(h), "{h} missing: {head}");
    }
    assert_eq!(http_get(server.addr, "/metrics", None).unwrap().0, 200);
}
