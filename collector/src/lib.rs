//! The pyrometer collector: receives profiles pushed by node agents over gRPC, keeps them in
//! an embedded store, and answers queries (flame graphs, pprof, folded, top, group totals)
//! and diffs over HTTP on the same port, with a web UI and its own `/metrics`.

pub mod api;
pub mod auth;
pub mod capture_files;
pub mod captures;
pub mod clickhouse;
pub mod config;
pub mod frames;
pub mod idmap;
pub mod ingest;
pub mod labelset;
pub mod limits;
pub mod memory;
pub mod metrics;
pub mod otlp_ingest;
pub mod query;
pub mod render;
pub mod serve;
pub mod sqlite;
pub mod store;
pub mod tenant;
pub mod tenant_name;
pub mod tls;
pub mod ui;
pub mod wire;
