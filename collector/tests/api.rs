//! The collector in-process on a random port, driven over real gRPC and HTTP: auth, dedup,
//! queries, errors, and malformed pushes that must never take it down.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use prost::Message;
use pyrometer_collector::ingest::{self, Limits};
use pyrometer_collector::metrics::Metrics;
use pyrometer_collector::server::{AppState, router};
use pyrometer_collector::sqlite::SqliteStore;
use pyrometer_proto as pb;
use pyrometer_proto::grpc::RawCodec;
use pyrometer_proto::ingest::{PUSH_PATH, PushReply, PushRequest};

const TOKEN: &str = "t0ken-for-tests";

fn profile(comm: &str, stack: &[&str], samples: i64, time_s: i64) -> pb::Profile {
    let mut strings = vec![String::new()];
    let mut id = |s: &str| {
        if let Some(i) = strings.iter().position(|x| x == s) {
            return i as i64;
        }
        strings.push(s.to_string());
        strings.len() as i64 - 1
    };
    let sample_type = vec![
        pb::ValueType {
            r#type: id("samples"),
            unit: id("count"),
        },
        pb::ValueType {
            r#type: id("cpu"),
            unit: id("nanoseconds"),
        },
    ];
    let mut function = Vec::new();
    let mut location = Vec::new();
    for (i, name) in stack.iter().enumerate() {
        let fid = i as u64 + 1;
        function.push(pb::Function {
            id: fid,
            name: id(name),
            ..Default::default()
        });
        location.push(pb::Location {
            id: fid,
            line: vec![pb::Line {
                function_id: fid,
                line: 0,
                ..Default::default()
            }],
            ..Default::default()
        });
    }
    // Leaf first, as pprof wants.
    let location_id: Vec<u64> = (1..=stack.len() as u64).rev().collect();
    let label = vec![pb::Label {
        key: id("comm"),
        str: id(comm),
        ..Default::default()
    }];
    pb::Profile {
        sample_type,
        sample: vec![pb::Sample {
            location_id,
            value: vec![samples, samples * 10],
            label,
        }],
        location,
        function,
        string_table: strings,
        time_nanos: time_s * 1_000_000_000,
        ..Default::default()
    }
}

fn request(agent: &str, seq: u64, node: &str, p: pb::Profile) -> Bytes {
    Bytes::from(
        PushRequest {
            agent_id: agent.into(),
            sequence: seq,
            node: node.into(),
            profile: Some(p),
        }
        .encode_to_vec(),
    )
}

async fn start(name: &str) -> (SocketAddr, Arc<AppState>) {
    let dir =
        std::env::temp_dir().join(format!("pyrometer-collector-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let state = Arc::new(AppState {
        store: Arc::new(SqliteStore::open(&dir).unwrap()),
        token: Some(TOKEN.into()),
        limits: Limits::default(),
        max_message_bytes: 1 << 20,
        metrics: Metrics::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, state)
}

async fn push(
    addr: SocketAddr,
    token: Option<&str>,
    body: Bytes,
) -> Result<PushReply, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut req = tonic::Request::new(body);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let path = http::uri::PathAndQuery::from_static(PUSH_PATH);
    let reply = grpc.unary(req, path, RawCodec).await?;
    Ok(PushReply::decode(reply.into_inner()).expect("reply decodes"))
}

