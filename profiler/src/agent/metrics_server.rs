//! The HTTP endpoint serving [`AgentMetrics`] as Prometheus text: `GET /metrics`, hand-written
//! on std's TcpListener (the node agent carries no HTTP server framework, DESIGN.md).
//!
//! A peer is not trusted to be quick: each connection is served on its own thread, at most
//! [`MAX_CONNECTIONS`] at once (one more is closed at once), and has [`DEADLINE`] in all to
//! send its request and take the answer, so a client that connects and stays silent, or
//! trickles its request a byte at a time, holds one slot for two seconds and no more.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::metrics::AgentMetrics;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 8;
/// Time a connection has for its request and the answer together.
pub const DEADLINE: Duration = Duration::from_secs(2);
/// The longest request head read.
const MAX_HEAD: usize = 8192;

/// Serves `GET /metrics` on a bound listener (bound while a privileged port still can be).
pub fn serve_on(listener: TcpListener, metrics: Arc<AgentMetrics>) -> std::io::Result<SocketAddr> {
    let local = listener.local_addr()?;
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
                    active.fetch_sub(1, Ordering::AcqRel);
                    continue; // dropped: closed at once
                }
                let (metrics, slot) = (metrics.clone(), active.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-conn".into())
                    .spawn(move || {
                        serve_one(conn, &metrics);
                        slot.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    active.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
    Ok(local)
}

fn serve_one(mut conn: TcpStream, metrics: &AgentMetrics) {
    let end = Instant::now() + DEADLINE;
    let left = || {
        end.checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    };
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
        let Some(left) = left() else { return };
        if conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&head);
    let path = line.split_whitespace().nth(1).unwrap_or("");
    let (status, ctype, body) = if path == "/metrics" || path.starts_with("/metrics?") {
        ("200 OK", "text/plain; version=0.0.4", metrics.render())
    } else {
        (
            "404 Not Found",
            "text/plain",
            "only /metrics is served here\n".into(),
        )
    };
    let Some(left) = left() else { return };
    let _ = conn.set_write_timeout(Some(left));
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    }

    /// Silent and trickling clients, as many as there are slots, do not keep an honest
    /// client from its answer beyond the deadline, and each is cut off at it.
    #[test]
    fn slow_clients_hold_a_slot_for_the_deadline_at_most() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let metrics = Arc::new(AgentMetrics::default());
        metrics.samples.store(1234, Ordering::Relaxed);
        let addr = serve_on(listener, metrics).unwrap();
        assert!(get(addr).contains("1234"), "served at all");

        let started = Instant::now();
        // First, so that it has a slot rather than being closed at once.
        let mut trickler = TcpStream::connect(addr).unwrap();
        trickler.write_all(b"G").unwrap();
        let mut silent: Vec<TcpStream> = (0..MAX_CONNECTIONS + 4)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let trickle = std::thread::spawn(move || {
            for _ in 0..50 {
                if trickler.write_all(b"G").is_err() {
                    return true; // cut off
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            false
        });
        // The honest client may find every slot taken and be closed; it retries, and within
        // the deadline (and some scheduling slack) a slot frees.
        let answer = loop {
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let _ = c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
            let mut out = String::new();
            let _ = c.read_to_string(&mut out);
            if !out.is_empty() {
                break out;
            }
            assert!(
                started.elapsed() < DEADLINE * 5,
                "no answer while slow clients hold on"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(answer.contains("1234"));
        // Every silent client is closed by the server (read returns 0 or an error).
        for c in &mut silent {
            c.set_read_timeout(Some(DEADLINE * 5)).unwrap();
            let mut b = [0u8; 1];
            assert!(matches!(c.read(&mut b), Ok(0) | Err(_)));
        }
        assert!(
            trickle.join().unwrap(),
            "the trickling client was not cut off"
        );
    }
}
