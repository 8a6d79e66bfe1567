//! Python processes for the kernel's frame walker (`ebpf/src/bpf/python.h`): detects which
//! sampled processes run a supported CPython, registers each with its runtime address and
//! structure offsets in the `py_procs` BPF map, and turns the (code object, instruction)
//! pairs the kernel records into `function (file:line)`, reading code objects from the live
//! process, cached per process and code object.
//!
//! Code objects are read as the records arrive, not when the profile is written: by then a
//! short-lived process (`record -- python script.py`) is gone. A code object's address can be
//! reused by another one after it is freed; the kernel records `co_firstlineno` with each
//! frame, and a cached entry whose first line differs is read again. The kernel keeps the
//! lines it read for up to 100 ms (`py_code_lines` in python.h), so a code object made at a
//! freed one's address is named as the old one for at most that long.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, MapData};
use pyrometer_ebpf::{PY_ABSENT, PY_ADDR_UNKNOWN, PyProcess, RawPyFrame};

use super::PythonError;
use super::debug_offsets::{self, Described};
use super::free_threaded::FreeThreadedGil;
use super::gc::GcProbes;
use super::gil::{self, GilSites};
use super::memory::{Memory, ProcessMemory};
use super::offsets::{ABSENT, PyOffsets};
use super::probe_target::{ProbeTarget, interpreter_target};
use super::retry::Retry;
use super::spans::{self, SpanTable};
use super::version::{self, BinaryCache, PythonRuntime};
use super::walk::{CodeObject, Walker};
use crate::bpf::Uprobes;
use crate::os::procs::BinaryKey;
use crate::os::procs::Process;
use crate::os::workers::{OffLoop, ProcessReads};

mod bodies;
mod probes;
pub use probes::Attached;
use probes::GilProbes;
mod tasks;

/// Threads reading interpreter binaries (version and symbols) off the sampling loop; each
/// read stuck past its deadline holds one until it returns.
const READ_WORKERS: usize = 2;
/// How long reading an interpreter binary may take before its process is left alone.
const READ_DEADLINE: Duration = Duration::from_secs(5);
/// How long a process whose read overran is left alone, at least.
const READ_BACKOFF: Duration = Duration::from_secs(60);

/// Code objects cached per process; past this the process's cache starts over.
const MAX_CODES_PER_PROCESS: usize = 65_536;
/// Processes tracked at once: the kernel map's size.
pub const MAX_PROCESSES: usize = 4096;

/// A Python frame as the profile shows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyFrameName {
    /// `co_qualname` (3.11+) or `co_name`; `<unreadable frame>` when the code object did not
    /// validate.
    pub function: Arc<str>,
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
    /// An asyncio task (`--async`): `function` is its name, or its coroutine's qualified name
    /// when the name is an automatic `Task-N`.
    pub task: bool,
}

struct CodeEntry {
    first_line: u32,
    function: Arc<str>,
    file: Arc<str>,
    code: CodeObject,
    /// Lines by instruction offset, as asked for.
    lines: HashMap<u32, Option<u32>>,
}

