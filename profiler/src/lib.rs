//! pyrometer's node-side library. Its public API is what the `pyrometer` binary uses: the
//! commands ([`record`], [`top`], [`dump`], [`verifier`], [`install_preload`] and the node
//! [`agent`], with [`command`]'s error type and shared settings), the profile [`model`], and
//! the formats ([`output`], [`input`], [`diff`]) and GPU polling ([`gpu`]). Below them, in
//! layers that import only downward (docs/src/internals.md draws them, `cargo xtask arch`
//! checks them): the profiler (sampler, tables, process registry, capture), interpreters and
//! allocations, the kernel side and symbolization, and the OS facts everything starts from.

#![warn(missing_docs)]

pub mod agent;
mod alloc;
mod bpf;
mod capture;
pub mod command;
pub mod diff;
pub mod dump;
pub mod gpu;
pub mod input;
pub mod install_preload;
pub mod model;
mod os;
mod otlp;
pub mod output;
mod profiler;
mod python;
mod ray;
pub mod record;
mod symbolize;
mod tables;
pub mod top;
mod unwinder;
pub mod verifier;

/// A hash map for the per-sample and per-push paths: std's SipHash was a tenth of the
/// always-on agent's time there. Randomly seeded per process, so stacks and names a
/// profiled program chooses cannot be made to collide ahead of time.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
