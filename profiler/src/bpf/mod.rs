//! Loads the kernel-side sampler (`pyrometer-ebpf`) with aya, attaches it, and gives the rest of
//! the agent typed access to its maps: the target set, the kernel stack map, the ring buffer
//! and the health counters.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf, StackTraceMap};
use aya::programs::perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent};
use aya::programs::uprobe::UProbeLinkId;
use aya::programs::{BtfTracePoint, PerfEvent};
use aya::{Btf, Ebpf, Endianness};
use pyrometer_ebpf as shared;

mod config;
mod counters;
pub mod load;
mod uprobes;
pub mod verifier;

pub use config::*;
pub use counters::{AllocCounters, Counters, ProgramStats, PythonCounters, UnwindCounters};
pub use load::{Feature, Refusal};
#[cfg(test)]
pub(crate) use uprobes::AskedProbes;
pub use uprobes::{ProbedCopies, Uprobes};

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error(
        "kernel BTF not found at {0}: pyrometer needs a kernel built with CONFIG_DEBUG_INFO_BTF=y (Linux 5.8+)"
    )]
    NoBtf(PathBuf),
    #[error("cannot parse kernel BTF at {path}: {reason}")]
    BadBtf { path: PathBuf, reason: String },
    #[error("this kernel ({0}) has no BPF ring buffers: pyrometer needs Linux 5.8 or newer")]
    NoRingBuffer(String),
    #[error("cannot load the BPF sampler: {0}")]
    Load(String),
    #[error(
        "cannot sample: Linux {} refused the BPF program {} ({}){}; nothing can be sampled on this kernel",
        .0.kernel, .0.program, .0.reason, .0.log.as_ref().map(|l| format!("; verifier log: {}", l.display())).unwrap_or_default()
    )]
    Refused(Refusal),
    #[error("cannot attach {what}: {reason}")]
    Attach { what: String, reason: String },
    #[error("BPF map {0}: {1}")]
    Map(&'static str, String),
}

/// The DWARF unwinder's maps: the row array and its bucket index (both memory-mapped by the
/// unwinder, with their capacities) and the per-process mapping table.
pub struct UnwindMaps {
    pub rows: MapData,
    pub rows_capacity: u32,
    pub index: MapData,
    pub index_entries: u32,
    pub procs: BpfHashMap<MapData, u32, shared::ProcessUnwind>,
}

/// The Python frame walker's process map: pid → where its interpreter keeps its state.
pub type PyProcs = BpfHashMap<MapData, u32, shared::PyProcess>;

/// The module bodies the Python frame walker last read, by address (`py_bodies`).
pub type PyBodies = BpfHashMap<MapData, shared::PyBodyKey, shared::PyBody>;

