//! Allocation profiling: which allocator entry points each target calls, the per-process
//! probes on them (`ebpf/src/bpf/alloc.h`), and the statistics that turn byte-sampled
//! allocations into unbiased estimates.
//!
//! Probes are attached per process (a uprobe filtered to one process costs the others
//! nothing, where a probe on libc for every process would trap every `malloc` on the node),
//! to every mapped object that defines allocator functions: whichever one the process's calls
//! resolve to is then probed (a preloaded jemalloc, or libc), and CPython's pymalloc beside it.

pub mod embedded;
pub mod preload;
pub mod sites;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::bpf::{ALLOC_ENTER, ALLOC_RETURN, Uprobes};
use crate::os::procs::{BinaryKey, MappingKind, Process};
use crate::os::workers::{OffLoop, ProcessReads};
use sites::Sites;

/// Threads searching binaries (and their debug files) for allocator sites, off the
/// sampling loop; each search stuck past its deadline holds one until it returns.
const READ_WORKERS: usize = 2;
const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// How long a process whose search overran is left alone, at least.
const READ_BACKOFF: std::time::Duration = std::time::Duration::from_secs(60);

type Found = Result<Arc<Sites>, String>;

/// The weight of a sampled allocation of `size` bytes when samples are taken every `mean`
/// bytes on average: it was sampled with probability 1 - exp(-size/mean), so it stands for
/// 1/p allocations (and size/p bytes). Every allocation is sampled at `mean` 1.
pub fn weight(size: u64, mean: u64) -> f64 {
    if mean <= 1 {
        return 1.0;
    }
    let p = -(-(size as f64) / mean as f64).exp_m1();
    if p > 0.0 { 1.0 / p } else { 1.0 }
}

/// The allocation probes of the profiled processes.
pub struct AllocProbes {
    debug_dirs: Vec<PathBuf>,
    sites: HashMap<BinaryKey, Found>,
    /// Searches running on a worker: a binary's probes are attached on the sync after its
    /// search came back ([`AllocProbes::ready_pids`]).
    reads: ProcessReads,
    searches: OffLoop<BinaryKey, Found>,
    /// Binaries probed in each process.
    probed: HashMap<u32, HashSet<BinaryKey>>,
    /// Processes with a C allocator (`malloc`) among their probed binaries.
    with_malloc: HashSet<u32>,
    /// Why a process's allocator (or one of its binaries) could not be probed.
    failures: HashMap<u32, String>,
    /// The probes on the preloaded sampler library, and the processes that load it (their
    /// allocator functions get no uprobes).
    pub preload: preload::PreloadProbes,
    preloaded: HashSet<u32>,
    /// The processes whose allocator functions get uprobes, when not every synced one does
    /// (the agent: only those chosen with `--alloc-pid`/`--alloc-comm`). Node-wide, reading
    /// every new binary's symbols (and its debug file) for allocator sites that nobody asked
    /// to probe was a third of the agent's CPU time on a busy node.
    chosen: Option<HashSet<u32>>,
    /// `record` without `--alloc-uprobes`: no allocator function gets a uprobe, and each
    /// process seen that does not load the library (one that cannot, or whose C library was
    /// mapped without it) is said once ([`AllocProbes::take_notices`]).
    preload_only: bool,
    /// Live processes said to be without the library.
    unsampled: HashSet<u32>,
    notices: Vec<String>,
    /// Probes attached so far.
    pub attached: u64,
}

impl AllocProbes {
    /// `debug_dirs`: where separate debug files are looked for (pymalloc's symbols in a
    /// stripped interpreter).
    pub fn new(debug_dirs: Vec<PathBuf>) -> Self {
        Self {
            debug_dirs,
            sites: HashMap::new(),
            reads: ProcessReads::new(READ_WORKERS, READ_DEADLINE, READ_BACKOFF),
            searches: OffLoop::default(),
            probed: HashMap::new(),
            with_malloc: HashSet::new(),
            failures: HashMap::new(),
            preload: preload::PreloadProbes::default(),
            preloaded: HashSet::new(),
            chosen: None,
            preload_only: false,
            unsampled: HashSet::new(),
            notices: Vec::new(),
            attached: 0,
        }
    }

