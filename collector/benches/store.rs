//! Collector throughput, printed by `cargo xtask bench` for both stores side by side on the
//! same synthetic cluster: ingest rate (decode + store, one thread, so per core; for
//! ClickHouse also the server's own CPU), bytes stored per sample, and query latency over one
//! hour of 10 s buckets from simulated nodes. Profiles are synthetic but shaped like an agent's: a few
//! processes with threads per node, stacks 15 to 45 frames deep drawn from a shared pool (the
//! same code runs on every node), a few hundred samples per 10 s batch.
//!
//! Sizes: BENCH_NODES (default 100), BENCH_BUCKETS (default 360 = 1 h), BENCH_ROWS (distinct
//! (labels, stack) rows per batch, default 100); BENCH_STORES=sqlite or clickhouse runs one.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prost::Message;
#[path = "../tests/common/certs.rs"]
mod certs;
#[path = "../tests/common/clickhouse_server.rs"]
mod clickhouse_server;

use clickhouse_server::ClickHouse;
use pyrometer_collector::clickhouse::{ClickHouseStore, Location};
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

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into ts.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A fresh store of each kind: SQLite in a temporary directory, and ClickHouse on a private
/// server (Debian's clickhouse-server, started here; skipped with a note when missing).
enum Kind {
    Sqlite(std::path::PathBuf),
    ClickHouse(ClickHouse),
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::Sqlite(_) => "SQLite",
            Kind::ClickHouse(_) => "ClickHouse",
        }
    }

    /// CPU seconds the ClickHouse server has used so far (0 for SQLite, which runs in the
    /// collector's thread and is already in its time).
    fn server_cpu_s(&self) -> f64 {
        let Kind::ClickHouse(server) = self else {
            return 0.0;
        };
        server_cpu::seconds(server.pid())
    }
}

/// The server's CPU time to the nanosecond, from a cgroup of its own (cgroup v1 `cpuacct`
/// or v2 `cpu.stat`), which also keeps the time of its threads that have exited (18.16
/// starts threads per query). Where no cgroup can be made, the process's `utime + stime`
/// in clock ticks (10 ms: a third of a small query's time, so those figures are coarse).
mod server_cpu {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    static GROUP: OnceLock<Option<(PathBuf, bool)>> = OnceLock::new();

    fn group(pid: u32) -> Option<&'static (PathBuf, bool)> {
        GROUP
            .get_or_init(|| {
                let name = format!("pyrometer-bench-{}", std::process::id());
                let v1 = PathBuf::from("/sys/fs/cgroup/cpuacct");
                let v2 = PathBuf::from("/sys/fs/cgroup");
                let (dir, is_v2) = if v1.join("cpuacct.usage").exists() {
                    (v1.join(name), false)
                } else if v2.join("cgroup.controllers").exists() {
                    (v2.join(name), true)
                } else {
                    return None;
                };
                std::fs::create_dir_all(&dir).ok()?;
                std::fs::write(dir.join("cgroup.procs"), pid.to_string()).ok()?;
                Some((dir, is_v2))
            })
            .as_ref()
    }

    pub fn seconds(pid: u32) -> f64 {
        if let Some((dir, is_v2)) = group(pid) {
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            let ns = if *is_v2 {
                read("cpu.stat")
                    .lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .map(|us| us * 1e3)
            } else {
                read("cpuacct.usage").trim().parse::<f64>().ok()
            };
            if let Some(ns) = ns {
                return ns / 1e9;
            }
        }
        ticks_s(pid)
    }

    /// Removes the cgroup once the server has exited (an emptied cgroup can be removed).
    pub fn remove() {
        if let Some(Some((dir, _))) = GROUP.get() {
            let _ = std::fs::remove_dir(dir);
        }
    }

    fn ticks_s(pid: u32) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis; utime and stime are 14th and 15th.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // SAFETY: sysconf has no memory effects.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        (ticks(11) + ticks(12)) / hz
    }
}

