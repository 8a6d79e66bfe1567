//! Collector throughput, printed by `cargo xtask bench`: ingest rate (decode + store, one
//! thread, so per core), bytes stored per sample, and query latency over one hour of 10 s
//! buckets from simulated nodes. Profiles are synthetic but shaped like an agent's: a few
//! processes with threads per node, stacks 15 to 45 frames deep drawn from a shared pool (the
//! same code runs on every node), a few hundred samples per 10 s batch.
//!
//! Sizes: BENCH_NODES (default 100), BENCH_BUCKETS (default 360 = 1 h), BENCH_ROWS (distinct
//! (labels, stack) rows per batch, default 100).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prost::Message;
use pyrometer_collector::ingest::{self, Limits};
use pyrometer_collector::query::Selector;
use pyrometer_collector::render;
use pyrometer_collector::sqlite::SqliteStore;
use pyrometer_collector::store::{BUCKET_SECONDS, Selection, Store};
use pyrometer_proto as pb;
use pyrometer_proto::ingest::PushRequest;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Shared code: 800 function names, 600 stacks (root first) over them.
fn stack_pool(rng: &mut Rng) -> (Vec<String>, Vec<Vec<usize>>) {
    let names: Vec<String> = (0..800)
        .map(|i| match i % 4 {
            0 => format!("_PyEval_EvalFrameDefault_{i}"),
            1 => format!("torch::autograd::Engine::evaluate_function_{i}"),
            2 => format!("ray::core::CoreWorker::ExecuteTask_{i}"),
            _ => format!("std::vector<float>::_M_realloc_insert_{i}"),
        })
        .collect();
    let stacks = (0..600)
        .map(|_| {
            let depth = 15 + rng.below(31) as usize;
            // Common roots, then anything.
            let mut s = vec![0, 1, 2];
            s.extend((3..depth).map(|_| rng.below(names.len() as u64) as usize));
            s
        })
        .collect();
    (names, stacks)
}

