//! The collector binary against hostile and careless clients, on both stores: every input
//! that once crashed it, stalled it or corrupted an answer, random mutations of valid
//! pushes, and connections that never finish their headers. After each input the collector
//! must be alive, a canary pushed before must query identically, its RSS must stay within
//! 256 MiB of what it was after the canary, and no push may have taken more than 2 s of the
//! CPU time of the thread that handled it (the collector's own
//! `pyrometer_collector_push_cpu_seconds_max`).

#[macro_use]
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::binary::Server;
use common::hostile::{self, Rng};
use common::{Kind, call, enc, now_s};
use pyrometer_proto::ingest::PUSH_PATH;
use pyrometer_proto::otlp::EXPORT_PATH;

const TOKEN: &str = "adversarial-read-push-0123456789";
const RSS_GROWTH: u64 = 256 << 20;
const CPU_LIMIT_S: f64 = 2.0;

for_each_store!(hostile_pushes_leave_the_collector_serving);

/// What an input must get.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Refused, the message naming this.
    Refused(&'static str),
    /// Stored.
    Stored,
    /// Either (random input).
    Any,
}

struct Harness {
    server: Server,
    canary: String,
    rss0: u64,
}

impl Harness {
    async fn send(&self, name: &str, path: &'static str, body: Vec<u8>, expect: Expect) {
        let size = body.len();
        let started = Instant::now();
        let result = call(self.server.addr, Some(TOKEN), path, body).await;
        let took = started.elapsed();
        match (expect, &result) {
            (Expect::Refused(says), Err(status)) => assert!(
                status.message().contains(says),
                "{name}: refused with {status:?}, not naming {says}"
            ),
            (Expect::Stored, Ok(_)) | (Expect::Any, _) => {}
            _ => panic!("{name} ({size} bytes): expected {expect:?}, got {result:?}"),
        }
        self.check(name, took);
    }

