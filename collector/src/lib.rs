//! The pyrometer collector: receives profiles pushed by node agents over gRPC, keeps them in
//! an embedded store, and answers queries (flame graphs, pprof, folded, top, group totals)
//! and diffs over HTTP on the same port, with a web UI and its own `/metrics`.

pub mod clickhouse;
pub mod diff_api;
pub mod idmap;
pub mod ingest;
pub mod metrics;
pub mod otlp_ingest;
pub mod query;
pub mod render;
pub mod series_api;
pub mod server;
pub mod sqlite;
pub mod store;
pub mod tls;
pub mod trace_link;
pub mod ui;
pub mod wire;
