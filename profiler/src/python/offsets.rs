//! Per-version CPython structure offsets, as one flat `#[repr(C)]` struct of integers so the
//! BPF side can later take the same table through a map unchanged.
//!
//! Every number below was read from the DWARF of the pyenv builds on the development machine
//! (`~/.pyenv/versions/3.X.Y/lib/libpython3.X.so.1.0`, built `--enable-shared` with `-g`) by
//! `scripts/python_offsets.py` run under gdb:
//!
//! ```sh
//! gdb -batch -nx -ex 'python exec(open("scripts/python_offsets.py").read())' \
//!     ~/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0
//! ```
//!
//! The unit test `offsets_match_dwarf` re-runs that script against every installed build and
//! compares. The layouts are CPython's private ones: they only hold within a minor version
//! (3.8.0–3.8.x share one), which is why the table is keyed by minor version alone. Builds with
//! a different object header (`--with-pydebug` / `Py_TRACE_REFS`) are refused by version
//! detection, not read with these numbers. 3.13 and later are not in the table: they describe
//! their own layout, read per process by [`super::debug_offsets`].

/// `u32::MAX`: the field does not exist in this version.
pub const ABSENT: u32 = u32::MAX;

/// How a frame's instruction position is stored.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// ≤3.10: `PyFrameObject`, `f_lasti` an int (bytes in 3.8–3.9, code units in 3.10).
    FrameObject = 0,
    /// 3.11+: `_PyInterpreterFrame`, an instruction pointer into `co_code_adaptive`.
    Interpreter = 1,
}

/// How `co_linetable` / `co_lnotab` is encoded.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineTableKind {
    /// 3.8–3.9 `co_lnotab`: (bytecode delta, signed line delta) pairs.
    Lnotab = 0,
    /// 3.10 `co_linetable`: (range length, signed line delta, -128 = none) pairs.
    Linetable310 = 1,
    /// 3.11+ location table (PEP 626/657 varint entries in code units).
    Locations311 = 2,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PyOffsets {
    pub major: u32,
    pub minor: u32,
    pub frame_kind: FrameKind,
    pub line_table_kind: LineTableKind,
    /// Bytes per unit of the stored instruction position (`f_lasti`, or code units for 3.11+).
    pub lasti_unit: u32,

    // _PyRuntimeState
    pub runtime_interpreters_head: u32,
    /// 3.8–3.11: the GIL is embedded in `_PyRuntime.ceval.gil`.
    pub runtime_gil: u32,

    // PyInterpreterState
    pub interp_next: u32,
    pub interp_threads_head: u32,
    /// 3.12+: `interp->ceval.gil`, a pointer to the GIL state.
    pub interp_gil_ptr: u32,

    // struct _gil_runtime_state
    pub gil_last_holder: u32,
    pub gil_locked: u32,
    pub gil_size: u32,

    // PyThreadState
    pub tstate_next: u32,
    pub tstate_interp: u32,
    /// ≤3.10 `frame`; 3.13 `current_frame`; 3.11–3.12 `cframe` (then `cframe_current_frame`).
    pub tstate_frame: u32,
    pub cframe_current_frame: u32,
    pub tstate_thread_id: u32,
    pub tstate_native_thread_id: u32,

    // Frames
    pub frame_code: u32,
    pub frame_previous: u32,
    pub frame_instr: u32,
    /// 3.11 `is_entry`, unused later.
    pub frame_is_entry: u32,
    /// 3.11+ `owner` (a char).
    pub frame_owner: u32,
    /// The `owner` value of shim frames pushed by the C stack (3.12+), else `ABSENT`.
    pub frame_owned_by_cstack: u32,

    // PyCodeObject
    pub code_filename: u32,
    pub code_name: u32,
    pub code_qualname: u32,
    pub code_firstlineno: u32,
    pub code_linetable: u32,
    /// 3.11+: where the instructions start inside the code object.
    pub code_adaptive: u32,

    // Objects
    pub object_type: u32,
    pub bytes_size: u32,
    pub bytes_data: u32,
    pub unicode_length: u32,
    pub unicode_state: u32,
    /// Data of a compact ASCII string follows `PyASCIIObject`.
    pub unicode_ascii_data: u32,
    /// Data of a compact non-ASCII string follows `PyCompactUnicodeObject`.
    pub unicode_compact_data: u32,
}

