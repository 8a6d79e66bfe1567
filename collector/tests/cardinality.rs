//! A million distinct label values, in four pushes of 250,000 samples, to the collector binary
//! on both stores with its default limits: the tenant keeps 100,000 label sets, the samples
//! of the other 900,000 are refused and counted, every push is answered within the CPU bound,
//! memory stays bounded, and the collector, killed, restarts with the 100,000 label sets
//! stored within 5 s and under 200 MB of RSS.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::binary::Server;
use common::{Kind, call, hostile, now_s};
use pyrometer_proto::ingest::PUSH_PATH;

for_each_store!(a_million_label_values_are_refused_past_the_limit);

const PUSHES: u64 = 4;
const PER_PUSH: u64 = 250_000;
const LIMIT: usize = 100_000;

async fn a_million_label_values_are_refused_past_the_limit(kind: Kind) {
    // Removed with the store in it when the test ends (after the server, declared later).
    let dir = tempfile::Builder::new()
        .prefix(&format!("pyrometer-card-{kind:?}-"))
        .tempdir()
        .unwrap();
    let path = dir.path().to_path_buf();
    let mut server = tokio::task::spawn_blocking(move || Server::start(kind, &path, &[], None))
        .await
        .unwrap();
    let rss0 = server.rss();
    let now = now_s();
    for p in 0..PUSHES {
        let body = hostile::distinct_labels(p * PER_PUSH, PER_PUSH, p + 1, now - 20);
        let started = Instant::now();
        call(server.addr, None, PUSH_PATH, body)
            .await
            .unwrap_or_else(|e| panic!("push {p}: {e:?}"));
        println!("push {p}: answered in {:?}", started.elapsed());
    }
    let refused = server.metric("pyrometer_collector_label_sets_refused_total");
    assert_eq!(refused as u64, PUSHES * PER_PUSH - LIMIT as u64);
    let cpu = server.metric("pyrometer_collector_push_cpu_seconds_max");
    assert!(cpu <= 2.0, "a push took {cpu:.2} s of CPU");
    let rss = server.rss();
    println!(
        "RSS {} MiB after the pushes, {} MiB before",
        rss >> 20,
        rss0 >> 20
    );
    assert!(rss <= rss0 + (256 << 20));
    let (code, body) = server.get("/api/v1/label/pid/values").unwrap();
    assert_eq!(code, 200);
    let values: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(values["values"].as_array().unwrap().len(), LIMIT);

    let took = tokio::task::spawn_blocking(move || {
        let took = server.restart();
        (took, server)
    })
    .await
    .unwrap();
    let (took, server) = took;
    let rss = server.rss();
    println!("restarted in {took:?}, RSS {} MiB", rss >> 20);
    assert!(took < Duration::from_secs(5), "restart took {took:?}");
    assert!(rss < 200 << 20, "RSS {} MiB after restart", rss >> 20);
    // Still at the limit after the restart: new label sets stay refused.
    call(
        server.addr,
        None,
        PUSH_PATH,
        hostile::distinct_labels(PUSHES * PER_PUSH, 10, 99, now - 10),
    )
    .await
    .unwrap();
    assert_eq!(
        server.metric("pyrometer_collector_label_sets_refused_total") as u64,
        10
    );
}
