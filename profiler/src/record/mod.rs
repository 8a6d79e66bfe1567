//! `record`: sample the targets for a while, then make one profile of it all. A
//! [`Recording`] goes through four steps, so the command line can act between them: [`open`]
//! (the kernel side, which may refuse optional sources), [`start`] (targets in place, a
//! command started, sampling on), [`run`] (until the duration, the command's exit or
//! Ctrl-C) and [`finish`] (the profile, its timeline and the report).
//!
//! [`open`]: Recording::open
//! [`start`]: Recording::start
//! [`run`]: Recording::run
//! [`finish`]: Recording::finish

pub mod report;
mod run;
mod start;
pub mod targets;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::Duration;

use crate::bpf::{AllocConfig, Feature, GpuKernelsConfig, SamplerConfig};
use crate::capture::Timeline;
use crate::command::CommandError;
use crate::gpu::kernels::probes::{self as gpu_probes, GpuProbes};
use crate::model::{Profile, Sources};
use crate::os::spawn::{HeldChild, StartupHold};
use crate::profiler::Profiler;
use crate::profiler::comm::CommFinder;
use crate::python::merge::FrameView;
use report::RunReport;
pub use targets::Targets;

/// What to record and how: the command line's options, checked.
#[derive(Debug)]
pub struct RecordConfig {
    /// What to sample.
    pub targets: Targets,
    /// Also the descendants of each pid (or comm match), current and future.
    pub subprocesses: bool,
    /// How long; None: until the target exits or Ctrl-C.
    pub duration: Option<Duration>,
    /// Samples per second per CPU.
    pub frequency: u64,
    /// Ring buffer size in bytes (a power of two).
    pub ring_buffer_bytes: u32,
    /// Walk user stacks with DWARF tables (else frame pointers only).
    pub dwarf: bool,
    /// Capacity of the unwind row array.
    pub unwind_rows: u32,
    /// Directories of separate debug files, searched before the system's.
    pub debug_dirs: Vec<PathBuf>,
    /// Fetch missing debug files from debuginfod servers (None: never).
    pub debuginfod: Option<crate::symbolize::debuginfod::DebuginfodConfig>,
    /// How long the end of the recording waits for debug files still on their way; those
    /// that come later are named by the next recording, from the cache.
    pub debuginfod_wait: Duration,
    /// Poll the GPUs: the interval and the NVML library.
    pub gpu: Option<(Duration, OsString)>,
    /// Measure off-CPU time: the shortest blocked interval counted.
    pub off_cpu: Option<Duration>,
    /// Measure the GIL of Python processes.
    pub gil: bool,
    /// Measure the garbage-collector pauses of Python processes.
    pub gc: bool,
    /// Follow the asyncio tasks of Python processes (task frames and labels).
    pub asyncio: bool,
    /// Sample allocations.
    pub alloc: Option<RecordAlloc>,
    /// GPU kernels by launching stack (`--gpu-kernels`).
    pub gpu_kernels: Option<RecordGpuKernels>,
    /// Which frames stacks of Python processes keep: `mixed`, `python` or `all`.
    pub frames: String,
    /// Keep per-sample times (for a Chrome trace).
    pub timeline: bool,
    /// `debug_reject` bits ([`crate::command::debug_reject_bits`]).
    pub debug_reject: u32,
    /// Kernel BTF to load against (None: the running kernel's).
    pub btf_path: Option<PathBuf>,
}

/// How allocations are sampled.
#[derive(Debug, Clone, Copy)]
pub struct RecordAlloc {
    /// Mean bytes between samples.
    pub sample_bytes: u64,
    /// Sampled blocks tracked at once for their free.
    pub live: u32,
    /// Report what is still in use at the end (`--leaks`).
    pub leaks: bool,
    /// With `leaks`: only blocks allocated at least this long before the end.
    pub min_age: Option<Duration>,
    /// Targets that cannot load the sampler library (static binaries, `--pid` processes
    /// started without it) get uprobes on their allocator (`--alloc-uprobes`): a trap into
    /// the kernel per allocator call. Without it such a target is refused, and no allocator
    /// function is ever probed: uprobes cost an allocation-heavy program hundreds of times
    /// its run time, so they are never chosen silently.
    pub uprobes: bool,
}

/// How GPU kernels are attributed to their launching stacks (`--gpu-kernels`).
#[derive(Debug, Clone)]
pub struct RecordGpuKernels {
    /// Take the stack of 1 in N launches per thread (None: the library's default).
    pub sample_every: Option<u32>,
    /// The NVML library whose device list maps UUIDs to the `gpu` label's index.
    pub nvml_lib: OsString,
}

/// What the recording's user sees while it runs.
pub trait Observer {
    /// One line to show (a notice, a warning), without a prefix.
    fn notice(&mut self, line: &str);
    /// Samples read so far and samples lost, after every turn of the loop.
    fn progress(&mut self, _samples: u64, _lost: u64) {}
}

/// A closure is an observer of the notices, which leaves progress unshown.
impl<F: FnMut(&str)> Observer for F {
    fn notice(&mut self, line: &str) {
        self(line)
    }
}

