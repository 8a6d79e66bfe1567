//! The kernel side's health counters, summed over CPUs: samples, drops, and why stack walks
//! stopped where they did.

use pyrometer_ebpf as shared;

use super::Sampler;

/// Sums of the per-CPU health counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Samples sent to the ring buffer.
    pub samples: u64,
    /// Records dropped because the ring buffer was full.
    pub ringbuf_drops: u64,
    /// Kernel stacks that could not be taken.
    pub kernel_stack_errors: u64,
    /// User stacks that could not be taken.
    pub user_stack_errors: u64,
    /// User stacks cut at the frame limit.
    pub user_stack_truncated: u64,
    /// Processes not targeted because `targets` was full.
    pub targets_full: u64,
    /// How the DWARF walks went.
    pub unwind: UnwindCounters,
    /// Off-CPU intervals sent to the ring buffer.
    pub offcpu_events: u64,
    /// Threads that blocked while `offcpu_pending` was full (their interval is lost).
    pub offcpu_map_full: u64,
    /// The Python frame walker's counts.
    pub python: PythonCounters,
    /// The allocation probes' counts.
    pub alloc: AllocCounters,
    /// Nanoseconds the sampler spent on target samples, timed by the program itself.
    pub sample_ns: u64,
    /// Nanoseconds spent walking Python frame chains (all programs), self-timed.
    pub python_ns: u64,
}

/// The kernel's Python frame walker: stacks of registered Python processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PythonCounters {
    /// Stacks of Python processes the walker looked at.
    pub walks: u64,
    /// ... of threads without a Python thread state (native threads, or not yet registered).
    pub no_thread: u64,
    /// ... whose frame chain was longer than a record holds (innermost frames kept).
    pub truncated: u64,
    /// ... whose frame chain could not be read to its end.
    pub read_errors: u64,
    /// Thread-state lists walked to find a thread seen for the first time.
    pub tstate_searches: u64,
    /// Contended GIL waits sent (`--gil`).
    pub gil_wait_events: u64,
    /// Contended waits whose stack was not kept (`gil_pending` full).
    pub gil_pending_full: u64,
    /// Threads whose GIL time was not tracked (`gil_threads` full).
    pub gil_threads_full: u64,
    /// Garbage collections sent (`--gc`).
    pub gc_events: u64,
    /// Collections not tracked (`gc_pending` full).
    pub gc_pending_full: u64,
}

/// The allocation probes (`--alloc`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocCounters {
    /// Sampled allocations sent.
    pub samples: u64,
    /// Frees of sampled blocks sent.
    pub frees: u64,
    /// Sampled blocks not tracked for their free (`alloc_live` full).
    pub live_full: u64,
    /// Allocator calls not seen (`alloc_threads` full).
    pub threads_full: u64,
    /// Frees the preloaded library reported (it reports the frees of sampled blocks only).
    pub preload_frees: u64,
}

/// Why DWARF walks stopped early, and how many reached the outermost frame.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnwindCounters {
    /// Samples the DWARF unwinder walked.
    pub samples: u64,
    /// ... that reached the outermost frame.
    pub complete: u64,
    /// ... that stopped at a pc in no known executable mapping.
    pub no_mapping: u64,
    /// ... that stopped at a mapping whose table is not loaded (yet).
    pub no_table: u64,
    /// ... that stopped at a pc no CFI row covers.
    pub no_row: u64,
    /// ... that stopped at an unsupported rule or unreadable stack memory.
    pub bad_cfa: u64,
    /// ... that stopped at the frame limit.
    pub truncated: u64,
    /// Frames whose row came from the per-CPU row cache, and those searched for.
    pub row_hits: u64,
    /// ... and those whose row was searched for.
    pub row_searches: u64,
    /// Samples sent with a copy of their user stack (a table the walk needed was being
    /// built, or the process was too new to be known): the agent walks them again later.
    pub stack_copies: u64,
    /// ... that wanted a copy and went without (over the per-CPU rate, or no room in the
    /// ring buffer): their frames are the kernel walk's.
    pub stack_copies_skipped: u64,
}

