//! The SQLite store's own tests: replays, the first layout's conversion, the time series,
//! compaction and expiry.

use super::*;
use crate::store::Row;

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

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pyrometer-store-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn replay_counts_once_and_survives_reopen() {
    let dir = tmp("replay");
    let store = SqliteStore::open(&dir).unwrap();
    let b = batch("a", 1, 1000, "n1", &["main", "work"], 7);
    assert!(!store.ingest(&b).unwrap().duplicate);
    assert!(store.ingest(&b).unwrap().duplicate);
    store
        .ingest(&batch("a", 2, 1003, "n1", &["main", "work"], 5))
        .unwrap();
    assert_eq!(total(&store, 0, 2000), 12);
    drop(store);
    let store = SqliteStore::open(&dir).unwrap();
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
    std::fs::create_dir_all(&dir).unwrap();
    {
        let conn = Connection::open(dir.join("pyrometer.sqlite")).unwrap();
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
    let store = SqliteStore::open(&dir).unwrap();
    assert_eq!(total(&store, 0, 2000), 12);
    assert_eq!(total(&store, 1010, 2000), 5);
    assert!(
        store
            .ingest(&batch("a", 1, 1000, "n1", &["main"], 1))
            .unwrap()
            .duplicate
    );
    drop(store);
    let store = SqliteStore::open(&dir).unwrap();
    assert_eq!(total(&store, 0, 2000), 12);
}

#[test]
fn series_sums_stacks_per_step_and_label_set() {
    let store = SqliteStore::open(&tmp("series")).unwrap();
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
    let store = SqliteStore::open(&dir).unwrap();
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
