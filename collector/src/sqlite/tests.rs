//! The SQLite store's own tests: replays, the first layout's conversion, the time series,
//! compaction and expiry.

use std::sync::Arc;

use super::*;
use crate::store::{Row, TENANT_LABEL, with_deadline};

fn batch(agent: &str, seq: u64, time_s: i64, node: &str, stack: &[&str], v: i64) -> Batch {
    let labels: LabelSet = [("node".to_string(), node.to_string())].into();
    Batch {
        agent_id: agent.into(),
        sequence: seq,
        time_s,
        sample_types: vec![("samples".into(), "count".into())],
        rows: vec![Row {
            labels: Arc::new(labels),
            stack: Arc::new(
                stack
                    .iter()
                    .map(|&s| crate::store::Frame::from(s))
                    .collect(),
            ),
            sample_type: 0,
            value: v,
        }],
        max_label_sets: None,
    }
}

fn total(store: &SqliteStore, from: i64, to: i64) -> i64 {
    let all = |_: &LabelSet| true;
    store
        .select(&Selection {
            from_s: from,
            to_s: to,
            sample_type: "samples",
            labels: &all,
        })
        .unwrap()
        .iter()
        .map(|s| s.value)
        .sum()
}

/// A private folder, removed with what is in it when dropped.
fn tmp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("pyrometer-store-{name}-"))
        .tempdir()
        .unwrap()
}

#[test]
fn replay_counts_once_and_survives_reopen() {
    let dir = tmp("replay");
    let store = SqliteStore::open(dir.path()).unwrap();
    let b = batch("a", 1, 1000, "n1", &["main", "work"], 7);
    assert!(!store.ingest(&b).unwrap().duplicate);
    assert!(store.ingest(&b).unwrap().duplicate);
    store
        .ingest(&batch("a", 2, 1003, "n1", &["main", "work"], 5))
        .unwrap();
    assert_eq!(total(&store, 0, 2000), 12);
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    assert!(store.ingest(&b).unwrap().duplicate);
    assert_eq!(total(&store, 0, 2000), 12);
    assert!(store.has_batch("a", 2).unwrap());
    assert_eq!(
        store.label_values("node", 0, 2000, &|_| true).unwrap(),
        vec!["n1"]
    );
    // The time range selects buckets: 1000 and 1003 share the bucket starting at 1000.
    assert_eq!(total(&store, 1010, 2000), 0);
}

/// A store of the first layout (one row per sample) is converted on open, totals kept.
#[test]
fn first_layout_is_converted() {
    let dir = tmp("convert");
    std::fs::create_dir_all(dir.path()).unwrap();
    {
        let conn = Connection::open(dir.path().join("pyrometer.sqlite")).unwrap();
        conn.execute_batch(
            "CREATE TABLE batches (agent_id TEXT NOT NULL, sequence INTEGER NOT NULL,
                 bucket INTEGER NOT NULL, PRIMARY KEY (agent_id, sequence)) WITHOUT ROWID;
             CREATE TABLE frames (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
             CREATE TABLE stacks (id INTEGER PRIMARY KEY, frames BLOB NOT NULL UNIQUE);
             CREATE TABLE labelsets (id INTEGER PRIMARY KEY, labels TEXT NOT NULL UNIQUE);
             CREATE TABLE types (id INTEGER PRIMARY KEY, name TEXT NOT NULL,
                 unit TEXT NOT NULL, UNIQUE (name, unit));
             CREATE TABLE samples (bucket INTEGER NOT NULL, labelset INTEGER NOT NULL,
                 stack INTEGER NOT NULL, type INTEGER NOT NULL, value INTEGER NOT NULL,
                 PRIMARY KEY (bucket, labelset, stack, type)) WITHOUT ROWID;
             INSERT INTO batches VALUES ('a', 1, 1000);
             INSERT INTO frames VALUES (1, 'main'), (2, 'work');
             INSERT INTO labelsets VALUES (1, '{\"node\":\"n1\"}');
             INSERT INTO types VALUES (1, 'samples', 'count');
             INSERT INTO samples VALUES (1000, 1, 1, 1, 7), (1010, 1, 1, 1, 5);",
        )
        .unwrap();
        conn.execute("INSERT INTO stacks VALUES (1, ?1)", [encode_stack(&[1, 2])])
            .unwrap();
    }
    let store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(total(&store, 0, 2000), 12);
    assert_eq!(total(&store, 1010, 2000), 5);
    assert!(
        store
            .ingest(&batch("a", 1, 1000, "n1", &["main"], 1))
            .unwrap()
            .duplicate
    );
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(total(&store, 0, 2000), 12);
}

