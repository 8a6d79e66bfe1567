//! A recording's start: the targets in place with their tables and probes before their first
//! sample, a command started and held until then, and sampling switched on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::targets::{command_path, prewarm_command};
use super::{Observer, Recording, Targets};
use crate::alloc::{AllocProbes, preload};
use crate::bpf::Sampler;
use crate::command::CommandError;
use crate::os::clock::monotonic_now_ns;
use crate::os::spawn::{HeldChild, StartupHold};
use crate::profiler::comm::CommFinder;
use crate::profiler::discover;

/// How long record waits for a command it preloaded the sampler library into to reach the
/// library's constructor (the command waits up to 2 s more for the answer). A command that
/// never loads the library (a set-user-ID program ignores LD_PRELOAD) costs this once.
const STARTUP_HOLD_WAIT: Duration = Duration::from_secs(1);

impl Recording {
    /// Puts the targets in place (a command is started, held before its `exec` until the
    /// kernel knows it) and starts sampling; notices go to `observer`.
    pub fn start(&mut self, observer: &mut dyn Observer) -> Result<(), CommandError> {
        if let Targets::Comm(_, re) = &self.config.targets {
            let events = discover::open_events()
                .map_err(|e| observer.notice(&e.to_string()))
                .ok();
            self.comm_finder = Some(CommFinder::new(re, self.config.subprocesses, events));
        }
        match &self.config.targets {
            Targets::All => {}
            Targets::Pids(pids) => {
                let pids = pids.clone();
                self.add_pids(&pids, observer)?;
            }
            Targets::Command(argv) => {
                let argv = argv.clone();
                self.start_command(&argv, observer)?;
            }
            Targets::Comm(..) => self.poll_comm(observer),
        }
        self.profiler
            .start()
            .map_err(|e| CommandError::Kernel(e.to_string()))?;
        if let Some(h) = self.held.take() {
            self.release(h);
        }
        Ok(())
    }

    /// Adds the processes `--comm` names that appeared since the last call.
    pub(super) fn poll_comm(&mut self, observer: &mut dyn Observer) {
        if let Some(f) = self.comm_finder.as_mut() {
            for e in f.poll(&mut self.profiler) {
                observer.notice(&e);
            }
        }
    }

    /// `--pid`: with allocation sampling, each must load the sampler library, or with
    /// `--alloc-uprobes` have an allocator to probe.
    fn add_pids(&mut self, pids: &[u32], observer: &mut dyn Observer) -> Result<(), CommandError> {
        self.profiler
            .add_pids(pids, self.config.subprocesses)
            .map_err(|e| CommandError::Input(e.to_string()))?;
        self.root_pids = pids.to_vec();
        // Processes started with their own copy of the GPU library (a container's).
        if self.sources.gpu_kernels {
            for &pid in pids {
                if let Some(Err(e)) = self
                    .profiler
                    .registry
                    .get(pid)
                    .and_then(|p| self.gpu_probes.attach_mapped(p, &mut self.profiler.sampler))
                {
                    observer.notice(&format!("pid {pid}: {e}"));
                }
            }
        }
        let Some(a) = &self.profiler.tables.alloc else {
            return Ok(());
        };
        let uprobes = self.config.alloc.is_some_and(|a| a.uprobes);
        for &pid in pids.iter().filter(|&&pid| !a.is_preloaded(pid)) {
            let why = preload::not_loaded(pid);
            if !uprobes {
                return Err(CommandError::Input(preload::uprobes_refusal(&why)));
            }
            if a.has_allocator(pid) {
                observer.notice(&preload::uprobes_note(&why));
            }
        }
        if let Some(&pid) = pids.iter().find(|&&pid| !a.has_allocator(pid)) {
            let p = self.profiler.registry.get(pid);
            let comm = p.map_or("?", |p| p.comm.as_str());
            let exe = p.and_then(|p| p.exe.as_deref());
            return Err(CommandError::Input(a.unprobed_reason(pid, comm, exe)));
        }
        Ok(())
    }

