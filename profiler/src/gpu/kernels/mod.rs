//! GPU kernels by launching stack, around the capture: the library `libpyrometer_cupti.so` and
//! the probes on it ([`probes`]), and what `record` says at the end ([`report`]). The channel,
//! the join and the accounting are the capture's (`crate::capture::gpu`).

pub mod probes;
pub mod report;