    /// Samples only the processes that load the preloaded library: uprobes on allocator
    /// functions are never chosen silently (they cost an allocation-heavy program hundreds of
    /// times its run time).
    pub fn preload_only(mut self) -> Self {
        self.preload_only = true;
        self
    }

    /// The library for a command started from `exe`, its probes attached (once): the
    /// command then samples in process when started with it in `LD_PRELOAD`. An error when
    /// the command cannot load it (statically linked), none can be had, or it cannot be
    /// probed.
    pub fn preload_command(
        &mut self,
        exe: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<PathBuf, preload::PreloadError> {
        let lib = preload::for_command(exe)?;
        self.preload
            .attach_file(&lib, probes)
            .map_err(|why| preload::PreloadError::Probe {
                path: lib.clone(),
                why,
            })?;
        Ok(lib)
    }

    /// Lines to show, once each: processes whose allocations are not sampled.
    pub fn take_notices(&mut self) -> Vec<String> {
        std::mem::take(&mut self.notices)
    }

    /// Probes the allocator functions only of the processes passed to
    /// [`AllocProbes::choose`]; the others are still checked for the preloaded library.
    pub fn only_chosen(mut self) -> Self {
        self.chosen = Some(HashSet::new());
        self
    }

    /// Process `pid`'s allocator functions are to be probed (with
    /// [`AllocProbes::only_chosen`]; every process's are without it).
    pub fn choose(&mut self, pid: u32) {
        if let Some(c) = self.chosen.as_mut() {
            c.insert(pid);
        }
    }

    /// Probes the allocator functions of every object `process` maps that was not probed in
    /// it yet (new processes, `dlopen`).
    /// A process that loads the preloaded sampler library gets its probes (once per copy of
    /// the library) instead.
    pub fn sync(&mut self, process: &Process, probes: &mut (dyn Uprobes + '_)) {
        let pid = process.pid;
        if self.preloaded.contains(&pid) {
            return;
        }
        if let Some((key, path)) = preload::mapped_library(process) {
            match self.preload.attach(key, &path, probes) {
                Ok(()) => {
                    self.mark_preloaded(pid);
                    return;
                }
                Err(e) => {
                    self.failures.insert(pid, e);
                }
            }
        }
        if self.preload_only {
            let why = match self.failures.get(&pid) {
                Some(f) => Some(format!(
                    "maps {}, which cannot be probed ({f})",
                    preload::LIBRARY
                )),
                None => preload::without_library(process).map(str::to_string),
            };
            if let Some(why) = why
                && self.unsampled.insert(pid)
            {
                self.notices.push(format!(
                    "pid {pid} ({}) {why}: its allocations are not sampled (--alloc-uprobes samples them with uprobes on its allocator)",
                    process.comm
                ));
            }
            return;
        }
        if self.chosen.as_ref().is_some_and(|c| !c.contains(&pid)) {
            return;
        }
        for m in process.mappings() {
            if m.kind != MappingKind::File {
                continue;
            }
            let Some(binary) = m.binary() else { continue };
            let key = binary.key().clone();
            if self.probed.get(&pid).is_some_and(|p| p.contains(&key)) {
                continue;
            }
            if !self.sites.contains_key(&key) {
                // On a worker, holding the binary (and so the file its path names) open.
                let held = Arc::clone(binary);
                let seen = binary.seen_path(&m.path).to_string();
                // The process's own root's debug files first (a container's or chroot's).
                let dirs = binary.debug_dirs(&self.debug_dirs);
                let search = move || {
                    let debug = crate::symbolize::separate_debug_file(
                        held.path(),
                        held.dir(),
                        &seen,
                        held.build_id(),
                        &dirs,
                    );
                    sites::find(held.path(), debug.as_ref()).map(Arc::new)
                };
                match self.searches.poll(&mut self.reads, pid, &key, search) {
                    Some(found) => {
                        self.sites.insert(key.clone(), found);
                    }
                    None => continue,
                }
            }
            self.probe(pid, key, binary.path(), |_| None, probes);
        }
    }

    /// Where its reads run: the loop's turn, waiting and the CPU budget are set there.
    pub fn reads(&mut self) -> &mut crate::os::workers::ProcessReads {
        &mut self.reads
    }

    /// Processes whose allocator-site search came back since the last call: syncing them
    /// again attaches their probes (every turn of the capture loop).
    pub fn ready_pids(&mut self) -> Vec<u32> {
        self.searches.ready(&mut self.reads)
    }

    /// Whether a search handed to a worker may come back soon.
    pub fn reads_due(&self) -> bool {
        self.searches.due_soon()
    }

    /// Probes the objects a command will map (its executable, the C library, a libpython)
    /// in process `pid` before it runs, so its first allocations are seen.
    pub fn prepare(&mut self, pid: u32, paths: &[PathBuf], probes: &mut (dyn Uprobes + '_)) {
        for path in paths {
            let Ok(key) = BinaryKey::of_file(path) else {
                continue;
            };
            let debug = |dirs: &[PathBuf]| {
                crate::symbolize::separate_debug_file(
                    path,
                    path.parent(),
                    &path.to_string_lossy(),
                    crate::os::procs::read_build_id(path).as_deref(),
                    dirs,
                )
            };
            self.probe(pid, key, path, debug, probes);
        }
    }

    fn probe(
        &mut self,
        pid: u32,
        key: BinaryKey,
        path: &Path,
        debug: impl FnOnce(&[PathBuf]) -> Option<crate::os::elfsyms::DebugFile>,
        probes: &mut (dyn Uprobes + '_),
    ) {
        self.probed.entry(pid).or_default().insert(key.clone());
        let dirs = &self.debug_dirs;
        let sites = self
            .sites
            .entry(key)
            .or_insert_with(|| sites::find(path, debug(dirs).as_ref()).map(Arc::new))
            .clone();
        let sites = match sites {
            Ok(s) => s,
            Err(e) => {
                self.failures.insert(pid, e);
                return;
            }
        };
        if sites.sites.is_empty() {
            return;
        }
        let mut attach = |program: &'static str, offset: u64, kind: u32| {
            probes
                .attach_process_probe(program, path, offset, u64::from(kind), pid)
                .map_err(|e| e.to_string())
        };
        for &(offset, kind) in &sites.sites {
            let result = attach(ALLOC_ENTER, offset, kind).and_then(|()| {
                if pyrometer_ebpf::is_free_kind(kind) {
                    Ok(())
                } else {
                    attach(ALLOC_RETURN, offset, kind)
                }
            });
            match result {
                Ok(()) => self.attached += 1,
                Err(e) => {
                    self.failures.insert(pid, e);
                    return;
                }
            }
        }
        if sites.has_malloc {
            self.with_malloc.insert(pid);
        }
    }

    /// Process `pid` loads (or will load, a command started with it) the preloaded library,
    /// whose probes are attached.
    pub fn mark_preloaded(&mut self, pid: u32) {
        self.preloaded.insert(pid);
        self.unsampled.remove(&pid);
        self.probed.entry(pid).or_default();
        self.with_malloc.insert(pid);
        self.failures.remove(&pid);
    }

    /// Whether `pid` samples in process, through the preloaded library.
    pub fn is_preloaded(&self, pid: u32) -> bool {
        self.preloaded.contains(&pid)
    }

    /// Whether some object of `pid` defines `malloc` and was probed.
    pub fn has_allocator(&self, pid: u32) -> bool {
        self.with_malloc.contains(&pid)
    }

    /// Why `pid`'s allocator could not be probed, if something failed.
    pub fn failure(&self, pid: u32) -> Option<&str> {
        self.failures.get(&pid).map(String::as_str)
    }

    /// Why the allocations of `pid` (named `comm`, running `exe`) are not sampled: its probes
    /// failed, or no object it maps defines malloc. For a pid whose allocator is probed too,
    /// so callers check [`AllocProbes::has_allocator`] first.
    pub fn unprobed_reason(&self, pid: u32, comm: &str, exe: Option<&Path>) -> String {
        if let Some(f) = self.failure(pid) {
            return format!("pid {pid} ({comm}): cannot probe its allocator: {f}");
        }
        let what = exe.map_or_else(|| comm.to_string(), |e| e.display().to_string());
        format!(
            "pid {pid} ({comm}): no allocator to probe: neither {what} nor a library it maps defines malloc (statically linked without symbols?)"
        )
    }

    /// Pids probed so far.
    pub fn pids(&self) -> Vec<u32> {
        self.probed.keys().copied().collect()
    }

    /// Forgets a process (exited); its probes are the sampler's to detach.
    pub fn forget(&mut self, pid: u32) {
        self.probed.remove(&pid);
        self.with_malloc.remove(&pid);
        self.preloaded.remove(&pid);
        self.unsampled.remove(&pid);
        self.failures.remove(&pid);
        if let Some(c) = self.chosen.as_mut() {
            c.remove(&pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::bpf::AskedProbes as Asked;

    #[test]
    fn only_chosen_processes_get_allocator_probes() {
        let me = std::process::id();
        let mut registry = crate::os::procs::ProcessRegistry::new();
        let process = registry.observe(me).unwrap();
        // This test binary maps libc (or defines malloc itself): something to probe.
        let mut every = AllocProbes::new(Vec::new());
        // The sites are searched for on a worker; waited for here.
        every.reads().set_waiting(true);
        let mut asked = Asked::default();
        every.sync(process, &mut asked);
        assert!(
            !asked.process.is_empty() && every.has_allocator(me),
            "record --alloc probes every synced process"
        );

        let mut chosen = AllocProbes::new(Vec::new()).only_chosen();
        chosen.reads().set_waiting(true);
        let mut asked = Asked::default();
        chosen.sync(process, &mut asked);
        assert!(
            asked.process.is_empty(),
            "not chosen: no probes, {:?}",
            asked.process
        );
        assert!(!chosen.has_allocator(me));
        chosen.choose(me);
        chosen.sync(process, &mut asked);
        assert!(
            !asked.process.is_empty() && chosen.has_allocator(me),
            "chosen: probed"
        );
        chosen.forget(me);
        let before = asked.process.len();
        chosen.sync(process, &mut asked);
        assert_eq!(
            asked.process.len(),
            before,
            "forgotten: not chosen any more"
        );
    }

    #[test]
    fn preload_only_probes_no_allocator_and_says_so_once() {
        let me = std::process::id();
        let mut registry = crate::os::procs::ProcessRegistry::new();
        let process = registry.observe(me).unwrap();
        let mut probes = AllocProbes::new(Vec::new()).preload_only();
        let mut asked = Asked::default();
        probes.sync(process, &mut asked);
        probes.sync(process, &mut asked);
        assert!(asked.process.is_empty(), "no uprobes: {:?}", asked.process);
        assert!(!probes.has_allocator(me));
        // This test binary is dynamically linked and its C library is mapped: it will not
        // load the library any more.
        let notices = probes.take_notices();
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert!(
            notices[0].contains(&format!("pid {me} "))
                && notices[0].contains("does not load libpyrometer_alloc.so")
                && notices[0].contains("--alloc-uprobes"),
            "{notices:?}"
        );
        assert!(probes.take_notices().is_empty());
    }

    #[test]
    fn weights_invert_the_sampling_probability() {
        assert_eq!(weight(100, 1), 1.0, "every allocation at rate 1");
        // A block much larger than the mean is always sampled.
        assert!((weight(100 << 20, 512 << 10) - 1.0).abs() < 1e-9);
        // A 1 KiB block at 512 KiB: p = 1 - e^(-1/512), about 1 in 512.5.
        let w = weight(1024, 512 << 10);
        assert!((w - 512.5).abs() < 0.1, "{w}");
        // The estimate of many equal blocks is unbiased: n * p * w = n.
        let p = 1.0 - (-1024.0f64 / (512.0 * 1024.0)).exp();
        assert!((1000.0 * p * w - 1000.0).abs() < 1e-6);
        assert_eq!(weight(0, 512), 1.0);
    }
}