/// The loaded and attached sampler. Dropping it detaches everything.
pub struct Sampler {
    ebpf: Ebpf,
    ring: RingBuf<MapData>,
    targets: BpfHashMap<MapData, u32, u32>,
    kernel_stacks: StackTraceMap<MapData>,
    counters: PerCpuArray<MapData, u64>,
    perf_prog_id: Option<u32>,
    unwind_maps: Option<(
        MapData,
        MapData,
        BpfHashMap<MapData, u32, pyrometer_ebpf::ProcessUnwind>,
    )>,
    unwind_rows: u32,
    py_procs: Option<BpfHashMap<MapData, u32, shared::PyProcess>>,
    py_bodies: Option<PyBodies>,
    /// With `--gil`: per-thread GIL state and sums.
    gil_threads: Option<BpfHashMap<MapData, u32, shared::GilThread>>,
    /// The agent's allocation targets.
    alloc_targets: Option<BpfHashMap<MapData, u32, u32>>,
    /// Probes attached for one process, detached when it is forgotten.
    pid_probes: std::collections::HashMap<u32, Vec<(&'static str, UProbeLinkId)>>,
    /// With off-CPU time: blocked threads' pending intervals, and the minimum reported.
    offcpu: Option<(BpfHashMap<MapData, u32, shared::OffCpuRecord>, u64)>,
    /// Features the kernel refused (the capture goes on without them).
    refusals: Vec<Refusal>,
    /// Whether the programs walk stacks with DWARF tables.
    dwarf: bool,
    /// Samples per second per CPU, once started.
    frequency_hz: u64,
}

impl Sampler {
    /// Loads the programs and maps, and attaches the fork/exit tracepoints. Sampling starts with
    /// [`Sampler::start`], so targets can be registered before the first sample.
    pub fn load(config: &SamplerConfig) -> Result<Self, BpfError> {
        check_ring_buffer_support()?;
        if !config.btf_path.exists() {
            return Err(BpfError::NoBtf(config.btf_path.clone()));
        }
        let btf = Btf::parse_file(&config.btf_path, Endianness::default()).map_err(|e| {
            BpfError::BadBtf {
                path: config.btf_path.clone(),
                reason: e.to_string(),
            }
        })?;
        raise_memlock_limit();

        let mut refusals = Vec::new();
        let mut dwarf = config.dwarf;
        let mut asyncio = config.asyncio;
        // The sampler first: when the kernel refuses the DWARF walk, the object is made again
        // without it (a load-time constant the verifier prunes by), frame pointers instead;
        // the asyncio task walk likewise, before the DWARF walk is given up.
        let mut ebpf = loop {
            let mut ebpf = load::open(config, &btf, dwarf, asyncio)?;
            for (name, tracepoint) in load::LIFECYCLE {
                load::load_program(&mut ebpf, &btf, name, load::Kind::Tracepoint(tracepoint))
                    .map_err(|f| BpfError::Refused(f.refusal(Feature::DwarfUnwinding)))?;
            }
            match load::load_program(&mut ebpf, &btf, load::SAMPLER, load::Kind::PerfEvent) {
                Ok(_) => break ebpf,
                Err(failure) if asyncio => {
                    refusals.push(failure.refusal(Feature::Async));
                    asyncio = false;
                }
                Err(failure) if dwarf => {
                    refusals.push(failure.refusal(Feature::DwarfUnwinding));
                    dwarf = false;
                }
                Err(failure) => {
                    return Err(BpfError::Refused(failure.refusal(Feature::DwarfUnwinding)));
                }
            }
        };
        for (name, tracepoint) in load::LIFECYCLE {
            attach_tracepoint(&mut ebpf, name, tracepoint)?;
        }

        // Optional stages: a refused one is switched off, the capture goes on.
        let mut enabled = std::collections::HashSet::new();
        for feature in load::requested(config) {
            let mut ok = true;
            for (name, kind) in load::feature_programs(feature) {
                match load::load_program(&mut ebpf, &btf, name, kind) {
                    Ok(_) => {}
                    Err(failure) => {
                        refusals.push(failure.refusal(feature));
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                enabled.insert(feature);
            }
        }
        if enabled.contains(&Feature::OffCpu) {
            attach_tracepoint(&mut ebpf, load::OFFCPU.0, load::OFFCPU.1)?;
        }

        let ring = take_as(&mut ebpf, "samples")?;
        let targets = take_as(&mut ebpf, "targets")?;
        let kernel_stacks = take_as(&mut ebpf, "kernel_stacks")?;
        let counters = take_as(&mut ebpf, "counters")?;
        let rows = match take(&mut ebpf, "unwind_rows")? {
            aya::maps::Map::Array(data) => data,
            _ => return Err(BpfError::Map("unwind_rows", "not an array".into())),
        };
        let index = match take(&mut ebpf, "unwind_index")? {
            aya::maps::Map::Array(data) => data,
            _ => return Err(BpfError::Map("unwind_index", "not an array".into())),
        };
        let procs = take_as(&mut ebpf, "unwind_procs")?;
        let py_procs = take_as(&mut ebpf, "py_procs")?;
        let py_bodies = take_as(&mut ebpf, "py_bodies")?;
        let alloc_targets =
            if enabled.contains(&Feature::Alloc) && config.alloc.is_some_and(|a| a.own_targets) {
                Some(take_as(&mut ebpf, "alloc_targets")?)
            } else {
                None
            };
        let gil_threads = if enabled.contains(&Feature::Gil) {
            Some(take_as(&mut ebpf, "gil_threads")?)
        } else {
            None
        };
        let offcpu = match config.off_cpu_min_ns {
            Some(min) if enabled.contains(&Feature::OffCpu) => {
                Some((take_as(&mut ebpf, "offcpu_pending")?, min))
            }
            _ => None,
        };
        Ok(Self {
            ebpf,
            ring,
            targets,
            kernel_stacks,
            counters,
            perf_prog_id: None,
            unwind_maps: Some((rows, index, procs)),
            unwind_rows: config.unwind_rows.max(1),
            py_procs: Some(py_procs),
            py_bodies: Some(py_bodies),
            gil_threads,
            alloc_targets,
            pid_probes: std::collections::HashMap::new(),
            offcpu,
            refusals,
            dwarf,
            frequency_hz: config.frequency_hz,
        })
    }

    /// Features the kernel refused: each was switched off, and the capture went on.
    pub fn refusals(&self) -> &[Refusal] {
        &self.refusals
    }

    /// Whether the kernel refused `feature` (it was switched off).
    pub fn refused(&self, feature: Feature) -> bool {
        self.refusals.iter().any(|r| r.feature == feature)
    }

    /// Whether user stacks are walked with DWARF tables (asked for and not refused).
    pub fn dwarf(&self) -> bool {
        self.dwarf
    }

    /// Hands out the DWARF unwinder's maps (once), for the unwinder that fills them. Until
    /// processes are registered there, every user stack is walked by frame pointers.
    pub fn take_unwind_maps(&mut self) -> Result<UnwindMaps, BpfError> {
        let (rows, index, procs) = self
            .unwind_maps
            .take()
            .ok_or_else(|| BpfError::Map("unwind_rows", "already taken".into()))?;
        Ok(UnwindMaps {
            rows,
            rows_capacity: self.unwind_rows,
            index,
            index_entries: load::index_entries(self.unwind_rows),
            procs,
        })
    }

    /// Hands out the Python frame walker's process map (once), for the tracker that fills it.
    /// Until processes are registered there, stacks have native frames only.
    pub fn take_py_procs(&mut self) -> Result<PyProcs, BpfError> {
        self.py_procs
            .take()
            .ok_or_else(|| BpfError::Map("py_procs", "already taken".into()))
    }

    /// Hands out the Python frame walker's module bodies (once), for the tracker that names
    /// the frames of bodies freed before it read them.
    pub fn take_py_bodies(&mut self) -> Result<PyBodies, BpfError> {
        self.py_bodies
            .take()
            .ok_or_else(|| BpfError::Map("py_bodies", "already taken".into()))
    }

    /// Adds a process to the agent's allocation targets.
    pub fn add_alloc_target(&mut self, pid: u32) -> Result<(), BpfError> {
        match self.alloc_targets.as_mut() {
            Some(map) => map
                .insert(pid, 1, 0)
                .map_err(|e| BpfError::Map("alloc_targets", e.to_string())),
            None => Ok(()),
        }
    }

    /// Every thread's GIL state and sums (`--gil`), by tid.
    pub fn gil_threads(&self) -> Vec<(u32, shared::GilThread)> {
        match &self.gil_threads {
            Some(map) => map.iter().filter_map(Result::ok).collect(),
            None => Vec::new(),
        }
    }

    /// Forgets the GIL state of the threads of `pids`: a capture measures them from its
    /// start, and leaves no entries behind for probes that are off again.
    pub fn forget_gil_threads(&mut self, pids: &[u32]) {
        let Some(map) = self.gil_threads.as_mut() else {
            return;
        };
        let theirs: Vec<u32> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, g)| pids.contains(&g.pid))
            .map(|(tid, _)| tid)
            .collect();
        for tid in theirs {
            let _ = map.remove(&tid);
        }
    }

