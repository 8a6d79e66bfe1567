//! CPython 3.13+ describes its own layout: `_PyRuntime` begins with `_Py_DebugOffsets`
//! (`Include/internal/pycore_debug_offsets.h`, `pycore_runtime.h` in 3.13), a cookie
//! `xdebugpy`, `PY_VERSION_HEX`, a `free_threaded` flag and, per structure, its size and the
//! offsets of the fields an out-of-process reader needs. This module reads it from the target's
//! memory, per process, checks it, and turns it into the [`PyOffsets`] the walkers use, so a
//! free-threaded or debug build, or a patch release that moved a field, is read with its own
//! numbers.
//!
//! The description itself is a C struct whose layout grows with each minor version (fields are
//! added inside its sub-structs), so where each entry sits is known per minor version: 3.13,
//! 3.14 and 3.15 are below, from those versions' headers. A later version is read with the
//! newest layout known and accepted only if everything read checks out (cookie, version, every
//! offset inside its structure's size); otherwise it gets a per-process "not supported" message,
//! never frames decoded with guessed numbers.
//!
//! What the description does not say, and how it is found instead:
//! - the `owner` value of the frame a C call into the eval loop pushes (the walkers' boundary
//!   between eval calls): an enum value, `FRAME_OWNED_BY_CSTACK` = 3 in 3.13 and
//!   `FRAME_OWNED_BY_INTERPRETER` = 3 from 3.14 on (`pycore_interpframe_structs.h`);
//! - that `f_executable` is a tagged `_PyStackRef` from 3.14 on (`Py_TAG_BITS`: 1 with the GIL,
//!   3 free-threaded and in 3.15): the walkers mask the low 3 bits, which are always clear in a
//!   real object pointer (objects are at least 8-byte aligned), for every 3.11+ frame;
//! - the line table's encoding (the 3.11 location table, unchanged since) and the code unit
//!   size (2 bytes);
//! - the size of `struct _gil_runtime_state` (208 bytes on x86-64 glibc, unchanged since 3.8),
//!   only used to tell a futex wait on the GIL from other waits;
//! - `sizeof(PyCompactUnicodeObject)` before 3.15: `PyASCIIObject` plus `utf8_length` and `utf8`
//!   (16 bytes);
//! - that `thread_state.thread_id` holds `pthread_self()`, the thread's fs base, which is how the
//!   kernel walker finds a sampled thread's state.
//!
//! Every number is checked against the DWARF of the real builds by the tests (pyenv 3.13, and
//! Debian's 3.14 and 3.15 with their `-dbg` packages).

use super::PythonError;
use super::memory::Memory;
use super::offsets::{FIRST_MINOR, FrameKind, LineTableKind, PyOffsets};
use super::version::PythonVersion;

/// `_Py_DebugOffsets.cookie`.
pub const COOKIE: &[u8; 8] = b"xdebugpy";

/// `owner` of the frame pushed by a C call into the eval loop (see the module docs).
const ENTRY_FRAME_OWNER: u32 = 3;
/// `PyASCIIObject.state.kind`'s first bit (see [`Described::unicode_kind_shift`]).
pub const DEFAULT_UNICODE_KIND_SHIFT: u32 = 2;
pub const FREE_THREADED_UNICODE_KIND_SHIFT: u32 = 8;
/// `_PyInterpreterFrame.f_globals`, not described: 24 in 3.13–3.15, free-threaded builds included
/// (their DWARF: `offsets_match_dwarf`, `forky_descriptions_match_dwarf`).
const FRAME_GLOBALS_AT: u32 = 24;
/// `sizeof(struct _gil_runtime_state)` (see the module docs).
const GIL_STATE_SIZE: u32 = 208;
/// The same on a free-threaded build, whose GIL state begins with `int enabled` (0 while the
/// GIL is off), padded to 8: 3.13.15t's and 3.14.7t's DWARF.
const FREE_THREADED_GIL_STATE_SIZE: u32 = 216;
/// `utf8_length` and `utf8` of `PyCompactUnicodeObject` after its `PyASCIIObject`.
const COMPACT_UNICODE_EXTRA: u64 = 16;
/// A structure larger than this is not believed: the description was torn or is not one.
const MAX_STRUCT_SIZE: u64 = 1 << 20;