const BASE: PyOffsets = PyOffsets {
    major: 3,
    minor: 0,
    frame_kind: FrameKind::FrameObject,
    line_table_kind: LineTableKind::Lnotab,
    lasti_unit: 1,
    runtime_interpreters_head: 32,
    runtime_gil: ABSENT,
    interp_next: 0,
    interp_threads_head: 8,
    interp_gil_ptr: ABSENT,
    gil_last_holder: 8,
    gil_locked: 16,
    gil_size: 208,
    tstate_next: 8,
    tstate_interp: 16,
    tstate_frame: 24,
    cframe_current_frame: ABSENT,
    tstate_thread_id: 176,
    tstate_native_thread_id: ABSENT,
    frame_code: 32,
    frame_previous: 24,
    frame_instr: 104,
    frame_is_entry: ABSENT,
    frame_owner: ABSENT,
    frame_owned_by_cstack: ABSENT,
    code_filename: 104,
    code_name: 112,
    code_qualname: ABSENT,
    code_firstlineno: 40,
    code_linetable: 120,
    code_adaptive: ABSENT,
    object_type: 8,
    bytes_size: 16,
    bytes_data: 32,
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_data: 48,
    unicode_compact_data: 72,
};

/// 3.8.18 DWARF. `_PyRuntime.ceval.gil` at 1152 (3.8 still has the pending-calls arrays there).
const PY38: PyOffsets = PyOffsets {
    minor: 8,
    runtime_gil: 1152,
    ..BASE
};

/// 3.9.18 DWARF.
const PY39: PyOffsets = PyOffsets {
    minor: 9,
    runtime_gil: 352,
    ..BASE
};

/// 3.10.13 DWARF: `f_lasti` moved to 96 and counts code units; `co_lnotab` became
/// `co_linetable` in the same slot.
const PY310: PyOffsets = PyOffsets {
    minor: 10,
    line_table_kind: LineTableKind::Linetable310,
    lasti_unit: 2,
    runtime_gil: 352,
    frame_instr: 96,
    ..BASE
};

/// 3.11.7 DWARF: `_PyInterpreterFrame`, `tstate->cframe->current_frame`, `native_thread_id`.
const PY311: PyOffsets = PyOffsets {
    minor: 11,
    frame_kind: FrameKind::Interpreter,
    line_table_kind: LineTableKind::Locations311,
    lasti_unit: 2,
    runtime_interpreters_head: 40,
    runtime_gil: 360,
    interp_threads_head: 16,
    tstate_frame: 56,
    cframe_current_frame: 8,
    tstate_thread_id: 152,
    tstate_native_thread_id: 160,
    frame_code: 32,
    frame_previous: 48,
    frame_instr: 56,
    frame_is_entry: 68,
    frame_owner: 69,
    code_filename: 112,
    code_name: 120,
    code_qualname: 128,
    code_firstlineno: 72,
    code_linetable: 136,
    code_adaptive: 184,
    ..BASE
};

/// 3.12.1 DWARF: per-interpreter GIL pointer, shim frames owned by the C stack (owner 3),
/// smaller unicode headers (no `wstr`).
const PY312: PyOffsets = PyOffsets {
    minor: 12,
    runtime_gil: ABSENT,
    interp_threads_head: 72,
    interp_gil_ptr: 384,
    cframe_current_frame: 0,
    tstate_thread_id: 136,
    tstate_native_thread_id: 144,
    frame_code: 0,
    frame_previous: 8,
    frame_is_entry: ABSENT,
    frame_owner: 70,
    frame_owned_by_cstack: 3,
    code_firstlineno: 68,
    code_adaptive: 192,
    unicode_ascii_data: 40,
    unicode_compact_data: 56,
    ..PY311
};

/// The minor versions read from a table, oldest first; 3.13+ describe themselves
/// ([`super::debug_offsets`]).
pub const SUPPORTED: &[PyOffsets] = &[PY38, PY39, PY310, PY311, PY312];

/// The table for CPython `major.minor` (3.8–3.12), or `None`.
pub fn for_version(major: u32, minor: u32) -> Option<&'static PyOffsets> {
    SUPPORTED
        .iter()
        .find(|o| o.major == major && o.minor == minor)
}