    /// Samples per second per CPU (`SamplerConfig::frequency_hz`).
    pub fn frequency_hz(&self) -> u64 {
        self.frequency_hz
    }

    /// Attaches the sampler to the software cpu-clock event of every online CPU, at the
    /// configured frequency.
    pub fn start(&mut self) -> Result<(), BpfError> {
        let frequency_hz = self.frequency_hz;
        let cpus = aya::util::online_cpus().map_err(|(what, e)| BpfError::Attach {
            what: "perf events".into(),
            reason: format!("{what}: {e}"),
        })?;
        let prog = self.perf_program()?;
        for cpu in cpus {
            prog.attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Frequency(frequency_hz),
                false,
            )
            .map_err(|e| BpfError::Attach {
                what: format!("cpu-clock perf event on CPU {cpu}"),
                reason: error_chain(&e),
            })?;
        }
        self.perf_prog_id = prog.info().ok().map(|i| i.id());
        Ok(())
    }

    /// Attaches the sampler to a cpu-clock event of one thread at `frequency_hz`, beside the
    /// node-wide events: an on-demand capture's burst. Its samples carry its period
    /// (`SampleHeader::aux`), which tells them from the always-on ones.
    pub fn attach_thread(
        &mut self,
        tid: u32,
        frequency_hz: u64,
    ) -> Result<aya::programs::perf_event::PerfEventLinkId, BpfError> {
        self.perf_program()?
            .attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::OneProcess {
                    pid: tid,
                    cpu: None,
                },
                SamplePolicy::Frequency(frequency_hz),
                false,
            )
            .map_err(|e| BpfError::Attach {
                what: format!("cpu-clock perf event of thread {tid}"),
                reason: error_chain(&e),
            })
    }

    /// The cpu-clock sampler program.
    fn perf_program(&mut self) -> Result<&mut PerfEvent, BpfError> {
        self.ebpf
            .program_mut("on_cpu_clock")
            .expect("loaded in Sampler::load")
            .try_into()
            .map_err(|e| BpfError::Load(error_chain(&e)))
    }

    /// Detaches an event of [`Sampler::attach_thread`] (closing it).
    pub fn detach_thread(&mut self, link: aya::programs::perf_event::PerfEventLinkId) {
        if let Some(prog) = self.ebpf.program_mut("on_cpu_clock")
            && let Ok(prog) = <&mut PerfEvent>::try_from(prog)
        {
            let _ = prog.detach(link);
        }
    }

    /// Adds a process to the in-kernel target set; `follow_children` makes the fork
    /// tracepoint add the processes it starts.
    pub fn add_target(&mut self, pid: u32, follow_children: bool) -> Result<(), BpfError> {
        let mut flags = shared::TARGET_SELECTED;
        if follow_children {
            flags |= shared::TARGET_FOLLOW_CHILDREN;
        }
        self.targets
            .insert(pid, flags, 0)
            .map_err(|e| BpfError::Map("targets", e.to_string()))
    }

    /// Kernel frames (leaf first) of a stack id from a sample record.
    pub fn kernel_stack(&self, id: i32) -> Option<Vec<u64>> {
        let id = u32::try_from(id).ok()?;
        let trace = self.kernel_stacks.get(&id, 0).ok()?;
        Some(trace.frames().iter().map(|f| f.ip).collect())
    }

    /// Hands every record waiting in the ring buffer to `f`; returns how many there were.
    /// The kernel side never waits for us: when the buffer is full it drops and counts.
    pub fn drain(&mut self, mut f: impl FnMut(&[u8])) -> usize {
        let mut n = 0;
        while let Some(item) = self.ring.next() {
            f(&item);
            n += 1;
        }
        n
    }

    /// Copies every waiting record into `out` (appending), so the caller can process them
    /// while also using the sampler (e.g. to read kernel stacks).
    pub fn drain_into(&mut self, out: &mut Vec<Vec<u8>>) -> usize {
        self.drain(|b| out.push(b.to_vec()))
    }

    /// The off-CPU records of threads still blocked at `now_ns` (CLOCK_MONOTONIC), as if they
    /// ran again now. Without them a thread that blocks for the whole capture (an idle worker
    /// waiting for tasks) would never be seen, since its interval is sent only when it wakes.
    pub fn pending_off_cpu(&self, now_ns: u64) -> Vec<shared::PendingOffCpu> {
        let Some((pending, min_ns)) = &self.offcpu else {
            return Vec::new();
        };
        pending
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(_, rec)| {
                let blocked = now_ns.saturating_sub(rec.hdr.timestamp_ns);
                (blocked >= *min_ns).then(|| shared::PendingOffCpu::new(rec, blocked))
            })
            .collect()
    }

    /// Waits until the ring buffer has data or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let mut pfd = libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }

    /// The perf_event program's accumulated run time (only counted while the
    /// `kernel.bpf_stats_enabled` sysctl is 1).
    pub fn program_stats(&self) -> Option<ProgramStats> {
        let id = self.perf_prog_id?;
        aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .map(|p| ProgramStats {
                run_time_ns: u64::try_from(p.run_time().as_nanos()).unwrap_or(u64::MAX),
                run_count: p.run_count(),
            })
    }
}