struct Tracked {
    runtime: PythonRuntime,
    layout: Described,
    /// Start of the interpreter's mapping, to notice an exec into another image.
    mapping_start: u64,
    /// The interpreter binary's path as the process maps it: frames of this module are the
    /// interpreter's own.
    module: Arc<str>,
    codes: HashMap<u64, Code>,
    /// `threading` names by tid, and when they were read.
    names: HashMap<u32, Arc<str>>,
    names_read: Option<Instant>,
    /// Where `threading._active` was found (see `names::thread_names_at`).
    threading_active: Option<u64>,
    /// Threads asked for without a name, and when they were first asked for.
    unnamed: HashMap<u32, Instant>,
    /// The span table the kernel reads (pyrometer-otel), once found.
    spans: Option<SpanTable>,
    /// When the process's maps were last searched for one, and how long until the next search.
    spans_checked: Instant,
    spans_wait: Duration,
    /// `--async`: whether the kernel has all it needs (`TaskGroup` included), when the
    /// process was last looked at for it and how long until the next look; names of tasks
    /// read, by (name object, coroutine code), for when the process is gone.
    aio_complete: bool,
    /// A sample ran asyncio's `Handle._run`: tasks are running, so the objects are looked
    /// for every `ASYNC_RECHECK` until found rather than after the back-off.
    aio_loop_seen: bool,
    /// The loop's objects were found (a TaskGroup's place may still be missing: looked for
    /// with the back-off, from `ASYNC_RECHECK` again).
    aio_found: bool,
    aio_checked: Instant,
    aio_wait: Duration,
    /// When a sample last asked for a look: a process not sampled lately does not keep the
    /// sampling loop waking for it.
    aio_asked: Instant,
    /// 3.14+: the `_asyncio` module's description, once found.
    aio_debug: Option<super::asyncio::AsyncioDebug>,
    task_names: HashMap<(u64, u64), Arc<str>>,
    /// Module bodies as the kernel met them (see `bodies`).
    bodies: bodies::Bodies,
}

/// A registered process whose asyncio objects are not all known yet (`asyncio` not imported,
/// no TaskGroup made) is looked at again after this long, doubling up to the maximum: a
/// look walks `sys.modules`, and a node-wide agent sees many processes that never run a loop.
/// One seen running a task step is looked at every `ASYNC_RECHECK` until its loop's objects
/// are found.
const ASYNC_RECHECK: Duration = Duration::from_millis(20);
const ASYNC_RECHECK_MAX: Duration = Duration::from_secs(10);
/// Looks due sooner than this after the last one are waited for by a sampling loop that
/// reads in batches (see [`PyTracker::next_async_look`]).
const ASYNC_PROMPT: Duration = Duration::from_secs(1);
/// The function asyncio's event loop runs each task step under (3.11+ qualified name).
const ASYNCIO_STEP: &str = "Handle._run";
/// Task names remembered per process.
const MAX_TASK_NAMES: usize = 4096;

/// A registered process without a span table is looked at again after this long, then after
/// twice as long each time up to `SPANS_RECHECK_MAX`: the package creates the table when the
/// application sets up tracing, usually at start-up, and a node-wide agent should not read the
/// maps of every Python process that never will four times a second. A table at the
/// package's fixed address is taken by the kernel at once (spans.h); this search finds the
/// others (the address was taken) and learns of the kernel's finds.
const SPANS_RECHECK: Duration = Duration::from_millis(250);
const SPANS_RECHECK_MAX: Duration = Duration::from_secs(2);

/// A thread seen in its first `NAME_REFRESH` without a name makes its process's names be
/// read again, at most this often; threads that stay without a name (not started by
/// `threading`) only every `NAME_REFRESH` after that.
const NAME_REREAD: Duration = Duration::from_millis(20);
/// A thread asked about for the first time has its process's names read at once unless a read
/// is this recent: a new `threading` thread has its name from before its first sample, and
/// waiting for `NAME_REREAD` left up to 20 ms of a new thread's samples (a fifth of a short
/// worker's) under its command name. The floor bounds the reads of a process that churns
/// through short-lived native threads.
const NAME_NEW_THREAD: Duration = Duration::from_millis(2);
const NAME_REFRESH: Duration = Duration::from_secs(1);
/// Unnamed threads remembered per process (beyond it the list starts over).
const MAX_UNNAMED: usize = 4096;
/// Thread names remembered per process, ended threads' included.
const MAX_NAMES: usize = 4096;

/// What is known of one code object address.
enum Code {
    Read(CodeEntry),
    /// The last read failed.
    Failed(Retry),
}