/// Where the entries the walkers need sit inside `_Py_DebugOffsets` (byte positions), for one
/// minor version of the description.
#[derive(Debug, Clone, Copy)]
struct Layout {
    minor: u32,
    /// Bytes to read: up to the last entry used.
    len: usize,
    free_threaded: usize,
    runtime_size: usize,
    runtime_interpreters_head: usize,
    interp_size: usize,
    interp_next: usize,
    interp_threads_head: usize,
    interp_ceval_gil: usize,
    interp_gil_state: usize,
    interp_gil_locked: usize,
    interp_gil_holder: usize,
    tstate_size: usize,
    tstate_next: usize,
    tstate_interp: usize,
    tstate_current_frame: usize,
    tstate_thread_id: usize,
    tstate_native_thread_id: usize,
    frame_size: usize,
    frame_previous: usize,
    frame_executable: usize,
    frame_instr_ptr: usize,
    frame_owner: usize,
    code_size: usize,
    code_filename: usize,
    code_name: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_firstlineno: usize,
    code_adaptive: usize,
    object_size: usize,
    object_type: usize,
    bytes_size: usize,
    bytes_ob_size: usize,
    bytes_sval: usize,
    unicode_size: usize,
    unicode_state: usize,
    unicode_length: usize,
    unicode_ascii_size: usize,
    /// 3.15+: `compactunicodeobject_size`.
    unicode_compact_size: Option<usize>,
    interp_imports_modules: usize,
    /// 3.15+: `heap_type_object.size` and `.ht_cached_keys`.
    heaptype: Option<(usize, usize)>,
    /// `interpreter_frame.tlbc_index` and `code_object.co_tlbc` (3.14+; meaningful on a
    /// free-threaded build only, 0 on others).
    tlbc: Option<(usize, usize)>,
}

/// 3.13 (`Include/internal/pycore_runtime.h` of 3.13.0).
const V313: Layout = Layout {
    minor: 13,
    len: 584,
    free_threaded: 16,
    runtime_size: 24,
    runtime_interpreters_head: 40,
    interp_size: 48,
    interp_next: 64,
    interp_threads_head: 72,
    interp_ceval_gil: 112,
    interp_gil_state: 120,
    interp_gil_locked: 136,
    interp_gil_holder: 144,
    tstate_size: 152,
    tstate_next: 168,
    tstate_interp: 176,
    tstate_current_frame: 184,
    tstate_thread_id: 192,
    tstate_native_thread_id: 200,
    frame_size: 224,
    frame_previous: 232,
    frame_executable: 240,
    frame_instr_ptr: 248,
    frame_owner: 264,
    code_size: 272,
    code_filename: 280,
    code_name: 288,
    code_qualname: 296,
    code_linetable: 304,
    code_firstlineno: 312,
    code_adaptive: 344,
    object_size: 352,
    object_type: 360,
    bytes_size: 512,
    bytes_ob_size: 520,
    bytes_sval: 528,
    unicode_size: 536,
    unicode_state: 544,
    unicode_length: 552,
    unicode_ascii_size: 560,
    unicode_compact_size: None,
    interp_imports_modules: 88,
    heaptype: None,
    tlbc: None,
};

