//! pyrometer's node-side library: loading and attaching the kernel programs, the process
//! registry and symbolizer, the aggregator, and the local outputs.

pub mod bpf;
pub mod model;
pub mod privileges;
pub mod target;
