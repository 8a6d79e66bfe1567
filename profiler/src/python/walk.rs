//! Walking a live interpreter: interpreters → thread states → frames → code objects. Every
//! pointer comes from a process that keeps running, so lists are bounded and cycle-checked,
//! objects are type-checked against the runtime's type objects, and a frame that does not
//! validate is reported as unreadable rather than decoded into garbage.

use std::collections::HashSet;

use super::PythonError;
use super::debug_offsets::Described;
use super::linetable;
use super::memory::Memory;
use super::offsets::{ABSENT, FrameKind, PyOffsets};
use super::version::PythonRuntime;

pub const MAX_INTERPRETERS: usize = 64;
pub const MAX_THREADS: usize = 1024;
pub const MAX_FRAMES: usize = 256;
/// Longer names are cut (with `…`): a name is for reading, and a torn length must not make us
/// allocate much.
pub const MAX_STRING: usize = 1024;
const MAX_LINE_TABLE: usize = 64 * 1024;
/// Bytecode copies of a function followed on a free-threaded build (`PY_TLBC_MAX`).
const TLBC_MAX: u64 = 4096;

/// 3.14+ keep `f_executable` as a `_PyStackRef` whose low bits tag the reference; object
/// pointers are 8-byte aligned, so clearing three bits is right for every 3.11+ frame (the kernel
/// walker does the same, `PY_STACKREF_TAG_MASK`).
pub const STACKREF_TAG_MASK: u64 = !7;

/// glibc x86_64: `pthread_self()` is the address of `struct pthread`, whose `tid` is at 0x2d0
/// (glibc 2.36, Debian 12; `offsetof(struct pthread, tid)`, stable since glibc 2.26). Only used
/// for 3.8–3.10, which store no native thread id; callers check the result is one of the
/// process's tasks.
pub const GLIBC_PTHREAD_TID: u64 = 0x2d0;

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
/// A frame of a dumped stack.
pub struct PyFrame {
    /// `co_qualname` (3.11+) or `co_name`; `None` when the frame did not validate.
    pub function: Option<String>,
    /// Its source file.
    pub file: Option<String>,
    /// Its line.
    pub line: Option<u32>,
    /// A native frame (`dump --native`), not a Python one.
    pub native: bool,
    /// The outermost Python frame of one `_PyEval_EvalFrameDefault` call (where native
    /// frames are spliced in).
    #[serde(skip)]
    pub entry: bool,
}

/// What a frame needs of its code object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeObject {
    /// `co_qualname` (3.11+) or `co_name`.
    pub function: String,
    pub file: String,
    pub first_line: u32,
    pub line_table: Vec<u8>,
    /// The address of its `co_filename` string: what tells a code object apart from the next
    /// one at a reused address when both start on the same line (see `Walker::filename_ref`).
    pub filename_ref: u64,
}

impl CodeObject {
    /// The line of the instruction at byte offset `addr` of the bytecode.
    pub fn line(&self, kind: super::offsets::LineTableKind, addr: u32) -> Option<u32> {
        linetable::line_for(kind, &self.line_table, self.first_line, addr)
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PyThread {
    /// The `PyThreadState` address.
    pub tstate: u64,
    /// `pthread_self()` of the thread.
    pub thread_id: u64,
    /// Kernel thread id: `native_thread_id` (3.11+), else read from glibc's `struct pthread`.
    pub tid: Option<u32>,
    pub holds_gil: bool,
    /// Innermost first.
    pub frames: Vec<PyFrame>,
    /// The chain went on past `MAX_FRAMES`, looped, or could not be read to its end.
    pub truncated: bool,
}

#[derive(Debug, Clone)]
pub struct Snapshot {
    pub threads: Vec<PyThread>,
    /// Address and size of the main interpreter's GIL state, for telling GIL waits apart.
    pub gil: Option<(u64, u64)>,
}

pub struct Walker<'a, M: Memory> {
    mem: &'a M,
    off: &'a PyOffsets,
    rt: &'a PythonRuntime,
    unicode_kind_shift: u32,
}

/// `PyASCIIObject.state`'s `kind`, `compact` and `ascii`, with `kind` starting at bit
/// `kind_shift` ([`Described::unicode_kind_shift`]).
pub fn string_state(state: u32, kind_shift: u32) -> (u32, bool, bool) {
    let bits = state.checked_shr(kind_shift).unwrap_or(0);
    (bits & 7, (bits >> 3) & 1 == 1, (bits >> 4) & 1 == 1)
}

impl<'a, M: Memory> Walker<'a, M> {
    pub fn new(mem: &'a M, layout: &'a Described, rt: &'a PythonRuntime) -> Self {
        Self {
            mem,
            off: &layout.offsets,
            rt,
            unicode_kind_shift: layout.unicode_kind_shift,
        }
    }