/// 3.14 (`Include/internal/pycore_debug_offsets.h` of Debian's 3.14.8): `threads_main`, code
/// generations, `stackpointer`/`tlbc_index`, `co_tlbc` and a set section were added.
const V314: Layout = Layout {
    minor: 14,
    len: 760,
    free_threaded: 16,
    runtime_size: 24,
    runtime_interpreters_head: 40,
    interp_size: 48,
    interp_next: 64,
    interp_threads_head: 72,
    interp_ceval_gil: 120,
    interp_gil_state: 128,
    interp_gil_locked: 144,
    interp_gil_holder: 152,
    tstate_size: 176,
    tstate_next: 192,
    tstate_interp: 200,
    tstate_current_frame: 208,
    tstate_thread_id: 216,
    tstate_native_thread_id: 224,
    frame_size: 248,
    frame_previous: 256,
    frame_executable: 264,
    frame_instr_ptr: 272,
    frame_owner: 288,
    code_size: 312,
    code_filename: 320,
    code_name: 328,
    code_qualname: 336,
    code_linetable: 344,
    code_firstlineno: 352,
    code_adaptive: 384,
    object_size: 400,
    object_type: 408,
    bytes_size: 592,
    bytes_ob_size: 600,
    bytes_sval: 608,
    unicode_size: 616,
    unicode_state: 624,
    unicode_length: 632,
    unicode_ascii_size: 640,
    unicode_compact_size: None,
    interp_imports_modules: 96,
    heaptype: None,
    tlbc: Some((304, 392)),
};

/// 3.15 (Debian's 3.15.0): thread-state profiling and exception entries, a heap-type section
/// and `compactunicodeobject_size` were added.
const V315: Layout = Layout {
    minor: 15,
    len: 888,
    free_threaded: 16,
    runtime_size: 24,
    runtime_interpreters_head: 40,
    interp_size: 48,
    interp_next: 64,
    interp_threads_head: 72,
    interp_ceval_gil: 120,
    interp_gil_state: 128,
    interp_gil_locked: 144,
    interp_gil_holder: 152,
    tstate_size: 176,
    tstate_next: 192,
    tstate_interp: 200,
    tstate_current_frame: 208,
    tstate_thread_id: 240,
    tstate_native_thread_id: 248,
    frame_size: 312,
    frame_previous: 320,
    frame_executable: 328,
    frame_instr_ptr: 336,
    frame_owner: 352,
    code_size: 376,
    code_filename: 384,
    code_name: 392,
    code_qualname: 400,
    code_linetable: 408,
    code_firstlineno: 416,
    code_adaptive: 448,
    object_size: 464,
    object_type: 472,
    bytes_size: 688,
    bytes_ob_size: 696,
    bytes_sval: 704,
    unicode_size: 712,
    unicode_state: 720,
    unicode_length: 728,
    unicode_ascii_size: 736,
    unicode_compact_size: Some(744),
    interp_imports_modules: 96,
    heaptype: Some((528, 536)),
    tlbc: Some((368, 456)),
};

const LAYOUTS: &[Layout] = &[V313, V314, V315];

/// A process's layout as its interpreter describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Described {
    pub offsets: PyOffsets,
    /// Built with `--disable-gil` (`3.13t`): no GIL to report.
    pub free_threaded: bool,
    /// For `threading`'s names ([`super::names`]): `interp->imports.modules`, and (3.15+)
    /// `PyHeapTypeObject.ht_cached_keys`; 0 / `None` for the tabled versions.
    pub interp_modules: u32,
    pub heaptype_cached_keys: Option<u32>,
    /// Where `PyASCIIObject.state`'s `kind` begins (`compact` and `ascii` follow it): bit 2,
    /// after a 2-bit `interned`, except on 3.14+ free-threaded builds, whose `interned` is a
    /// byte of its own (it is accessed atomically), which puts `kind` at bit 8.
    pub unicode_kind_shift: u32,
}

impl Described {
    /// A tabled version's layout (3.8–3.12): the default object header, nothing more.
    pub fn tabled(offsets: PyOffsets) -> Self {
        Self {
            offsets,
            free_threaded: false,
            interp_modules: 0,
            heaptype_cached_keys: None,
            unicode_kind_shift: DEFAULT_UNICODE_KIND_SHIFT,
        }
    }
}