/// One node's push for one 10 s bucket.
fn batch(
    rng: &mut Rng,
    pool: &(Vec<String>, Vec<Vec<usize>>),
    node: usize,
    bucket: i64,
    rows: usize,
) -> (Vec<u8>, i64) {
    let (names, stacks) = pool;
    let mut strings = vec![String::new()];
    let mut ids: HashMap<String, i64> = HashMap::new();
    let mut id = |s: &str, strings: &mut Vec<String>| -> i64 {
        if let Some(&i) = ids.get(s) {
            return i;
        }
        strings.push(s.to_string());
        let i = strings.len() as i64 - 1;
        ids.insert(s.to_string(), i);
        i
    };
    let sample_type = vec![
        pb::ValueType {
            r#type: id("samples", &mut strings),
            unit: id("count", &mut strings),
        },
        pb::ValueType {
            r#type: id("cpu", &mut strings),
            unit: id("nanoseconds", &mut strings),
        },
    ];
    let mut functions: HashMap<usize, u64> = HashMap::new();
    let mut function = Vec::new();
    let mut location = Vec::new();
    let mut samples = Vec::new();
    let mut total = 0;
    for _ in 0..rows {
        let proc_ = rng.below(8);
        let thread = rng.below(4);
        let stack = &stacks[rng.below(stacks.len() as u64) as usize];
        let mut location_id = Vec::with_capacity(stack.len());
        for &f in stack.iter().rev() {
            let next = functions.len() as u64 + 1;
            let fid = *functions.entry(f).or_insert(next);
            if fid == next {
                function.push(pb::Function {
                    id: fid,
                    name: id(&names[f], &mut strings),
                    ..Default::default()
                });
                location.push(pb::Location {
                    id: fid,
                    line: vec![pb::Line {
                        function_id: fid,
                        ..Default::default()
                    }],
                    ..Default::default()
                });
            }
            location_id.push(fid);
        }
        let n = 1 + rng.below(5) as i64;
        total += n;
        let label = vec![
            pb::Label {
                key: id("pid", &mut strings),
                num: 1000 + proc_ as i64,
                ..Default::default()
            },
            pb::Label {
                key: id("comm", &mut strings),
                str: id(&format!("ray::Worker{proc_}"), &mut strings),
                ..Default::default()
            },
            pb::Label {
                key: id("thread", &mut strings),
                str: id(&format!("worker-{thread}"), &mut strings),
                ..Default::default()
            },
        ];
        samples.push(pb::Sample {
            location_id,
            value: vec![n, n * 10_101_010],
            label,
        });
    }
    let profile = pb::Profile {
        sample_type,
        sample: samples,
        location,
        function,
        string_table: strings,
        time_nanos: bucket * BUCKET_SECONDS * 1_000_000_000,
        duration_nanos: BUCKET_SECONDS * 1_000_000_000,
        ..Default::default()
    };
    let req = PushRequest {
        agent_id: format!("agent-{node}"),
        sequence: bucket as u64,
        node: format!("node-{node}"),
        profile: Some(profile),
    };
    (req.encode_to_vec(), total)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes --bench; nothing else is expected.
    let nodes = env("BENCH_NODES", 100);
    let buckets = env("BENCH_BUCKETS", 360) as i64;
    let rows = env("BENCH_ROWS", 100);
    let dir =
        std::env::temp_dir().join(format!("pyrometer-collector-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = SqliteStore::open(&dir).expect("open the store");
    let limits = Limits::default();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let pool = stack_pool(&mut rng);
    let now_s = 2_000_000_000;
    let first_bucket = now_s / BUCKET_SECONDS - buckets;

    let (mut busy, mut samples, mut stored_rows, mut wire_bytes) =
        (Duration::ZERO, 0i64, 0u64, 0usize);
    for b in 0..buckets {
        for n in 0..nodes {
            let (bytes, total) = batch(&mut rng, &pool, n, first_bucket + b, rows);
            let started = Instant::now();
            let decoded = ingest::decode(&bytes, &limits, now_s).expect("valid batch");
            let r = store.ingest(&decoded).expect("ingest");
            busy += started.elapsed();
            samples += total;
            stored_rows += r.rows;
            wire_bytes += bytes.len();
        }
    }
    let size = store.size_bytes().expect("size");
    let batches = nodes as u64 * buckets as u64;
    println!(
        "collector ingest ({nodes} nodes x {buckets} buckets of 10 s, {rows} rows a batch, one thread)"
    );
    println!(
        "  ingest rate (decode + store)       {:>10.0} samples/s per core ({:.0} rows/s, {:.0} batches/s)",
        samples as f64 / busy.as_secs_f64(),
        stored_rows as f64 / busy.as_secs_f64(),
        batches as f64 / busy.as_secs_f64()
    );
    println!(
        "  stored                             {:>10.1} bytes per sample ({:.1} MiB for {samples} samples; {:.0} bytes a sample on the wire)",
        size as f64 / samples as f64,
        size as f64 / (1 << 20) as f64,
        wire_bytes as f64 / samples as f64
    );

    let from_s = first_bucket * BUCKET_SECONDS;
    let to_s = now_s + 1;
    for (what, query) in [
        ("whole cluster", "{}"),
        ("one node", "{node=\"node-7\"}"),
        ("one process name", "{comm=\"ray::Worker3\"}"),
    ] {
        let selector = Selector::parse(query).expect("query");
        let predicate = |l: &pyrometer_collector::store::LabelSet| selector.matches(l);
        let mut times = Vec::new();
        let mut stacks = 0;
        for _ in 0..5 {
            let started = Instant::now();
            let selected = store
                .select(&Selection {
                    from_s,
                    to_s,
                    sample_type: "samples",
                    labels: &predicate,
                })
                .expect("select");
            let folded = render::folded(&selected);
            stacks = folded.len();
            times.push(started.elapsed());
        }
        println!(
            "  query 1 h, {what:<17}       {:>10.1} ms median of 5 ({stacks} stacks, folded)",
            median(times).as_secs_f64() * 1e3
        );
        // The web UI's chart over the same selection: one point per label set and 20 s step
        // (the step the UI asks for over an hour).
        let mut times = Vec::new();
        let mut points = 0;
        for _ in 0..5 {
            let started = Instant::now();
            let series = store
                .series(
                    &Selection {
                        from_s,
                        to_s,
                        sample_type: "samples",
                        labels: &predicate,
                    },
                    2 * BUCKET_SECONDS,
                )
                .expect("series");
            points = series.len();
            times.push(started.elapsed());
        }
        println!(
            "  series 1 h, {what:<17}      {:>10.1} ms median of 5 ({points} points, 20 s steps)",
            median(times).as_secs_f64() * 1e3
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