    /// `-- CMD`: the tables it will need first are built, the GIL probes go in before the
    /// interpreter starts (so its first acquisitions count), allocations are sampled in its
    /// own process when it can preload the sampler library (else, with `--alloc-uprobes`,
    /// with uprobes on its allocator; without, it is refused); then it starts, held until
    /// sampling is on.
    fn start_command(
        &mut self,
        argv: &[String],
        observer: &mut dyn Observer,
    ) -> Result<(), CommandError> {
        let exe = command_path(&argv[0]);
        let tables = &mut self.profiler.tables;
        let sampler = &mut self.profiler.sampler;
        if let Some(u) = tables.unwinder.as_mut() {
            prewarm_command(u, exe.as_deref());
        }
        let interpreter = exe
            .as_deref()
            .and_then(crate::python::version::interpreter_binary);
        if let Some(interpreter) = &interpreter {
            tables.python.prewarm(interpreter);
        }
        // A failure is reported when the process shows up.
        if self.sources.gil
            && let Some(interpreter) = &interpreter
        {
            let _ = tables.python.prepare_gil(interpreter, sampler);
        }
        if self.sources.gc
            && let Some(interpreter) = &interpreter
        {
            let _ = tables.python.prepare_gc(interpreter, sampler);
        }
        let uprobes = self.config.alloc.is_some_and(|a| a.uprobes);
        let preload = match (tables.alloc.as_mut(), exe.as_deref()) {
            (Some(a), Some(exe)) => preload_library(a, exe, sampler, uprobes, observer)?,
            _ => None,
        };
        let sample_bytes = self.config.alloc.map_or(0, |a| a.sample_bytes);
        let mut env: Vec<(&str, std::ffi::OsString)> = preload
            .as_deref()
            .map(|lib| {
                vec![
                    (
                        "LD_PRELOAD",
                        preload::ld_preload(lib, std::env::var_os("LD_PRELOAD")),
                    ),
                    (preload::MEAN_ENV, sample_bytes.to_string().into()),
                ]
            })
            .unwrap_or_default();
        if let Some(lib) = &self.gpu_library {
            env.extend(gpu_command_env(
                lib,
                self.config.gpu_kernels.as_ref(),
                observer,
            ));
        }
        self.startup_hold = preload.as_ref().and_then(|_| StartupHold::new().ok());
        let h = HeldChild::spawn_holding(
            argv,
            &env,
            self.startup_hold.as_ref().and_then(|s| s.child_fd()),
        )
        .map_err(|e| CommandError::Input(e.to_string()))?;
        if let Some(s) = self.startup_hold.as_mut() {
            s.spawned();
        }
        sampler
            .add_target(h.pid(), true)
            .map_err(|e| CommandError::Input(e.to_string()))?;
        tables.python.choose(h.pid());
        if let (Some(a), Some(lib)) = (tables.alloc.as_mut(), preload.as_deref()) {
            a.mark_preloaded(h.pid());
            if let Some(u) = tables.unwinder.as_mut() {
                u.prewarm(lib);
            }
        }
        // Likewise the allocation probes, on the objects the command will map; a command
        // with no allocator to probe (static and stripped) is refused before it runs. A
        // script (`#!`) maps its interpreter, not itself: its processes are probed as they
        // show up.
        if let (Some(a), Some(exe)) = (tables.alloc.as_mut(), exe.as_deref().filter(|e| is_elf(e)))
            && preload.is_none()
        {
            let mut objects = vec![exe.to_path_buf()];
            objects.extend(crate::os::elfsyms::preloaded_libraries());
            objects.extend(crate::os::elfsyms::needed_libraries(exe));
            a.prepare(h.pid(), &objects, sampler);
            if !a.has_allocator(h.pid()) {
                let name = exe
                    .file_name()
                    .map_or_else(|| argv[0].clone(), |n| n.to_string_lossy().into_owned());
                return Err(CommandError::Input(a.unprobed_reason(
                    h.pid(),
                    &name,
                    Some(exe),
                )));
            }
        }
        self.held = Some(h);
        Ok(())
    }

    /// Lets the held command run. The sampler library holds it again between the loader's
    /// work and its main: its libraries are mapped, so their tables go in before it runs
    /// (see StartupHold).
    fn release(&mut self, h: HeldChild) {
        let pid = h.pid();
        self.child = Some(h.release());
        if let Some(mut hold) = self.startup_hold.take()
            && hold.wait_ready(STARTUP_HOLD_WAIT)
        {
            let read_at = monotonic_now_ns();
            if let Ok(p) = self.profiler.registry.exec(pid) {
                self.profiler
                    .tables
                    .sync_process_waiting(p, &mut self.profiler.sampler);
                self.held_maps_read = Some((pid, read_at));
            }
            hold.release();
        }
    }
}

/// What a command started with the GPU library gets in its environment (CUDA's and NVTX's
/// injection variables, the library's 1-in-N); an NVTX tool the environment names already
/// keeps its place, and the observer hears that NVTX ranges go unlabelled.
fn gpu_command_env(
    lib: &Path,
    config: Option<&super::RecordGpuKernels>,
    observer: &mut dyn Observer,
) -> Vec<(&'static str, std::ffi::OsString)> {
    use crate::gpu::kernels::probes as gpu_probes;
    let (vars, kept) = gpu_probes::command_env(
        lib,
        config.and_then(|g| g.sample_every),
        std::env::var_os(gpu_probes::NVTX_INJECTION_ENV),
    );
    if let Some(other) = kept {
        observer.notice(&format!(
            "{} names another NVTX tool ({}): NVTX ranges are not labelled",
            gpu_probes::NVTX_INJECTION_ENV,
            other.to_string_lossy()
        ));
    }
    vars
}

/// Whether `path` is an ELF file (not a `#!` script).
fn is_elf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| &magic == b"\x7fELF")
}

/// The sampler library a command gets preloaded, with its probes attached. Where it cannot
/// be used: None (uprobes on the allocator, said in one line) when `uprobes_allowed`
/// (`--alloc-uprobes`), else the error that says why and what to do.
fn preload_library(
    probes: &mut AllocProbes,
    exe: &Path,
    sampler: &mut Sampler,
    uprobes_allowed: bool,
    observer: &mut dyn Observer,
) -> Result<Option<PathBuf>, CommandError> {
    match probes.preload_command(exe, sampler) {
        Ok(lib) => Ok(Some(lib)),
        Err(why) if uprobes_allowed => {
            observer.notice(&preload::uprobes_note(&why));
            Ok(None)
        }
        Err(why) => Err(CommandError::Input(preload::uprobes_refusal(&why))),
    }
}
