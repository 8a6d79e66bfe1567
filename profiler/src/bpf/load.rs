//! Loading the kernel programs stage by stage, so a kernel that refuses one optional stage
//! (GIL, allocations, off-CPU) costs that feature only, and one that refuses the DWARF walk
//! costs frame-pointer stacks instead of the capture.
//!
//! Every program lives in one object (`pyrometer-ebpf`), sharing the maps; what differs
//! between configurations is set at load time (read-only globals the verifier uses to prune
//! whole stages, map sizes) and which programs are loaded. [`open`] makes the object with its
//! maps, [`load_program`] loads one program and, when the kernel refuses it, keeps the
//! verifier's log in a file and its reason in one line.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use aya::programs::{BtfTracePoint, PerfEvent, ProgramError, UProbe};
use aya::{Btf, Ebpf, EbpfLoader};
use pyrometer_ebpf as shared;

use super::{BpfError, SamplerConfig, error_chain};

/// The verifier's limit on processed instructions (BPF_COMPLEXITY_LIMIT_INSNS).
pub const VERIFIER_LIMIT: u32 = 1_000_000;
/// Our budget per program: a tenth of the limit, on every kernel we test.
pub const VERIFIER_BUDGET: u32 = VERIFIER_LIMIT / 10;

/// A feature that a kernel can refuse while the capture goes on without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// The in-kernel DWARF walk: without it, stacks come from frame pointers.
    DwarfUnwinding,
    OffCpu,
    Gil,
    Alloc,
    /// GPU kernels by launching stack: the probes on libpyrometer_cupti.so.
    GpuKernels,
    /// CPython's garbage-collector pauses.
    Gc,
    /// asyncio task stacks (`--async`): the task walk after the Python frames.
    Async,
}

impl Feature {
    pub const ALL: [Feature; 7] = [
        Feature::DwarfUnwinding,
        Feature::OffCpu,
        Feature::Gil,
        Feature::Alloc,
        Feature::GpuKernels,
        Feature::Gc,
        Feature::Async,
    ];

    /// The label value on `/metrics` and in `--stats`.
    pub fn key(self) -> &'static str {
        match self {
            Feature::DwarfUnwinding => "dwarf_unwinding",
            Feature::OffCpu => "off_cpu",
            Feature::Gil => "gil",
            Feature::Alloc => "alloc",
            Feature::GpuKernels => "gpu_kernels",
            Feature::Gc => "gc",
            Feature::Async => "async",
        }
    }

    /// What a user loses, in the words of the one-line message.
    pub fn describe(self) -> &'static str {
        match self {
            Feature::DwarfUnwinding => "DWARF unwinding off (stacks from frame pointers)",
            Feature::OffCpu => "off-CPU time off",
            Feature::Gil => "GIL view off",
            Feature::Alloc => "allocation profiling off",
            Feature::GpuKernels => "GPU kernels by stack off",
            Feature::Gc => "GC pauses off",
            Feature::Async => "asyncio task stacks off",
        }
    }

    /// The `debug_reject` bit that makes a kernel refuse this stage (tests).
    pub fn reject_bit(self) -> u32 {
        match self {
            Feature::DwarfUnwinding => shared::REJECT_DWARF,
            Feature::OffCpu => shared::REJECT_OFFCPU,
            Feature::Gil => shared::REJECT_GIL,
            Feature::Alloc => shared::REJECT_ALLOC,
            Feature::GpuKernels => shared::REJECT_GPU,
            Feature::Gc => shared::REJECT_GC,
            Feature::Async => shared::REJECT_ASYNC,
        }
    }

    /// Parses a `--debug-reject` name.
    pub fn from_key(name: &str) -> Option<Feature> {
        match name {
            "dwarf" | "dwarf_unwinding" => Some(Feature::DwarfUnwinding),
            "off_cpu" | "off-cpu" | "offcpu" => Some(Feature::OffCpu),
            "gil" => Some(Feature::Gil),
            "alloc" => Some(Feature::Alloc),
            "gpu" | "gpu_kernels" | "gpu-kernels" => Some(Feature::GpuKernels),
            "gc" => Some(Feature::Gc),
            "async" | "asyncio" => Some(Feature::Async),
            _ => None,
        }
    }
}

/// A program the kernel refused.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub feature: Feature,
    pub program: String,
    /// The running kernel's release.
    pub kernel: String,
    /// The verifier's own reason (one line), or the load error.
    pub reason: String,
    /// Where the full verifier log was written.
    pub log: Option<PathBuf>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: Linux {} refused the BPF program {} ({})",
            self.feature.describe(),
            self.kernel,
            self.program,
            self.reason
        )?;
        match &self.log {
            Some(log) => write!(f, "; verifier log: {}", log.display()),
            None => Ok(()),
        }
    }
}