/// The description's layout for `minor`: its own, else the newest known for a later version.
fn layout_for(minor: u32) -> Option<&'static Layout> {
    if minor < FIRST_MINOR {
        return None;
    }
    LAYOUTS
        .iter()
        .find(|l| l.minor == minor)
        .or_else(|| LAYOUTS.last())
}

/// Reads and checks the `_Py_DebugOffsets` at `runtime` (the address of `_PyRuntime`) of an
/// interpreter of `version` (3.13+).
pub fn read<M: Memory>(
    mem: &M,
    runtime: u64,
    version: PythonVersion,
) -> Result<Described, PythonError> {
    let unsupported = |reason: String| PythonError::Unsupported {
        version: version.to_string(),
        reason,
    };
    let layout = layout_for(version.minor)
        .filter(|_| version.major == 3)
        .ok_or_else(|| unsupported("it does not describe itself".into()))?;
    let mut raw = vec![0u8; layout.len];
    mem.read(runtime, &mut raw)?;
    parse(&raw, layout, version).map_err(unsupported)
}

/// Turns the raw description into offsets; `Err` says what did not check out.
fn parse(raw: &[u8], l: &Layout, version: PythonVersion) -> Result<Described, String> {
    if raw.get(..8) != Some(COOKIE.as_slice()) {
        return Err("its _PyRuntime does not start with the _Py_DebugOffsets cookie".into());
    }
    let word = |at: usize| -> u64 {
        raw.get(at..at + 8).map_or(u64::MAX, |b| {
            u64::from_le_bytes(b.try_into().unwrap_or([0xff; 8]))
        })
    };
    let hex = word(8);
    let (major, minor) = ((hex >> 24) & 0xff, (hex >> 16) & 0xff);
    if (major, minor) != (u64::from(version.major), u64::from(version.minor)) {
        return Err(format!(
            "its _Py_DebugOffsets says version {major}.{minor}, the binary {}.{}",
            version.major, version.minor
        ));
    }
    let free_threaded = match word(l.free_threaded) {
        0 => false,
        1 => true,
        other => return Err(format!("_Py_DebugOffsets.free_threaded is {other}")),
    };
    let mut c = Checker { word: &word };
    let sizes = Sizes::check(&mut c, l)?;
    let gil_size = if free_threaded {
        FREE_THREADED_GIL_STATE_SIZE
    } else {
        GIL_STATE_SIZE
    };
    let mut offsets = described_offsets(&mut c, l, &sizes, version.minor, gil_size)?;
    if let (true, Some((frame_at, code_at))) = (free_threaded, l.tlbc) {
        offsets.frame_tlbc_index =
            c.field("interpreter_frame.tlbc_index", frame_at, 4, sizes.frame)? as u32;
        offsets.code_tlbc = c.field("code_object.co_tlbc", code_at, 8, sizes.code)? as u32;
    }
    let u32_of = |v: u64| v as u32; // every value was bounded by a size under MAX_STRUCT_SIZE
    let interp = sizes.interp;
    // The kernel walker reads one fixed-size window of each frame.
    let frame_end = [
        offsets.frame_code + 8,
        offsets.frame_previous + 8,
        offsets.frame_instr + 8,
        offsets.frame_owner + 1,
        // ABSENT saturates, and is left out.
        offsets.frame_tlbc_index.saturating_add(4),
        offsets.frame_globals + 8,
    ]
    .into_iter()
    .filter(|&end| end != u32::MAX)
    .max()
    .unwrap_or(0);
    if frame_end > pyrometer_ebpf::PY_FRAME_READ_MAX {
        return Err(format!(
            "its interpreter frame's fields end at byte {frame_end}, past the {} the kernel \
             walker reads",
            pyrometer_ebpf::PY_FRAME_READ_MAX
        ));
    }
    let interp_modules = u32_of(c.field(
        "interpreter_state.imports_modules",
        l.interp_imports_modules,
        8,
        interp,
    )?);
    let heaptype_cached_keys = match l.heaptype {
        Some((size_at, at)) => {
            let size = c.size("heap_type_object", size_at)?;
            Some(u32_of(c.field(
                "heap_type_object.ht_cached_keys",
                at,
                8,
                size,
            )?))
        }
        None => None,
    };
    let unicode_kind_shift = if free_threaded && version.minor >= 14 {
        FREE_THREADED_UNICODE_KIND_SHIFT
    } else {
        DEFAULT_UNICODE_KIND_SHIFT
    };
    Ok(Described {
        offsets,
        free_threaded,
        interp_modules,
        heaptype_cached_keys,
        unicode_kind_shift,
    })
}

