//! GPU kernels by launching stack, the capture's part: what `libpyrometer_cupti.so`
//! (`gpu-inject/`, loaded by CUDA's injection hook) sends through the ring buffer is parsed
//! ([`channel`]), joined with the stacks the kernel's probe took at sampled launches ([`join`]),
//! added up by stack, device and stream ([`account`]) with the device-busy union beside the
//! summed time ([`busy`]), and turned into the profile's GPU samples ([`samples`]). Attaching
//! the probes and reporting are `crate::gpu::kernels`'.

pub mod account;
pub mod busy;
// Its records mirror gpu-inject/c/pyrometer_gpu.h field for field, and are documented there.
#[allow(missing_docs)]
pub mod channel;
pub mod join;
pub mod samples;
#[cfg(test)]
pub(crate) mod testenc;

/// The library's file name.
pub const LIBRARY: &str = "libpyrometer_cupti.so";
