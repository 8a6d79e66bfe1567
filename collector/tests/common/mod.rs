//! Helpers shared by the collector's socket-level tests: synthetic pprof batches, a real gRPC
//! push, and plain HTTP/1.1 GETs.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

/// Runs the async test body `$f(kind)` once per store, each as its own test (`$f::sqlite`,
/// `$f::clickhouse`). Test binaries that run on one store only leave it unused.
#[allow(unused_macros)]
macro_rules! for_each_store {
    ($f:ident) => {
        mod $f {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$f(super::Kind::Sqlite).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn clickhouse() {
                super::$f(super::Kind::ClickHouse).await
            }
        }
    };
}

use std::io::{Read, Write};
use std::net::SocketAddr;

use bytes::Bytes;
use prost::Message;
use pyrometer_proto as pb;
use pyrometer_proto::grpc::RawCodec;
use pyrometer_proto::ingest::{PUSH_PATH, PushReply, PushRequest};

/// Polls `condition` until it holds (a test waits for the event it needs, never for a fixed
/// time); panics after `timeout`, naming `what`.
pub async fn wait_until(
    timeout: std::time::Duration,
    what: &str,
    mut condition: impl FnMut() -> bool,
) {
    let start = std::time::Instant::now();
    while !condition() {
        assert!(
            start.elapsed() < timeout,
            "waited {:.1}s for {what}",
            start.elapsed().as_secs_f64()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

pub fn profile(comm: &str, stack: &[&str], samples: i64, time_s: i64) -> pb::Profile {
    profile_of(comm, &[(stack, samples)], time_s)
}

/// One process's samples: `samples` counts and 10 ns of CPU per sample for each stack (given
/// root first).
pub fn profile_of(comm: &str, stacks: &[(&[&str], i64)], time_s: i64) -> pb::Profile {
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
    let comm_key = id("comm");
    let comm_value = id(comm);
    let mut function: Vec<pb::Function> = Vec::new();
    let mut location = Vec::new();
    let mut sample = Vec::new();
    for (stack, samples) in stacks {
        let mut location_id = Vec::new();
        // Leaf first, as pprof wants.
        for name in stack.iter().rev() {
            let name = id(name);
            let fid = match function.iter().find(|f| f.name == name) {
                Some(f) => f.id,
                None => {
                    let fid = function.len() as u64 + 1;
                    function.push(pb::Function {
                        id: fid,
                        name,
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
                    fid
                }
            };
            location_id.push(fid);
        }
        sample.push(pb::Sample {
            location_id,
            value: vec![*samples, samples * 10],
            label: vec![pb::Label {
                key: comm_key,
                str: comm_value,
                ..Default::default()
            }],
        });
    }
    pb::Profile {
        sample_type,
        sample,
        location,
        function,
        string_table: strings,
        time_nanos: time_s * 1_000_000_000,
        ..Default::default()
    }
}

pub fn request(agent: &str, seq: u64, node: &str, p: pb::Profile) -> Bytes {
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

pub async fn push(
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

/// One unary gRPC call of `path` with a raw body: the raw reply.
pub async fn call(
    addr: SocketAddr,
    token: Option<&str>,
    path: &'static str,
    body: Vec<u8>,
) -> Result<Bytes, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut grpc = tonic::client::Grpc::new(channel).max_encoding_message_size(64 << 20);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut req = tonic::Request::new(Bytes::from(body));
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let path = http::uri::PathAndQuery::from_static(path);
    Ok(grpc.unary(req, path, RawCodec).await?.into_inner())
}

pub fn now_s() -> i64 {
    pyrometer_collector::api::now_s()
}

#[path = "hostile.rs"]
pub mod hostile;

#[path = "binary.rs"]
pub mod binary;

/// A plain HTTP/1.1 GET: status and body.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_with(addr, path, None).await
}

/// A plain HTTP/1.1 GET with a bearer token: status and body.
pub async fn get_with(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let path = path.to_string();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
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

/// The body of a chunked HTTP/1.1 answer, its chunks joined.
pub fn dechunk(mut body: &str) -> String {
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

pub fn enc(s: &str) -> String {
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

/// Serves `state` on a random loopback port as the collector binary does; the address.
pub async fn serve(state: std::sync::Arc<pyrometer_collector::api::AppState>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = pyrometer_collector::api::router(state.clone());
    let metrics = state.metrics.clone();
    tokio::spawn(pyrometer_collector::serve::serve(
        listener,
        app,
        None,
        pyrometer_collector::serve::Options::default(),
        metrics,
        std::future::pending(),
    ));
    addr
}

#[path = "certs.rs"]
pub mod certs;

#[path = "clickhouse_server.rs"]
pub mod clickhouse_server;

use std::path::Path;
use std::sync::Arc;

use clickhouse_server::ClickHouse;
use pyrometer_collector::clickhouse::{ClickHouseStore, Location};
use pyrometer_collector::sqlite::SqliteStore;
use pyrometer_collector::store::Store;

/// The stores every API-level test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    ClickHouse,
}

/// A store of `kind` in `dir`, with the ClickHouse server behind it (dropped last).
pub struct TestStore {
    pub store: Arc<dyn Store>,
    pub server: Option<ClickHouse>,
}

pub fn test_store(kind: Kind, dir: &Path) -> TestStore {
    let _ = std::fs::remove_dir_all(dir);
    match kind {
        Kind::Sqlite => TestStore {
            store: Arc::new(SqliteStore::open(dir).unwrap()),
            server: None,
        },
        Kind::ClickHouse => {
            let server = ClickHouse::start(dir);
            let store = clickhouse_store(&server, "pyrometer");
            TestStore {
                store: Arc::new(store),
                server: Some(server),
            }
        }
    }
}

pub fn clickhouse_store(server: &ClickHouse, db: &str) -> ClickHouseStore {
    ClickHouseStore::open(
        &Location::parse(&server.url(db)).unwrap(),
        Some((
            clickhouse_server::USER.into(),
            clickhouse_server::PASSWORD.into(),
        )),
        std::time::Duration::from_secs(10),
    )
    .unwrap()
}