/// The sizes of the structures a description covers, each checked.
struct Sizes {
    runtime: u64,
    interp: u64,
    tstate: u64,
    frame: u64,
    code: u64,
    object: u64,
    bytes: u64,
    unicode: u64,
}

impl Sizes {
    fn check(c: &mut Checker<'_>, l: &Layout) -> Result<Sizes, String> {
        Ok(Sizes {
            runtime: c.size("runtime_state", l.runtime_size)?,
            interp: c.size("interpreter_state", l.interp_size)?,
            tstate: c.size("thread_state", l.tstate_size)?,
            frame: c.size("interpreter_frame", l.frame_size)?,
            code: c.size("code_object", l.code_size)?,
            object: c.size("pyobject", l.object_size)?,
            bytes: c.size("bytes_object", l.bytes_size)?,
            unicode: c.size("unicode_object", l.unicode_size)?,
        })
    }
}

/// The offsets a description gives, each checked against its structure's size.
fn described_offsets(
    c: &mut Checker<'_>,
    l: &Layout,
    sizes: &Sizes,
    minor: u32,
    gil_size: u32,
) -> Result<PyOffsets, String> {
    let Sizes {
        runtime,
        interp,
        tstate,
        frame,
        code,
        object,
        bytes,
        unicode,
    } = *sizes;
    let gil_state = c.field(
        "interpreter_state.gil_runtime_state",
        l.interp_gil_state,
        0,
        interp,
    )?;
    let gil_field = |c: &mut Checker<'_>, name: &str, at: usize, width: u64| {
        let abs = c.field(name, at, width, interp)?;
        let rel = abs
            .checked_sub(gil_state)
            .filter(|&r| r + width <= u64::from(gil_size))
            .ok_or_else(|| format!("_Py_DebugOffsets.{name} ({abs}) is outside the GIL state"))?;
        Ok::<u32, String>(rel as u32)
    };
    let gil_locked = gil_field(
        c,
        "interpreter_state.gil_runtime_state_locked",
        l.interp_gil_locked,
        4,
    )?;
    let gil_last_holder = gil_field(
        c,
        "interpreter_state.gil_runtime_state_holder",
        l.interp_gil_holder,
        8,
    )?;

    let unicode_ascii_data = c.field(
        "unicode_object.asciiobject_size",
        l.unicode_ascii_size,
        0,
        256,
    )?;
    let unicode_compact_data = match l.unicode_compact_size {
        Some(at) => c.field("unicode_object.compactunicodeobject_size", at, 0, 256)?,
        None => unicode_ascii_data + COMPACT_UNICODE_EXTRA,
    };
    let frame_globals = frame_globals(frame)?;
    let u32_of = |v: u64| v as u32; // every value was bounded by a size under MAX_STRUCT_SIZE
    Ok(PyOffsets {
        major: 3,
        minor,
        frame_kind: FrameKind::Interpreter,
        line_table_kind: LineTableKind::Locations311,
        lasti_unit: 2,
        runtime_interpreters_head: u32_of(c.field(
            "runtime_state.interpreters_head",
            l.runtime_interpreters_head,
            8,
            runtime,
        )?),
        runtime_gil: super::offsets::ABSENT,
        interp_next: u32_of(c.field("interpreter_state.next", l.interp_next, 8, interp)?),
        interp_threads_head: u32_of(c.field(
            "interpreter_state.threads_head",
            l.interp_threads_head,
            8,
            interp,
        )?),
        interp_gil_ptr: u32_of(c.field(
            "interpreter_state.ceval_gil",
            l.interp_ceval_gil,
            8,
            interp,
        )?),
        gil_last_holder,
        gil_locked,
        gil_size,
        tstate_next: u32_of(c.field("thread_state.next", l.tstate_next, 8, tstate)?),
        tstate_interp: u32_of(c.field("thread_state.interp", l.tstate_interp, 8, tstate)?),
        tstate_frame: u32_of(c.field(
            "thread_state.current_frame",
            l.tstate_current_frame,
            8,
            tstate,
        )?),
        cframe_current_frame: super::offsets::ABSENT,
        tstate_thread_id: u32_of(c.field(
            "thread_state.thread_id",
            l.tstate_thread_id,
            8,
            tstate,
        )?),
        tstate_native_thread_id: u32_of(c.field(
            "thread_state.native_thread_id",
            l.tstate_native_thread_id,
            8,
            tstate,
        )?),
        frame_code: u32_of(c.field(
            "interpreter_frame.executable",
            l.frame_executable,
            8,
            frame,
        )?),
        frame_previous: u32_of(c.field(
            "interpreter_frame.previous",
            l.frame_previous,
            8,
            frame,
        )?),
        frame_instr: u32_of(c.field("interpreter_frame.instr_ptr", l.frame_instr_ptr, 8, frame)?),
        frame_is_entry: super::offsets::ABSENT,
        frame_owner: u32_of(c.field("interpreter_frame.owner", l.frame_owner, 1, frame)?),
        frame_owned_by_cstack: ENTRY_FRAME_OWNER,
        code_filename: u32_of(c.field("code_object.filename", l.code_filename, 8, code)?),
        code_name: u32_of(c.field("code_object.name", l.code_name, 8, code)?),
        code_qualname: u32_of(c.field("code_object.qualname", l.code_qualname, 8, code)?),
        code_firstlineno: u32_of(c.field(
            "code_object.firstlineno",
            l.code_firstlineno,
            4,
            code,
        )?),
        code_linetable: u32_of(c.field("code_object.linetable", l.code_linetable, 8, code)?),
        // The bytecode is the flexible array at the very end.
        code_adaptive: u32_of(c.field("code_object.co_code_adaptive", l.code_adaptive, 0, code)?),
        object_type: u32_of(c.field("pyobject.ob_type", l.object_type, 8, object)?),
        bytes_size: u32_of(c.field("bytes_object.ob_size", l.bytes_ob_size, 8, bytes)?),
        bytes_data: u32_of(c.field("bytes_object.ob_sval", l.bytes_sval, 0, bytes)?),
        unicode_length: u32_of(c.field("unicode_object.length", l.unicode_length, 8, unicode)?),
        unicode_state: u32_of(c.field("unicode_object.state", l.unicode_state, 4, unicode)?),
        unicode_ascii_data: u32_of(unicode_ascii_data),
        unicode_compact_data: u32_of(unicode_compact_data),
        frame_tlbc_index: super::offsets::ABSENT,
        code_tlbc: super::offsets::ABSENT,
        frame_globals,
    })
}

