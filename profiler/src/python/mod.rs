//! CPython support: version detection, per-version structure offsets, line tables and a
//! memory walker that reads a live interpreter's threads and frames without stopping it.
//! `pyrometer dump` is built on [`dump`]; the BPF frame walker will reuse [`offsets`].

pub mod asyncio;
pub mod debug_offsets;
pub mod free_threaded;
pub mod gc;
pub mod gil;
pub mod gil_report;
pub mod linetable;
pub mod memory;
pub mod merge;
pub mod names;
pub mod native;
pub mod native_sample;
pub mod offsets;
mod probe_target;
mod retry;
pub mod run_delay;
pub mod spans;
pub mod threads;
pub mod tracker;
pub mod version;
pub mod walk;

#[cfg(test)]
mod tests;

use std::io;
use std::path::Path;

use crate::os::procs::{ProcError, ProcessRegistry};
use crate::os::workers::ProcessReads;
use memory::ProcessMemory;
use threads::ThreadState;
use walk::PyFrame;

/// Why a Python process could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    /// The pid is gone.
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    /// The process maps no interpreter.
    #[error("pid {pid} ({comm}) is not a Python process: no libpython or python executable mapped")]
    NotPython {
        /// The process.
        pid: u32,
        /// Its name.
        comm: String,
    },
    #[error(
        "Python {version} is not supported by dump ({})",
        unsupported_detail(reason)
    )]
    /// An interpreter whose layout pyrometer cannot read.
    Unsupported {
        /// Its version.
        version: String,
        /// Why.
        reason: String,
    },
    #[error(
        "cannot read the memory of pid {0}: permission denied (run as its user or as root, or grant CAP_SYS_PTRACE)"
    )]
    /// The process's memory may not be read (the pid).
    Permission(u32),
    /// An address the process does not map.
    #[error("unreadable address {0:#x}")]
    BadAddress(u64),
    /// A read of the process's memory failed.
    #[error("cannot read memory at {addr:#x}: {source}")]
    Read {
        /// Where.
        addr: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The interpreter's binary is not the ELF file it should be.
    #[error("cannot parse {path}: {reason}")]
    Elf {
        /// The binary.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The interpreter's binary lacks a symbol pyrometer reads.
    #[error("{path} has no symbol {symbol}")]
    MissingSymbol {
        /// The symbol.
        symbol: String,
        /// The binary.
        path: String,
    },
    /// The process's `/proc` entries could not be read.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// A cached failure, as its message.
    #[error("{0}")]
    Message(String),
    /// The interpreter's binary is being read (off the sampling loop); asked again later.
    #[error("the interpreter's binary is still being read")]
    Pending,
    /// A read of the interpreter's binary did not finish within its deadline.
    #[error(
        "pid {pid}'s interpreter binary was not read within {} s: the file system it is on does not answer",
        BINARY_DEADLINE.as_secs()
    )]
    Stalled {
        /// The process.
        pid: u32,
    },
}

/// How long `dump` waits for a read of a process's interpreter binary.
pub const BINARY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a one-shot `dump` leaves a process alone once one of its reads overran: for the
/// rest of the dump.
const REST_OF_DUMP: std::time::Duration = std::time::Duration::from_secs(3600);