    /// The collector serves, the canary reads the same, memory and CPU stayed bounded.
    fn check(&self, name: &str, took: Duration) {
        let mut alive = self.server.get("/metrics").is_some();
        for _ in 0..50 {
            if alive {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            alive = self.server.get("/metrics").is_some();
        }
        assert!(alive, "{name}: the collector no longer answers");
        assert_eq!(
            canary(&self.server),
            self.canary,
            "{name}: the canary changed"
        );
        let rss = self.server.rss();
        assert!(
            rss <= self.rss0 + RSS_GROWTH,
            "{name}: RSS {} MiB, started at {} MiB",
            rss >> 20,
            self.rss0 >> 20
        );
        let cpu = self
            .server
            .metric("pyrometer_collector_push_cpu_seconds_max");
        assert!(
            cpu <= CPU_LIMIT_S,
            "{name}: a push took {cpu:.2} s of CPU (answered in {took:?})"
        );
    }
}

fn canary(server: &Server) -> String {
    let q = enc(r#"{comm="canary"}"#);
    let (code, body) = server
        .get(&format!(
            "/api/v1/profile?format=folded&query={q}&from=now-1h"
        ))
        .expect("canary query answered");
    assert_eq!(code, 200, "{body}");
    body
}

async fn hostile_pushes_leave_the_collector_serving(kind: Kind) {
    let base = std::env::temp_dir().join(format!(
        "pyrometer-adversarial-{kind:?}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&base).unwrap();
    let token_file = base.join("tokens");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let args = vec![
        "--token-file".to_string(),
        token_file.display().to_string(),
        "--header-timeout".into(),
        "3".into(),
    ];
    let dir = base.join("collector");
    let server = tokio::task::spawn_blocking(move || Server::start(kind, &dir, &args, Some(TOKEN)))
        .await
        .unwrap();
    let now = now_s();
    call(
        server.addr,
        Some(TOKEN),
        PUSH_PATH,
        hostile::simple("canary", 1, "canary", 42, now - 30),
    )
    .await
    .unwrap();
    let canary = canary(&server);
    assert_eq!(canary, "canary;main;work 42\n");
    let rss0 = server.rss();
    let h = Harness {
        server,
        canary,
        rss0,
    };
    let t = now - 60;
    let cases: Vec<(&str, &'static str, Vec<u8>, Expect)> = vec![
        (
            "a million empty samples of a thousand types",
            PUSH_PATH,
            hostile::empty_samples_many_types(t),
            Expect::Refused("max_samples"),
        ),
        (
            "200000 samples without values",
            PUSH_PATH,
            hostile::empty_samples(200_000, t),
            Expect::Refused("0 values for 1 sample types"),
        ),
        (
            "a location of 10000 inlined lines referenced 1000 times (41 KB)",
            PUSH_PATH,
            hostile::inlined(10_000, 1000, 10, t),
            Expect::Stored,
        ),
        (
            "a location of 100000 inlined lines referenced 1000 times (404 KB)",
            PUSH_PATH,
            hostile::inlined(100_000, 1000, 11, t),
            Expect::Stored,
        ),
        (
            "20000 distinct stacks under a 4000-line location",
            PUSH_PATH,
            hostile::deep_distinct(20_000, 4000, t),
            Expect::Refused("max_expansion"),
        ),
        (
            "two samples of i64::MAX on one stack",
            PUSH_PATH,
            hostile::huge_values(12, t),
            Expect::Stored,
        ),
        (
            "a batch stamped in the year 2100",
            PUSH_PATH,
            hostile::simple("future", 1, "future", 1, 4_102_444_800),
            Expect::Refused("outside the accepted window"),
        ),
        (
            "a batch older than the retention",
            PUSH_PATH,
            hostile::simple("past", 1, "past", 1, now - 30 * 86_400),
            Expect::Refused("outside the accepted window"),
        ),
        (
            "100 labels on a sample",
            PUSH_PATH,
            hostile::wide_labels(100, 1, 13, t),
            Expect::Refused("max_labels_per_sample"),
        ),
        (
            "a 3000-byte label",
            PUSH_PATH,
            hostile::wide_labels(1, 3000, 14, t),
            Expect::Refused("max_label_"),
        ),
        (
            "a 5000-byte string",
            PUSH_PATH,
            hostile::wide_labels(1, 5000, 15, t),
            Expect::Refused("max_string_bytes"),
        ),
        (
            "1000001 strings",
            PUSH_PATH,
            hostile::many("strings", 1_000_001, t),
            Expect::Refused("max_strings"),
        ),
        (
            "500001 functions",
            PUSH_PATH,
            hostile::many("functions", 500_001, t),
            Expect::Refused("max_functions"),
        ),
        (
            "500001 locations",
            PUSH_PATH,
            hostile::many("locations", 500_001, t),
            Expect::Refused("max_locations"),
        ),
        (
            "10001 mappings",
            PUSH_PATH,
            hostile::many("mappings", 10_001, t),
            Expect::Refused("max_mappings"),
        ),
        (
            "a 17 MiB push",
            PUSH_PATH,
            vec![0x0a; 17 << 20],
            Expect::Refused("message"),
        ),
        (
            "OTLP: a 10000-location stack shared by 10000 samples (~80 KB)",
            EXPORT_PATH,
            hostile::otlp_shared_stack(10_000, 10_000, t),
            Expect::Stored,
        ),
        (
            "OTLP: a 30000-location stack shared by 30000 samples (~240 KB)",
            EXPORT_PATH,
            hostile::otlp_shared_stack(30_000, 30_000, t),
            Expect::Stored,
        ),
        (
            "OTLP: 400000 strings, 50000 samples labelled through them (~5 MB)",
            EXPORT_PATH,
            hostile::otlp_many_strings(400_000, 50_000, t),
            Expect::Stored,
        ),
        (
            "OTLP: 500001 dictionary attributes",
            EXPORT_PATH,
            hostile::otlp_many_strings(10, 500_001, t),
            Expect::Refused("max_"),
        ),
    ];
    for (name, path, body, expect) in cases {
        h.send(name, path, body, expect).await;
    }

    // What the stored inputs became.
    let q = enc(r#"{node="n-evil"}"#);
    let (_, folded) = h
        .server
        .get(&format!(
            "/api/v1/profile?format=folded&query={q}&from=now-1h"
        ))
        .unwrap();
    let deepest = folded.lines().map(|l| l.split(';').count()).max().unwrap();
    assert_eq!(deepest, 4096, "stacks are cut to the depth limit");
    assert!(
        folded.starts_with("[truncated];inlined_fn;"),
        "{}",
        &folded[..80]
    );
    let q = enc(r#"{comm="huge"}"#);
    let (_, by) = h
        .server
        .get(&format!("/api/v1/profile?by=comm&query={q}&from=now-1h"))
        .unwrap();
    let by: serde_json::Value = serde_json::from_str(&by).unwrap();
    let total = by["total"].as_i64().unwrap();
    match kind {
        // Summed in the collector, saturating.
        Kind::Sqlite => assert_eq!(total, i64::MAX, "sums saturate: {by}"),
        // Summed by ClickHouse over rows bounded when written (see MAX_ROW_VALUE).
        Kind::ClickHouse => assert_eq!(total, 1 << 47, "rows are bounded: {by}"),
    }
    assert!(
        h.server
            .metric("pyrometer_collector_pushes_refused_total{reason=\"max_strings\"}")
            >= 1.0
    );

    // Random mutations of valid pushes, and of an OTLP request.
    let mut rng = Rng(0x5eed_0000 ^ kind as u64);
    let valid = hostile::simple("mutant", 1, "mutant", 3, t);
    let otlp = hostile::otlp_shared_stack(20, 20, t);
    for i in 0..300 {
        let (path, base) = if i % 3 == 2 {
            (EXPORT_PATH, &otlp)
        } else {
            (PUSH_PATH, &valid)
        };
        let body = hostile::mutate(base, &mut rng);
        h.send(&format!("mutation {i}"), path, body, Expect::Any)
            .await;
    }

    // Pushes only as gRPC: a browser's text/plain POST is refused.
    let (code, _) = raw(
        &h,
        &format!(
            "POST {PUSH_PATH} HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n\
             Authorization: Bearer {TOKEN}\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
        ),
    );
    assert_eq!(code, 415);
    // Reads need the token.
    let open = common::binary::http_get(h.server.addr, "/api/v1/labels", None).unwrap();
    assert_eq!(open.0, 401, "{}", open.1);

    half_sent_headers(&h).await;
    let _ = std::fs::remove_dir_all(&base);
}

/// Sends a raw HTTP/1.1 request: the status.
fn raw(h: &Harness, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(h.server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    (
        out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0),
        out,
    )
}

/// 2000 connections that send half a header: pushes and `/metrics` keep being answered
/// while they hang, and the collector closes them after its header timeout (3 s here).
async fn half_sent_headers(h: &Harness) {
    raise_file_limit();
    let mut open = Vec::new();
    for _ in 0..2000 {
        let Ok(mut s) = TcpStream::connect(h.server.addr) else {
            break;
        };
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nX-Slow: ");
        open.push(s);
    }
    assert!(open.len() >= 1000, "only {} connections opened", open.len());
    let started = Instant::now();
    call(
        h.server.addr,
        Some(TOKEN),
        PUSH_PATH,
        hostile::simple("during", 1, "during", 1, now_s()),
    )
    .await
    .expect("a push while 2000 connections hang");
    assert!(h.server.get("/metrics").is_some());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // All closed by the collector within its header timeout (and a margin).
    let deadline = Instant::now() + Duration::from_secs(20);
    for mut s in open {
        s.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        let mut buf = [0u8; 256];
        let closed = matches!(s.read(&mut buf), Ok(0)) || matches!(s.read(&mut buf), Ok(0));
        assert!(closed, "a half-sent request was kept open");
    }
    h.check("2000 half-sent headers", Duration::ZERO);
}

fn raise_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only `lim`.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(65_536);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}