/// How a program's load went.
#[derive(Debug, Clone)]
pub struct ProgramLoad {
    pub program: &'static str,
    /// Instructions the verifier processed (`verified_insns`, Linux 5.16+).
    pub processed: Option<u32>,
    /// What else the verifier said of its work, when asked ([`verifier_stats`]).
    pub stats: Option<VerifierStats>,
    /// The load system call, verification and JIT included.
    pub load_time: Duration,
}

/// The verifier's statistics lines for one program: states explored (`total_states`), the
/// most kept at once (`peak_states`), and its own time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifierStats {
    pub processed: Option<u32>,
    pub total_states: Option<u32>,
    pub peak_states: Option<u32>,
    pub time_us: Option<u64>,
}

/// Reads the statistics lines of a verifier log ("processed N insns (limit L)
/// max_states_per_insn M total_states T peak_states P mark_read R", "verification time U
/// usec"); None when it has neither.
pub fn verifier_stats(log: &str) -> Option<VerifierStats> {
    let mut stats = VerifierStats::default();
    let mut found = false;
    for line in log.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("processed ") {
            found = true;
            let words: Vec<&str> = rest.split_whitespace().collect();
            stats.processed = words.first().and_then(|w| w.parse().ok());
            let after = |key: &str| {
                words
                    .iter()
                    .position(|w| *w == key)
                    .and_then(|i| words.get(i + 1))
                    .and_then(|w| w.parse().ok())
            };
            stats.total_states = after("total_states");
            stats.peak_states = after("peak_states");
        } else if let Some(rest) = line.strip_prefix("verification time ") {
            found = true;
            stats.time_us = rest.split_whitespace().next().and_then(|w| w.parse().ok());
        }
    }
    found.then_some(stats)
}

/// Why a program did not load.
#[derive(Debug, Clone)]
pub struct LoadFailure {
    pub program: &'static str,
    pub reason: String,
    /// The verifier's whole log, when the kernel gave one.
    pub log: Option<String>,
    pub load_time: Duration,
}

impl LoadFailure {
    /// Writes the log next to other temporary files; returns the refusal to report.
    pub fn refusal(&self, feature: Feature) -> Refusal {
        let log = self.log.as_ref().and_then(|text| {
            let path = std::env::temp_dir().join(format!(
                "pyrometer-{}-{}.verifier.log",
                std::process::id(),
                self.program
            ));
            std::fs::write(&path, text).ok().map(|()| path)
        });
        Refusal {
            feature,
            program: self.program.to_string(),
            kernel: kernel_release(),
            reason: self.reason.clone(),
            log,
        }
    }
}