/// The parenthesised part of an "is not supported" message: the reason, else the range.
pub fn unsupported_detail(reason: &str) -> String {
    if reason.is_empty() {
        format!("{} are", offsets::supported_range())
    } else {
        reason.to_string()
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// One thread of a [`ProcessDump`].
pub struct ThreadDump {
    /// Kernel thread id, when it could be told.
    pub tid: Option<u32>,
    /// `pthread_self()` of the thread.
    pub thread_id: u64,
    /// The OS thread name (`/proc/PID/task/TID/comm`), not `threading`'s name.
    pub name: Option<String>,
    /// `threading.Thread.name`, when `threading` tracks the thread and its name could be read.
    pub python_name: Option<String>,
    /// What the thread is doing.
    pub state: ThreadState,
    /// Whether it holds the GIL.
    pub holds_gil: bool,
    /// Why a blocked thread sleeps (its system call), when that could be read.
    pub reason: Option<String>,
    /// Innermost first.
    pub frames: Vec<PyFrame>,
    /// The stack was cut (too deep, looping or unreadable).
    pub truncated: bool,
    /// With native frames asked for: why this thread has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub native_error: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// What `dump` read of a Python process.
pub struct ProcessDump {
    /// The process.
    pub pid: u32,
    /// Its command line, when readable.
    pub command: Option<String>,
    /// The interpreter's version.
    pub version: String,
    /// The binary holding the interpreter (`libpython3.X.so…` or the executable).
    pub binary: String,
    /// Its threads.
    pub threads: Vec<ThreadDump>,
}

/// The current Python stack of every thread of `pid`. Reads are `process_vm_readv` calls, so
/// the process is never stopped; a thread whose frames changed mid-read may show frames
/// marked unreadable. With `native`, each thread's native frames are spliced in (its
/// registers are read under a ptrace stop that lasts only for the read; see [`native`]).
pub fn dump(proc_root: &Path, pid: u32, with_native: bool) -> Result<ProcessDump, PythonError> {
    let mut reads = ProcessReads::new(1, BINARY_DEADLINE, REST_OF_DUMP);
    let native = with_native.then_some(native::Registers::Stop);
    dump_with(proc_root, pid, native, &mut reads)
}

/// Like [`dump`], the interpreter's binary read on `reads`' workers within their deadline. A
/// caller that dumps again and again (the agent) keeps one: a process whose read overran is
/// then left alone for its backoff, and its workers bound the threads held by reads that
/// never answer. `native`: each thread's native frames too, its registers read that way.
pub fn dump_with(
    proc_root: &Path,
    pid: u32,
    native: Option<native::Registers>,
    reads: &mut ProcessReads,
) -> Result<ProcessDump, PythonError> {
    let mut registry = ProcessRegistry::with_proc_root(proc_root);
    let process = registry.observe(pid).map_err(|e| match e {
        // Another user's maps are unreadable without ptrace access, like its memory.
        ProcError::Io { ref source, .. } if source.kind() == io::ErrorKind::PermissionDenied => {
            PythonError::Permission(pid)
        }
        e => PythonError::Proc(e),
    })?;
    // Read on a worker: a binary on a file system that does not answer fails the dump in
    // one line rather than holding it (and the agent's capture requests) for good.
    let detected = version::detect_reading(process, &mut |_, job| reads.run(pid, job));
    let runtime = detected.map_err(|e| match e {
        PythonError::Pending if reads.is_stalled(pid) => PythonError::Stalled { pid },
        PythonError::Pending => PythonError::Message(
            "no reader is free: reads of other processes' files that do not answer hold them"
                .into(),
        ),
        e => e,
    })?;
    let mem = ProcessMemory::new(pid);
    let layout = debug_offsets::for_process(&mem, &runtime)?;
    let snapshot = walk::Walker::new(&mem, &layout, &runtime).snapshot()?;
    // Names are a nicety: a `threading` state that does not validate leaves the stacks shown.
    let python_names = names::thread_names(&mem, &runtime, &layout).unwrap_or_default();
    let tasks = task_ids(proc_root, pid);
    let threads = snapshot
        .threads
        .into_iter()
        .map(|t| {
            // The interpreter knows its threads by their ids in its own pid namespace; a tid
            // read through glibc's struct pthread (3.8–3.10) is trusted only when it names a
            // task of this process.
            let tid = t.tid.and_then(|ns_tid| {
                tasks
                    .iter()
                    .find(|&&(_, inner)| inner == ns_tid)
                    .map(|&(host, _)| host)
            });
            let os = tid.map(|tid| threads::os_thread(proc_root, pid, tid, snapshot.gil));
            ThreadDump {
                tid,
                thread_id: t.thread_id,
                name: os.as_ref().and_then(|o| o.name.clone()),
                python_name: python_names.get(&t.thread_id).cloned(),
                state: os.as_ref().map_or(ThreadState::Unknown, |o| o.state),
                // The kernel state is read after the GIL word: when they disagree across a
                // hand-off, the later read wins.
                holds_gil: t.holds_gil
                    && os
                        .as_ref()
                        .is_none_or(|o| o.state != ThreadState::WaitingForGil),
                reason: os.and_then(|o| o.reason),
                frames: t.frames,
                truncated: t.truncated,
                native_error: None,
            }
        })
        .collect::<Vec<_>>();
    let threads = match native {
        Some(how) => add_native_frames(&mut registry, pid, &runtime.path, threads, how),
        None => threads,
    };
    Ok(ProcessDump {
        pid,
        command: version::command_line(proc_root, pid),
        version: runtime.version.to_string(),
        binary: runtime.path,
        threads,
    })
}

/// Splices each thread's native frames into its Python ones (the mixed view of `record`:
/// native frames outside the interpreter binary, Python frames at their eval calls).
fn add_native_frames(
    registry: &mut ProcessRegistry,
    pid: u32,
    interpreter: &str,
    threads: Vec<ThreadDump>,
    how: native::Registers,
) -> Vec<ThreadDump> {
    use crate::model::{Frame, FrameKind};
    use native_sample::Sampled;
    let mem = ProcessMemory::new(pid);
    let mut tables = native::NativeTables::default();
    let mut symbolizer = crate::symbolize::Symbolizer::new();
    let mut sampling = native_sample::SamplingBudget::default();
    threads
        .into_iter()
        .map(|mut t| {
            let Some(tid) = t.tid else {
                t.native_error = Some("its kernel thread id is not known".into());
                return t;
            };
            let sampled = match how {
                native::Registers::Stop => native::thread_registers(tid).map(Sampled::at),
                // Not blocked in a system call: one perf sample of it running.
                native::Registers::Blocked => {
                    match native::blocked_registers(registry.proc_root(), pid, tid) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => sampling.sample(tid),
                        r => r.map(Sampled::at),
                    }
                }
            };
            let sampled = match sampled {
                Ok(s) => s,
                Err(e) => {
                    t.native_error = Some(format!("cannot read its registers: {e}"));
                    return t;
                }
            };
            let live = |a| memory::Memory::read_u64(&mem, a).ok();
            let (addrs, complete) = match registry.get(pid) {
                Some(p) => {
                    native::walk(p, sampled.regs, |a| sampled.read_u64(a, live), &mut tables)
                }
                None => (Vec::new(), false),
            };
            if !complete && tables.gave_up_on(pid) {
                t.native_error = Some(format!(
                    "past the frames shown: an object's unwind table was not read within {} s \
                     (its file system does not answer)",
                    native::TABLE_DEADLINE.as_secs()
                ));
            }
            let natives = symbolizer.user(registry, pid, &addrs);
            let python: Vec<(Frame, bool)> = t
                .frames
                .iter()
                .map(|f| {
                    let frame = Frame {
                        file: f.file.clone(),
                        line: f.line,
                        ..Frame::named(
                            f.function.as_deref().unwrap_or(tracker::UNREADABLE),
                            FrameKind::Python,
                        )
                    };
                    (frame, f.entry)
                })
                .collect();
            let view = merge::FrameView::Mixed;
            let merged = merge::merge(natives, &python, view, Some(interpreter), complete);
            t.frames = merged
                .into_iter()
                .map(|f| {
                    let native = f.kind != FrameKind::Python;
                    let unreadable = !native && f.function == tracker::UNREADABLE;
                    PyFrame {
                        function: (!unreadable).then_some(f.function),
                        file: f.file.or(f
                            .module
                            .map(|m| m.rsplit('/').next().unwrap_or(&m).to_string())),
                        line: f.line,
                        native,
                        entry: false,
                    }
                })
                .collect();
            t
        })
        .collect()
}

/// `threading.Thread.name` of each thread of a live Python process, by its tid here (mapped
/// from the process's own pid namespace). Threads without a name (not started by `threading`,
/// or unreadable) are left out.
pub fn thread_names_by_tid<M: memory::Memory>(
    proc_root: &Path,
    pid: u32,
    mem: &M,
    layout: &debug_offsets::Described,
    runtime: &version::PythonRuntime,
    active: &mut Option<u64>,
) -> std::collections::HashMap<u32, String> {
    let Ok(names) = names::thread_names_at(mem, runtime, layout, active) else {
        return Default::default();
    };
    if names.is_empty() {
        return Default::default();
    }
    let Ok(ids) = walk::Walker::new(mem, layout, runtime).thread_ids() else {
        return Default::default();
    };
    let tasks = task_ids(proc_root, pid);
    ids.into_iter()
        .filter_map(|(thread_id, ns_tid)| {
            let host = tasks.iter().find(|&&(_, inner)| Some(inner) == ns_tid)?.0;
            Some((host, names.get(&thread_id)?.clone()))
        })
        .collect()
}

/// The process's tasks as (tid here, tid in the process's own pid namespace): the last
/// `NSpid:` entry of each task's status, or the tid itself on kernels without the line.
fn task_ids(proc_root: &Path, pid: u32) -> Vec<(u32, u32)> {
    let dir = proc_root.join(pid.to_string()).join("task");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let tids = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .take(walk::MAX_THREADS * 4);
    // A process's threads all live in its pid namespace: when that is the one this /proc
    // shows (the process's NSpid has one entry), every id is the same in both, and no
    // thread's status needs reading (one read per thread was a fifth of an agent's names
    // read).
    let status = |dir: &Path| {
        crate::os::proctext::read(&dir.join("status"), crate::os::proctext::TEXT_CAP).ok()
    };
    let own_namespace = status(&proc_root.join(pid.to_string()))
        .is_some_and(|s| crate::os::procs::ns_pids(&s).is_some_and(|ids| ids.count() == 1));
    if own_namespace {
        return tids.map(|tid| (tid, tid)).collect();
    }
    tids.map(|tid| {
        let inner = status(&dir.join(tid.to_string()))
            .and_then(|s| crate::os::procs::parse_ns_pid(&s))
            .unwrap_or(tid);
        (tid, inner)
    })
    .collect()
}

/// pyenv's libpython of version `dir` (3.`minor`), or None after a skip in the ledger when
/// this machine lacks it: the tests that read the installed interpreters' binaries.
#[cfg(test)]
pub(crate) fn pyenv_libpython(dir: &str, minor: u32) -> Option<std::path::PathBuf> {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let lib = std::path::Path::new(&home).join(format!(
        ".pyenv/versions/{dir}/lib/libpython3.{minor}.so.1.0"
    ));
    if !lib.exists() {
        skip_ledger::skip(
            &format!("python:3.{minor}"),
            format!("3.{minor}: {} is missing", lib.display()),
        );
        return None;
    }
    Some(lib)
}
