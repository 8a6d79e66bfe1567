//! The agent's health counters and the minimal HTTP endpoint that serves them as Prometheus
//! text. Hand-written on std's TcpListener: the node agent deliberately carries no HTTP
//! server framework (DESIGN.md), and `/metrics` is one GET.

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Default)]
pub struct AgentMetrics {
    pub samples: AtomicU64,
    pub lost_ring_buffer: AtomicU64,
    pub lost_bad_record: AtomicU64,
    pub opted_out_samples: AtomicU64,
    pub user_stack_errors: AtomicU64,
    pub kernel_stack_errors: AtomicU64,
    pub batches_spooled: AtomicU64,
    pub batches_pushed: AtomicU64,
    pub samples_pushed: AtomicU64,
    pub batches_dropped: AtomicU64,
    pub samples_dropped: AtomicU64,
    pub push_errors: AtomicU64,
    pub push_ns: AtomicU64,
    pub spool_batches: AtomicU64,
    pub spool_bytes: AtomicU64,
    /// Times the kernel dropped process events (`--comm` discovery) and every process was
    /// read again.
    pub process_event_overflows: AtomicU64,
    /// Times the symbolizer opened a file too large for its DWARF (symbol table only).
    pub dwarf_skipped_files: AtomicU64,
    /// Processes found over their budget (--process-budget-mb): user stacks of one
    /// `[budget]` frame.
    pub processes_over_budget: AtomicU64,
    /// Times a process went over its CPU budget in an interval (--process-cpu-budget-ms).
    pub processes_over_cpu_budget: AtomicU64,
    /// Files of profiled processes refused (a FIFO, a link, a device, over the cap).
    pub refused_files: AtomicU64,
    /// Reads of profiled processes' files that overran their deadline.
    pub stalled_reads: AtomicU64,
    /// The symbolizer's reads still running when a push stopped waiting for them.
    pub deferred_reads: AtomicU64,
    /// Python processes walked for native frames only: an interpreter without a known
    /// layout, and one whose description of itself did not validate.
    pub python_refused_unsupported: AtomicU64,
    pub python_refused_invalid: AtomicU64,
    /// The Python tracker's counters (code objects read, unreadable frames, ...), as of the
    /// last push.
    pub python: Mutex<crate::python::tracker::TrackerStats>,
    /// In-kernel DWARF walks, and those that stopped before the outermost frame, by reason
    /// (UNWIND_STOP_REASONS order).
    pub unwind_walks: AtomicU64,
    pub unwind_stopped: [AtomicU64; 6],
    /// Samples that wanted a copy of their stack, by what became of them
    /// (STACK_COPY_OUTCOMES order).
    pub stack_copies: [AtomicU64; 6],
    /// DWARF frames whose row the kernel's per-CPU row cache gave, and those searched for.
    pub unwind_row_hits: AtomicU64,
    pub unwind_row_searches: AtomicU64,
    /// Executables whose unwind tables did not fit in `--unwind-rows`, executable mappings
    /// beyond the per-process bound, and the row array's use: the signs that a node needs a
    /// larger `--unwind-rows` (a PyTorch process alone needs several million rows).
    pub unwind_tables_too_big: AtomicU64,
    pub unwind_mappings_dropped: AtomicU64,
    pub unwind_rows_used: AtomicU64,
    pub unwind_rows_capacity: AtomicU64,
    /// Table builds put off for want of the node-wide build budget, and the processes
    /// waiting for one now (unwound by frame pointers meanwhile).
    pub unwind_builds_deferred: AtomicU64,
    pub unwind_processes_waiting: AtomicU64,
    /// The GPU poller's state, when GPUs are polled: rendered as the `pyrometer_gpu_*`
    /// gauges.
    pub gpu: OnceLock<Arc<Mutex<crate::gpu::GpuState>>>,
    /// GPU kernels by launching stack: the join's counts (cumulative), with the GPU libraries'
    /// own.
    pub gpu_kernels: Mutex<crate::capture::gpu::join::Stats>,
    /// Per GPU (its `gpu` label): device ns of the records read, summed over streams, and the
    /// ns it was busy (the union of their intervals), added up over pushes.
    pub gpu_device_ns: Mutex<std::collections::BTreeMap<String, (u64, u64)>>,
    /// Features the kernel refused at start: (feature, BPF program), each rendered as
    /// `pyrometer_agent_feature_refused{feature,program} 1`.
    pub refused: OnceLock<Vec<(&'static str, String)>>,
    /// CPython garbage-collector pauses per process (`--gc`).
    pub gc: Mutex<super::gc_metrics::GcPauses>,
    /// Debug files fetched by build id, when servers are configured.
    pub debuginfod: Mutex<Option<crate::symbolize::debuginfod::DebuginfodStats>>,
}

/// What became of the samples that wanted a copy of their stack: `sent` with one, `skipped`
/// (over the per-CPU rate, or no room in the ring buffer); of those sent, `rewalked` (the walk
/// of the copy went further, `complete` of them to the outermost frame), `unchanged` (counted
/// as the kernel walked them) and `early` (counted before their tables came).
pub const STACK_COPY_OUTCOMES: [&str; 6] = [
    "sent",
    "skipped",
    "rewalked",
    "complete",
    "unchanged",
    "early",
];

/// `frame_pointers`: walks that left the tables for frame pointers and ended on a zero
/// return address, which the kernel gives no reason of their own.
pub const UNWIND_STOP_REASONS: [&str; 6] = [
    "no_mapping",
    "no_table",
    "no_row",
    "bad_cfa",
    "truncated",
    "frame_pointers",
];

impl AgentMetrics {
    /// Takes the counters of the readers of profiled processes: the symbolizer's, the
    /// unwinder's and the Python tracker's (once per push).
    pub(super) fn read_readers(
        &self,
        symbols: &crate::symbolize::SymbolizerStats,
        unwinder: Option<crate::unwinder::UnwinderStats>,
        python: &crate::python::tracker::TrackerStats,
    ) {
        self.dwarf_skipped_files
            .store(symbols.dwarf_skipped_files, Relaxed);
        self.processes_over_budget
            .store(symbols.processes_over_budget, Relaxed);
        self.refused_files.store(symbols.refused_files, Relaxed);
        self.deferred_reads.store(symbols.deferred_reads, Relaxed);
        let unwinder_stalled = unwinder.map_or(0, |u| u.stalled_reads);
        self.stalled_reads.store(
            symbols.stalled_reads + unwinder_stalled + python.stalled_reads,
            Relaxed,
        );
        self.python_refused_unsupported
            .store(python.refused_unsupported, Relaxed);
        self.python_refused_invalid
            .store(python.refused_invalid, Relaxed);
        *self.python.lock().unwrap_or_else(|e| e.into_inner()) = *python;
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut o = String::new();
        self.render_totals(&mut o);
        self.render_readers(&mut o);
        self.render_python(&mut o);
        if let Some(refused) = self.refused.get() {
            let _ = write!(
                o,
                "# HELP pyrometer_agent_feature_refused A feature the kernel refused: the agent runs without it.\n\
                 # TYPE pyrometer_agent_feature_refused gauge\n"
            );
            for (feature, program) in refused {
                let _ = writeln!(
                    o,
                    "pyrometer_agent_feature_refused{{feature=\"{feature}\",program=\"{program}\"}} 1"
                );
            }
        }
        let _ = write!(
            o,
            "# HELP pyrometer_agent_samples_lost_total Samples lost before aggregation, by reason.\n\
             # TYPE pyrometer_agent_samples_lost_total counter\n\
             pyrometer_agent_samples_lost_total{{reason=\"ring_buffer\"}} {}\n\
             pyrometer_agent_samples_lost_total{{reason=\"bad_record\"}} {}\n\
             # HELP pyrometer_agent_unwind_errors_total Stacks that could not be unwound, by side.\n\
             # TYPE pyrometer_agent_unwind_errors_total counter\n\
             pyrometer_agent_unwind_errors_total{{stack=\"user\"}} {}\n\
             pyrometer_agent_unwind_errors_total{{stack=\"kernel\"}} {}\n\
             # HELP pyrometer_agent_python_processes_refused_total Python processes walked for native frames only, by reason: a version without a known layout, or a description of itself (_Py_DebugOffsets) that did not validate.\n\
             # TYPE pyrometer_agent_python_processes_refused_total counter\n\
             pyrometer_agent_python_processes_refused_total{{reason=\"unsupported\"}} {}\n\
             pyrometer_agent_python_processes_refused_total{{reason=\"invalid\"}} {}\n\
             # HELP pyrometer_agent_push_duration_seconds Time of acknowledged pushes.\n\
             # TYPE pyrometer_agent_push_duration_seconds summary\n\
             pyrometer_agent_push_duration_seconds_sum {}\n\
             pyrometer_agent_push_duration_seconds_count {}\n",
            self.lost_ring_buffer.load(Relaxed),
            self.lost_bad_record.load(Relaxed),
            self.user_stack_errors.load(Relaxed),
            self.kernel_stack_errors.load(Relaxed),
            self.python_refused_unsupported.load(Relaxed),
            self.python_refused_invalid.load(Relaxed),
            self.push_ns.load(Relaxed) as f64 / 1e9,
            self.batches_pushed.load(Relaxed),
        );
        let _ = writeln!(
            o,
            "# HELP pyrometer_agent_unwind_stopped_total DWARF walks that stopped before the outermost frame, by reason.\n\
             # TYPE pyrometer_agent_unwind_stopped_total counter"
        );
        for (reason, v) in UNWIND_STOP_REASONS.iter().zip(&self.unwind_stopped) {
            let _ = writeln!(
                o,
                "pyrometer_agent_unwind_stopped_total{{reason=\"{reason}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = writeln!(
            o,
            "# HELP pyrometer_agent_stack_copies_total Samples taken before their unwind tables were in, which keep a copy of their stack to be walked again once they are, by outcome.\n\
             # TYPE pyrometer_agent_stack_copies_total counter"
        );
        for (outcome, v) in STACK_COPY_OUTCOMES.iter().zip(&self.stack_copies) {
            let _ = writeln!(
                o,
                "pyrometer_agent_stack_copies_total{{outcome=\"{outcome}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = write!(
            o,
            "# HELP pyrometer_agent_unwind_row_lookups_total DWARF frames by where their unwind row came from: the kernel's per-CPU row cache or a search of the table.\n\
             # TYPE pyrometer_agent_unwind_row_lookups_total counter\n\
             pyrometer_agent_unwind_row_lookups_total{{source=\"cache\"}} {}\n\
             pyrometer_agent_unwind_row_lookups_total{{source=\"search\"}} {}\n",
            self.unwind_row_hits.load(Relaxed),
            self.unwind_row_searches.load(Relaxed),
        );
        if let Some(gpu) = self.gpu.get() {
            crate::gpu::metrics::render(&gpu.lock().expect("not poisoned"), &mut o);
        }
        render_gpu_kernels(&self.gpu_kernels.lock().expect("not poisoned"), &mut o);
        self.gc.lock().expect("not poisoned").render(&mut o);
        if let Some(d) = *self.debuginfod.lock().expect("not poisoned") {
            render_debuginfod(&d, &mut o);
        }
        let devices = self.gpu_device_ns.lock().expect("not poisoned");
        if !devices.is_empty() {
            let _ = write!(
                o,
                "# HELP pyrometer_agent_gpu_device_seconds_total Device time of the GPU work read from the GPU libraries: summed over streams, and busy (the union of its intervals).\n\
                 # TYPE pyrometer_agent_gpu_device_seconds_total counter\n"
            );
            for (gpu, (summed, busy)) in devices.iter() {
                let gpu = gpu.replace('\\', "\\\\").replace('"', "\\\"");
                let _ = write!(
                    o,
                    "pyrometer_agent_gpu_device_seconds_total{{gpu=\"{gpu}\",time=\"summed\"}} {}\n\
                     pyrometer_agent_gpu_device_seconds_total{{gpu=\"{gpu}\",time=\"busy\"}} {}\n",
                    *summed as f64 / 1e9,
                    *busy as f64 / 1e9,
                );
            }
        }
        o
    }
}

impl AgentMetrics {
    /// The Python tracker's counters, as of the last push.
    fn render_python(&self, out: &mut String) {
        let py = *self.python.lock().unwrap_or_else(|e| e.into_inner());
        for (name, help, v) in [
            (
                "pyrometer_agent_python_processes_total",
                "Python processes registered with the kernel's frame walker.",
                py.processes,
            ),
            (
                "pyrometer_agent_python_processes_not_registered_total",
                "Python processes left with native frames only because the walker's process table was full.",
                py.map_full,
            ),
            (
                "pyrometer_agent_python_code_reads_total",
                "Code objects read from profiled processes (each is cached after its read).",
                py.code_reads,
            ),
            (
                "pyrometer_agent_python_bad_code_objects_total",
                "Code objects that did not validate when read: freed, torn, or replaced by another.",
                py.bad_codes,
            ),
            (
                "pyrometer_agent_python_unreadable_frames_total",
                "Python frames pushed as <unreadable frame>: their code object could not be read.",
                py.unreadable_frames,
            ),
            (
                "pyrometer_agent_python_module_bodies_named_total",
                "Frames of module bodies freed before their read, named from the module the kernel met them in.",
                py.freed_bodies,
            ),
            (
                "pyrometer_agent_python_span_tables_total",
                "Span tables (pyrometer-otel) found in Python processes.",
                py.span_tables,
            ),
        ] {
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"
            );
        }
    }

    /// What reading profiled processes' files cost and met: files read without their DWARF,
    /// processes over their budgets, files refused, reads past their deadline or not waited for.
    fn render_readers(&self, out: &mut String) {
        one(
            out,
            "pyrometer_agent_symbolized_without_dwarf_total",
            "counter",
            "Times a binary was opened for its symbol table only, its DWARF not fitting in --dwarf-mb (frames without lines or inlined functions).",
            self.dwarf_skipped_files.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_processes_over_budget_total",
            "counter",
            "Processes found over --process-budget-mb: each of their user stacks is one [budget] frame from then on.",
            self.processes_over_budget.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_processes_over_cpu_budget_total",
            "counter",
            "Times a process went over --process-cpu-budget-ms in a push interval: each of its user stacks is one [budget] frame until later intervals' budgets pay off what it spent over.",
            self.processes_over_cpu_budget.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_refused_files_total",
            "counter",
            "Files of profiled processes refused: a FIFO, a link, a device, over the size cap, or replaced between their check and their reading.",
            self.refused_files.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_stalled_reads_total",
            "counter",
            "Reads of profiled processes' files that did not finish by their deadline (the process is left alone for a while).",
            self.stalled_reads.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_deferred_reads_total",
            "counter",
            "Reads for naming frames still running when a push or capture stopped waiting for them: their frames are module and offset there, and the answer is used from the next push on.",
            self.deferred_reads.load(Relaxed),
        );
    }

    /// The metrics without labels: one HELP, TYPE and value each.
    fn render_totals(&self, out: &mut String) {
        one(
            out,
            "pyrometer_agent_samples_total",
            "counter",
            "Samples read from the kernel.",
            self.samples.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_process_event_overflows_total",
            "counter",
            "Times the kernel dropped process events (its socket buffer was full) and every process was read again to find those chosen by name.",
            self.process_event_overflows.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_batches_spooled_total",
            "counter",
            "Batches written to the spool (every batch is, before its push).",
            self.batches_spooled.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_batches_pushed_total",
            "counter",
            "Batches the collector acknowledged.",
            self.batches_pushed.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_samples_pushed_total",
            "counter",
            "Samples in acknowledged batches.",
            self.samples_pushed.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_batches_dropped_total",
            "counter",
            "Batches deleted unsent: the oldest when the spool was full, or refused as invalid.",
            self.batches_dropped.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_samples_dropped_total",
            "counter",
            "Samples in dropped batches.",
            self.samples_dropped.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_push_errors_total",
            "counter",
            "Push attempts that failed (the batch stays spooled).",
            self.push_errors.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_spool_batches",
            "gauge",
            "Batches waiting in the spool.",
            self.spool_batches.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_opted_out_samples_total",
            "counter",
            "Samples of processes opted out by --exclude-cgroup, dropped unread.",
            self.opted_out_samples.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_spool_size_bytes",
            "gauge",
            "Bytes waiting in the spool.",
            self.spool_bytes.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_walks_total",
            "counter",
            "User stacks walked by the in-kernel DWARF unwinder.",
            self.unwind_walks.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_tables_too_big_total",
            "counter",
            "Executables whose unwind tables did not fit in --unwind-rows (walked by frame pointers).",
            self.unwind_tables_too_big.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_mappings_dropped_total",
            "counter",
            "Executable mappings beyond 128 in one process, left to frame pointers.",
            self.unwind_mappings_dropped.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_rows_used",
            "gauge",
            "Rows of the unwind row array in use.",
            self.unwind_rows_used.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_rows_capacity",
            "gauge",
            "Rows of the unwind row array (--unwind-rows).",
            self.unwind_rows_capacity.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_builds_deferred_total",
            "counter",
            "Unwind table builds put off for want of the table-building budget (frame pointers meanwhile).",
            self.unwind_builds_deferred.load(Relaxed),
        );
        one(
            out,
            "pyrometer_agent_unwind_processes_waiting",
            "gauge",
            "Processes waiting for the table-building budget.",
            self.unwind_processes_waiting.load(Relaxed),
        );
    }
}

/// What debuginfod servers gave (`pyrometer_agent_debuginfod_*`).
fn render_debuginfod(d: &crate::symbolize::debuginfod::DebuginfodStats, o: &mut String) {
    let _ = write!(
        o,
        "# HELP pyrometer_agent_debuginfod_total Debug files by build id: downloads tried, debug files taken from the cache, build ids the cache lacked, files stored, build ids no server has, failed downloads.\n\
         # TYPE pyrometer_agent_debuginfod_total counter\n\
         pyrometer_agent_debuginfod_total{{event=\"fetch\"}} {}\n\
         pyrometer_agent_debuginfod_total{{event=\"hit\"}} {}\n\
         pyrometer_agent_debuginfod_total{{event=\"miss\"}} {}\n\
         pyrometer_agent_debuginfod_total{{event=\"stored\"}} {}\n\
         pyrometer_agent_debuginfod_total{{event=\"not_found\"}} {}\n\
         pyrometer_agent_debuginfod_total{{event=\"failure\"}} {}\n\
         # HELP pyrometer_agent_debuginfod_bytes_total Bytes of debug files downloaded.\n\
         # TYPE pyrometer_agent_debuginfod_bytes_total counter\n\
         pyrometer_agent_debuginfod_bytes_total {}\n",
        d.fetches, d.hits, d.misses, d.stored, d.not_found, d.failures, d.bytes,
    );
}

/// The GPU kernel join's counters (`pyrometer_agent_gpu_*`).
fn render_gpu_kernels(st: &crate::capture::gpu::join::Stats, o: &mut String) {
    let _ = write!(
        o,
        "# HELP pyrometer_agent_gpu_launches_total Kernel launches, copies and sets the GPU libraries saw, and those whose stack they sampled.\n\
         # TYPE pyrometer_agent_gpu_launches_total counter\n\
         pyrometer_agent_gpu_launches_total{{sampled=\"false\"}} {}\n\
         pyrometer_agent_gpu_launches_total{{sampled=\"true\"}} {}\n\
         # HELP pyrometer_agent_gpu_records_total Device records (kernels, copies and sets) read from the GPU libraries.\n\
         # TYPE pyrometer_agent_gpu_records_total counter\n\
         pyrometer_agent_gpu_records_total{{kind=\"kernel\"}} {}\n\
         pyrometer_agent_gpu_records_total{{kind=\"copy\"}} {}\n\
         # HELP pyrometer_agent_gpu_lost_total GPU work or its attribution lost, by reason.\n\
         # TYPE pyrometer_agent_gpu_lost_total counter\n\
         pyrometer_agent_gpu_lost_total{{reason=\"cupti_dropped\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"chunk_lost\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"chunk_refused\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"chunk_rate\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"record_refused\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"launch_not_queued\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"stack_missing\"}} {}\n\
         pyrometer_agent_gpu_lost_total{{reason=\"bound\"}} {}\n\
         # HELP pyrometer_agent_gpu_processes_off_total Processes started with the GPU library that did not record, by reason.\n\
         # TYPE pyrometer_agent_gpu_processes_off_total counter\n\
         pyrometer_agent_gpu_processes_off_total{{reason=\"stood_aside\"}} {}\n\
         pyrometer_agent_gpu_processes_off_total{{reason=\"no_cupti\"}} {}\n\
         pyrometer_agent_gpu_processes_off_total{{reason=\"cupti_error\"}} {}\n",
        st.lib_launches.saturating_sub(st.lib_sampled),
        st.lib_sampled,
        st.kernels,
        st.copies,
        st.cupti_dropped,
        st.chunks_lost,
        st.chunks_refused,
        st.chunks_rate_limited,
        st.records_refused,
        st.notes_dropped,
        st.stacks_missing,
        st.kept_refused,
        st.processes_stood_aside,
        st.processes_without_cupti,
        st.processes_cupti_error,
    );
}

/// Copies the kernel's counters and the unwind tables' to the metrics.
pub fn publish_counters(
    metrics: &AgentMetrics,
    c: &crate::bpf::Counters,
    samples: u64,
    unwinder: Option<crate::unwinder::UnwinderStats>,
    held: crate::profiler::held::HeldStats,
) {
    metrics.samples.store(samples, Relaxed);
    for (slot, v) in metrics.stack_copies.iter().zip([
        c.unwind.stack_copies,
        c.unwind.stack_copies_skipped,
        held.rewalked,
        held.complete,
        held.unchanged,
        held.early,
    ]) {
        slot.store(v, Relaxed);
    }
    metrics.lost_ring_buffer.store(c.ringbuf_drops, Relaxed);
    metrics
        .user_stack_errors
        .store(c.user_stack_errors, Relaxed);
    metrics
        .kernel_stack_errors
        .store(c.kernel_stack_errors, Relaxed);
    let u = c.unwind;
    metrics.unwind_walks.store(u.samples, Relaxed);
    metrics.unwind_row_hits.store(u.row_hits, Relaxed);
    metrics.unwind_row_searches.store(u.row_searches, Relaxed);
    for (slot, v) in metrics.unwind_stopped.iter().zip([
        u.no_mapping,
        u.no_table,
        u.no_row,
        u.bad_cfa,
        u.truncated,
        u.by_frame_pointers(),
    ]) {
        slot.store(v, Relaxed);
    }
    if let Some(t) = unwinder {
        metrics
            .unwind_tables_too_big
            .store(t.tables_too_big, Relaxed);
        metrics
            .unwind_mappings_dropped
            .store(t.mappings_dropped, Relaxed);
        metrics.unwind_rows_used.store(t.rows_used, Relaxed);
        metrics.unwind_rows_capacity.store(t.rows_capacity, Relaxed);
        metrics
            .unwind_builds_deferred
            .store(t.builds_deferred, Relaxed);
        metrics
            .unwind_processes_waiting
            .store(t.processes_waiting, Relaxed);
    }
}

/// One metric without labels: its HELP, TYPE and value.
fn one(out: &mut String, name: &str, kind: &str, help: &str, v: u64) {
    let _ = write!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
    );
}
