//! The collector in-process on a random port, driven over real gRPC and HTTP: auth, dedup,
//! queries, errors, and malformed pushes that must never take it down. Each test runs
//! against both stores (SQLite, and a private ClickHouse server).

#[macro_use]
mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use common::{Kind, TestStore, enc, profile, profile_of, push, request, test_store};
use proptest::prelude::*;
use pyrometer_collector::api::AppState;
use pyrometer_collector::auth::Auth;
use pyrometer_collector::config::Config;
use pyrometer_collector::ingest::{self, Limits};

const TOKEN: &str = "t0ken-for-tests";

for_each_store!(auth_dedup_queries_and_errors);
for_each_store!(diff_of_two_ranges_and_of_two_label_sets);
for_each_store!(malformed_pushes_are_refused_and_the_collector_keeps_serving);
for_each_store!(series_over_time_split_by_label);
for_each_store!(flame_format_for_the_web_ui);

/// The collector on a random port over a fresh store of `kind` (kept alive by the guard).
async fn start(name: &str, kind: Kind) -> (SocketAddr, Arc<AppState>, TestStore) {
    let dir = std::env::temp_dir().join(format!(
        "pyrometer-collector-{name}-{kind:?}-{}",
        std::process::id()
    ));
    let guard = tokio::task::spawn_blocking(move || test_store(kind, &dir))
        .await
        .unwrap();
    let config = Config {
        limits: Limits {
            max_push_bytes: 1 << 20,
            ..Limits::default()
        },
        ..Config::default()
    };
    let state = Arc::new(
        AppState::new(guard.store.clone())
            .with_auth(Auth::open().with_tokens(TOKEN).unwrap())
            .with_config(config),
    );
    (common::serve(state.clone()).await, state, guard)
}

/// GET with the test's token (reads need one when pushes do).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    common::get_with(addr, path, Some(TOKEN)).await
}

async fn auth_dedup_queries_and_errors(kind: Kind) {
    let (addr, state, _store) = start("api", kind).await;
    let now = pyrometer_collector::api::now_s();
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
    assert_eq!(state.metrics.pushes_refused.get("invalid"), 0);
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The share of one function in a diff's `functions` list.
fn row<'a>(d: &'a serde_json::Value, function: &str) -> &'a serde_json::Value {
    d["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["function"] == function)
        .unwrap_or_else(|| panic!("no {function} in {d}"))
}