/// `f_globals` of an interpreter frame of `frame` bytes (not described: [`FRAME_GLOBALS_AT`]).
fn frame_globals(frame: u64) -> Result<u32, String> {
    if u64::from(FRAME_GLOBALS_AT) + 8 > frame {
        return Err(format!(
            "its interpreter frame ({frame} bytes) is too small for f_globals at {FRAME_GLOBALS_AT}"
        ));
    }
    Ok(FRAME_GLOBALS_AT)
}

/// Bounds checks on the entries of one description.
struct Checker<'a> {
    word: &'a dyn Fn(usize) -> u64,
}

impl Checker<'_> {
    /// A structure's size, which must be plausible.
    fn size(&mut self, name: &str, at: usize) -> Result<u64, String> {
        let v = (self.word)(at);
        if v == 0 || v > MAX_STRUCT_SIZE {
            return Err(format!("_Py_DebugOffsets.{name}.size is {v}"));
        }
        Ok(v)
    }

    /// A field's offset, which must leave `width` bytes inside a structure of `size`.
    fn field(&mut self, name: &str, at: usize, width: u64, size: u64) -> Result<u64, String> {
        let v = (self.word)(at);
        if v.checked_add(width).is_none_or(|end| end > size) {
            return Err(format!(
                "_Py_DebugOffsets.{name} ({v}) is outside its structure ({size} bytes)"
            ));
        }
        Ok(v)
    }
}