impl UnwindCounters {
    /// Walks that left the tables for frame pointers (code without a table or outside the
    /// known mappings) and followed them to a zero return address: the kernel counts no
    /// reason for them, so they are what the reasons and the complete walks leave over.
    pub fn by_frame_pointers(&self) -> u64 {
        self.samples.saturating_sub(
            self.complete
                + self.no_mapping
                + self.no_table
                + self.no_row
                + self.bad_cfa
                + self.truncated,
        )
    }
}

/// Run time and count of the perf_event program, from `kernel.bpf_stats_enabled`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProgramStats {
    /// Nanoseconds the program ran.
    pub run_time_ns: u64,
    /// Times it ran.
    pub run_count: u64,
}

impl Sampler {
    /// The per-CPU counters summed.
    pub fn counters(&self) -> Counters {
        let sum = |index: u32| -> u64 {
            self.counters
                .get(&index, 0)
                .map(|v| v.iter().sum())
                .unwrap_or(0)
        };
        Counters {
            samples: sum(shared::COUNTER_SAMPLES),
            ringbuf_drops: sum(shared::COUNTER_RINGBUF_DROPS),
            kernel_stack_errors: sum(shared::COUNTER_KERNEL_STACK_ERRORS),
            user_stack_errors: sum(shared::COUNTER_USER_STACK_ERRORS),
            user_stack_truncated: sum(shared::COUNTER_USER_STACK_TRUNCATED),
            targets_full: sum(shared::COUNTER_TARGETS_FULL),
            unwind: UnwindCounters {
                samples: sum(shared::COUNTER_UNWIND_SAMPLES),
                complete: sum(shared::COUNTER_UNWIND_COMPLETE),
                no_mapping: sum(shared::COUNTER_UNWIND_NO_MAPPING),
                no_table: sum(shared::COUNTER_UNWIND_NO_TABLE),
                no_row: sum(shared::COUNTER_UNWIND_NO_ROW),
                bad_cfa: sum(shared::COUNTER_UNWIND_BAD_CFA),
                truncated: sum(shared::COUNTER_UNWIND_TRUNCATED),
                row_hits: sum(shared::COUNTER_UNWIND_ROW_HITS),
                row_searches: sum(shared::COUNTER_UNWIND_ROW_SEARCHES),
                stack_copies: sum(shared::COUNTER_STACK_COPIES),
                stack_copies_skipped: sum(shared::COUNTER_STACK_COPIES_SKIPPED),
            },
            offcpu_events: sum(shared::COUNTER_OFFCPU_EVENTS),
            offcpu_map_full: sum(shared::COUNTER_OFFCPU_MAP_FULL),
            python: PythonCounters {
                walks: sum(shared::COUNTER_PY_WALKS),
                no_thread: sum(shared::COUNTER_PY_NO_THREAD),
                truncated: sum(shared::COUNTER_PY_TRUNCATED),
                read_errors: sum(shared::COUNTER_PY_READ_ERRORS),
                tstate_searches: sum(shared::COUNTER_PY_TSTATE_SEARCHES),
                gil_wait_events: sum(shared::COUNTER_GIL_WAIT_EVENTS),
                gil_pending_full: sum(shared::COUNTER_GIL_PENDING_FULL),
                gil_threads_full: sum(shared::COUNTER_GIL_THREADS_FULL),
                gc_events: sum(shared::COUNTER_GC_EVENTS),
                gc_pending_full: sum(shared::COUNTER_GC_PENDING_FULL),
            },
            alloc: AllocCounters {
                samples: sum(shared::COUNTER_ALLOC_SAMPLES),
                frees: sum(shared::COUNTER_ALLOC_FREES),
                live_full: sum(shared::COUNTER_ALLOC_LIVE_FULL),
                threads_full: sum(shared::COUNTER_ALLOC_THREADS_FULL),
                preload_frees: sum(shared::COUNTER_ALLOC_PRELOAD_FREES),
            },
            sample_ns: sum(shared::COUNTER_SAMPLE_NS),
            python_ns: sum(shared::COUNTER_PY_NS),
        }
    }
}