#[test]
fn series_sums_stacks_per_step_and_label_set() {
    let dir = tmp("series");
    let store = SqliteStore::open(dir.path()).unwrap();
    // Two nodes; n1 has two stacks in the bucket at 1000 and one at 1010, n2 one at 1020.
    let mut b = batch("a", 1, 1000, "n1", &["main", "a"], 3);
    b.rows.push(Row {
        stack: Arc::new(vec!["main".into(), "b".into()]),
        ..b.rows[0].clone()
    });
    store.ingest(&b).unwrap();
    store
        .ingest(&batch("a", 2, 1012, "n1", &["main", "a"], 5))
        .unwrap();
    store
        .ingest(&batch("b", 1, 1020, "n2", &["main", "a"], 7))
        .unwrap();
    let all = |_: &LabelSet| true;
    let sel = |from_s, to_s| Selection {
        from_s,
        to_s,
        sample_type: "samples",
        labels: &all,
    };
    let points = |sel: Selection<'_>, step| {
        let mut p: Vec<(String, i64, i64)> = store
            .series(&sel, step)
            .unwrap()
            .into_iter()
            .map(|p| (p.labels["node"].clone(), p.time_s, p.value))
            .collect();
        p.sort();
        p
    };
    assert_eq!(
        points(sel(0, 2000), 10),
        [
            ("n1".into(), 1000, 6),
            ("n1".into(), 1010, 5),
            ("n2".into(), 1020, 7)
        ]
    );
    // A 30 s step holds the buckets at 990..1020 in one point (990 is a multiple of 30).
    assert_eq!(
        points(sel(0, 2000), 30),
        [("n1".into(), 990, 11), ("n2".into(), 1020, 7)]
    );
    assert_eq!(points(sel(1010, 1020), 10), [("n1".into(), 1010, 5)]);
    let n2 = |l: &LabelSet| l.get("node").is_some_and(|n| n == "n2");
    let only_n2 = Selection {
        labels: &n2,
        ..sel(0, 2000)
    };
    assert_eq!(points(only_n2, 10), [("n2".into(), 1020, 7)]);
    let missing_type = Selection {
        sample_type: "cpu",
        ..sel(0, 2000)
    };
    assert!(store.series(&missing_type, 10).unwrap().is_empty());
}

#[test]
fn compaction_keeps_totals_and_expiry_removes() {
    let dir = tmp("compact");
    let store = SqliteStore::open(dir.path()).unwrap();
    for i in 0..60 {
        store
            .ingest(&batch("a", i, 3000 + i as i64 * 10, "n1", &["x"], 1))
            .unwrap();
    }
    assert!(store.compact(3600, 300).unwrap() > 0);
    assert_eq!(total(&store, 0, 10_000), 60);
    // 3000..3300 became one bucket at 3000.
    assert_eq!(total(&store, 3000, 3001), 30);
    store.expire(3300).unwrap();
    assert_eq!(total(&store, 0, 10_000), 30);
}

fn tenant_batch(seq: u64, time_s: i64, tenant: &str, pid: u64, stack: &[&str]) -> Batch {
    let mut b = batch("t", seq, time_s, "n1", stack, 1);
    let mut labels = (*b.rows[0].labels).clone();
    labels.insert("pid".into(), pid.to_string());
    if !tenant.is_empty() {
        labels.insert(TENANT_LABEL.into(), tenant.into());
    }
    b.rows[0].labels = Arc::new(labels);
    b
}

