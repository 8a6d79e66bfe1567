//! What a recording reports at its end: one figure per source, the GIL table, the leak
//! sites, and the counters `--stats` writes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

pub use crate::bpf::{AllocCounters, Counters, ProgramStats, PythonCounters, UnwindCounters};
use crate::gpu::{self, summary::DeviceSummary};
use crate::model::Profile;
use crate::output::folded::frame_name;
pub use crate::unwinder::UnwinderStats;

/// Executable mappings of one process the unwind tables hold at most.
pub const MAX_MAPPINGS: usize = pyrometer_ebpf::MAX_MAPPINGS;

/// Everything the end of a recording reports.
pub struct RunReport {
    /// On-CPU samples counted.
    pub samples: u64,
    /// Samples lost (ring buffer full, bad records).
    pub lost: u64,
    /// Processes sampled.
    pub processes: usize,
    /// How long it recorded.
    pub elapsed: Duration,
    /// Frames nothing could name.
    pub unsymbolized: u64,
    /// The output written.
    pub output: PathBuf,
    /// The kernel side's counters.
    pub counters: Counters,
    /// With --off-cpu: (intervals, ns blocked, the minimum counted).
    pub off_cpu: Option<(u64, u64, Duration)>,
    /// With --gil: the table, processes without the GIL view, contended waits and their ns.
    pub gil: Option<GilReport>,
    /// With --gc: the collections seen.
    pub gc: Option<GcReport>,
    /// With `--alloc`: what was sampled.
    pub alloc: Option<AllocReport>,
    /// Python frames read, and those whose process was gone by then.
    pub py_frames: (u64, u64),
    /// The unwind tables' figures (all zero with `--unwind fp`).
    pub unwinder: UnwinderStats,
    /// What became of the samples taken before their tables were in, which kept a copy of
    /// their stack.
    pub stack_copies: crate::profiler::held::HeldStats,
    /// The Python tracker's counters: processes walked for native frames only (an
    /// unsupported version, a description of itself that did not validate), code objects
    /// read, unreadable frames.
    pub python: crate::python::tracker::TrackerStats,
    /// The sampler program's run time and count, when `kernel.bpf_stats_enabled` was on.
    pub bpf: Option<ProgramStats>,
    /// CPU time pyrometer spent while sampling.
    pub capture_cpu_ns: u64,
    /// With `--gpu`: each device's summary.
    pub gpus: Option<Vec<DeviceSummary>>,
    /// With `--gpu-kernels`: what the GPU libraries reported.
    pub gpu_kernels: Option<GpuKernelsReport>,
    /// With debuginfod servers: what was fetched.
    pub debuginfod: Option<DebuginfodReport>,
}

/// What debuginfod servers gave a recording.
pub struct DebuginfodReport {
    /// Downloads, cache hits, misses, failures, bytes.
    pub stats: crate::symbolize::debuginfod::DebuginfodStats,
    /// Downloads still under way when the recording stopped waiting.
    pub pending: usize,
    /// The last download's failure, one line.
    pub last_error: Option<String>,
    /// The cache directory.
    pub cache: PathBuf,
}

/// The GPU kernels' part of a report (`--gpu-kernels`).
pub struct GpuKernelsReport {
    /// The summary, one line a fact.
    pub text: String,
    /// The same for `--stats`.
    pub json: serde_json::Value,
    /// Kernels, copies and sets the devices ran.
    pub records: u64,
}

/// The GIL's part of a report (`--gil`).
pub struct GilReport {
    /// The per-thread table.
    pub table: String,
    /// Processes without the GIL view, and why.
    pub unavailable: Vec<(u32, String)>,
    /// Free-threaded processes (pid, command name, whether their GIL was seen on): no GIL
    /// table for them.
    pub free_threaded: Vec<(u32, String, bool)>,
    /// Contended waits counted with their stacks.
    pub wait_events: u64,
    /// ... and their total, ns.
    pub wait_ns: u64,
}

/// The garbage collector's part of a report (`--gc`).
pub struct GcReport {
    /// Collections.
    pub events: u64,
    /// Their total pause, ns.
    pub ns: u64,
    /// Pause ns by generation (None: not known).
    pub by_generation: std::collections::BTreeMap<Option<u8>, u64>,
    /// Processes whose collections could not be probed, and why.
    pub unavailable: Vec<(u32, String)>,
}