/// A recording between its steps.
pub struct Recording {
    config: RecordConfig,
    profiler: Profiler,
    /// The sources that run: asked for and not refused.
    sources: Sources,
    /// The pids whose exit ends the recording (the `--pid` ones).
    root_pids: Vec<u32>,
    /// The command (`-- CMD`), held until sampling starts, then running.
    held: Option<HeldChild>,
    startup_hold: Option<StartupHold>,
    child: Option<Child>,
    /// The command's pid and when its maps were read at the handshake, for the capture.
    held_maps_read: Option<(u32, u64)>,
    comm_finder: Option<CommFinder>,
    run: Option<run::Running>,
    /// With `--gpu-kernels`: the library a command gets, with its probes attached.
    gpu_library: Option<PathBuf>,
    gpu_probes: GpuProbes,
}

/// A finished recording.
pub struct Recorded {
    /// Every sample, symbolized.
    pub profile: Profile,
    /// Per-sample times, when the config asked for them.
    pub timeline: Option<Timeline>,
    /// What the end of the recording reports.
    pub report: RunReport,
    /// The command's exit status (`-- CMD`), when it exited.
    pub child_status: Option<ExitStatus>,
    /// With `--gpu`: the polls kept, and how many older ones were dropped.
    pub gpu_polls: Option<(usize, u64)>,
}

impl Recording {
    /// Loads the kernel side for `config`. A source the kernel refuses is switched off and
    /// said so through `observer`; [`Recording::sources`] tells what runs.
    pub fn open(config: RecordConfig, observer: &mut dyn Observer) -> Result<Self, CommandError> {
        frame_view(&config.frames)?;
        crate::command::check_sampling_privileges()?;
        // The GPU library must be there before anything starts: a command run without it
        // would record no GPU work.
        let gpu_library = match &config.gpu_kernels {
            Some(_) => Some(
                gpu_probes::library()
                    .map_err(|e| CommandError::Input(format!("--gpu-kernels: {e}")))?,
            ),
            None => None,
        };
        let sampler = SamplerConfig {
            frequency_hz: config.frequency,
            filter: config.targets.filter(),
            ring_buffer_bytes: config.ring_buffer_bytes,
            unwind_rows: config.unwind_rows,
            btf_path: crate::bpf::btf_path_or_default(config.btf_path.as_deref()),
            off_cpu_min_ns: config
                .off_cpu
                .map(|min| u64::try_from(min.as_nanos()).unwrap_or(u64::MAX)),
            gil: config.gil,
            gc: config.gc,
            asyncio: config.asyncio,
            alloc: config.alloc.map(|a| AllocConfig {
                sample_bytes: a.sample_bytes,
                live_entries: a.live,
                own_targets: false,
            }),
            gpu_kernels: config
                .gpu_kernels
                .as_ref()
                .map(|_| GpuKernelsConfig { all: false }),
            dwarf: config.dwarf,
            debug_reject: config.debug_reject,
        };
        let mut profiler = Profiler::open(&sampler, &debug_dirs(&config.debug_dirs))
            .map_err(|e| CommandError::Kernel(e.to_string()))?;
        if !config.alloc.is_some_and(|a| a.uprobes) {
            let tables = &mut profiler.tables;
            tables.alloc = tables.alloc.take().map(|a| a.preload_only());
        }
        for refusal in profiler.refusals() {
            observer.notice(&refusal.to_string());
        }
        // The probes sit on the library file itself, so a process that loads it later (at
        // its cuInit) is seen from its first launch.
        let mut gpu_probes = GpuProbes::default();
        let gpu_library = gpu_library
            .filter(|_| !profiler.refused(Feature::GpuKernels))
            .filter(
                |lib| match gpu_probes.attach_file(lib, &mut profiler.sampler) {
                    Ok(()) => true,
                    Err(e) => {
                        observer.notice(&format!(
                            "cannot probe {}: {e}; GPU kernels are not recorded",
                            lib.display()
                        ));
                        false
                    }
                },
            );
        // What the kernel refused is off from here on.
        let sources = Sources {
            off_cpu: config.off_cpu.is_some() && !profiler.refused(Feature::OffCpu),
            gil: config.gil && !profiler.refused(Feature::Gil),
            alloc: config.alloc.is_some() && !profiler.refused(Feature::Alloc),
            gpu_kernels: gpu_library.is_some(),
            gc: config.gc && !profiler.refused(Feature::Gc),
        };
        Ok(Self {
            config,
            profiler,
            sources,
            root_pids: Vec::new(),
            held: None,
            startup_hold: None,
            child: None,
            held_maps_read: None,
            comm_finder: None,
            run: None,
            gpu_library,
            gpu_probes,
        })
    }

    /// The sources that run: those asked for that the kernel did not refuse.
    pub fn sources(&self) -> Sources {
        self.sources
    }

    /// Whether the kernel refused some source.
    pub fn refused_any(&self) -> bool {
        !self.profiler.refusals().is_empty()
    }

    /// Samples per second per CPU.
    pub fn frequency_hz(&self) -> u64 {
        self.profiler.frequency_hz()
    }

    fn frames(&self) -> FrameView {
        FrameView::parse(&self.config.frames).expect("checked by Recording::open")
    }
}

/// `--frames`: `mixed`, `python` or `all`.
pub(crate) fn frame_view(frames: &str) -> Result<FrameView, CommandError> {
    FrameView::parse(frames).ok_or_else(|| {
        CommandError::Input(format!("--frames {frames}: expected mixed, python or all"))
    })
}

/// The directories searched for separate debug files: those given, then the system's.
pub(crate) fn debug_dirs(given: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = given.to_vec();
    dirs.extend(
        crate::symbolize::DEFAULT_DEBUG_DIRS
            .iter()
            .map(PathBuf::from),
    );
    dirs
}