/// The running kernel's release (`uname -r`).
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The line of a verifier log that says why it refused: the last one that is not one of the
/// statistics lines the verifier always ends with.
pub fn verifier_reason(log: &str) -> Option<String> {
    log.lines()
        .rev()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .find(|l| {
            !l.starts_with("processed ")
                && !l.starts_with("verification time")
                && !l.starts_with("stack depth")
                && !l.starts_with("mark_read")
        })
        .map(|l| truncate(l, 200))
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The kind of a program, which decides how it is loaded.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    PerfEvent,
    /// A BTF tracepoint, with the kernel tracepoint it attaches to.
    Tracepoint(&'static str),
    Uprobe,
}

/// The lifecycle tracepoints every capture needs.
pub const LIFECYCLE: [(&str, &str); 3] = [
    ("on_fork", "sched_process_fork"),
    ("on_exec", "sched_process_exec"),
    ("on_exit", "sched_process_exit"),
];
pub const SAMPLER: &str = "on_cpu_clock";
pub const OFFCPU: (&str, &str) = ("on_sched_switch", "sched_switch");

/// The optional stages `config` asks for, in the order they are loaded.
pub fn requested(config: &SamplerConfig) -> Vec<Feature> {
    [
        (Feature::OffCpu, config.off_cpu_min_ns.is_some()),
        (Feature::Gil, config.gil),
        (Feature::Alloc, config.alloc.is_some()),
        (Feature::GpuKernels, config.gpu_kernels.is_some()),
        (Feature::Gc, config.gc),
    ]
    .into_iter()
    .filter_map(|(feature, on)| on.then_some(feature))
    .collect()
}

/// The programs of an optional feature.
pub fn feature_programs(feature: Feature) -> Vec<(&'static str, Kind)> {
    match feature {
        Feature::DwarfUnwinding => vec![(SAMPLER, Kind::PerfEvent)],
        Feature::OffCpu => vec![(OFFCPU.0, Kind::Tracepoint(OFFCPU.1))],
        Feature::Gil => super::GIL_PROGRAMS
            .iter()
            .map(|&p| (p, Kind::Uprobe))
            .collect(),
        Feature::Alloc => vec![
            (super::ALLOC_ENTER, Kind::Uprobe),
            (super::ALLOC_RETURN, Kind::Uprobe),
            (super::ALLOC_PRELOAD, Kind::Uprobe),
            (super::ALLOC_PRELOAD_FREE, Kind::Uprobe),
            (super::ALLOC_PRELOAD_MOVE, Kind::Uprobe),
        ],
        Feature::GpuKernels => vec![
            (super::GPU_LAUNCH, Kind::Uprobe),
            (super::GPU_CHANNEL, Kind::Uprobe),
        ],
        Feature::Gc => super::GC_PROGRAMS
            .iter()
            .map(|&p| (p, Kind::Uprobe))
            .collect(),
        // The task walk is the sampler's (and the off-CPU program's) Python walk.
        Feature::Async => vec![(SAMPLER, Kind::PerfEvent)],
    }
}

/// Makes the object with its maps for `config`, nothing loaded yet. `dwarf` says whether the
/// programs carry the DWARF walk.
pub fn open(
    config: &SamplerConfig,
    btf: &Btf,
    dwarf: bool,
    asyncio: bool,
) -> Result<Ebpf, BpfError> {
    let filter_mode = match config.filter {
        super::Filter::All => shared::FILTER_ALL,
        super::Filter::Targets => shared::FILTER_TARGETS,
    };
    let self_tgid = std::process::id();
    let offcpu_min_ns = config.off_cpu_min_ns.unwrap_or(u64::MAX);
    // Without --off-cpu the program is never loaded; the map still exists in the object.
    let offcpu_entries = if config.off_cpu_min_ns.is_some() {
        shared::OFFCPU_PENDING_ENTRIES
    } else {
        1
    };
    let uretprobes_used = u32::from(config.gil || config.gc || config.alloc.is_some());
    let gil_view = u32::from(config.gil);
    let alloc = config.alloc.unwrap_or(super::AllocConfig {
        sample_bytes: super::DEFAULT_ALLOC_SAMPLE_BYTES,
        live_entries: 1,
        own_targets: false,
    });
    let alloc_filter = if alloc.own_targets {
        shared::ALLOC_FILTER_MAP
    } else {
        shared::ALLOC_FILTER_TARGETS
    };
    let preload_all = u32::from(alloc.own_targets);
    let alloc_entries = |n: u32| if config.alloc.is_some() { n } else { 1 };
    // Without --gil the GIL maps stay in the object, one entry each.
    let gil_entries = |n: u32| if config.gil { n } else { 1 };
    let unwind_dwarf = u32::from(dwarf);
    let py_async_walk = u32::from(asyncio);
    let gpu_all = u32::from(config.gpu_kernels.is_some_and(|g| g.all));
    // A quarter of the ring buffer waiting wakes the agent; below that it polls.
    let wakeup_bytes = u64::from(config.ring_buffer_bytes / 4);
    // Not `new()`, which parses the kernel's BTF again before `.btf` replaces it.
    EbpfLoader::with_btf(Some(btf))
        .override_global("filter_mode", &filter_mode, true)
        .override_global("self_tgid", &self_tgid, true)
        .override_global("debug_reject", &config.debug_reject, true)
        .override_global("unwind_dwarf", &unwind_dwarf, true)
        .override_global("py_async_walk", &py_async_walk, true)
        .override_global("ringbuf_wakeup_bytes", &wakeup_bytes, true)
        .override_global("offcpu_min_ns", &offcpu_min_ns, true)
        .override_global("uretprobes_used", &uretprobes_used, true)
        .override_global("gil_view", &gil_view, true)
        .map_max_entries("gil_threads", gil_entries(16384))
        .map_max_entries("gil_pending", gil_entries(4096))
        .map_max_entries("gil_holders", gil_entries(4096))
        // Without --gc its map stays in the object with one entry.
        .map_max_entries(
            "gc_pending",
            if config.gc {
                shared::GC_PENDING_ENTRIES
            } else {
                1
            },
        )
        .override_global("alloc_sample_bytes", &alloc.sample_bytes, true)
        .override_global("alloc_filter", &alloc_filter, true)
        // The agent records every process that loads the preloaded sampler library.
        .override_global("alloc_preload_all", &preload_all, true)
        .override_global("gpu_all", &gpu_all, true)
        .map_max_entries("alloc_live", alloc_entries(alloc.live_entries.max(1)))
        .map_max_entries("alloc_threads", alloc_entries(16384))
        .map_max_entries("alloc_targets", if alloc.own_targets { 4096 } else { 1 })
        .map_max_entries("samples", config.ring_buffer_bytes)
        .map_max_entries("unwind_rows", config.unwind_rows.max(1))
        .map_max_entries("unwind_index", index_entries(config.unwind_rows))
        .map_max_entries("offcpu_pending", offcpu_entries)
        .load(shared::SAMPLER_OBJECT)
        .map_err(|e| BpfError::Load(error_chain(&e)))
}

/// Entries of the tables' bucket indexes for a row capacity: one per KiB of text, where
/// tables have about 10 rows a KiB; a quarter of the rows leaves ample room.
pub fn index_entries(unwind_rows: u32) -> u32 {
    (unwind_rows / 4).max(1)
}

/// Loads one program of the object.
pub fn load_program(
    ebpf: &mut Ebpf,
    btf: &Btf,
    program: &'static str,
    kind: Kind,
) -> Result<ProgramLoad, LoadFailure> {
    let failure = |reason: String, log: Option<String>, load_time| LoadFailure {
        program,
        reason,
        log,
        load_time,
    };
    let Some(prog) = ebpf.program_mut(program) else {
        return Err(failure(
            "missing from the object".into(),
            None,
            Duration::ZERO,
        ));
    };
    let start = Instant::now();
    let loaded = match kind {
        Kind::PerfEvent => <&mut PerfEvent>::try_from(prog).and_then(|p| p.load()),
        Kind::Tracepoint(tp) => <&mut BtfTracePoint>::try_from(prog).and_then(|p| p.load(tp, btf)),
        Kind::Uprobe => <&mut UProbe>::try_from(prog).and_then(|p| p.load()),
    };
    let load_time = start.elapsed();
    match loaded {
        Ok(()) => {
            let processed = ebpf
                .program(program)
                .and_then(|p| p.info().ok())
                .and_then(|i| i.verified_instruction_count());
            let stats = aya::programs::take_verifier_stats()
                .as_deref()
                .and_then(verifier_stats);
            Ok(ProgramLoad {
                program,
                processed: processed.or(stats.and_then(|s| s.processed)),
                stats,
                load_time,
            })
        }
        Err(ProgramError::LoadError {
            io_error,
            verifier_log,
        }) => {
            let log = verifier_log.to_string();
            let reason = verifier_reason(&log).unwrap_or_else(|| io_error.to_string());
            Err(failure(reason, Some(log), load_time))
        }
        Err(e) => Err(failure(error_chain(&e), None, load_time)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_is_the_last_line_before_the_statistics() {
        let log = "0: R1=ctx() R10=fp0\n; asm\n1: (79) r0 = *(u64 *)(r10 +8)\n\
                   invalid read from stack off 8+0 size 8\n\
                   processed 2 insns (limit 1000000) max_states_per_insn 0 total_states 0 peak_states 0 mark_read 0\n";
        assert_eq!(
            verifier_reason(log).as_deref(),
            Some("invalid read from stack off 8+0 size 8")
        );
        let too_large = "BPF program is too large. Processed 1000001 insn\n\
                         processed 1000001 insns (limit 1000000) max_states_per_insn 52 total_states 32188 peak_states 143000 mark_read 10\n";
        assert_eq!(
            verifier_reason(too_large).as_deref(),
            Some("BPF program is too large. Processed 1000001 insn")
        );
        assert_eq!(verifier_reason("\n\n"), None);
    }

    #[test]
    fn verifier_statistics_are_read_from_their_lines() {
        let log = "processed 58123 insns (limit 1000000) max_states_per_insn 4 total_states 2711 peak_states 913 mark_read 88\n\
                   verification time 8412 usec\n\
                   stack depth 48+0+0\n";
        assert_eq!(
            verifier_stats(log),
            Some(VerifierStats {
                processed: Some(58123),
                total_states: Some(2711),
                peak_states: Some(913),
                time_us: Some(8412),
            })
        );
        // An older kernel's line without the states fields.
        let old = verifier_stats("processed 17 insns (limit 1000000)\n").unwrap();
        assert_eq!((old.processed, old.total_states), (Some(17), None));
        assert_eq!(verifier_stats("0: R1=ctx()\n"), None);
    }

    #[test]
    fn a_refusal_is_one_line_naming_feature_program_kernel_and_log() {
        let r = Refusal {
            feature: Feature::Gil,
            program: "gil_take_enter".into(),
            kernel: "6.18.44".into(),
            reason: "invalid read from stack off 8+0 size 8".into(),
            log: Some(PathBuf::from("/tmp/x.verifier.log")),
        };
        let line = r.to_string();
        assert!(!line.contains('\n'));
        assert_eq!(
            line,
            "GIL view off: Linux 6.18.44 refused the BPF program gil_take_enter \
             (invalid read from stack off 8+0 size 8); verifier log: /tmp/x.verifier.log"
        );
        for f in Feature::ALL {
            assert_eq!(Feature::from_key(f.key()), Some(f));
        }
    }
}