/// Counters for the record summary and `--stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// Python processes registered with the kernel walker.
    pub processes: u64,
    /// Code objects read from target processes.
    pub code_reads: u64,
    /// Code objects that did not validate (freed, torn, not a code object).
    pub bad_codes: u64,
    /// Registrations the kernel map refused (full).
    pub map_full: u64,
    /// Frames of module bodies whose code object was freed (or another body's) when read,
    /// named from the module the kernel met them in (`py_bodies`).
    pub freed_bodies: u64,
    /// Frames named `<unreadable frame>`: their code object could not be read, or the
    /// address held another one by the time it was read and the kernel kept no module for it.
    pub unreadable_frames: u64,
    /// Span tables (pyrometer-otel) found, at registration or later.
    pub span_tables: u64,
    /// Python processes walked for native frames only, once each: their interpreter is a
    /// version without a known layout.
    pub refused_unsupported: u64,
    /// The same, their interpreter's description of itself (`_Py_DebugOffsets`) read from
    /// their memory did not validate (a torn or crafted one).
    pub refused_invalid: u64,
    /// Reads of interpreter binaries that overran their deadline (see `READ_DEADLINE`).
    pub stalled_reads: u64,
}

pub struct PyTracker {
    map: Option<BpfHashMap<MapData, u32, PyProcess>>,
    /// The kernel walker's module bodies (`py_bodies`), for frames whose code object was
    /// freed before it was read.
    bodies: Option<crate::bpf::PyBodies>,
    gil: Option<GilProbes>,
    /// `--gc`: the garbage-collector probes.
    gc: Option<GcProbes>,
    /// Registered processes whose GIL cannot be probed, and why.
    gil_unavailable: HashMap<u32, String>,
    /// With the GIL view on: free-threaded processes seen, with their names and whether their
    /// GIL was on, kept after they exit for the report.
    free_threaded: FreeThreadedGil,
    /// The sites of every binary probed, for the summary.
    gil_binaries: Vec<GilSites>,
    binaries: BinaryCache,
    /// Interpreter binaries being read on a worker: a process is registered on the turn
    /// after its binary's read came back, and samples without Python frames until then.
    reads: ProcessReads,
    binary_reads: OffLoop<BinaryKey, version::Analyzed>,
    /// The GIL's and the collector's probe sites of interpreter binaries, searched for on
    /// the same workers (a whole copy of the binary, up to 256 MiB, and its debug file).
    gil_reads: OffLoop<BinaryKey, Result<GilSites, String>>,
    gc_reads: OffLoop<BinaryKey, Result<super::gc::GcSites, String>>,
    /// Registered processes whose probes wait for their binary's sites.
    probes_pending: HashSet<u32>,
    procs: HashMap<u32, Tracked>,
    /// Processes the user chose by pid or name: their executable is read for an interpreter
    /// whatever it is called (a renamed or embedding static binary), as `dump` reads it.
    chosen: HashSet<u32>,
    /// One line each, for the user: processes whose Python cannot be walked, and why.
    notices: Vec<String>,
    noticed: HashSet<u32>,
    stats: TrackerStats,
    proc_root: PathBuf,
    /// `--async`: asyncio task stacks.
    asyncio: bool,
}

impl PyTracker {
    /// `map` is the sampler's `py_procs`; without it (tests, `--frames` off) nothing is
    /// registered with the kernel but code objects can still be resolved.
    pub fn new(map: Option<BpfHashMap<MapData, u32, PyProcess>>) -> Self {
        Self {
            map,
            bodies: None,
            gil: None,
            gc: None,
            gil_unavailable: HashMap::new(),
            free_threaded: Default::default(),
            gil_binaries: Vec::new(),
            binaries: BinaryCache::default(),
            reads: ProcessReads::new(READ_WORKERS, READ_DEADLINE, READ_BACKOFF),
            binary_reads: OffLoop::default(),
            gil_reads: OffLoop::default(),
            gc_reads: OffLoop::default(),
            probes_pending: HashSet::new(),
            procs: HashMap::new(),
            chosen: HashSet::new(),
            notices: Vec::new(),
            noticed: HashSet::new(),
            stats: TrackerStats::default(),
            proc_root: PathBuf::from("/proc"),
            asyncio: false,
        }
    }