fn main() {
    // `cargo bench` passes --bench; nothing else is expected.
    let nodes = env("BENCH_NODES", 100);
    let buckets = env("BENCH_BUCKETS", 360) as i64;
    let rows = env("BENCH_ROWS", 100);
    // Queries only, over a SQLite store an earlier run left (its directory), e.g. to compare
    // query changes without ingesting again.
    if let Ok(dir) = std::env::var("BENCH_QUERY_SQLITE") {
        let path = std::path::PathBuf::from(dir);
        let store = SqliteStore::open(&path).expect("open the store");
        queries(&Kind::Sqlite(path), &store, buckets);
        return;
    }
    let base =
        std::env::temp_dir().join(format!("pyrometer-collector-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    // BENCH_STORES=sqlite (or clickhouse) runs one store only.
    let stores = std::env::var("BENCH_STORES").unwrap_or_else(|_| "sqlite,clickhouse".into());
    let mut kinds = Vec::new();
    if stores.contains("sqlite") {
        kinds.push(Kind::Sqlite(base.join("sqlite")));
    }
    let clickhouse = stores.contains("clickhouse");
    if clickhouse && std::path::Path::new(clickhouse_server::SERVER).exists() {
        kinds.push(Kind::ClickHouse(ClickHouse::start(
            &base.join("clickhouse"),
        )));
    } else if clickhouse {
        println!(
            "(no {}: ClickHouse figures skipped; cargo xtask deps installs it)",
            clickhouse_server::SERVER
        );
    }
    println!(
        "collector stores ({nodes} nodes x {buckets} buckets of 10 s, {rows} rows a batch, ingest on one thread)"
    );
    for kind in &kinds {
        let store: Box<dyn Store> = match kind {
            Kind::Sqlite(dir) => Box::new(SqliteStore::open(dir).expect("open the store")),
            Kind::ClickHouse(server) => Box::new(
                ClickHouseStore::open(
                    &Location::parse(&server.url("bench")).expect("url"),
                    Some((
                        clickhouse_server::USER.into(),
                        clickhouse_server::PASSWORD.into(),
                    )),
                    Duration::from_secs(60),
                )
                .expect("open the ClickHouse store"),
            ),
        };
        run(kind, store.as_ref(), nodes, buckets, rows);
    }
    drop(kinds);
    server_cpu::remove();
    let _ = std::fs::remove_dir_all(&base);
}

fn run(kind: &Kind, store: &dyn Store, nodes: usize, buckets: i64, rows: usize) {
    let limits = Limits::default();
    // The same seed for every store: the same cluster.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let pool = stack_pool(&mut rng);
    let now_s = 2_000_000_000;
    let first_bucket = now_s / BUCKET_SECONDS - buckets;

    let (mut busy, mut samples, mut stored_rows, mut wire_bytes) =
        (Duration::ZERO, 0i64, 0u64, 0usize);
    let (mut cpu, mut decode_cpu) = (Duration::ZERO, Duration::ZERO);
    let cpu_before = kind.server_cpu_s();
    for b in 0..buckets {
        for n in 0..nodes {
            let (bytes, total) = batch(&mut rng, &pool, n, first_bucket + b, rows);
            let started = Instant::now();
            let cpu_started = thread_cpu();
            let decoded =
                ingest::decode(&bytes, &ingest::Context::new(&limits, now_s)).expect("valid batch");
            let decoded_at = thread_cpu();
            decode_cpu += decoded_at - cpu_started;
            let r = store.ingest(&decoded).expect("ingest");
            cpu += thread_cpu() - cpu_started;
            busy += started.elapsed();
            samples += total;
            stored_rows += r.rows;
            wire_bytes += bytes.len();
        }
    }
    let server_cpu = kind.server_cpu_s() - cpu_before;
    let batches = nodes as u64 * buckets as u64;
    let size = store.size_bytes().expect("size");
    let name = kind.name();
    println!(
        "  {name:<10} ingest (decode + store)   {:>10.0} samples/s per collector core (its CPU time; {:.0} rows/s)",
        samples as f64 / cpu.as_secs_f64(),
        stored_rows as f64 / cpu.as_secs_f64(),
    );
    println!(
        "  {name:<10} ingest CPU per batch      {:>10.0} us decoding + {:.0} us storing",
        decode_cpu.as_secs_f64() * 1e6 / batches as f64,
        (cpu - decode_cpu).as_secs_f64() * 1e6 / batches as f64,
    );
    println!(
        "  {name:<10} ingest, one thread        {:>10.0} samples/s wall clock ({:.0} batches/s, waits for fsync or HTTP included)",
        samples as f64 / busy.as_secs_f64(),
        batches as f64 / busy.as_secs_f64()
    );
    if server_cpu > 0.0 {
        println!(
            "  {name:<10} server CPU while ingesting {:>10.0} samples/s per server core ({server_cpu:.1} s of CPU)",
            samples as f64 / server_cpu
        );
    }
    println!(
        "  {name:<10} stored                    {:>10.1} bytes per sample ({:.1} MiB for {samples} samples; {:.0} bytes a sample on the wire)",
        size as f64 / samples as f64,
        size as f64 / (1 << 20) as f64,
        wire_bytes as f64 / samples as f64
    );

    if let Kind::ClickHouse(server) = kind {
        settle(server);
    }
    queries(kind, store, buckets);
}

/// Waits (up to a minute) until ClickHouse has merged the parts the ingest wrote, as it
/// does on its own some seconds after inserts, so query times and the server's CPU measure
/// the queries rather than background merges.
fn settle(server: &ClickHouse) {
    let started = Instant::now();
    let sql = "SELECT count() FROM system.merges WHERE database = 'bench'";
    while server.sql(sql).trim() != "0" && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let parts_sql = "SELECT count() FROM system.parts WHERE database = 'bench' AND table = 'samples_v2' AND active";
    let parts = server.sql(parts_sql);
    // Queries read every active part, and how many an ingest leaves unmerged depends on the
    // merges' timing (4 to 9 in five runs of the same ingest): merged into one, runs compare
    // alike.
    server.sql("OPTIMIZE TABLE bench.samples_v2 FINAL");
    println!(
        "  ClickHouse merges settled after {:.1} s; {} active parts, {} after OPTIMIZE FINAL",
        started.elapsed().as_secs_f64(),
        parts.trim(),
        server.sql(parts_sql).trim()
    );
}

/// An hour's queries over the store (the last `buckets` buckets before the cluster's "now").
fn queries(kind: &Kind, store: &dyn Store, buckets: i64) {
    let name = kind.name();
    let now_s = 2_000_000_000;
    let from_s = (now_s / BUCKET_SECONDS - buckets) * BUCKET_SECONDS;
    let to_s = now_s + 1;
    for (what, query) in [
        ("whole cluster", "{}"),
        ("one node", "{node=\"node-7\"}"),
        ("one process name", "{comm=\"ray::Worker3\"}"),
    ] {
        let selector = Selector::parse(query).expect("query");
        let predicate = |l: &pyrometer_collector::store::LabelSet| selector.matches(l);
        let selection = Selection {
            from_s,
            to_s,
            sample_type: "samples",
            labels: &predicate,
        };
        // The flame graph the API and web UI draw (label sets merged down to `comm`, which
        // is all a flame graph reads), then the same selection with every label kept, as a
        // pprof download needs it.
        let merged = || {
            render::folded(
                &store
                    .select_merged(&selection, &["comm"])
                    .expect("select_merged"),
            )
            .len()
        };
        let full = || render::folded(&store.select(&selection).expect("select")).len();
        for (how, f) in [
            ("flame graph", &merged as &dyn Fn() -> usize),
            ("every label", &full),
        ] {
            let mut times = Vec::new();
            let mut cpu_times = Vec::new();
            let mut own_times = Vec::new();
            let mut stacks = 0;
            for _ in 0..5 {
                let started = Instant::now();
                let cpu_started = thread_cpu();
                let server_started = kind.server_cpu_s();
                stacks = f();
                times.push(started.elapsed());
                own_times.push(thread_cpu() - cpu_started);
                cpu_times.push(
                    thread_cpu() - cpu_started
                        + Duration::from_secs_f64((kind.server_cpu_s() - server_started).max(0.0)),
                );
            }
            // CPU time (the collector's thread and the ClickHouse server's) beside the wall
            // clock: on a shared machine the latter mostly measures the neighbours.
            println!(
                "  {name:<10} query 1 h, {what:<17}{:>10.1} ms median of 5 ({:.1} ms CPU, the collector's {:.1}; {stacks} stacks, folded; {how})",
                median(times).as_secs_f64() * 1e3,
                median(cpu_times).as_secs_f64() * 1e3,
                median(own_times).as_secs_f64() * 1e3
            );
        }
        // The web UI's chart over the same selection: one point per label set and 20 s step
        // (the step the UI asks for over an hour).
        let mut times = Vec::new();
        let mut cpu_times = Vec::new();
        let mut own_times = Vec::new();
        let mut points = 0;
        for _ in 0..5 {
            let started = Instant::now();
            let cpu_started = thread_cpu();
            let server_started = kind.server_cpu_s();
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
            own_times.push(thread_cpu() - cpu_started);
            cpu_times.push(
                thread_cpu() - cpu_started
                    + Duration::from_secs_f64((kind.server_cpu_s() - server_started).max(0.0)),
            );
        }
        println!(
            "  {name:<10} series 1 h, {what:<16}{:>10.1} ms median of 5 ({:.1} ms CPU, the collector's {:.1}; {points} points, 20 s steps)",
            median(times).as_secs_f64() * 1e3,
            median(cpu_times).as_secs_f64() * 1e3,
            median(own_times).as_secs_f64() * 1e3
        );
    }
}
