//! The collector's own health on `/metrics`, in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::store::Ingested;

/// A counter per reason; reasons are names fixed in the code (limit keys and the like), so
/// their number is bounded.
#[derive(Default)]
pub struct ByReason(Mutex<BTreeMap<&'static str, u64>>);

impl ByReason {
    pub fn add(&self, reason: &'static str) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(reason).or_default();
        *n = n.saturating_add(1);
    }

    pub fn get(&self, reason: &str) -> u64 {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.get(reason).copied().unwrap_or(0)
    }

    /// `name{label="reason"} n` lines, the `always` reasons listed even at 0.
    fn render(&self, out: &mut String, name: &str, label: &str, help: &str, always: &[&str]) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for r in always {
            m.entry(r).or_default();
        }
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} counter\n");
        for (reason, n) in m {
            let _ = writeln!(out, "{name}{{{label}=\"{reason}\"}} {n}");
        }
    }
}

#[derive(Default)]
pub struct Metrics {
    pub batches_ingested: AtomicU64,
    pub batches_duplicate: AtomicU64,
    pub rows_ingested: AtomicU64,
    /// Pushes refused: `unauthenticated`, `forbidden`, `invalid`, `store_error`, `time_window`,
    /// `rate_limited`, or the key of the limit a push broke.
    pub pushes_refused: ByReason,
    /// Requests (pushes and reads) whose credentials were missing, wrong or not allowed.
    pub auth_failures: ByReason,
    /// Readings of the token file on SIGHUP: `ok`, or `error` (the old tokens stay).
    pub token_reloads: ByReason,
    /// Samples of new label sets refused over a tenant's `max_label_sets`.
    pub label_sets_refused: AtomicU64,
    pub tls_handshake_failures: AtomicU64,
    /// Connections closed on arrival because `--max-connections` were open.
    pub connections_refused: AtomicU64,
    /// Queries answered 503 because the store was unavailable.
    pub queries_unavailable: AtomicU64,
    /// Queries answered 503 because they ran past their tenant's query timeout.
    pub queries_timed_out: AtomicU64,
    ingest_ns: AtomicU64,
    ingest_count: AtomicU64,
    /// CPU time of the threads that decoded and stored pushes, and the most one took.
    push_cpu_ns: AtomicU64,
    push_cpu_max_ns: AtomicU64,
    query_ns: AtomicU64,
    query_count: AtomicU64,
    query_errors: AtomicU64,
}

impl Metrics {
    pub fn observe_ingest(&self, took: Duration, stored: Ingested) {
        self.ingest_ns.fetch_add(took.as_nanos() as u64, Relaxed);
        self.ingest_count.fetch_add(1, Relaxed);
        if stored.duplicate {
            self.batches_duplicate.fetch_add(1, Relaxed);
        } else {
            self.batches_ingested.fetch_add(1, Relaxed);
            self.rows_ingested.fetch_add(stored.rows, Relaxed);
            self.label_sets_refused
                .fetch_add(stored.rows_refused, Relaxed);
        }
    }

    /// The CPU time one push (or OTLP request) took of the thread that handled it.
    pub fn observe_push_cpu(&self, cpu: Duration) {
        let ns = cpu.as_nanos() as u64;
        self.push_cpu_ns.fetch_add(ns, Relaxed);
        self.push_cpu_max_ns.fetch_max(ns, Relaxed);
    }

    pub fn observe_query(&self, took: Duration, ok: bool) {
        self.query_ns.fetch_add(took.as_nanos() as u64, Relaxed);
        self.query_count.fetch_add(1, Relaxed);
        if !ok {
            self.query_errors.fetch_add(1, Relaxed);
        }
    }

    pub fn render(&self, store_bytes: Option<u64>) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"
            );
        };
        counter(
            &mut out,
            "pyrometer_collector_batches_ingested_total",
            "Batches stored (first delivery).",
            self.batches_ingested.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_batches_duplicate_total",
            "Batches received again after being stored (replays), not counted twice.",
            self.batches_duplicate.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_sample_rows_ingested_total",
            "Sample rows (stack, label set, type) stored.",
            self.rows_ingested.load(Relaxed),
        );
        self.pushes_refused.render(
            &mut out,
            "pyrometer_collector_pushes_refused_total",
            "reason",
            "Pushes refused, by reason (a limit's key when a push broke it).",
            &["unauthenticated", "invalid", "store_error"],
        );
        self.auth_failures.render(
            &mut out,
            "pyrometer_collector_auth_failures_total",
            "reason",
            "Requests refused for their credentials, by reason.",
            &["missing", "wrong_token", "forbidden"],
        );
        self.token_reloads.render(
            &mut out,
            "pyrometer_collector_token_file_reloads_total",
            "result",
            "Readings of the token file on SIGHUP; after an error the tokens read before stay.",
            &["ok", "error"],
        );
        counter(
            &mut out,
            "pyrometer_collector_label_sets_refused_total",
            "Samples of new label sets refused over a tenant's max_label_sets.",
            self.label_sets_refused.load(Relaxed),
        );
        summary(
            &mut out,
            "pyrometer_collector_ingest_duration_seconds",
            "Time to decode and store one batch.",
            self.ingest_ns.load(Relaxed),
            self.ingest_count.load(Relaxed),
        );
        let _ = write!(
            out,
            "# HELP pyrometer_collector_push_cpu_seconds_total CPU time of the threads that \
             decoded and stored pushes.\n\
             # TYPE pyrometer_collector_push_cpu_seconds_total counter\n\
             pyrometer_collector_push_cpu_seconds_total {}\n\
             # HELP pyrometer_collector_push_cpu_seconds_max The most CPU time one push took.\n\
             # TYPE pyrometer_collector_push_cpu_seconds_max gauge\n\
             pyrometer_collector_push_cpu_seconds_max {}\n",
            self.push_cpu_ns.load(Relaxed) as f64 / 1e9,
            self.push_cpu_max_ns.load(Relaxed) as f64 / 1e9,
        );
        summary(
            &mut out,
            "pyrometer_collector_query_duration_seconds",
            "Time to answer one profile query.",
            self.query_ns.load(Relaxed),
            self.query_count.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_tls_handshake_failures_total",
            "Connections dropped in the TLS handshake (plain-text clients, unknown CAs, timeouts).",
            self.tls_handshake_failures.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_connections_refused_total",
            "Connections closed on arrival because --max-connections were open.",
            self.connections_refused.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_query_errors_total",
            "Profile queries answered with an error.",
            self.query_errors.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_queries_store_unavailable_total",
            "Queries answered 503 because the store was unreachable or overloaded.",
            self.queries_unavailable.load(Relaxed),
        );
        counter(
            &mut out,
            "pyrometer_collector_queries_timed_out_total",
            "Queries answered 503 because they ran past their tenant's query_timeout.",
            self.queries_timed_out.load(Relaxed),
        );
        if let Some(bytes) = store_bytes {
            let _ = write!(
                out,
                "# HELP pyrometer_collector_store_size_bytes Bytes the store occupies on disk.\n\
                 # TYPE pyrometer_collector_store_size_bytes gauge\n\
                 pyrometer_collector_store_size_bytes {bytes}\n"
            );
        }
        out
    }
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn summary(out: &mut String, name: &str, help: &str, ns: u64, count: u64) {
    let _ = write!(
        out,
        "# HELP {name} {help}\n# TYPE {name} summary\n{name}_sum {}\n{name}_count {count}\n",
        ns as f64 / 1e9
    );
}