/// New label sets beyond the tenant's limit are refused (counted), known ones still stored,
/// other tenants unaffected; the count survives a restart.
#[test]
fn label_sets_are_limited_per_tenant() {
    let dir = tmp("cardinality");
    let store = SqliteStore::open(dir.path()).unwrap();
    let limited = |b: Batch| Batch {
        max_label_sets: Some(3),
        ..b
    };
    for pid in 0..5 {
        let r = store
            .ingest(&limited(tenant_batch(pid, 1000, "ci", pid, &["main"])))
            .unwrap();
        assert_eq!(
            (r.rows, r.rows_refused),
            if pid < 3 { (1, 0) } else { (0, 1) }
        );
    }
    let known = store
        .ingest(&limited(tenant_batch(10, 1000, "ci", 1, &["main"])))
        .unwrap();
    assert_eq!(known.rows_refused, 0);
    assert_eq!(
        store
            .ingest(&limited(tenant_batch(11, 1000, "", 9, &["main"])))
            .unwrap()
            .rows_refused,
        0
    );
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    let r = store
        .ingest(&limited(tenant_batch(12, 1000, "ci", 7, &["main"])))
        .unwrap();
    assert_eq!(r.rows_refused, 1);
}

/// Expiry removes the label sets, stacks and names only expired samples used, keeps the
/// rest, and a store reopened reads no stack until a query needs it.
#[test]
fn expiry_prunes_what_no_sample_uses() {
    let dir = tmp("prune");
    let store = SqliteStore::open(dir.path()).unwrap();
    store
        .ingest(&tenant_batch(1, 1000, "", 1, &["main", "old_only"]))
        .unwrap();
    store
        .ingest(&tenant_batch(2, 5000, "", 2, &["main", "kept"]))
        .unwrap();
    assert_eq!(store.interned().unwrap(), (2, 2, 3));
    store.expire(2000).unwrap();
    assert_eq!(store.interned().unwrap(), (1, 1, 2));
    assert_eq!(total(&store, 0, 10_000), 1);
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    assert!(
        store.cache().stack_by_id.is_empty(),
        "no stack read at start"
    );
    let all = |_: &LabelSet| true;
    let got = store
        .select(&Selection {
            from_s: 0,
            to_s: 10_000,
            sample_type: "samples",
            labels: &all,
        })
        .unwrap();
    let frames: Vec<&str> = got[0].stack.iter().map(|f| &**f).collect();
    assert_eq!(frames, ["main", "kept"]);
    store
        .ingest(&tenant_batch(3, 6000, "", 3, &["main", "late"]))
        .unwrap();
    store.expire(5500).unwrap();
    assert_eq!(store.interned().unwrap(), (1, 1, 2));
    assert_eq!(total(&store, 0, 10_000), 1);
    // A label set a push used while retention looked is kept, though the snapshot found
    // it unused.
    let id: i64 = store
        .writer()
        .query_row("SELECT id FROM labelsets", [], |r| r.get(0))
        .unwrap();
    *store.touched.lock().unwrap() = Some(retention::Touched::default());
    store.touch([id].into_iter(), [].into_iter(), Vec::new());
    assert_eq!(
        store
            .delete_slice("labelsets", &[id], |t| &t.labelsets)
            .unwrap(),
        0
    );
    *store.touched.lock().unwrap() = None;
    assert_eq!(total(&store, 0, 10_000), 1);
}

/// A query past its deadline stops with `Timeout`; a push meanwhile does not wait for it.
#[test]
fn queries_stop_at_their_deadline_and_never_block_pushes() {
    let dir = tmp("deadline");
    let store = Arc::new(SqliteStore::open(dir.path()).unwrap());
    for i in 0..200 {
        store
            .ingest(&tenant_batch(
                i,
                1000 + i as i64 * 10,
                "",
                i,
                &["main", "work"],
            ))
            .unwrap();
    }
    let all = |_: &LabelSet| true;
    let sel = Selection {
        from_s: 0,
        to_s: 100_000,
        sample_type: "samples",
        labels: &all,
    };
    let past = std::time::Instant::now() - std::time::Duration::from_secs(1);
    assert!(matches!(
        with_deadline(past, || store.select(&sel)),
        Err(StoreError::Timeout)
    ));
    assert!(matches!(
        with_deadline(past, || store.series(&sel, 10)),
        Err(StoreError::Timeout)
    ));
    // A reader inside a long read transaction: the writer still commits.
    let reader = store.reader().unwrap();
    reader.execute_batch("BEGIN").unwrap();
    reader
        .query_row("SELECT count(*) FROM chunks", [], |_| Ok(()))
        .unwrap();
    let started = std::time::Instant::now();
    store
        .ingest(&tenant_batch(999, 9000, "", 1, &["main"]))
        .unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
    reader.execute_batch("COMMIT").unwrap();
}

