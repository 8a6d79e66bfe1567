//! Whether a free-threaded interpreter (`3.13t`, `3.14t`) runs with its GIL on, for the GIL
//! view's line about it. A free-threaded build has a GIL state still: its first field,
//! `int enabled`, is 0 while the GIL is off and turns non-zero when `PYTHON_GIL=1` or
//! `-X gil=1` is given, or an extension module that does not declare itself safe without the
//! GIL is imported (`_PyEval_EnableGILTransiently`/`Permanently` in `Python/ceval_gil.c`).
//! It is read from the process while its samples arrive, at most every
//! [`RECHECK`], so a process that has exited by the end of the recording is still told right.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::memory::{Memory, ProcessMemory};
use super::offsets::PyOffsets;

/// How often a process's GIL flag is read again as its samples arrive.
const RECHECK: Duration = Duration::from_millis(100);

/// Offset of `enabled` in a free-threaded build's `struct _gil_runtime_state` (3.13.15t's and
/// 3.14.7t's DWARF; it is the structure's first field under `Py_GIL_DISABLED`).
const GIL_ENABLED: u64 = 0;

/// Processes tracked at most (the GIL view's other tables have the same bound).
const MAX_PROCESSES: usize = 4096;

/// One free-threaded process of the GIL view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeThreaded {
    pub comm: String,
    /// The GIL was seen enabled at some point of the recording.
    pub gil_enabled: bool,
}

struct Watched {
    process: FreeThreaded,
    runtime: u64,
    offsets: PyOffsets,
    checked: Option<Instant>,
}

/// The free-threaded processes the GIL view has seen, with what their GIL flag said.
#[derive(Default)]
pub struct FreeThreadedGil {
    watched: BTreeMap<u32, Watched>,
}

impl FreeThreadedGil {
    /// Starts watching a registered free-threaded process (`runtime`: its `_PyRuntime`).
    pub fn add(&mut self, pid: u32, comm: String, runtime: u64, offsets: PyOffsets) {
        if self.watched.len() >= MAX_PROCESSES && !self.watched.contains_key(&pid) {
            return;
        }
        self.watched.insert(
            pid,
            Watched {
                process: FreeThreaded {
                    comm,
                    gil_enabled: false,
                },
                runtime,
                offsets,
                checked: None,
            },
        );
        self.check(pid);
    }

    /// Reads the process's GIL flag again when the last read is older than [`RECHECK`];
    /// called as its samples arrive. Once seen on, it stays reported on.
    pub fn check(&mut self, pid: u32) {
        let Some(w) = self.watched.get_mut(&pid) else {
            return;
        };
        let now = Instant::now();
        if w.process.gil_enabled || w.checked.is_some_and(|t| now - t < RECHECK) {
            return;
        }
        w.checked = Some(now);
        if gil_enabled(&ProcessMemory::new(pid), w.runtime, &w.offsets) == Some(true) {
            w.process.gil_enabled = true;
        }
    }

    /// Every process seen, by pid.
    pub fn processes(&self) -> impl Iterator<Item = (u32, &FreeThreaded)> {
        self.watched.iter().map(|(&pid, w)| (pid, &w.process))
    }
}

/// Whether the main interpreter's GIL is enabled; `None` when it cannot be read (the
/// interpreter not initialized yet, finalized, or the process gone).
pub fn gil_enabled<M: Memory>(mem: &M, runtime: u64, o: &PyOffsets) -> Option<bool> {
    let interp = mem
        .read_u64(runtime.wrapping_add(u64::from(o.runtime_interpreters_head)))
        .ok()
        .filter(|&a| a != 0)?;
    let gil = mem
        .read_u64(interp.wrapping_add(u64::from(o.interp_gil_ptr)))
        .ok()
        .filter(|&a| a != 0)?;
    let mut word = [0u8; 4];
    mem.read(gil.wrapping_add(GIL_ENABLED), &mut word).ok()?;
    Some(i32::from_le_bytes(word) != 0)
}