async fn diff_of_two_ranges_and_of_two_label_sets(kind: Kind) {
    let (addr, _state, _store) = start("diff", kind).await;
    let now = pyrometer_collector::api::now_s();
    let (old, new) = (now - 600, now - 60);
    // slow: 50 % of the samples, then 66.7 % (z ~ 13); a kernel frame under it is charged
    // to it unless kernel=true.
    let base = profile_of(
        "app",
        &[
            (&["main", "slow"], 1400),
            (&["main", "slow", "write_[k]"], 100),
            (&["main", "other"], 1500),
        ],
        old,
    );
    let cand = profile_of(
        "app",
        &[(&["main", "slow"], 2000), (&["main", "other"], 1000)],
        new,
    );
    for (seq, node, p) in [(1, "n1", base), (2, "n2", cand)] {
        let body = request("agent", seq, node, p);
        push(addr, Some(TOKEN), body).await.unwrap();
    }

    // One query, two time ranges: new_query defaults to base_query.
    let ranges = format!(
        "base_from={}&base_to={}&new_from={}&new_to={}",
        old - 30,
        old + 30,
        new - 30,
        new + 30
    );
    let q = enc(r#"{comm="app"}"#);
    let (code, body) = get(
        addr,
        &format!("/api/v1/diff?base_query={q}&{ranges}&fail_above=5"),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let d = json(&body);
    assert_eq!(d["regressions"], serde_json::json!(["slow"]));
    assert_eq!(d["functions"][0]["function"], "slow");
    assert_eq!(d["base"]["samples"], 3000);
    assert_eq!(d["new"]["samples"], 3000);
    assert_eq!(d["new"]["query"], r#"{comm="app"}"#);
    assert_eq!(d["type"], "samples");
    let slow = row(&d, "slow");
    assert!(
        (slow["self_delta_pts"].as_f64().unwrap() - 16.67).abs() < 0.01,
        "{slow}"
    );
    assert!(slow["z"].as_f64().unwrap() > 12.0 && slow["regression"] == true);
    assert!(row(&d, "other")["self_delta_pts"].as_f64().unwrap() < -16.0);
    assert!(
        d["functions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["function"] != "write_[k]")
    );
    // Without fail_above there are verdicts to compute from, but no gate.
    let (_, body) = get(addr, &format!("/api/v1/diff?{ranges}")).await;
    assert_eq!(json(&body)["regressions"], serde_json::json!([]));
    // kernel=true judges the kernel frame on its own.
    let (_, body) = get(addr, &format!("/api/v1/diff?{ranges}&kernel=true")).await;
    let k = json(&body);
    assert!((row(&k, "write_[k]")["base_self_pct"].as_f64().unwrap() - 3.33).abs() < 0.01);
    // CPU time is compared, but the z-test still counts samples (not nanoseconds).
    let (_, body) = get(
        addr,
        &format!("/api/v1/diff?{ranges}&type=cpu&fail_above=5"),
    )
    .await;
    let cpu = json(&body);
    assert_eq!(cpu["base"]["total"], 30_000);
    assert_eq!(cpu["base"]["samples"], 3000);
    assert_eq!(cpu["regressions"], serde_json::json!(["slow"]));

    // Two label sets over one range: new_from/new_to default to the base ones.
    let wide = format!("base_from={}&base_to={}", old - 30, new + 30);
    let (code, body) = get(
        addr,
        &format!(
            "/api/v1/diff?{wide}&base_query={}&new_query={}&fail_above=5&inclusive=true",
            enc(r#"{node="n1"}"#),
            enc(r#"{node="n2"}"#)
        ),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let d = json(&body);
    assert_eq!(d["judged"], "inclusive");
    assert_eq!(d["regressions"], serde_json::json!(["slow"]));
    assert_eq!(row(&d, "main")["inclusive_delta_pts"], 0.0);

    // The differential flame graph: the candidate's shape, each frame's change of its own
    // stack's share in the tooltip (slow's base share excludes its write_[k] child there).
    let (code, svg) = get(addr, &format!("/api/v1/diff?{ranges}&format=svg")).await;
    assert_eq!(code, 200, "{svg}");
    assert!(svg.starts_with("<?xml") && svg.contains("<svg"), "{svg}");
    assert!(
        svg.contains("<title>slow (2,000 samples, 66.67%; +20.00%)</title>"),
        "{svg}"
    );
    assert!(
        svg.contains("pyrometer diff: {} 20") && svg.contains(" UTC</text>"),
        "the title names the sides and their UTC ranges"
    );

    let empty = enc(r#"{node="nosuch"}"#);
    for (bad, want) in [
        (format!("base_query={}", enc(r#"{node="n1""#)), 400),
        (format!("{ranges}&new_query={}", enc(r#"{node=~"("}"#)), 400),
        ("base_from=yesterday".to_string(), 400),
        (
            "base_from=now-1h&new_from=now&new_to=now-1h".to_string(),
            400,
        ),
        (format!("{ranges}&new_from=now"), 400),
        (format!("{ranges}&format=png"), 400),
        (format!("{ranges}&type=nosuch"), 400),
        (format!("{ranges}&fail_above=lots"), 400),
        (format!("{ranges}&alpha=2"), 400),
        (format!("{ranges}&inclusive=maybe"), 400),
        (format!("{ranges}&min_samples=-1"), 400),
        // Too few samples to gate on, as `pyrometer diff --fail-above` refuses.
        (format!("{ranges}&fail_above=5&min_samples=5000"), 400),
        // A side that matched nothing: no shares to compare.
        (format!("{ranges}&new_query={empty}"), 404),
        (
            format!("base_from={}&base_to={}", now - 5000, now - 4000),
            404,
        ),
    ] {
        let (code, body) = get(addr, &format!("/api/v1/diff?{bad}")).await;
        assert_eq!(code, want, "{bad}: {body}");
        let v = json(&body);
        assert_eq!(v["code"], want);
        assert!(v["error"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    }
    let (_, body) = get(addr, &format!("/api/v1/diff?{ranges}&new_query={empty}")).await;
    assert!(
        json(&body)["error"].as_str().unwrap().contains("new side"),
        "{body}"
    );
}

/// `/api/v1/series` over real pushes: a regular grid of steps, values summed over stacks,
/// a split by node, the smaller series folded into "other", and one-line errors.
async fn series_over_time_split_by_label(kind: Kind) {
    let (addr, _state, _store) = start("series", kind).await;
    // Two pushes from n1 a minute apart (two stacks in the first), one from n2 and one
    // from n3; all within the last five minutes, on 10 s bucket boundaries.
    let now = pyrometer_collector::api::now_s();
    let t0 = now - now.rem_euclid(60) - 240;
    let pushes = [
        (
            "a1",
            1,
            "n1",
            profile_of("app", &[(&["main", "a"], 4), (&["main", "b"], 6)], t0),
        ),
        ("a1", 2, "n1", profile("app", &["main", "a"], 5, t0 + 60)),
        ("a2", 1, "n2", profile("db", &["main", "q"], 7, t0 + 60)),
        ("a3", 1, "n3", profile("web", &["main", "h"], 1, t0 + 120)),
    ];
    for (agent, seq, node, p) in pushes {
        push(addr, Some(TOKEN), request(agent, seq, node, p))
            .await
            .unwrap();
    }
    let range = format!("from={}&to={}", t0 - 60, t0 + 179);
    let (code, body) = get(addr, &format!("/api/v1/series?{range}&step=60")).await;
    assert_eq!(code, 200, "{body}");
    let s = json(&body);
    assert_eq!(
        (s["type"].as_str(), s["unit"].as_str()),
        (Some("samples"), Some("count"))
    );
    assert_eq!(s["step"], 60);
    assert_eq!(s["total"], 23);
    let ts: Vec<i64> = serde_json::from_value(s["timestamps"].clone()).unwrap();
    assert_eq!(ts, [t0 - 60, t0, t0 + 60, t0 + 120]);
    assert_eq!(s["series"].as_array().unwrap().len(), 1);
    assert_eq!(s["series"][0]["values"], serde_json::json!([0, 10, 12, 1]));

    let (_, body) = get(addr, &format!("/api/v1/series?{range}&step=60&by=node")).await;
    let s = json(&body);
    let by_node: Vec<(String, serde_json::Value)> = s["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["labels"]["node"].as_str().unwrap().to_string(),
                x["values"].clone(),
            )
        })
        .collect();
    assert_eq!(
        by_node,
        [
            ("n1".to_string(), serde_json::json!([0, 10, 5, 0])),
            ("n2".to_string(), serde_json::json!([0, 0, 7, 0])),
            ("n3".to_string(), serde_json::json!([0, 0, 0, 1])),
        ]
    );
    // Only the largest series is kept; n2 and n3 become "other".
    let (_, body) = get(
        addr,
        &format!("/api/v1/series?{range}&step=60&by=node&limit=1"),
    )
    .await;
    let s = json(&body);
    assert_eq!(s["series"][0]["labels"]["node"], "n1");
    assert_eq!(s["series"][1]["other"], true);
    assert_eq!(s["series"][1]["values"], serde_json::json!([0, 0, 7, 1]));
    // A label query and another type: n1's CPU time (10 ns per sample).
    let q = enc(r#"{node="n1"}"#);
    let (_, body) = get(
        addr,
        &format!("/api/v1/series?{range}&step=60&type=cpu&query={q}"),
    )
    .await;
    let s = json(&body);
    assert_eq!(s["unit"], "nanoseconds");
    assert_eq!(s["series"][0]["values"], serde_json::json!([0, 100, 50, 0]));
    // Without a step the collector picks one from the range.
    let (code, body) = get(addr, "/api/v1/series?from=now-1h").await;
    assert_eq!(code, 200, "{body}");
    let s = json(&body);
    assert_eq!(s["total"], 23);
    assert!(s["timestamps"].as_array().unwrap().len() <= 400, "{body}");

    for (bad, says) in [
        ("step=15", "multiple of the store's 10 s buckets"),
        ("step=x", "not a number of seconds"),
        ("step=10&from=now-30d", "use a step of at least"),
        ("limit=0", "limit"),
        ("type=nope", "unknown sample type 'nope'"),
        ("query=%7Bnode%3D", "bad query"),
        ("from=now&to=now-1h", "empty time range"),
    ] {
        let (code, body) = get(addr, &format!("/api/v1/series?{bad}")).await;
        assert_eq!(code, 400, "{bad}: {body}");
        let e = json(&body)["error"].as_str().unwrap().to_string();
        assert!(e.contains(says) && !e.contains('\n'), "{bad}: {e}");
    }
}

/// `format=flame`: interned names and `[value, process, frames...]` rows, as the UI reads them.
async fn flame_format_for_the_web_ui(kind: Kind) {
    let (addr, _state, _store) = start("flame", kind).await;
    let now = pyrometer_collector::api::now_s();
    for (agent, node, p) in [
        (
            "a1",
            "n1",
            profile_of("app", &[(&["main", "a"], 4), (&["main", "b"], 6)], now),
        ),
        ("a2", "n2", profile("app", &["main", "a"], 5, now)),
    ] {
        push(addr, Some(TOKEN), request(agent, 1, node, p))
            .await
            .unwrap();
    }
    let (code, body) = get(addr, "/api/v1/profile?format=flame").await;
    assert_eq!(code, 200, "{body}");
    let f = json(&body);
    assert_eq!(f["total"], 15);
    assert_eq!(f["unit"], "count");
    let names: Vec<String> = serde_json::from_value(f["names"].clone()).unwrap();
    let rows: Vec<(i64, Vec<&str>)> = f["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let r = r.as_array().unwrap();
            let frames = r[1..]
                .iter()
                .map(|i| names[i.as_u64().unwrap() as usize].as_str());
            (r[0].as_i64().unwrap(), frames.collect())
        })
        .collect();
    // The two nodes' main;a merge (same process, same stack).
    assert_eq!(
        rows,
        [(9, vec!["app", "main", "a"]), (6, vec!["app", "main", "b"])]
    );
    let (code, body) = get(addr, "/api/v1/profile?format=flame&from=now-9h&to=now-8h").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(json(&body)["stacks"], serde_json::json!([]));
}

async fn malformed_pushes_are_refused_and_the_collector_keeps_serving(kind: Kind) {
    let (addr, _state, _store) = start("malformed", kind).await;
    let now = pyrometer_collector::api::now_s();
    let valid = request("a", 1, "n1", profile("app", &["main", "work"], 5, now));
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
            let limits = Limits::default();
            let ctx = ingest::Context::new(&limits, now);
            assert!(ingest::decode(&body, &ctx).is_ok(), "{r:?}");
        }
    }
    assert!(!push(addr, Some(TOKEN), valid).await.unwrap().duplicate);
    assert_eq!(get(addr, "/metrics").await.0, 200);
}

/// The clock of the decoding tests below: the pushes' time.
const NOW: i64 = 1_700_000_000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = ingest::decode(&bytes, &ingest::Context::new(&Limits::default(), NOW));
    }

    #[test]
    fn mutated_requests_never_panic(pos in 0usize..200, byte in any::<u8>(), cut in 0usize..200) {
        let mut body = request("a", 1, "n", profile("app", &["main", "f", "g"], 3, NOW)).to_vec();
        let pos = pos % body.len();
        body[pos] = byte;
        body.truncate(cut.max(1).min(body.len()));
        let _ = ingest::decode(&body, &ingest::Context::new(&Limits::default(), NOW));
    }
}