    /// Follows the asyncio tasks of every Python process registered from now on (`--async`).
    pub fn enable_async(&mut self) {
        self.asyncio = true;
    }

    /// Probes the garbage collector of every Python process registered from now on
    /// (`record --gc`); debug files are looked for in `debug_dirs`.
    pub fn enable_gc(&mut self, debug_dirs: Vec<PathBuf>) {
        self.gc = Some(GcProbes::new(debug_dirs));
    }

    /// With `--gc`: the probes, the binaries probed and the processes that could not be.
    pub fn gc_probes(&self) -> Option<&GcProbes> {
        self.gc.as_ref()
    }

    /// Reads the interpreter a command about to start will run (see `BinaryCache::prewarm`).
    pub fn prewarm(&mut self, interpreter: &Path) {
        self.binaries.prewarm(interpreter);
    }

    /// Registered processes whose GIL could not be probed, with the reason.
    pub fn gil_unavailable(&self) -> &HashMap<u32, String> {
        &self.gil_unavailable
    }

    /// With the GIL view on: the free-threaded processes seen.
    pub fn free_threaded(&self) -> &FreeThreadedGil {
        &self.free_threaded
    }

    /// With the GIL view on: reads again whether a free-threaded process runs with its GIL
    /// on (at most every 100 ms). Called as its samples arrive.
    pub fn check_free_threaded_gil(&mut self, pid: u32) {
        self.free_threaded.check(pid);
    }

    pub fn stats(&self) -> TrackerStats {
        self.stats
    }

    /// Messages gathered since the last call (one line each).
    pub fn take_notices(&mut self) -> Vec<String> {
        std::mem::take(&mut self.notices)
    }

    /// Marks `pid` as chosen by the user (see `chosen`), before its first sync.
    pub fn choose(&mut self, pid: u32) {
        self.chosen.insert(pid);
    }