/// A batch of 64 rows whose label set and stacks (64 down to 1 frame deep) no other `seq`
/// uses: each push writes new pages.
fn all_new_batch(seq: u64) -> Batch {
    let mut b = batch("a", seq, 1000 + seq as i64 * 10, "n", &["main"], 1);
    let labels: LabelSet = [("node".to_string(), format!("node-{seq}"))].into();
    let labels = Arc::new(labels);
    b.rows = (0..64)
        .map(|i| Row {
            labels: labels.clone(),
            stack: Arc::new(
                (i..64)
                    .map(|f| crate::store::Frame::from(format!("function_{f:04}_{seq}").as_str()))
                    .collect(),
            ),
            sample_type: 0,
            value: 1,
        })
        .collect();
    b
}

/// The log grows while a reader holds an old snapshot (no checkpoint can empty it then); once
/// the reader is gone, the next pushes find it checkpointed and cut it back to its limit, so a
/// burst of pushes does not leave the store's disk use at its high-water mark.
#[test]
fn write_ahead_log_is_cut_back_after_a_burst() {
    let dir = tmp("wal");
    let store = SqliteStore::open(dir.path()).unwrap();
    let wal = dir.path().join("pyrometer.sqlite-wal");
    let wal_len = || std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    store
        .ingest(&batch("a", 0, 1000, "n", &["main"], 1))
        .unwrap();
    let reader = rusqlite::Connection::open(dir.path().join("pyrometer.sqlite")).unwrap();
    reader
        .execute_batch("BEGIN; SELECT count(*) FROM sqlite_master;")
        .unwrap();
    let mut seq = 1;
    while wal_len() <= 2 * JOURNAL_SIZE_LIMIT {
        assert!(seq < 100_000, "the log never grew: {} bytes", wal_len());
        store.ingest(&all_new_batch(seq)).unwrap();
        seq += 1;
    }
    reader.execute_batch("COMMIT").unwrap();
    drop(reader);
    let grown = wal_len();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while wal_len() > JOURNAL_SIZE_LIMIT {
        assert!(
            std::time::Instant::now() < deadline,
            "the log stayed at {} bytes (grown to {grown}), limit {JOURNAL_SIZE_LIMIT}",
            wal_len()
        );
        store
            .ingest(&batch("a", seq, 1000, "n", &["main"], 1))
            .unwrap();
        seq += 1;
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Pushes one after another with no query reading keep the log within its size limit: the
/// push that fills it past its threshold checkpoints it, and the next starts it again from
/// its beginning. A checkpoint beside a writer that never pauses does not catch up (the
/// store bench's log grew to 227 MiB that way).
#[test]
fn write_ahead_log_stays_within_its_limit_under_back_to_back_pushes() {
    let dir = tmp("wal-busy");
    let store = SqliteStore::open(dir.path()).unwrap();
    let db = dir.path().join("pyrometer.sqlite");
    let wal = dir.path().join("pyrometer.sqlite-wal");
    let len = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let mut largest = 0;
    let mut seq = 0;
    // Written in all: four times the limit, so the log was started again several times.
    while len(&db) <= 4 * JOURNAL_SIZE_LIMIT {
        seq += 1;
        assert!(seq < 100_000, "the database never grew: {} bytes", len(&db));
        store.ingest(&all_new_batch(seq)).unwrap();
        largest = largest.max(len(&wal));
    }
    assert!(
        largest <= JOURNAL_SIZE_LIMIT,
        "the log reached {largest} bytes over {seq} pushes (limit {JOURNAL_SIZE_LIMIT}, \
         database {} bytes)",
        len(&db)
    );
}