/// The allocations' part of a report (`--alloc`, `--leaks`).
pub struct AllocReport {
    /// Mean bytes between samples.
    pub mean: u64,
    /// Sampled allocations.
    pub samples: u64,
    /// Frees of sampled blocks.
    pub frees: u64,
    /// Resizes of sampled blocks (their in-use entries moved).
    pub moves: u64,
    /// Uprobes attached on allocator functions (0 when every target preloads the sampler
    /// library), and copies of the library probed.
    pub uprobes: u64,
    /// Copies of the sampler library probed.
    pub preload_libraries: usize,
    /// Estimated allocations.
    pub objects: f64,
    /// Estimated bytes allocated.
    pub bytes: f64,
    /// With --leaks: the minimum age of a block counted, and the top sites.
    pub leaks: Option<(Duration, Vec<LeakSite>)>,
    /// Processes whose allocator could not be probed, and why.
    pub unprobed: Vec<String>,
    /// Times the live-block table was full and its older half dropped.
    pub live_dropped: u64,
}

/// In-use memory of one allocation site (innermost frames), estimated.
pub struct LeakSite {
    /// The site: its three innermost frames.
    pub site: String,
    /// Estimated blocks in use.
    pub objects: f64,
    /// Estimated bytes in use.
    pub bytes: f64,
}

/// The sites with the most in-use bytes: each sample's three innermost frames, leaf first.
pub fn leak_sites(profile: &Profile, top: usize) -> Vec<LeakSite> {
    let (Ok(objects), Ok(bytes)) = (
        profile.type_index("inuse_objects"),
        profile.type_index("inuse_space"),
    ) else {
        return Vec::new();
    };
    let mut sites: HashMap<String, (f64, f64)> = HashMap::new();
    for s in &profile.samples {
        if s.values[bytes] <= 0 {
            continue;
        }
        let site = profile
            .stack_frames(s.stack)
            .filter(|f| f.kind != crate::model::FrameKind::Kernel)
            .take(3)
            .map(frame_name)
            .collect::<Vec<_>>()
            .join(" <- ");
        let e = sites.entry(site).or_default();
        e.0 += s.values[objects] as f64;
        e.1 += s.values[bytes] as f64;
    }
    let mut out: Vec<LeakSite> = sites
        .into_iter()
        .map(|(site, (objects, bytes))| LeakSite {
            site,
            objects,
            bytes,
        })
        .collect();
    out.sort_by(|a, b| {
        b.bytes
            .total_cmp(&a.bytes)
            .then_with(|| a.site.cmp(&b.site))
    });
    out.truncate(top);
    out
}