    fn field(&self, base: u64, offset: u32) -> Result<u64, PythonError> {
        self.mem.read_u64(base.wrapping_add(u64::from(offset)))
    }

    /// Reads every thread of every interpreter. Errors only when the runtime itself cannot be
    /// read (process gone, no permission); a bad thread or frame is marked, not fatal.
    pub fn snapshot(&self) -> Result<Snapshot, PythonError> {
        let o = self.off;
        let mut threads = Vec::new();
        let mut gil = None;
        let mut seen_interps = HashSet::new();
        let mut interp = self.field(self.rt.runtime, o.runtime_interpreters_head)?;
        if o.runtime_gil != ABSENT {
            gil = Some(self.rt.runtime + u64::from(o.runtime_gil));
        }
        while interp != 0 && seen_interps.len() < MAX_INTERPRETERS && seen_interps.insert(interp) {
            if gil.is_none() && o.interp_gil_ptr != ABSENT {
                gil = self
                    .field(interp, o.interp_gil_ptr)
                    .ok()
                    .filter(|&g| g != 0);
            }
            let gil_state = gil.and_then(|g| self.gil_holder(g));
            let mut seen = HashSet::new();
            let mut tstate = self.field(interp, o.interp_threads_head).unwrap_or(0);
            while tstate != 0 && threads.len() < MAX_THREADS && seen.insert(tstate) {
                threads.push(self.thread(tstate, gil_state));
                tstate = self.field(tstate, o.tstate_next).unwrap_or(0);
            }
            interp = self.field(interp, o.interp_next).unwrap_or(0);
        }
        Ok(Snapshot {
            threads,
            gil: gil.map(|g| (g, u64::from(o.gil_size))),
        })
    }

    /// The thread state holding the GIL, if it is held.
    fn gil_holder(&self, gil: u64) -> Option<u64> {
        let locked = self
            .mem
            .read_u32(gil + u64::from(self.off.gil_locked))
            .ok()?;
        let holder = self.field(gil, self.off.gil_last_holder).ok()?;
        (locked != 0 && holder != 0).then_some(holder)
    }

    /// `pthread_self()` and the kernel thread id (in the process's pid namespace) of a thread
    /// state: `native_thread_id` (3.11+), else read from glibc's `struct pthread`.
    fn ident(&self, tstate: u64) -> (u64, Option<u32>) {
        let o = self.off;
        let thread_id = self.field(tstate, o.tstate_thread_id).unwrap_or(0);
        let tid = if o.tstate_native_thread_id != ABSENT {
            self.field(tstate, o.tstate_native_thread_id).ok()
        } else if thread_id != 0 {
            self.mem
                .read_u32(thread_id.wrapping_add(GLIBC_PTHREAD_TID))
                .ok()
                .map(u64::from)
        } else {
            None
        }
        .and_then(|t| u32::try_from(t).ok())
        .filter(|&t| t != 0);
        (thread_id, tid)
    }

    fn thread(&self, tstate: u64, gil_holder: Option<u64>) -> PyThread {
        let (thread_id, tid) = self.ident(tstate);
        let (frames, truncated) = self.frames(tstate);
        PyThread {
            tstate,
            thread_id,
            tid,
            holds_gil: gil_holder == Some(tstate),
            frames,
            truncated,
        }
    }

    /// (`pthread_self()`, kernel tid in the process's namespace) of every thread of every
    /// interpreter, without their frames.
    pub fn thread_ids(&self) -> Result<Vec<(u64, Option<u32>)>, PythonError> {
        let o = self.off;
        let mut out = Vec::new();
        let mut seen_interps = HashSet::new();
        let mut interp = self.field(self.rt.runtime, o.runtime_interpreters_head)?;
        while interp != 0 && seen_interps.len() < MAX_INTERPRETERS && seen_interps.insert(interp) {
            let mut seen = HashSet::new();
            let mut tstate = self.field(interp, o.interp_threads_head).unwrap_or(0);
            while tstate != 0 && out.len() < MAX_THREADS && seen.insert(tstate) {
                out.push(self.ident(tstate));
                tstate = self.field(tstate, o.tstate_next).unwrap_or(0);
            }
            interp = self.field(interp, o.interp_next).unwrap_or(0);
        }
        Ok(out)
    }