    /// Registers `process` with the kernel walker when it runs a supported CPython (again
    /// after an exec into another image); a process that stopped being Python is forgotten.
    pub fn sync(&mut self, process: &Process, probes: Option<&mut (dyn Uprobes + '_)>) {
        let pid = process.pid;
        let (reads, work) = (&mut self.reads, &mut self.binary_reads);
        let chosen = self.chosen.contains(&pid);
        let detected =
            version::detect_cached(process, &mut self.binaries, chosen, &mut |key, job| {
                work.poll(reads, pid, key, job)
            });
        self.stats.stalled_reads = self.reads.overran();
        let runtime = match detected {
            Ok(rt) => rt,
            // Read on a worker: registered once it comes back ([`PyTracker::ready_pids`]).
            Err(PythonError::Pending) => return,
            Err(PythonError::NotPython { .. }) => {
                self.remove(pid);
                return;
            }
            Err(e) => {
                self.remove(pid);
                if self.noticed.insert(pid) {
                    self.stats.refused_unsupported += 1;
                    self.notices.push(format!(
                        "pid {pid} ({}): {}: native frames only",
                        process.comm,
                        unsupported_message(&e)
                    ));
                }
                return;
            }
        };
        let mapping_start = interpreter_start(process, &runtime.path);
        // Registered already, unless the kernel dropped the entry since: its exec tracepoint
        // deletes it, and fires after the new image's maps are visible, so a sync that read
        // them for an earlier exec event can register the new image just before that delete
        // (a chrooted interpreter, started through sh, unshare and chroot, lost its Python
        // frames for its whole life one run in five).
        if let Some(t) = self.procs.get(&pid)
            && t.runtime.path == runtime.path
            && t.mapping_start == mapping_start
            && self.map.as_ref().is_none_or(|m| m.get(&pid, 0).is_ok())
        {
            // Its probes wait for a search of its binary that has come back since.
            if let Some(probes) = probes
                && self.probes_pending.remove(&pid)
            {
                self.attach_gil(process, &runtime, probes);
                self.attach_gc(process, &runtime, probes);
            }
            return;
        }
        let layout = match debug_offsets::for_process(&ProcessMemory::new(pid), &runtime) {
            Ok(layout) => layout,
            Err(e) => {
                self.remove(pid);
                if self.noticed.insert(pid) {
                    self.stats.refused_invalid += 1;
                    self.notices.push(format!(
                        "pid {pid} ({}): {}: native frames only",
                        process.comm,
                        unsupported_message(&e)
                    ));
                }
                return;
            }
        };
        let offsets = &layout.offsets;
        if self.procs.len() >= MAX_PROCESSES && !self.procs.contains_key(&pid) {
            self.stats.map_full += 1;
            return;
        }
        let span_table = spans::find(&self.proc_root, pid, &ProcessMemory::new(pid));
        let entry = PyProcess {
            runtime: runtime.runtime,
            gil: gil_address(pid, &runtime, offsets),
            frame_read: super::offsets::frame_read_len(offsets),
            reserved: 0,
            off: *offsets,
            span_slots: span_table.map_or(0, |t| t.slots),
            span_mask: span_table.map_or(0, |t| t.mask),
            span_probed_at: 0,
            span_probes: 0,
            aio: Default::default(),
        };
        if self.asyncio
            && let Some(why) = super::asyncio::unsupported(&runtime, &layout)
            && self.noticed.insert(pid)
        {
            self.notices.push(format!(
                "pid {pid} ({}): {why}: --async is off for it",
                process.comm
            ));
        }
        if let Some(map) = self.map.as_mut()
            && map.insert(pid, entry, 0).is_err()
        {
            self.stats.map_full += 1;
            return;
        }
        self.stats.processes += 1;
        self.stats.span_tables += u64::from(span_table.is_some());
        if layout.free_threaded {
            if self.gil.as_ref().is_some_and(GilProbes::every_process) {
                self.free_threaded
                    .add(pid, process.comm.clone(), runtime.runtime, *offsets);
            }
        } else if let Some(probes) = probes {
            self.attach_gil(process, &runtime, probes);
            self.attach_gc(process, &runtime, probes);
        }
        self.procs.insert(
            pid,
            Tracked {
                module: Arc::from(runtime.path.as_str()),
                runtime,
                layout,
                mapping_start,
                codes: HashMap::new(),
                names: HashMap::new(),
                names_read: None,
                threading_active: None,
                unnamed: HashMap::new(),
                spans: span_table,
                spans_checked: Instant::now(),
                spans_wait: SPANS_RECHECK,
                aio_complete: false,
                aio_loop_seen: false,
                aio_found: false,
                aio_checked: Instant::now(),
                aio_wait: Duration::ZERO,
                aio_asked: Instant::now(),
                aio_debug: None,
                task_names: HashMap::new(),
                bodies: bodies::Bodies::default(),
            },
        );
        self.refresh_async(pid);
    }

    /// Where its reads run: the loop's turn, waiting and the CPU budget are set there.
    pub fn reads(&mut self) -> &mut crate::os::workers::ProcessReads {
        &mut self.reads
    }

    /// Processes whose interpreter binary's read came back since the last call: syncing
    /// them again registers them (every turn of the capture loop).
    pub fn ready_pids(&mut self) -> Vec<u32> {
        let mut pids = self.binary_reads.ready(&mut self.reads);
        pids.extend(self.gil_reads.ready(&mut self.reads));
        pids.extend(self.gc_reads.ready(&mut self.reads));
        pids.sort_unstable();
        pids.dedup();
        self.stats.stalled_reads = self.reads.overran();
        pids
    }

    /// Whether a read handed to a worker may come back soon.
    pub fn reads_due(&self) -> bool {
        self.binary_reads.due_soon() || self.gil_reads.due_soon() || self.gc_reads.due_soon()
    }

    /// Looks for the span table of a registered process that has none yet (backing off from
    /// `SPANS_RECHECK` to `SPANS_RECHECK_MAX`), and tells the kernel where it is once found.
    /// Called as its samples arrive, so an idle process costs nothing.
    pub fn refresh_spans(&mut self, pid: u32) {
        let Some(t) = self.procs.get_mut(&pid) else {
            return;
        };
        if t.spans.is_some() || t.spans_checked.elapsed() < t.spans_wait {
            return;
        }
        t.spans_checked = Instant::now();
        t.spans_wait = (t.spans_wait * 2).min(SPANS_RECHECK_MAX);
        // The kernel takes a table at the package's fixed address itself (spans.h): then the
        // entry says where, and no /proc scan is needed.
        if let Some(map) = self.map.as_ref()
            && let Ok(entry) = map.get(&pid, 0)
            && entry.span_slots != 0
        {
            t.spans = Some(SpanTable {
                slots: entry.span_slots,
                mask: entry.span_mask,
            });
            self.stats.span_tables += 1;
            return;
        }
        let Some(table) = spans::find(&self.proc_root, pid, &ProcessMemory::new(pid)) else {
            return;
        };
        t.spans = Some(table);
        self.stats.span_tables += 1;
        if let Some(map) = self.map.as_mut()
            && let Ok(mut entry) = map.get(&pid, 0)
        {
            entry.span_slots = table.slots;
            entry.span_mask = table.mask;
            let _ = map.insert(pid, entry, 0);
        }
    }

    /// Forgets a process (exited, or no longer Python).
    pub fn remove(&mut self, pid: u32) {
        self.probes_pending.remove(&pid);
        if let Some(gil) = self.gil.as_mut() {
            gil.forget(pid);
        }
        if self.procs.remove(&pid).is_some()
            && let Some(map) = self.map.as_mut()
        {
            let _ = map.remove(&pid);
        }
    }

    /// Pids registered now.
    pub fn pids(&self) -> Vec<u32> {
        self.procs.keys().copied().collect()
    }

    /// The interpreter binary of a registered process, as the process maps it.
    pub fn module(&self, pid: u32) -> Option<Arc<str>> {
        self.procs.get(&pid).map(|t| t.module.clone())
    }

    /// Names one frame of `pid` the kernel recorded in a sample taken at `sample_ns`
    /// (CLOCK_MONOTONIC). `None` when the process is not (or no longer) registered.
    pub fn resolve(&mut self, pid: u32, frame: RawPyFrame, sample_ns: u64) -> Option<PyFrameName> {
        let name = match frame.task_name {
            Some(name) => self.task_frame(pid, name, frame.code),
            None if frame.first_line == 1 => self
                .resolve_body(pid, frame, sample_ns)
                .or_else(|| self.resolve_code(pid, frame)),
            None => self.resolve_code(pid, frame),
        };
        if name.as_ref().is_some_and(|n| &*n.function == UNREADABLE) {
            self.stats.unreadable_frames += 1;
        }
        name
    }

    fn resolve_code(&mut self, pid: u32, frame: RawPyFrame) -> Option<PyFrameName> {
        let t = self.procs.get_mut(&pid)?;
        let stale = match t.codes.get(&frame.code) {
            Some(Code::Read(e)) if frame.first_line != 0 && e.first_line != frame.first_line => {
                true
            }
            // Module bodies (and other bracketed code: `<lambda>`, `<genexpr>`) are the code
            // objects freed while the process runs, after their one run, and all modules start
            // on line 1: a start-up module's cached entry named the script's `<module>` at the
            // same address `<frozen site>`. Their filename reference is checked on each use.
            // A process that has exited (or unmapped the memory) keeps the name: its first line
            // agreed, and nothing can have taken the address since. Reading again there made
            // the script's `<module>` unreadable in the last samples of a run that ended.
            Some(Code::Read(e)) if e.function.starts_with('<') => {
                let mem = ProcessMemory::new(pid);
                Walker::new(&mem, &t.layout, &t.runtime)
                    .filename_ref(frame.code)
                    .is_ok_and(|r| r != e.code.filename_ref)
            }
            Some(Code::Read(_)) => false,
            Some(Code::Failed(retry)) => retry.due(Instant::now()),
            None => true,
        };
        if stale {
            if t.codes.len() >= MAX_CODES_PER_PROCESS {
                t.codes.clear();
            }
            let mem = ProcessMemory::new(pid);
            let read = Walker::new(&mem, &t.layout, &t.runtime).code(frame.code);
            self.stats.code_reads += 1;
            match read {
                Ok(code) => {
                    let first_line = code.first_line;
                    let entry = CodeEntry {
                        first_line: code.first_line,
                        function: Arc::from(code.function.as_str()),
                        file: Arc::from(code.file.as_str()),
                        code,
                        lines: HashMap::new(),
                    };
                    t.codes.insert(frame.code, Code::Read(entry));
                    if frame.first_line != 0 && frame.first_line != first_line {
                        // The address holds another code object by now: the frame's own
                        // was freed (a module body or exec'd string that finished running).
                        self.stats.bad_codes += 1;
                        return Some(unreadable());
                    }
                }
                Err(_) => {
                    self.stats.bad_codes += 1;
                    // A good entry stays: the frame that disagreed with it was torn (read
                    // while it changed) or the process is gone, and neither makes the cached
                    // code object wrong for the frames that agree with it.
                    let now = Instant::now();
                    match t.codes.entry(frame.code) {
                        Entry::Occupied(mut o) => {
                            if let Code::Failed(retry) = o.get_mut() {
                                *retry = retry.again(now);
                            }
                        }
                        Entry::Vacant(v) => {
                            v.insert(Code::Failed(Retry::first(now)));
                        }
                    }
                    return Some(unreadable());
                }
            }
        }
        let kind = t.layout.offsets.line_table_kind;
        Some(match t.codes.get_mut(&frame.code) {
            Some(Code::Read(e)) => {
                if self.asyncio && !t.aio_complete && &*e.function == ASYNCIO_STEP {
                    t.aio_loop_seen = true;
                }
                let line = if frame.addr == PY_ADDR_UNKNOWN {
                    None
                } else {
                    *e.lines
                        .entry(frame.addr)
                        .or_insert_with(|| e.code.line(kind, frame.addr))
                };
                PyFrameName {
                    function: e.function.clone(),
                    file: Some(e.file.clone()),
                    line,
                    task: false,
                }
            }
            Some(Code::Failed(_)) | None => unreadable(),
        })
    }

    /// The `threading.Thread.name` of thread `tid` of a registered process, read from the
    /// process (again when a thread without a name is asked for: see `NAME_REREAD`).
    pub fn thread_name(&mut self, pid: u32, tid: u32) -> Option<Arc<str>> {
        let t = self.procs.get_mut(&pid)?;
        if let Some(name) = t.names.get(&tid) {
            return Some(name.clone());
        }
        let now = Instant::now();
        if t.unnamed.len() >= MAX_UNNAMED {
            t.unnamed.clear();
        }
        let new_thread = !t.unnamed.contains_key(&tid);
        let first_asked = *t.unnamed.entry(tid).or_insert(now);
        let due = match t.names_read {
            None => true,
            // A thread never asked about, one new since the last read (it may have started
            // since), one seen in the last NAME_REFRESH (`threading` registers a thread a
            // little after it starts running), or a stale read.
            Some(read) => {
                let age = now.duration_since(read);
                let young = first_asked >= read || now.duration_since(first_asked) < NAME_REFRESH;
                (new_thread && age >= NAME_NEW_THREAD)
                    || (young && age >= NAME_REREAD)
                    || age >= NAME_REFRESH
            }
        };
        if !due {
            return None;
        }
        t.names_read = Some(now);
        let mem = ProcessMemory::new(pid);
        let fresh = super::thread_names_by_tid(
            &self.proc_root,
            pid,
            &mem,
            &t.layout,
            &t.runtime,
            &mut t.threading_active,
        );
        // Names of threads that have ended stay: their samples (and the GIL table at the end
        // of a recording) still need them, and a read as the process winds down no longer
        // sees them. Past the bound only the live threads' names are kept.
        if t.names.len() + fresh.len() > MAX_NAMES {
            t.names.clear();
        }
        t.names.extend(
            fresh
                .into_iter()
                .map(|(tid, name)| (tid, Arc::from(name.as_str()))),
        );
        let names = &t.names;
        t.unnamed.retain(|tid, _| !names.contains_key(tid));
        t.names.get(&tid).cloned()
    }

    /// Whether thread `tid` of `pid` was asked about without a name in the last
    /// `NAME_REFRESH` and still runs: `threading` may yet register it, and
    /// [`PyTracker::thread_name`] reads the names again for it every `NAME_REREAD` (a caller
    /// that polls rarely polls sooner while so, since the name is gone once the thread
    /// ends). A thread that has ended will not get one: reading the names for it again
    /// every 20 ms for the rest of its second was most of an agent's CPU on a process
    /// starting ten short threads a second.
    pub fn awaits_name(&self, pid: u32, tid: u32) -> bool {
        self.procs
            .get(&pid)
            .and_then(|t| t.unnamed.get(&tid))
            .is_some_and(|first| first.elapsed() < NAME_REFRESH)
            && self
                .proc_root
                .join(pid.to_string())
                .join("task")
                .join(tid.to_string())
                .exists()
    }

    /// Forgets processes that are gone (every few seconds from the capture loop), and looks
    /// again for the GIL of processes registered before their interpreter had one (3.12+
    /// point to it from the interpreter state, which a just-started process may not have yet).
    pub fn gc(&mut self) {
        if let Some(map) = self.map.as_mut() {
            for (&pid, t) in &self.procs {
                if let Ok(mut entry) = map.get(&pid, 0)
                    && entry.gil == 0
                {
                    entry.gil = gil_address(pid, &t.runtime, &t.layout.offsets);
                    if entry.gil != 0 {
                        let _ = map.insert(pid, entry, 0);
                    }
                }
            }
        }
        for pid in self.pids() {
            if !crate::os::pids::exists(pid) {
                self.remove(pid);
                self.noticed.remove(&pid);
            }
        }
        self.chosen.retain(|&pid| crate::os::pids::exists(pid));
    }
}

/// The name of a frame whose code object could not be read.
pub const UNREADABLE: &str = "<unreadable frame>";

fn unreadable() -> PyFrameName {
    PyFrameName {
        function: Arc::from(UNREADABLE),
        file: None,
        line: None,
        task: false,
    }
}

fn unsupported_message(e: &PythonError) -> String {
    match e {
        PythonError::Unsupported { version, reason } => {
            format!(
                "Python {version} is not supported ({})",
                super::unsupported_detail(reason)
            )
        }
        e => format!("cannot walk its Python frames ({e})"),
    }
}

fn interpreter_start(process: &Process, path: &str) -> u64 {
    process
        .mappings()
        .iter()
        .find(|m| m.path == path)
        .map_or(0, |m| m.start)
}

/// Where the interpreter's GIL state lives: inside `_PyRuntime` (3.8–3.11), or behind the
/// main interpreter's pointer (3.12+), read from the process; 0 when it cannot be told yet.
fn gil_address(pid: u32, rt: &PythonRuntime, o: &PyOffsets) -> u64 {
    if o.runtime_gil != ABSENT {
        return rt.runtime + u64::from(o.runtime_gil);
    }
    let mem = ProcessMemory::new(pid);
    mem.read_u64(rt.runtime + u64::from(o.runtime_interpreters_head))
        .and_then(|interp| mem.read_u64(interp + u64::from(o.interp_gil_ptr)))
        .unwrap_or(0)
}
