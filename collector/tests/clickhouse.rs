//! The ClickHouse store against a private clickhouse-server (Debian's 18.16): two
//! collectors sharing it, the server killed and restarted under a stream of pushes, schema
//! versions, credentials and retention, and its time series against SQLite's.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use common::clickhouse_server::{self, ClickHouse};
use common::{Kind, clickhouse_store, get, profile, push, request, test_store, wait_until};
use pyrometer_collector::api::{AppState, now_s};
use pyrometer_collector::clickhouse::{ClickHouseStore, Location};
use pyrometer_collector::ingest::{Context, Limits};
use pyrometer_collector::store::{Batch, LabelSet, Row, Selection, Store, StoreError};

fn scratch(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("pyrometer-ch-{name}-{}", std::process::id()))
}

async fn collector(store: Arc<dyn Store>) -> SocketAddr {
    common::serve(Arc::new(AppState::new(store))).await
}

async fn open(server: &ClickHouse) -> Arc<dyn Store> {
    let url = server.url("shared");
    tokio::task::spawn_blocking(move || {
        Arc::new(
            ClickHouseStore::open(
                &Location::parse(&url).unwrap(),
                Some((
                    clickhouse_server::USER.into(),
                    clickhouse_server::PASSWORD.into(),
                )),
                Duration::from_secs(4),
            )
            .unwrap(),
        ) as Arc<dyn Store>
    })
    .await
    .unwrap()
}