/// A process's layout: the table for 3.8–3.12, else what its interpreter says of itself,
/// read from its memory (`_Py_DebugOffsets` at `_PyRuntime`).
pub fn for_process<M: Memory>(
    mem: &M,
    rt: &super::version::PythonRuntime,
) -> Result<Described, PythonError> {
    if let Some(table) = super::offsets::for_version(rt.version.major, rt.version.minor) {
        return Ok(Described::tabled(*table));
    }
    read(mem, rt.runtime, rt.version)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(minor: u32) -> PythonVersion {
        PythonVersion {
            major: 3,
            minor,
            micro: Some(0),
        }
    }

    /// A 3.13 description with the numbers pyenv's 3.13.0 DWARF has.
    fn sample_313() -> Vec<u8> {
        let mut raw = vec![0u8; V313.len];
        let mut put = |at: usize, v: u64| raw[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put(8, 0x030d00f0);
        for (at, v) in [
            (V313.runtime_size, 1800),
            (V313.runtime_interpreters_head, 632),
            (V313.interp_size, 100_000),
            (V313.interp_next, 7264),
            (V313.interp_threads_head, 7344),
            (V313.interp_ceval_gil, 16),
            (V313.interp_gil_state, 5000),
            (V313.interp_gil_locked, 5016),
            (V313.interp_gil_holder, 5008),
            (V313.tstate_size, 400),
            (V313.tstate_next, 8),
            (V313.tstate_interp, 16),
            (V313.tstate_current_frame, 72),
            (V313.tstate_thread_id, 152),
            (V313.tstate_native_thread_id, 160),
            (V313.frame_size, 80),
            (V313.frame_previous, 8),
            (V313.frame_executable, 0),
            (V313.frame_instr_ptr, 56),
            (V313.frame_owner, 70),
            (V313.code_size, 200),
            (V313.code_filename, 112),
            (V313.code_name, 120),
            (V313.code_qualname, 128),
            (V313.code_linetable, 136),
            (V313.code_firstlineno, 68),
            (V313.code_adaptive, 200),
            (V313.object_size, 16),
            (V313.object_type, 8),
            (V313.bytes_size, 40),
            (V313.bytes_ob_size, 16),
            (V313.bytes_sval, 32),
            (V313.unicode_size, 40),
            (V313.unicode_state, 32),
            (V313.unicode_length, 16),
            (V313.unicode_ascii_size, 40),
        ] {
            put(at, v);
        }
        raw[..8].copy_from_slice(COOKIE);
        raw
    }

    #[test]
    fn a_description_becomes_the_walkers_offsets() {
        let d = parse(&sample_313(), &V313, version(13)).unwrap();
        assert!(!d.free_threaded);
        let o = d.offsets;
        assert_eq!(
            (o.runtime_interpreters_head, o.interp_threads_head),
            (632, 7344)
        );
        assert_eq!((o.gil_locked, o.gil_last_holder, o.gil_size), (16, 8, 208));
        assert_eq!((o.tstate_frame, o.frame_instr, o.frame_owner), (72, 56, 70));
        assert_eq!((o.unicode_ascii_data, o.unicode_compact_data), (40, 56));
        assert_eq!(o.frame_owned_by_cstack, 3);
    }

    /// A free-threaded build says so, and its larger object header moves `ob_type`: the
    /// walkers and the name reader take it from the description, and the GIL state (which
    /// begins with its `enabled` flag there) is 8 bytes larger.
    #[test]
    fn a_free_threaded_description_is_read_with_its_own_header() {
        let mut raw = sample_313();
        raw[16] = 1;
        raw[V313.object_type..V313.object_type + 8].copy_from_slice(&24u64.to_le_bytes());
        raw[V313.object_size..V313.object_size + 8].copy_from_slice(&32u64.to_le_bytes());
        let d = parse(&raw, &V313, version(13)).unwrap();
        assert!(d.free_threaded);
        assert_eq!(d.offsets.object_type, 24);
        let rt = super::super::version::PythonRuntime {
            version: version(13),
            path: "python3.13t".into(),
            runtime: 0x1000,
            code_type: 1,
            unicode_type: 2,
            bytes_type: 3,
            dict_type: 4,
            long_type: 5,
            module_type: 6,
            type_type: 7,
            cfunction_type: 0,
            method_type: 0,
            function_type: 0,
        };
        assert_eq!(d.offsets.gil_size, FREE_THREADED_GIL_STATE_SIZE);
        // Names are read through the larger header: an empty image is a read error.
        let mem = super::super::tests::FakeMemory::default();
        assert!(!matches!(
            super::super::names::thread_names(&mem, &rt, &d),
            Err(PythonError::Unsupported { .. })
        ));
    }

    #[test]
    fn a_bad_description_is_refused_with_the_reason() {
        let mut raw = sample_313();
        raw[0] = b'y';
        assert!(
            parse(&raw, &V313, version(13))
                .unwrap_err()
                .contains("cookie")
        );

        let raw = sample_313();
        let e = parse(&raw, &V313, version(14)).unwrap_err();
        assert!(e.contains("says version 3.13"), "{e}");

        let mut raw = sample_313();
        raw[V313.tstate_current_frame..V313.tstate_current_frame + 8]
            .copy_from_slice(&4000u64.to_le_bytes());
        let e = parse(&raw, &V313, version(13)).unwrap_err();
        assert!(e.contains("thread_state.current_frame (4000)"), "{e}");

        let mut raw = sample_313();
        raw[V313.code_size..V313.code_size + 8].copy_from_slice(&0u64.to_le_bytes());
        assert!(
            parse(&raw, &V313, version(13))
                .unwrap_err()
                .contains("code_object.size is 0")
        );

        let mut raw = sample_313();
        raw[V313.frame_size..V313.frame_size + 8].copy_from_slice(&400u64.to_le_bytes());
        raw[V313.frame_owner..V313.frame_owner + 8].copy_from_slice(&300u64.to_le_bytes());
        let e = parse(&raw, &V313, version(13)).unwrap_err();
        assert!(e.contains("past the 128"), "{e}");

        let mut raw = sample_313();
        raw[16] = 7;
        assert!(
            parse(&raw, &V313, version(13))
                .unwrap_err()
                .contains("free_threaded is 7")
        );
    }

    #[test]
    fn later_versions_try_the_newest_layout() {
        assert_eq!(layout_for(12).map(|l| l.minor), None);
        assert_eq!(layout_for(13).map(|l| l.minor), Some(13));
        assert_eq!(layout_for(15).map(|l| l.minor), Some(15));
        assert_eq!(layout_for(16).map(|l| l.minor), Some(15));
        for l in LAYOUTS {
            let last = [l.unicode_ascii_size, l.unicode_compact_size.unwrap_or(0)];
            assert!(last.iter().all(|&at| at + 8 <= l.len), "3.{}", l.minor);
        }
    }
}