/// Whether `major.minor` can be read at all: from a table, or from its own description.
pub fn is_supported(major: u32, minor: u32) -> bool {
    for_version(major, minor).is_some()
        || (major == 3 && minor >= super::debug_offsets::FIRST_MINOR)
}

/// The supported range as text, for messages: `3.8 and newer`.
pub fn supported_range() -> String {
    let first = SUPPORTED.first().map_or(0, |o| o.minor);
    format!("3.{first} and newer")
}

/// A process's layout: the table for 3.8–3.12, else what its interpreter says of itself,
/// read from its memory (`_Py_DebugOffsets` at `_PyRuntime`).
pub fn for_process<M: super::memory::Memory>(
    mem: &M,
    rt: &super::version::PythonRuntime,
) -> Result<super::debug_offsets::Described, super::PythonError> {
    if let Some(table) = for_version(rt.version.major, rt.version.minor) {
        return Ok(super::debug_offsets::Described::tabled(*table));
    }
    super::debug_offsets::read(mem, rt.runtime, rt.version)
}

impl PyOffsets {
    /// The table as the kernel's `struct py_offsets` (ebpf/src/bpf/shared.h), field by field.
    pub fn to_words(&self) -> [u32; pyrometer_ebpf::PY_OFFSET_FIELDS] {
        [
            self.major,
            self.minor,
            self.frame_kind as u32,
            self.line_table_kind as u32,
            self.lasti_unit,
            self.runtime_interpreters_head,
            self.runtime_gil,
            self.interp_next,
            self.interp_threads_head,
            self.interp_gil_ptr,
            self.gil_last_holder,
            self.gil_locked,
            self.gil_size,
            self.tstate_next,
            self.tstate_interp,
            self.tstate_frame,
            self.cframe_current_frame,
            self.tstate_thread_id,
            self.tstate_native_thread_id,
            self.frame_code,
            self.frame_previous,
            self.frame_instr,
            self.frame_is_entry,
            self.frame_owner,
            self.frame_owned_by_cstack,
            self.code_filename,
            self.code_name,
            self.code_qualname,
            self.code_firstlineno,
            self.code_linetable,
            self.code_adaptive,
            self.object_type,
            self.bytes_size,
            self.bytes_data,
            self.unicode_length,
            self.unicode_state,
            self.unicode_ascii_data,
            self.unicode_compact_data,
        ]
    }

    /// Bytes of a frame the kernel walker must read to see every frame field it uses.
    pub fn frame_read_len(&self) -> u32 {
        let instr_len = match self.frame_kind {
            FrameKind::FrameObject => 4,
            FrameKind::Interpreter => 8,
        };
        [
            self.frame_code + 8,
            self.frame_previous + 8,
            self.frame_instr + instr_len,
            self.frame_is_entry.saturating_add(1),
            self.frame_owner.saturating_add(1),
        ]
        .into_iter()
        .filter(|&end| end != 0 && end <= pyrometer_ebpf::PY_FRAME_READ_MAX)
        .max()
        .unwrap_or(pyrometer_ebpf::PY_FRAME_READ_MAX)
    }
}

#[cfg(test)]
mod kernel_layout_tests {
    use super::*;

    #[test]
    fn words_follow_the_struct() {
        // The struct is all u32-sized fields in the kernel's order: a byte copy must agree.
        assert_eq!(size_of::<PyOffsets>(), 4 * pyrometer_ebpf::PY_OFFSET_FIELDS);
        for o in SUPPORTED {
            // SAFETY: PyOffsets is #[repr(C)], all fields u32 or #[repr(u32)] enums, no padding
            // (checked above), so its bytes are exactly PY_OFFSET_FIELDS u32 values.
            let raw: [u32; pyrometer_ebpf::PY_OFFSET_FIELDS] =
                unsafe { std::mem::transmute_copy(o) };
            assert_eq!(raw, o.to_words(), "3.{}", o.minor);
        }
    }

    #[test]
    fn frame_reads_cover_every_field() {
        for o in SUPPORTED {
            let len = o.frame_read_len();
            assert!(len <= pyrometer_ebpf::PY_FRAME_READ_MAX, "3.{}", o.minor);
            assert!(o.frame_instr + 4 <= len && o.frame_previous + 8 <= len);
        }
        // 3.8's f_lasti sits at 104 in PyFrameObject.
        assert_eq!(for_version(3, 8).unwrap().frame_read_len(), 108);
    }
}