fn folded_total(folded: &str) -> i64 {
    folded
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<i64>().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_collectors_share_one_store_and_store_each_batch_once() {
    let dir = scratch("shared");
    let server = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || ClickHouse::start(&dir)
    })
    .await
    .unwrap();
    let (a, b) = (
        collector(open(&server).await).await,
        collector(open(&server).await).await,
    );
    let now = now_s();
    let b1 = request(
        "agent-1",
        1,
        "n1",
        profile("app", &["main", "work"], 7, now),
    );
    assert!(!push(a, None, b1.clone()).await.unwrap().duplicate);
    // The same batch replayed through the other collector (a lost acknowledgement behind a
    // load balancer) is recognized.
    assert!(push(b, None, b1).await.unwrap().duplicate);
    let b2 = request(
        "agent-2",
        1,
        "n2",
        profile("db", &["main", "query"], 3, now),
    );
    assert!(!push(b, None, b2).await.unwrap().duplicate);
    // One batch sent to both at once, several times: stored once whatever interleaving.
    let b3 = request(
        "agent-1",
        2,
        "n1",
        profile("app", &["main", "idle"], 5, now),
    );
    let racers: Vec<_> = (0..6)
        .map(|i| {
            let body = b3.clone();
            let to = if i % 2 == 0 { a } else { b };
            tokio::spawn(async move { push(to, None, body).await.unwrap() })
        })
        .collect();
    for r in racers {
        r.await.unwrap();
    }
    for c in [a, b] {
        let (code, folded) = get(c, "/api/v1/profile?format=folded").await;
        assert_eq!(code, 200, "{folded}");
        assert_eq!(
            folded, "app;main;idle 5\napp;main;work 7\ndb;main;query 3\n",
            "collector {c}"
        );
        // The series counts each batch once too (the same first-attempt rule as the profile).
        let (code, series) = get(c, "/api/v1/series?from=now-5m&step=10").await;
        assert_eq!(code, 200, "{series}");
        let series: serde_json::Value = serde_json::from_str(&series).unwrap();
        assert_eq!(series["total"], 15, "collector {c}: {series}");
        let (_, values) = get(c, "/api/v1/label/node/values").await;
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&values).unwrap()["values"],
            serde_json::json!(["n1", "n2"])
        );
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Batch `seq` of the outage test's agent, and its sample count.
fn outage_batch(seq: u64, now: i64) -> (bytes::Bytes, i64) {
    let samples = 1 + (seq as i64 % 4);
    let body = request(
        "agent-o",
        seq,
        "n-o",
        profile("app", &["main", "work"], samples, now - 300 + seq as i64),
    );
    (body, samples)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clickhouse_killed_mid_run_loses_and_doubles_nothing() {
    let dir = scratch("outage");
    let mut server = tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || ClickHouse::start(&dir)
    })
    .await
    .unwrap();
    let addr = collector(open(&server).await).await;
    let now = now_s();
    // A pusher that behaves as an agent's spool: each batch is sent until acknowledged. The
    // test follows it through the batches stored and the pushes refused.
    let batches = 60u64;
    let (stored, refusals) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let pusher = tokio::spawn({
        let (stored, refusals) = (stored.clone(), refusals.clone());
        async move {
            let mut refused = 0u64;
            let mut sent = 0i64;
            for seq in 1..=batches {
                let (body, samples) = outage_batch(seq, now);
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    match push(addr, None, body.clone()).await {
                        Ok(_) => break,
                        Err(s) => {
                            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                            assert!(Instant::now() < deadline, "never stored: {s:?}");
                            refused += 1;
                            refusals.fetch_add(1, Relaxed);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
                sent += samples;
                stored.fetch_add(1, Relaxed);
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            (sent, refused)
        }
    });
    // Kill the server while batches stream in, check the collector says so, restart it.
    wait_until(Duration::from_secs(60), "5 batches stored", || {
        stored.load(Relaxed) >= 5
    })
    .await;
    tokio::task::block_in_place(|| server.kill());
    wait_until(Duration::from_secs(60), "a push refused", || {
        refusals.load(Relaxed) >= 1
    })
    .await;
    let (code, body) = get(addr, "/api/v1/profile?format=folded").await;
    assert_eq!(code, 503, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    let message = error["error"].as_str().unwrap();
    assert!(
        message.contains("unavailable") && !message.contains('\n'),
        "{message}"
    );
    let (_, metrics) = get(addr, "/metrics").await;
    assert!(
        metrics.contains("pyrometer_collector_queries_store_unavailable_total 1"),
        "{metrics}"
    );
    // The outage lasts a few of the pusher's retries.
    wait_until(Duration::from_secs(60), "5 pushes refused", || {
        refusals.load(Relaxed) >= 5
    })
    .await;
    tokio::task::block_in_place(|| server.resume());
    let (sent, refused) = pusher.await.unwrap();
    assert!(refused > 0, "the outage was not noticed by the pusher");
    let (code, folded) = get(addr, "/api/v1/profile?format=folded").await;
    assert_eq!(code, 200, "{folded}");
    assert_eq!(folded_total(&folded), sent, "{folded}");
    // Replaying everything (an agent that lost all acknowledgements) adds nothing.
    for seq in 1..=batches {
        let (body, _) = outage_batch(seq, now);
        assert!(push(addr, None, body).await.unwrap().duplicate, "{seq}");
    }
    let (_, folded) = get(addr, "/api/v1/profile?format=folded").await;
    assert_eq!(folded_total(&folded), sent);
    let (_, metrics) = get(addr, "/metrics").await;
    let store_errors: u64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("pyrometer_collector_pushes_refused_total{reason=\"store_error\"} ")
        })
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(store_errors, refused, "{metrics}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn schema_versions_credentials_and_retention() {
    let dir = scratch("schema");
    let server = ClickHouse::start(&dir);
    let location = Location::parse(&server.url("versioned")).unwrap();
    let creds = || {
        Some((
            clickhouse_server::USER.to_string(),
            clickhouse_server::PASSWORD.to_string(),
        ))
    };
    let store = clickhouse_store(&server, "versioned");
    assert_eq!(
        server
            .sql("SELECT max(version) FROM versioned.schema_version")
            .trim(),
        pyrometer_collector::clickhouse::schema::VERSION.to_string()
    );
    // Opening again (a second collector) changes nothing: one row per version applied.
    drop(clickhouse_store(&server, "versioned"));
    assert_eq!(
        server
            .sql("SELECT count() FROM versioned.schema_version")
            .trim(),
        pyrometer_collector::clickhouse::schema::VERSION.to_string()
    );

    // Retention drops whole days older than the cut.
    let now = now_s();
    let day = 86_400;
    let old = now - 3 * day;
    for (seq, t) in [(1, old), (2, now)] {
        let bytes = request("a", seq, "n", profile("app", &["main"], 4, t));
        let batch =
            pyrometer_collector::ingest::decode(&bytes, &Context::new(&Limits::default(), now))
                .unwrap();
        store.ingest(&batch).unwrap();
    }
    let total = |from: i64| everything(&store, from, now + 1);
    assert_eq!(total(old - day), 8);
    assert!(store.expire(now - day).unwrap() > 0);
    assert_eq!(total(old - day), 4);
    assert!(store.size_bytes().unwrap() > 0);

    // A store written by a newer collector is refused with what to do.
    server.sql("INSERT INTO versioned.schema_version (version) VALUES (99)");
    let e = ClickHouseStore::open(&location, creds(), Duration::from_secs(4))
        .err()
        .expect("a newer schema is refused");
    assert!(matches!(e, StoreError::Schema(_)), "{e}");
    assert!(e.to_string().contains("upgrade pyrometer-collector"), "{e}");

    // Wrong credentials: one line, not the password, and not "unavailable".
    let e = ClickHouseStore::open(
        &Location::parse(&server.url("other")).unwrap(),
        Some((clickhouse_server::USER.into(), "wrong-pw".into())),
        Duration::from_secs(4),
    )
    .err()
    .expect("wrong password is refused");
    let text = e.to_string();
    assert!(!text.contains("wrong-pw") && !text.contains('\n'), "{text}");
    assert!(!e.is_unavailable(), "{text}");

    // Nothing listening: unavailable, quickly.
    let port = server.port;
    drop(server);
    let started = Instant::now();
    let e = ClickHouseStore::open(
        &Location::parse(&format!("clickhouse://127.0.0.1:{port}/x")).unwrap(),
        creds(),
        Duration::from_secs(4),
    )
    .err()
    .expect("nothing listens");
    assert!(e.is_unavailable(), "{e}");
    assert!(started.elapsed() < Duration::from_secs(4));
    let _ = std::fs::remove_dir_all(&dir);
}

fn everything(store: &dyn Store, from_s: i64, to_s: i64) -> i64 {
    let all = |_: &LabelSet| true;
    store
        .select(&Selection {
            from_s,
            to_s,
            sample_type: "samples",
            labels: &all,
        })
        .unwrap()
        .iter()
        .map(|s| s.value)
        .sum()
}

fn pushed(store: &dyn Store, agent: &str, seq: u64, node: &str, time_s: i64) -> bool {
    pushed_stack(store, agent, seq, node, time_s, &["main"])
}

fn pushed_stack(
    store: &dyn Store,
    agent: &str,
    seq: u64,
    node: &str,
    time_s: i64,
    stack: &[&str],
) -> bool {
    let bytes = request(agent, seq, node, profile("app", stack, 4, time_s));
    let batch =
        pyrometer_collector::ingest::decode(&bytes, &Context::new(&Limits::default(), time_s))
            .unwrap();
    !store.ingest(&batch).unwrap().duplicate
}

/// Waits (up to a minute) for ClickHouse's background mutations of `db` to finish.
fn mutations_done(server: &ClickHouse, db: &str) {
    let started = Instant::now();
    let sql =
        format!("SELECT count() FROM system.mutations WHERE database = '{db}' AND NOT is_done");
    while server.sql(&sql).trim() != "0" {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "mutations never finished"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A store of schema version 1 (rows sorted by time first, in `samples`; label sets and
/// stacks without a write time) opens as the current version: its rows stay readable beside
/// new ones in
/// `samples_v2`, a replay of an old batch is still recognized, and retention drops days of
/// both tables.
#[test]
fn a_version_1_store_is_upgraded_in_place() {
    let dir = scratch("upgrade");
    let server = ClickHouse::start(&dir);
    let now = now_s();
    let day = 86_400;
    let old = now - 3 * day;
    {
        let store = clickhouse_store(&server, "up");
        assert!(pushed(&store, "a", 1, "n1", old));
        assert!(pushed(&store, "a", 2, "n1", now));
    }
    // What version 1 left: the rows in `samples`, no `samples_v2`, `all_samples` or `at`.
    for sql in [
        "INSERT INTO up.samples SELECT * FROM up.samples_v2",
        "DROP TABLE up.all_samples",
        "DROP TABLE up.samples_v2",
        "ALTER TABLE up.labelsets DROP COLUMN at",
        "ALTER TABLE up.stacks DROP COLUMN at",
        "DROP TABLE up.schema_version",
        "CREATE TABLE up.schema_version (version UInt32, applied_at DateTime DEFAULT now())
         ENGINE = ReplacingMergeTree() ORDER BY version",
        "INSERT INTO up.schema_version (version) VALUES (1)",
    ] {
        server.sql(sql);
    }
    let store = clickhouse_store(&server, "up");
    assert_eq!(
        server
            .sql("SELECT max(version) FROM up.schema_version")
            .trim(),
        pyrometer_collector::clickhouse::schema::VERSION.to_string()
    );
    assert_eq!(
        server
            .sql("SELECT count() FROM system.columns WHERE database = 'up' AND table IN ('labelsets', 'stacks') AND name = 'at'")
            .trim(),
        "2"
    );
    assert_eq!(everything(&store, old - day, now + 1), 8);
    assert!(
        !pushed(&store, "a", 2, "n1", now),
        "an old batch's replay is stored again"
    );
    assert!(pushed(&store, "a", 3, "n2", now));
    assert_eq!(
        server
            .sql("SELECT count() FROM up.samples_v2 WHERE type = 0")
            .trim(),
        "1"
    );
    assert_eq!(everything(&store, old - day, now + 1), 12);
    // A second collector opening it changes nothing.
    drop(clickhouse_store(&server, "up"));
    assert_eq!(everything(&store, old - day, now + 1), 12);
    assert!(store.expire(now - day).unwrap() > 0);
    assert_eq!(everything(&store, old - day, now + 1), 8);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Retention removes the label sets and stacks no sample row uses any more (once they are
/// older than the grace a collector's cache relies on), keeps those still used, and a label
/// set seen again after its removal is written again and read back.
#[test]
fn retention_removes_label_sets_no_sample_uses() {
    let dir = scratch("labelsets");
    let server = ClickHouse::start(&dir);
    let now = now_s();
    let day = 86_400;
    let store = clickhouse_store(&server, "ls");
    assert!(pushed_stack(
        &store,
        "a",
        1,
        "gone-node",
        now - 3 * day,
        &["main", "gone"]
    ));
    assert!(pushed_stack(
        &store,
        "a",
        2,
        "kept-node",
        now,
        &["main", "kept"]
    ));
    let stacks = |frame: &str| {
        server
            .sql(&format!(
                "SELECT count() FROM ls.stacks WHERE has(frames, '{frame}')"
            ))
            .trim()
            .to_string()
    };
    let count = |node: &str| {
        server
            .sql(&format!(
                "SELECT count() FROM ls.labelsets WHERE labels LIKE '%\"{node}\"%'"
            ))
            .trim()
            .to_string()
    };
    // Written just now: within the grace, nothing is removed yet.
    store.expire(now - day).unwrap();
    mutations_done(&server, "ls");
    assert_eq!(count("gone-node"), "1");
    assert_eq!(stacks("gone"), "1");
    // As if written long ago.
    server.sql("ALTER TABLE ls.labelsets UPDATE at = toDateTime(1000) WHERE 1");
    server.sql("ALTER TABLE ls.stacks UPDATE at = toDateTime(1000) WHERE 1");
    mutations_done(&server, "ls");
    store.expire(now - day).unwrap();
    mutations_done(&server, "ls");
    assert_eq!(count("gone-node"), "0");
    assert_eq!(count("kept-node"), "1");
    assert_eq!(stacks("gone"), "0");
    assert_eq!(stacks("kept"), "1");
    assert_eq!(everything(&store, now - 4 * day, now + 1), 4);
    // Another collector (its cache empty) meets the label set again.
    let other = clickhouse_store(&server, "ls");
    assert!(pushed(&other, "b", 1, "gone-node", now));
    assert_eq!(count("gone-node"), "1");
    let values = store
        .label_values("node", now - 60, now + 1, &|_| true)
        .unwrap();
    assert_eq!(values, ["gone-node", "kept-node"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A batch of one stack per `(node, value)` at `time_s`.
fn batch(agent: &str, sequence: u64, time_s: i64, rows: &[(&str, i64)]) -> Batch {
    Batch {
        agent_id: agent.into(),
        sequence,
        time_s,
        sample_types: vec![("samples".into(), "count".into())],
        rows: rows
            .iter()
            .enumerate()
            .map(|(i, &(node, value))| Row {
                labels: Arc::new(LabelSet::from([("node".to_string(), node.to_string())])),
                stack: Arc::new(vec!["main".into(), format!("f{i}").into()]),
                sample_type: 0,
                value,
            })
            .collect(),
        max_label_sets: None,
    }
}

/// `Store::series` on ClickHouse answers what it answers on SQLite for the same batches:
/// steps that do not divide the buckets' times (the step's start is `bucket - bucket
/// mod step`, rounded down also for times before the epoch), a label filter, a range that
/// cuts buckets off, and a batch stored twice counted once.
#[test]
fn series_matches_sqlite_for_the_same_batches() {
    let batches = [
        batch("a", 1, -25, &[("n1", 4)]),
        batch("a", 2, 1000, &[("n1", 3), ("n1", 2), ("n2", 9)]),
        batch("a", 3, 1012, &[("n1", 5)]),
        batch("b", 1, 1020, &[("n2", 7)]),
        batch("b", 2, 1100, &[("n2", 1), ("n1", 6)]),
    ];
    let stores: Vec<_> = [Kind::Sqlite, Kind::ClickHouse]
        .into_iter()
        .map(|kind| {
            let t = test_store(kind, &scratch(&format!("series-{kind:?}")));
            for b in &batches {
                assert!(!t.store.ingest(b).unwrap().duplicate);
            }
            assert!(t.store.ingest(&batches[1]).unwrap().duplicate);
            t
        })
        .collect();
    let all = |_: &LabelSet| true;
    let n1 = |l: &LabelSet| l.get("node").is_some_and(|n| n == "n1");
    let filters: [&(dyn Fn(&LabelSet) -> bool + Sync); 2] = [&all, &n1];
    let points = |store: &dyn Store, from_s, to_s, step, labels| {
        let selection = Selection {
            from_s,
            to_s,
            sample_type: "samples",
            labels,
        };
        let mut p: Vec<(String, i64, i64)> = store
            .series(&selection, step)
            .unwrap()
            .into_iter()
            .map(|p| (p.labels["node"].clone(), p.time_s, p.value))
            .collect();
        p.sort();
        p
    };
    for (from_s, to_s) in [(-100, 2000), (1010, 1100), (0, 1000)] {
        for step in [10, 30, 70, 3600] {
            for labels in filters {
                let want = points(&*stores[0].store, from_s, to_s, step, labels);
                let got = points(&*stores[1].store, from_s, to_s, step, labels);
                assert_eq!(got, want, "range {from_s}..{to_s}, step {step}");
            }
        }
    }
    // The ground truth itself, so both stores cannot agree on a wrong answer.
    assert_eq!(
        points(&*stores[1].store, -100, 2000, 30, &all),
        [
            ("n1".to_string(), -30, 4),
            ("n1".to_string(), 990, 10),
            ("n1".to_string(), 1080, 6),
            ("n2".to_string(), 990, 9),
            ("n2".to_string(), 1020, 7),
            ("n2".to_string(), 1080, 1),
        ]
    );
    let unknown = Selection {
        from_s: 0,
        to_s: 2000,
        sample_type: "cpu",
        labels: &all,
    };
    assert!(stores[1].store.series(&unknown, 10).unwrap().is_empty());
}

fn labelled(
    agent: &str,
    sequence: u64,
    time_s: i64,
    rows: &[(&str, &str, &str, usize, i64)],
) -> Batch {
    Batch {
        agent_id: agent.into(),
        sequence,
        time_s,
        sample_types: vec![("samples".into(), "count".into())],
        rows: rows
            .iter()
            .map(|&(node, comm, thread, stack, value)| Row {
                labels: Arc::new(LabelSet::from(
                    [("node", node), ("comm", comm), ("thread", thread)]
                        .map(|(k, v)| (k.to_string(), v.to_string())),
                )),
                stack: Arc::new(vec!["main".into(), format!("f{stack}").into()]),
                sample_type: 0,
                value,
            })
            .collect(),
        max_label_sets: None,
    }
}

/// `Store::select_merged` (label sets cut to some labels, then summed, as flame graphs and
/// per-label totals ask for) answers on both stores what merging `Store::select`'s full
/// answer gives, for several kept labels, filters and ranges; a replayed batch counts once
/// and entries that cancel out are left out.
#[test]
fn merged_selections_match_the_full_selection_on_both_stores() {
    let batches = [
        labelled(
            "a",
            1,
            1000,
            &[
                ("n1", "A", "t1", 0, 4),
                ("n1", "A", "t2", 0, 3),
                ("n1", "B", "t1", 1, 2),
                ("n1", "B", "t2", 2, 5),
            ],
        ),
        labelled(
            "b",
            1,
            1003,
            &[
                ("n2", "A", "t1", 0, 6),
                ("n2", "B", "t1", 1, 1),
                // Cancels n1's B t2 f2 once merged to `comm`.
                ("n2", "B", "t2", 2, -5),
            ],
        ),
        labelled(
            "a",
            2,
            1020,
            &[("n1", "A", "t1", 3, 8), ("n2", "B", "t1", 0, 9)],
        ),
    ];
    let stores: Vec<_> = [Kind::Sqlite, Kind::ClickHouse]
        .into_iter()
        .map(|kind| {
            let t = test_store(kind, &scratch(&format!("merged-{kind:?}")));
            for b in &batches {
                assert!(!t.store.ingest(b).unwrap().duplicate);
            }
            assert!(t.store.ingest(&batches[0]).unwrap().duplicate);
            t
        })
        .collect();
    let all = |_: &LabelSet| true;
    let n1 = |l: &LabelSet| l.get("node").is_some_and(|n| n == "n1");
    let b = |l: &LabelSet| l.get("comm").is_some_and(|c| c == "B");
    let filters: [&(dyn Fn(&LabelSet) -> bool + Sync); 3] = [&all, &n1, &b];
    let entries = |stacks: Vec<pyrometer_collector::store::Stacked>| {
        let mut e: Vec<(LabelSet, String, i64)> = stacks
            .into_iter()
            .map(|s| ((*s.labels).clone(), s.stack.join(";"), s.value))
            .collect();
        e.sort();
        e
    };
    let keeps: [&[&str]; 6] = [
        &[],
        &["comm"],
        &["node"],
        &["comm", "node"],
        &["comm", "node", "thread"],
        &["absent"],
    ];
    for t in &stores {
        let store = &*t.store;
        for (from_s, to_s) in [(0, 2000), (1000, 1010), (1010, 1030)] {
            for labels in filters {
                let selection = Selection {
                    from_s,
                    to_s,
                    sample_type: "samples",
                    labels,
                };
                for keep in keeps {
                    let want = entries(pyrometer_collector::store::merge(
                        store.select(&selection).unwrap(),
                        keep,
                    ));
                    let got = entries(store.select_merged(&selection, keep).unwrap());
                    assert_eq!(got, want, "range {from_s}..{to_s}, keep {keep:?}");
                }
            }
        }
    }
    // The ground truth itself, so a store cannot agree with itself on a wrong answer.
    let selection = Selection {
        from_s: 0,
        to_s: 2000,
        sample_type: "samples",
        labels: &all,
    };
    let comm = |c: &str| LabelSet::from([("comm".to_string(), c.to_string())]);
    for t in &stores {
        assert_eq!(
            entries(t.store.select_merged(&selection, &["comm"]).unwrap()),
            [
                (comm("A"), "main;f0".to_string(), 13),
                (comm("A"), "main;f3".to_string(), 8),
                (comm("B"), "main;f0".to_string(), 9),
                (comm("B"), "main;f1".to_string(), 3),
            ]
        );
        assert!(
            t.store
                .select_merged(
                    &Selection {
                        sample_type: "cpu",
                        ..selection
                    },
                    &[]
                )
                .unwrap()
                .is_empty()
        );
    }
}

/// The store over HTTPS (`clickhouses://`): checked against the CA given, it stores and reads;
/// against the system's roots, which do not hold the test's CA, it does not open.
#[test]
fn the_store_speaks_https_checked_against_its_ca() {
    let dir = scratch("https");
    let server = ClickHouse::start_https(&dir);
    let port = server.https_port.unwrap();
    let url = format!("clickhouses://127.0.0.1:{port}/secure");
    let credentials = || {
        Some((
            clickhouse_server::USER.to_string(),
            clickhouse_server::PASSWORD.to_string(),
        ))
    };
    let mut location = Location::parse(&url).unwrap();
    assert!(location.tls);
    let refused = match ClickHouseStore::open(&location, credentials(), Duration::from_secs(10)) {
        Ok(_) => panic!("opened over HTTPS although the system's roots do not hold the test CA"),
        Err(e) => e.to_string(),
    };
    // A machine without system roots refuses before connecting, and says what to give.
    assert!(
        refused.contains("certificate") || refused.contains("--store-ca"),
        "{refused}"
    );
    location.ca = Some(server.ca());
    let store = ClickHouseStore::open(&location, credentials(), Duration::from_secs(10)).unwrap();
    let now = now_s();
    assert!(pushed(&store, "a", 1, "tls-node", now));
    assert_eq!(everything(&store, now - 60, now + 1), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
