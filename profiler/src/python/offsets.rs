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
pub const ABSENT: u32 = pyrometer_ebpf::PY_ABSENT;

/// How a frame's instruction position is stored, how the line table is encoded, and the
/// table itself: the kernel's `struct py_offsets` (ebpf/src/bpf/shared.h), generated from the
/// header, so the same value is what the walker in the kernel gets.
pub use pyrometer_ebpf::{PyFrameKind as FrameKind, PyLineTableKind as LineTableKind, PyOffsets};

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
    frame_tlbc_index: ABSENT,
    code_tlbc: ABSENT,
    frame_globals: 48,
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
    frame_globals: 8,
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
    frame_globals: 24,
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

/// The first minor version that describes itself.
pub const FIRST_MINOR: u32 = 13;

/// The table for CPython `major.minor` (3.8–3.12), or `None`.
pub fn for_version(major: u32, minor: u32) -> Option<&'static PyOffsets> {
    SUPPORTED
        .iter()
        .find(|o| o.major == major && o.minor == minor)
}

/// Whether `major.minor` can be read at all: from a table, or from its own description.
pub fn is_supported(major: u32, minor: u32) -> bool {
    for_version(major, minor).is_some() || (major == 3 && minor >= FIRST_MINOR)
}

/// The supported range as text, for messages: `3.8 and newer`.
pub fn supported_range() -> String {
    let first = SUPPORTED.first().map_or(0, |o| o.minor);
    format!("3.{first} and newer")
}

/// Bytes of a frame the kernel walker must read to see every frame field it uses.
pub fn frame_read_len(o: &PyOffsets) -> u32 {
    let instr_len = match o.frame_kind {
        FrameKind::FrameObject => 4,
        FrameKind::Interpreter => 8,
    };
    [
        o.frame_code + 8,
        o.frame_previous + 8,
        o.frame_instr + instr_len,
        o.frame_is_entry.saturating_add(1),
        o.frame_owner.saturating_add(1),
        o.frame_tlbc_index.saturating_add(4),
        o.frame_globals.saturating_add(8),
    ]
    .into_iter()
    .filter(|&end| end != 0 && end <= pyrometer_ebpf::PY_FRAME_READ_MAX)
    .max()
    .unwrap_or(pyrometer_ebpf::PY_FRAME_READ_MAX)
}

#[cfg(test)]
mod kernel_layout_tests {
    use super::*;

    #[test]
    fn frame_reads_cover_every_field() {
        for o in SUPPORTED {
            let len = frame_read_len(o);
            assert!(len <= pyrometer_ebpf::PY_FRAME_READ_MAX, "3.{}", o.minor);
            assert!(o.frame_instr + 4 <= len && o.frame_previous + 8 <= len);
        }
        // 3.8's f_lasti sits at 104 in PyFrameObject.
        assert_eq!(frame_read_len(for_version(3, 8).unwrap()), 108);
    }
}
