//! `top`: sampling for a live view. It samples as `record` does (kernel programs, unwind
//! tables, Python walker); the caller takes what was read so far as a symbolized profile
//! whenever it redraws (every second), so a sliding window of profiles can be shown.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::bpf::SamplerConfig;
use crate::capture::Capture;
use crate::command::CommandError;
use crate::model::Profile;
use crate::os::pids;
use crate::profiler::Profiler;
use crate::profiler::comm::CommFinder;
use crate::profiler::discover;
use crate::python::merge::FrameView;
use crate::record::Targets;
use crate::symbolize::Symbolizer;

/// What to watch and how.
#[derive(Debug)]
pub struct TopConfig {
    /// What to sample (not a command).
    pub targets: Targets,
    /// Also the descendants of each pid (or comm match), current and future.
    pub subprocesses: bool,
    /// Samples per second per CPU.
    pub frequency: u64,
    /// Which frames stacks of Python processes keep: `mixed`, `python` or `all`.
    pub frames: String,
    /// Walk user stacks with DWARF tables (else frame pointers only).
    pub dwarf: bool,
    /// Directories of separate debug files, searched before the system's.
    pub debug_dirs: Vec<PathBuf>,
    /// asyncio task stacks (`--async`).
    pub asyncio: bool,
}

/// Sampling for the live view.
pub struct Top {
    profiler: Profiler,
    capture: Capture,
    frames: FrameView,
    symbolizer: Symbolizer,
    comm_finder: Option<CommFinder>,
    root_pids: Vec<u32>,
}

impl Top {
    /// Loads the kernel side, puts the targets in place and starts sampling; notices go to
    /// `notice`.
    pub fn start(config: TopConfig, notice: &mut dyn FnMut(&str)) -> Result<Top, CommandError> {
        config.targets.check()?;
        let frames = crate::record::frame_view(&config.frames)?;
        crate::command::check_sampling_privileges()?;
        let sampler = SamplerConfig {
            frequency_hz: config.frequency,
            filter: config.targets.filter(),
            ring_buffer_bytes: 8 << 20,
            unwind_rows: 1 << 20,
            btf_path: crate::bpf::btf_path_or_default(None),
            off_cpu_min_ns: None,
            gpu_kernels: None,
            gil: false,
            gc: false,
            asyncio: config.asyncio,
            alloc: None,
            dwarf: config.dwarf,
            debug_reject: 0,
        };
        let debug_dirs = crate::record::debug_dirs(&config.debug_dirs);
        let mut profiler = Profiler::open(&sampler, &debug_dirs)
            .map_err(|e| CommandError::Kernel(e.to_string()))?;
        for refusal in profiler.refusals() {
            notice(&refusal.to_string());
        }
        let mut comm_finder = match &config.targets {
            Targets::Comm(_, re) => {
                let events = discover::open_events()
                    .map_err(|e| notice(&e.to_string()))
                    .ok();
                Some(CommFinder::new(re, config.subprocesses, events))
            }
            _ => None,
        };
        let mut root_pids = Vec::new();
        match &config.targets {
            Targets::Pids(pids) => {
                profiler
                    .add_pids(pids, config.subprocesses)
                    .map_err(|e| CommandError::Input(e.to_string()))?;
                root_pids = pids.clone();
            }
            Targets::Comm(..) => {
                if let Some(f) = comm_finder.as_mut() {
                    for e in f.poll(&mut profiler) {
                        notice(&e);
                    }
                }
            }
            Targets::All | Targets::Command(_) => {}
        }
        profiler
            .start()
            .map_err(|e| CommandError::Kernel(e.to_string()))?;
        Ok(Top {
            profiler,
            capture: new_capture(frames),
            frames,
            symbolizer: Symbolizer::new().with_debug_dirs(debug_dirs),
            comm_finder,
            root_pids,
        })
    }

    /// Reads what the kernel sent (without waiting); returns the notices to show.
    pub fn pump(&mut self) -> Vec<String> {
        self.profiler.pump(&mut self.capture, Duration::ZERO)
    }

    /// Adds the processes `--comm` names that appeared; returns what could not be added.
    pub fn poll_comm(&mut self) -> Vec<String> {
        match self.comm_finder.as_mut() {
            Some(f) => f.poll(&mut self.profiler),
            None => Vec::new(),
        }
    }

    /// Whether every `--pid` target has exited (never true for other targets).
    pub fn targets_gone(&self) -> bool {
        !self.root_pids.is_empty()
            && self
                .root_pids
                .iter()
                .all(|&p| !pids::alive(Path::new("/proc"), p))
    }

    /// Samples lost so far (the ring buffer was full).
    pub fn lost(&self) -> u64 {
        self.profiler.sampler.counters().ringbuf_drops
    }

    /// What was read since the last call, symbolized: None when `keep` is false (paused:
    /// the samples are let go).
    pub fn take_profile(&mut self, keep: bool) -> Option<Profile> {
        self.capture
            .name_late_threads(&mut self.profiler.tables.python);
        let taken = std::mem::replace(&mut self.capture, new_capture(self.frames));
        let period_ns = self.profiler.period_ns();
        keep.then(|| {
            taken.into_profile(&mut self.profiler.registry, &mut self.symbolizer, period_ns)
        })
    }
}

fn new_capture(frames: FrameView) -> Capture {
    let mut c = Capture::default();
    c.frames = frames;
    c
}
