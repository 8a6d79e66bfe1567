//! What the kernel side is loaded with: which processes it samples, how often, and which
//! optional stages (off-CPU time, GIL, allocations, the DWARF walk) it runs.

use std::path::PathBuf;

/// Default location of the running kernel's BTF.
pub const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

/// `--off-cpu-min` default (record and agent): long enough that a thread blocking for
/// microseconds at a high rate (spin-then-futex locks, busy polling) sends nothing, short
/// enough to catch a 1 ms I/O wait.
pub const DEFAULT_OFF_CPU_MIN: std::time::Duration = std::time::Duration::from_millis(1);

/// The GIL probe programs: take_gil's entry and return, drop_gil's entry.
pub const GIL_PROGRAMS: [&str; 3] = ["gil_take_enter", "gil_take_return", "gil_drop"];

/// The garbage-collector probe programs: a collection's start (USDT `gc__start` or the
/// collector function's entry), its end at USDT `gc__done`, and its end at the function's return.
pub const GC_PROGRAMS: [&str; 3] = ["gc_start", "gc_done", "gc_return"];

/// Which processes the kernel side samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Every process but the idle task and pyrometer itself.
    All,
    /// Only processes in the `targets` map.
    Targets,
}

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub frequency_hz: u64,
    pub filter: Filter,
    /// Ring buffer size in bytes: a power of two and a multiple of the page size.
    pub ring_buffer_bytes: u32,
    pub btf_path: PathBuf,
    /// Capacity of the unwind row array shared by all unwind tables (12 bytes a row).
    pub unwind_rows: u32,
    /// Off-CPU time (the sched_switch program): `Some(minimum blocked ns reported)`.
    pub off_cpu_min_ns: Option<u64>,
    /// GIL wait and hold time: loads the take_gil/drop_gil probe programs, attached per
    /// interpreter binary with [`Sampler::attach_uprobe`].
    pub gil: bool,
    /// CPython's garbage-collector pauses: loads the gc probe programs, attached per
    /// interpreter binary.
    pub gc: bool,
    /// asyncio task stacks: the Python walk also reads each thread's running task and the
    /// tasks awaiting it. A kernel that refuses it turns it off (see [`Sampler::refusals`]).
    pub asyncio: bool,
    /// Allocation sampling: loads the allocator probe programs, attached per process.
    pub alloc: Option<AllocConfig>,
    /// GPU kernels by launching stack: loads the probes of libpyrometer_cupti.so, attached per
    /// copy of the library.
    pub gpu_kernels: Option<GpuKernelsConfig>,
    /// Walk user stacks with DWARF unwind tables (`--unwind dwarf`); frame pointers only
    /// otherwise. A kernel that refuses the walk turns it off (see [`Sampler::refusals`]).
    pub dwarf: bool,
    /// `debug_reject` bits (tests only): makes the kernel refuse the stages named.
    pub debug_reject: u32,
}

/// How allocations are sampled (`record --alloc`, the agent's `--alloc-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocConfig {
    /// Mean bytes between samples; 1 samples every allocation.
    pub sample_bytes: u64,
    /// Capacity of the kernel's table of sampled blocks still allocated.
    pub live_entries: u32,
    /// Only processes added with [`Sampler::add_alloc_target`] (the agent), rather than every
    /// target (`record`).
    pub own_targets: bool,
}

/// `--alloc-sample-bytes` default: tcmalloc's and Go's rate.
pub const DEFAULT_ALLOC_SAMPLE_BYTES: u64 = 512 * 1024;
/// `--alloc-live` default: sampled blocks tracked at once (about 80 bytes each in the kernel).
pub const DEFAULT_ALLOC_LIVE: u32 = 262_144;

/// The allocator probe programs: every entry point's entry, and the return of those that
/// return a block.
pub const ALLOC_ENTER: &str = "alloc_enter";
pub const ALLOC_RETURN: &str = "alloc_return";
/// The preloaded sampler library's probe functions' programs (`pyrometer_alloc_sampled`,
/// `pyrometer_free_sampled`, `pyrometer_realloc_sampled`), attached for every process.
pub const ALLOC_PRELOAD: &str = "alloc_preload";
pub const ALLOC_PRELOAD_FREE: &str = "alloc_preload_free";
pub const ALLOC_PRELOAD_MOVE: &str = "alloc_preload_move";

/// Which processes' GPU library reports count (`record --gpu-kernels`, the agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuKernelsConfig {
    /// Every process that loads the library (the agent), rather than the targets (`record`).
    pub all: bool,
}

/// The GPU library's probe programs: on `pyrometer_gpu_launch` (a sampled launch's stack) and
/// `pyrometer_gpu_channel` (a chunk of its channel), attached for every process.
pub const GPU_LAUNCH: &str = "gpu_launch";
pub const GPU_CHANNEL: &str = "gpu_channel";

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            frequency_hz: 99,
            filter: Filter::Targets,
            ring_buffer_bytes: 8 << 20,
            btf_path: PathBuf::from(KERNEL_BTF),
            unwind_rows: 1 << 20,
            off_cpu_min_ns: None,
            gil: false,
            gc: false,
            asyncio: false,
            alloc: None,
            gpu_kernels: None,
            dwarf: true,
            debug_reject: 0,
        }
    }
}