impl RunReport {
    /// `--stats`: the counters as JSON.
    pub fn stats_json(&self) -> serde_json::Value {
        let c = &self.counters;
        let unwinder = &self.unwinder;
        let bpf = self.bpf;
        let capture_cpu_ns = self.capture_cpu_ns;
        let mut json = serde_json::json!({
            "samples": self.samples,
            "lost": self.lost,
            "kernel_samples": c.samples,
            "ringbuf_drops": c.ringbuf_drops,
            "user_stack_errors": c.user_stack_errors,
            "kernel_stack_errors": c.kernel_stack_errors,
            "user_stack_truncated": c.user_stack_truncated,
            "elapsed_ns": self.elapsed.as_nanos() as u64,
            "agent_cpu_ns": self_cpu_ns(),
            "agent_capture_cpu_ns": capture_cpu_ns,
            "bpf_run_time_ns": bpf.map(|b| b.run_time_ns),
            "bpf_sample_ns": c.sample_ns,
            "bpf_run_count": bpf.map(|b| b.run_count),
            "unwind_samples": c.unwind.samples,
            "unwind_complete": c.unwind.complete,
            "unwind_no_mapping": c.unwind.no_mapping,
            "unwind_no_table": c.unwind.no_table,
            "unwind_no_row": c.unwind.no_row,
            "unwind_bad_cfa": c.unwind.bad_cfa,
            "unwind_truncated": c.unwind.truncated,
            "unwind_tables_built": unwinder.tables_built,
            "unwind_tables_failed": unwinder.tables_failed,
            "unwind_tables_evicted": unwinder.tables_evicted,
            "unwind_rows_used": unwinder.rows_used,
            "unwind_rows_capacity": unwinder.rows_capacity,
            "unwind_table_bytes": unwinder.rows_used * 12,
            "unwind_build_ns": unwinder.build_ns,

            "offcpu_kernel_events": c.offcpu_events,
            "offcpu_map_full": c.offcpu_map_full,
            "python_frames": self.py_frames.0,
            "python_frames_unresolved": self.py_frames.1,
            "python_walks": c.python.walks,
            "python_no_thread": c.python.no_thread,
            "python_truncated": c.python.truncated,
            "python_read_errors": c.python.read_errors,
            "python_tstate_searches": c.python.tstate_searches,
            "gil_wait_events": c.python.gil_wait_events,
            "alloc_kernel_samples": c.alloc.samples,
            "alloc_kernel_frees": c.alloc.frees,
            "alloc_live_full": c.alloc.live_full,
            "alloc_threads_full": c.alloc.threads_full,
        });
        json["alloc_preload_frees"] = c.alloc.preload_frees.into();
        json["gc_kernel_events"] = c.python.gc_events.into();
        json["gc_pending_full"] = c.python.gc_pending_full.into();
        json["unwind_row_cache_hits"] = c.unwind.row_hits.into();
        json["unwind_row_searches"] = c.unwind.row_searches.into();
        json["bpf_python_ns"] = c.python_ns.into();
        json["unwind_tables_too_big"] = unwinder.tables_too_big.into();
        json["unwind_mappings_dropped"] = unwinder.mappings_dropped.into();
        json["stack_copies"] = c.unwind.stack_copies.into();
        json["stack_copies_skipped"] = c.unwind.stack_copies_skipped.into();
        json["stack_copies_rewalked"] = self.stack_copies.rewalked.into();
        json["stack_copies_complete"] = self.stack_copies.complete.into();
        json["stack_copies_unchanged"] = self.stack_copies.unchanged.into();
        json["stack_copies_early"] = self.stack_copies.early.into();
        let py = &self.python;
        json["python_processes_unsupported"] = py.refused_unsupported.into();
        json["python_processes_invalid"] = py.refused_invalid.into();
        json["python_processes"] = py.processes.into();
        json["python_processes_not_registered"] = py.map_full.into();
        json["python_code_reads"] = py.code_reads.into();
        json["python_bad_code_objects"] = py.bad_codes.into();
        json["python_unreadable_frames"] = py.unreadable_frames.into();
        json["python_module_bodies_named"] = py.freed_bodies.into();
        json["python_span_tables"] = py.span_tables.into();
        if let Some(a) = &self.alloc {
            json["alloc_samples"] = a.samples.into();
            json["alloc_frees"] = a.frees.into();
            json["alloc_moves"] = a.moves.into();
            json["alloc_uprobes"] = a.uprobes.into();
            json["alloc_preload_libraries"] = a.preload_libraries.into();
            json["alloc_estimated_bytes"] = a.bytes.into();
            json["alloc_estimated_objects"] = a.objects.into();
        }
        if let Some(k) = &self.gpu_kernels {
            json["gpu_kernels"] = k.json.clone();
        }
        if let Some(g) = &self.gpus {
            json["gpus"] = gpu::summary::to_json(g);
        }
        if let Some(d) = &self.debuginfod {
            json["debuginfod"] = serde_json::json!({
                "fetches": d.stats.fetches,
                "hits": d.stats.hits,
                "misses": d.stats.misses,
                "stored": d.stats.stored,
                "not_found": d.stats.not_found,
                "failures": d.stats.failures,
                "bytes": d.stats.bytes,
                "pending": d.pending,
            });
        }
        json
    }
}

/// CPU time (user + system) this process has used so far.
pub(crate) fn self_cpu_ns() -> u64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(usage.ru_utime) + us(usage.ru_stime)) * 1000
}

/// A thread's kernel name, when it still exists.
pub(crate) fn thread_comm(pid: u32, tid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}
