//! pyrometer's node-side library: loading and attaching the kernel programs, the process
//! registry and symbolizer, the aggregator, and the local outputs.

pub mod agent_metrics;
pub mod alloc;
pub mod bpf;
pub mod capture;
pub mod diff;
pub mod elfsyms;
pub mod gpu;
pub mod input;
pub mod model;
pub mod otlp;
pub mod output;
pub mod privileges;
pub mod procevents;
pub mod procs;
pub mod push;
pub mod python;
pub mod ray;
pub mod signals;
pub mod spool;
pub mod symbolize;
pub mod tables;
pub mod target;
pub mod unwinder;

/// A hash map for the per-sample and per-push paths: std's SipHash was a tenth of the
/// always-on agent's time there. Randomly seeded per process, so stacks and names a
/// profiled program chooses cannot be made to collide ahead of time.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