    fn current_frame(&self, tstate: u64) -> Result<u64, PythonError> {
        let o = self.off;
        let frame = self.field(tstate, o.tstate_frame)?;
        if o.cframe_current_frame != ABSENT && frame != 0 {
            // 3.11–3.12: the thread state points at a _PyCFrame.
            return self.field(frame, o.cframe_current_frame);
        }
        Ok(frame)
    }

    fn frames(&self, tstate: u64) -> (Vec<PyFrame>, bool) {
        let o = self.off;
        let mut frames = Vec::new();
        let mut seen = HashSet::new();
        let Ok(mut frame) = self.current_frame(tstate) else {
            return (frames, true);
        };
        while frame != 0 {
            if frames.len() >= MAX_FRAMES || !seen.insert(frame) {
                return (frames, true);
            }
            if o.frame_owner != ABSENT && o.frame_owned_by_cstack != ABSENT {
                match self.mem.read_u8(frame + u64::from(o.frame_owner)) {
                    // A shim the C stack pushed to enter the eval loop: no Python code, and
                    // the frame before it was the outermost of that eval call.
                    Ok(owner) if u32::from(owner) == o.frame_owned_by_cstack => {
                        if let Some(last) = frames.last_mut() {
                            last.entry = true;
                        }
                        frame = self.field(frame, o.frame_previous).unwrap_or(0);
                        continue;
                    }
                    Ok(_) => {}
                    Err(_) => return (frames, true),
                }
            }
            let mut f = self.frame(frame).unwrap_or(PyFrame {
                function: None,
                file: None,
                line: None,
                native: false,
                entry: false,
            });
            f.entry = match o.frame_kind {
                // One frame per eval call up to 3.10.
                FrameKind::FrameObject => true,
                FrameKind::Interpreter if o.frame_is_entry != ABSENT => self
                    .mem
                    .read_u8(frame + u64::from(o.frame_is_entry))
                    .is_ok_and(|e| e != 0),
                // 3.12+: marked when the shim below it is met.
                FrameKind::Interpreter => false,
            };
            frames.push(f);
            match self.field(frame, o.frame_previous) {
                Ok(prev) => frame = prev,
                Err(_) => return (frames, true),
            }
        }
        (frames, false)
    }

    fn frame(&self, frame: u64) -> Result<PyFrame, PythonError> {
        let o = self.off;
        let mut code_addr = self.field(frame, o.frame_code)?;
        if o.frame_kind == FrameKind::Interpreter {
            code_addr &= STACKREF_TAG_MASK;
        }
        let code = self.code(code_addr)?;
        let line = self
            .instruction_offset(frame, code_addr)
            .ok()
            .flatten()
            .and_then(|addr| code.line(o.line_table_kind, addr));
        Ok(PyFrame {
            function: Some(code.function),
            file: Some(code.file),
            line,
            native: false,
            entry: false,
        })
    }

    /// Reads a code object: its name, file, first line and line table. Fails unless `code`
    /// is an object of the runtime's code type with well-formed fields.
    pub fn code(&self, code: u64) -> Result<CodeObject, PythonError> {
        let o = self.off;
        if code == 0 || self.field(code, o.object_type)? != self.rt.code_type {
            return Err(PythonError::BadAddress(code));
        }
        let name_field = if o.code_qualname != ABSENT {
            o.code_qualname
        } else {
            o.code_name
        };
        let function = self.string(self.field(code, name_field)?)?;
        let filename_ref = self.field(code, o.code_filename)?;
        let file = self.string(filename_ref)?;
        let first_line = self.mem.read_u32(code + u64::from(o.code_firstlineno))?;
        let line_table = self.bytes(self.field(code, o.code_linetable)?)?;
        Ok(CodeObject {
            function,
            file,
            first_line,
            line_table,
            filename_ref,
        })
    }