/// A plain HTTP/1.1 GET: status and body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text[9..12].parse().unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        };
        (status, body)
    })
    .await
    .unwrap()
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_dedup_queries_and_errors() {
    let (addr, state) = start("api").await;
    let now = pyrometer_collector::server::now_s();
    let body = request(
        "agent-1",
        1,
        "n1",
        profile("app", &["main", "work"], 7, now),
    );

    let e = push(addr, None, body.clone()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let e = push(addr, Some("wrong"), body.clone()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    assert!(!e.message().contains(TOKEN));
    let r = push(addr, Some(TOKEN), body.clone()).await.unwrap();
    assert!(!r.duplicate);
    // A replay (lost acknowledgement) is acknowledged again but not stored twice.
    assert!(
        push(addr, Some(TOKEN), body.clone())
            .await
            .unwrap()
            .duplicate
    );
    push(
        addr,
        Some(TOKEN),
        request(
            "agent-2",
            1,
            "n2",
            profile("db", &["main", "query"], 3, now),
        ),
    )
    .await
    .unwrap();

    let (code, folded) = get(addr, "/api/v1/profile?format=folded").await;
    assert_eq!(code, 200, "{folded}");
    assert_eq!(folded, "app;main;work 7\ndb;main;query 3\n");
    let q = enc(r#"{node="n1"}"#);
    let (_, folded) = get(
        addr,
        &format!("/api/v1/profile?format=folded&query={q}&type=cpu"),
    )
    .await;
    assert_eq!(folded, "app;main;work 70\n");
    let q = enc(r#"{comm=~"d.*", node!="n1"}"#);
    let (_, folded) = get(addr, &format!("/api/v1/profile?format=folded&query={q}")).await;
    assert_eq!(folded, "db;main;query 3\n");
    let q = enc(r#"{comm!~"d.*"}"#);
    let (_, folded) = get(addr, &format!("/api/v1/profile?format=folded&query={q}")).await;
    assert_eq!(folded, "app;main;work 7\n");

    let (code, by) = get(addr, "/api/v1/profile?by=node").await;
    assert_eq!(code, 200);
    let by: serde_json::Value = serde_json::from_str(&by).unwrap();
    assert_eq!(by["total"], 10);
    assert_eq!(by["groups"][0]["labels"]["node"], "n1");
    assert_eq!(by["groups"][0]["total"], 7);
    assert_eq!(by["groups"][1]["total"], 3);

    let (_, names) = get(addr, "/api/v1/labels").await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&names).unwrap()["names"],
        serde_json::json!(["comm", "node"])
    );
    let (_, values) = get(addr, "/api/v1/label/node/values").await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&values).unwrap()["values"],
        serde_json::json!(["n1", "n2"])
    );
    let (code, svg) = get(addr, "/api/v1/profile").await;
    assert_eq!(code, 200);
    assert!(svg.contains("<svg") && svg.contains("work"));
    let (code, top) = get(addr, "/api/v1/profile?format=top").await;
    assert_eq!(code, 200);
    assert!(top.contains("\"function\":\"work\""), "{top}");

    for bad in [
        format!("/api/v1/profile?query={}", enc(r#"{node="n1""#)),
        format!("/api/v1/profile?query={}", enc(r#"{node=~"("}"#)),
        "/api/v1/profile?from=yesterday".to_string(),
        "/api/v1/profile?from=now&to=now-1h".to_string(),
        "/api/v1/profile?format=png".to_string(),
        "/api/v1/profile?type=nosuch".to_string(),
    ] {
        let (code, body) = get(addr, &bad).await;
        assert_eq!(code, 400, "{bad}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["code"], 400);
        assert!(v["error"].as_str().is_some_and(|m| !m.is_empty()));
    }

    let (_, metrics) = get(addr, "/metrics").await;
    assert!(
        metrics.contains("pyrometer_collector_pushes_refused_total{reason=\"unauthenticated\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("pyrometer_collector_batches_duplicate_total 1"));
    assert!(metrics.contains("pyrometer_collector_batches_ingested_total 2"));
    assert_eq!(
        state
            .metrics
            .refused_invalid
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_pushes_are_refused_and_the_collector_keeps_serving() {
    let (addr, _state) = start("malformed").await;
    let valid = request(
        "a",
        1,
        "n1",
        profile("app", &["main", "work"], 5, 1_700_000_000),
    );
    let mut cases: Vec<Bytes> = (0..valid.len())
        .step_by(3)
        .map(|n| valid.slice(..n))
        .collect();
    cases.push(Bytes::from(vec![0xff; 64]));
    cases.push(Bytes::from(vec![0u8; 2 << 20])); // over the 1 MiB limit
    let mut broken = profile("app", &["main"], 1, 1);
    broken.sample[0].location_id.push(99);
    cases.push(request("a", 2, "n1", broken));
    let mut broken = profile("app", &["main"], 1, 1);
    broken.function[0].name = 1000;
    cases.push(request("a", 3, "n1", broken));
    for body in cases {
        if let Ok(r) = push(addr, Some(TOKEN), body.clone()).await {
            // Some truncations are still valid messages (e.g. without a profile they are not).
            assert!(
                ingest::decode(&body, &Limits::default(), 0).is_ok(),
                "{r:?}"
            );
        }
    }
    assert!(!push(addr, Some(TOKEN), valid).await.unwrap().duplicate);
    assert_eq!(get(addr, "/metrics").await.0, 200);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = ingest::decode(&bytes, &Limits::default(), 0);
    }

    #[test]
    fn mutated_requests_never_panic(pos in 0usize..200, byte in any::<u8>(), cut in 0usize..200) {
        let mut body = request("a", 1, "n", profile("app", &["main", "f", "g"], 3, 5)).to_vec();
        let pos = pos % body.len();
        body[pos] = byte;
        body.truncate(cut.max(1).min(body.len()));
        let _ = ingest::decode(&body, &Limits::default(), 0);
    }
}