fn attach_tracepoint(ebpf: &mut Ebpf, name: &str, tracepoint: &str) -> Result<(), BpfError> {
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(name)
        .ok_or_else(|| BpfError::Load(format!("program {name} missing from object")))?
        .try_into()
        .map_err(|e| BpfError::Load(error_chain(&e)))?;
    prog.attach().map(|_| ()).map_err(|e| BpfError::Attach {
        what: format!("tracepoint {tracepoint}"),
        reason: error_chain(&e),
    })
}

fn take(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, BpfError> {
    ebpf.take_map(name)
        .ok_or_else(|| BpfError::Map(name, "missing from object".into()))
}

/// Map `name` taken out of the object as its typed view.
fn take_as<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, BpfError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    T::try_from(take(ebpf, name)?).map_err(|e| BpfError::Map(name, e.to_string()))
}

/// Formats an error with its sources, so the verifier's or kernel's reason is not lost.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; later ones use memcg and ignore it.
pub(crate) fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid struct; failure only matters on old kernels, where
    // the map creation error that follows says what went wrong.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };
}

/// Ring buffers came with Linux 5.8.
fn check_ring_buffer_support() -> Result<(), BpfError> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let release = release.trim().to_string();
    if let Some((major, minor)) = parse_release(&release)
        && (major, minor) < (5, 8)
    {
        return Err(BpfError::NoRingBuffer(release));
    }
    Ok(())
}

fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// True when `path` looks like the kernel BTF override used by tests (`--btf-path`).
pub fn btf_path_or_default(path: Option<&Path>) -> PathBuf {
    path.map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(KERNEL_BTF))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_release_parsing() {
        assert_eq!(parse_release("6.18.44-fc-v1045"), Some((6, 18)));
        assert_eq!(parse_release("5.4.0"), Some((5, 4)));
        assert_eq!(parse_release("garbage"), None);
    }

    #[test]
    fn missing_btf_is_a_clear_error() {
        let cfg = SamplerConfig {
            btf_path: PathBuf::from("/nonexistent/vmlinux"),
            ..SamplerConfig::default()
        };
        let err = Sampler::load(&cfg).err().expect("load must fail");
        assert!(
            err.to_string()
                .contains("kernel BTF not found at /nonexistent/vmlinux")
        );
    }
}

/// Tests against the real kernel: they need root (or the sampling capabilities).
#[cfg(test)]
mod kernel_tests {
    use super::*;
    use std::process::{Child, Command};
    use std::time::Instant;

    fn spinner() -> Child {
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("spawn sh")
    }

    #[test]
    fn samples_only_the_targets_with_stacks() {
        if !crate::os::privileges::may_sample() {
            return;
        }
        let mut target = spinner();
        let mut other = spinner();
        let config = SamplerConfig {
            frequency_hz: 199,
            ..SamplerConfig::default()
        };
        let mut sampler = Sampler::load(&config).expect("load");
        sampler.add_target(target.id(), false).unwrap();
        sampler.start().unwrap();
        let (mut mine, mut foreign, mut with_user) = (0, 0, 0);
        // Until enough samples arrived: on a busy machine the spinner may get little CPU.
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && mine < 60 {
            sampler.wait(Duration::from_millis(50));
            sampler.drain(|bytes| {
                let s = shared::RawSample::parse(bytes).expect("well-formed record");
                if s.header.pid == target.id() {
                    mine += 1;
                    if s.user_frames().count() > 0 {
                        with_user += 1;
                    }
                } else {
                    foreign += 1;
                }
            });
        }
        target.kill().ok();
        other.kill().ok();
        target.wait().ok();
        other.wait().ok();
        assert!(mine > 20, "only {mine} samples of the target");
        assert_eq!(foreign, 0, "samples of untargeted processes leaked through");
        assert!(
            with_user * 2 > mine,
            "{with_user}/{mine} samples have user frames"
        );
        assert!(sampler.counters().samples >= mine);
    }
}
