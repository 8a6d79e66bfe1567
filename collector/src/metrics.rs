//! The collector's own health on `/metrics`, in the Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::store::Ingested;

#[derive(Default)]
pub struct Metrics {
    pub batches_ingested: AtomicU64,
    pub batches_duplicate: AtomicU64,
    pub rows_ingested: AtomicU64,
    pub refused_unauthenticated: AtomicU64,
    pub refused_invalid: AtomicU64,
    pub store_errors: AtomicU64,
    pub tls_handshake_failures: AtomicU64,
    /// Queries answered 503 because the store was unavailable.
    pub queries_unavailable: AtomicU64,
    ingest_ns: AtomicU64,
    ingest_count: AtomicU64,
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
        }
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
        let _ = write!(
            out,
            "# HELP pyrometer_collector_pushes_refused_total Pushes refused, by reason.\n\
             # TYPE pyrometer_collector_pushes_refused_total counter\n\
             pyrometer_collector_pushes_refused_total{{reason=\"unauthenticated\"}} {}\n\
             pyrometer_collector_pushes_refused_total{{reason=\"invalid\"}} {}\n\
             pyrometer_collector_pushes_refused_total{{reason=\"store_error\"}} {}\n",
            self.refused_unauthenticated.load(Relaxed),
            self.refused_invalid.load(Relaxed),
            self.store_errors.load(Relaxed),
        );
        summary(
            &mut out,
            "pyrometer_collector_ingest_duration_seconds",
            "Time to decode and store one batch.",
            self.ingest_ns.load(Relaxed),
            self.ingest_count.load(Relaxed),
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

fn summary(out: &mut String, name: &str, help: &str, ns: u64, count: u64) {
    let _ = write!(
        out,
        "# HELP {name} {help}\n# TYPE {name} summary\n{name}_sum {}\n{name}_count {count}\n",
        ns as f64 / 1e9
    );
}