    /// Where the bytecode the frame runs begins: `co_code_adaptive`, or on a 3.14+
    /// free-threaded build the thread's own copy, entry `tlbc_index` of the code object's
    /// `co_tlbc` array (as the kernel walker reads it, `py_tlbc_start`); `None` when that
    /// copy cannot be found.
    fn bytecode_copy(&self, frame: u64, code: u64) -> Result<Option<u64>, PythonError> {
        let o = self.off;
        let shared = code + u64::from(o.code_adaptive);
        if o.frame_tlbc_index == ABSENT {
            return Ok(Some(shared));
        }
        let index = self.mem.read_u32(frame + u64::from(o.frame_tlbc_index))? as i32;
        if index <= 0 {
            return Ok(Some(shared));
        }
        let index = index as u64;
        let array = self.field(code, o.code_tlbc)?;
        if array == 0 || index >= TLBC_MAX || index >= self.mem.read_u64(array)? {
            return Ok(None);
        }
        let start = self.mem.read_u64(array + 8 + index * 8)?;
        Ok((start != 0).then_some(start))
    }

    /// The `co_filename` address of the code object at `code` (one read).
    pub fn filename_ref(&self, code: u64) -> Result<u64, PythonError> {
        self.field(code, self.off.code_filename)
    }

    /// Byte offset into the bytecode of the frame's current instruction.
    fn instruction_offset(&self, frame: u64, code: u64) -> Result<Option<u32>, PythonError> {
        let o = self.off;
        Ok(Some(match o.frame_kind {
            FrameKind::FrameObject => {
                // -1 before the first instruction ran.
                let lasti = self.mem.read_u32(frame + u64::from(o.frame_instr))? as i32;
                (lasti.max(0) as u32).saturating_mul(o.lasti_unit)
            }
            FrameKind::Interpreter => {
                let instr = self.field(frame, o.frame_instr)?;
                let start = match self.bytecode_copy(frame, code)? {
                    Some(start) => start,
                    None => return Ok(None),
                };
                match instr.checked_sub(start) {
                    Some(d) if d < MAX_LINE_TABLE as u64 * 64 => d as u32,
                    _ => return Ok(None),
                }
            }
        }))
    }

    fn bytes(&self, obj: u64) -> Result<Vec<u8>, PythonError> {
        let o = self.off;
        if self.field(obj, o.object_type)? != self.rt.bytes_type {
            return Err(PythonError::BadAddress(obj));
        }
        let len = self.field(obj, o.bytes_size)? as i64;
        if !(0..=MAX_LINE_TABLE as i64).contains(&len) {
            return Err(PythonError::BadAddress(obj));
        }
        let mut buf = vec![0u8; len as usize];
        self.mem.read(obj + u64::from(o.bytes_data), &mut buf)?;
        Ok(buf)
    }

    /// A `str` object as Rust text: compact strings only (every code object's names are).
    pub fn string(&self, obj: u64) -> Result<String, PythonError> {
        let o = self.off;
        if obj == 0 || self.field(obj, o.object_type)? != self.rt.unicode_type {
            return Err(PythonError::BadAddress(obj));
        }
        let len = self.field(obj, o.unicode_length)? as i64;
        if len < 0 {
            return Err(PythonError::BadAddress(obj));
        }
        let state = self.mem.read_u32(obj + u64::from(o.unicode_state))?;
        let (kind, compact, ascii) = string_state(state, self.unicode_kind_shift);
        if !compact || !matches!(kind, 1 | 2 | 4) {
            return Err(PythonError::BadAddress(obj));
        }
        let data = obj
            + u64::from(if ascii {
                o.unicode_ascii_data
            } else {
                o.unicode_compact_data
            });
        let chars = (len as usize).min(MAX_STRING);
        let mut buf = vec![0u8; chars * kind as usize];
        self.mem.read(data, &mut buf)?;
        let mut text: String = match kind {
            1 => buf.iter().map(|&b| char::from(b)).collect(),
            2 => buf
                .chunks_exact(2)
                .map(|c| {
                    char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]])))
                        .unwrap_or('\u{fffd}')
                })
                .collect(),
            _ => buf
                .chunks_exact(4)
                .map(|c| {
                    char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .unwrap_or('\u{fffd}')
                })
                .collect(),
        };
        if chars < len as usize {
            text.push('…');
        }
        Ok(text)
    }
}
