//! Unwind information for the in-kernel DWARF CFI unwinder.
//!
//! [`build_table`] compiles the call frame information of one x86-64 ELF object (`.eh_frame`,
//! or `.debug_frame` when there is no `.eh_frame`) into a sorted array of [`UnwindRow`]s. The
//! BPF program finds the row for a pc by binary search (the reference is [`lookup`]) and
//! computes the caller's `rsp`, `rip` and `rbp` from it. [`TableCache`] shares tables between
//! processes: one table per executable per node, keyed by build-id.
//!
//! # Row format
//!
//! A row says how to unwind every pc from `row.pc` up to the next row's `pc`:
//!
//! | field        | type  | meaning |
//! |--------------|-------|---------|
//! | `pc`         | `u32` | ELF virtual address where the row starts applying (what `readelf --debug-dump=frames` prints, before the load bias). The BPF side looks up `pc - bias`. |
//! | `cfa_type`   | `u8`  | how to compute the CFA (the caller's `rsp`), one of the `CFA_*` constants |
//! | `rbp_type`   | `u8`  | how to recover the caller's `rbp`, one of the `RBP_*` constants |
//! | `cfa_offset` | `i16` | for [`CFA_RSP`] / [`CFA_RBP`]: CFA = register + `cfa_offset`; 0 otherwise |
//! | `rbp_offset` | `i16` | for [`RBP_OFFSET`]: the caller's `rbp` is stored at CFA + `rbp_offset`; 0 otherwise |
//! | `reserved`   | `u16` | always 0 |
//!
//! The return address is always at CFA − 8: rows whose CIE/FDE says anything else are
//! [`CFA_UNSUPPORTED`], so the row does not need a field for it. Other registers (`rbx`,
//! `r12`…) are not tracked: no CFA rule this format can express reads them.
//!
//! `cfa_type` values:
//! - [`CFA_NONE`]: no CFI covers this pc (a gap between FDEs, or past the last FDE). A row of
//!   this type is written at every FDE's end address unless the next FDE starts there.
//! - [`CFA_RSP`] / [`CFA_RBP`]: CFA = `rsp` / `rbp` + `cfa_offset`.
//! - [`CFA_PLT`]: the lazy-binding PLT expression binutils emits for `.plt` entries,
//!   CFA = `rsp` + 8 + ((`rip` & 15) >= 11 ? 8 : 0). Recognised byte for byte (see
//!   [`PLT_CFA_EXPRESSION`]); PLT0 and the first bytes of `.plt` have ordinary rsp rows.
//! - [`CFA_SIGNAL`]: the FDE's CIE has augmentation `S` (a signal trampoline such as libc's
//!   `__restore_rt`): the interrupted registers are in the `ucontext_t` on the stack, which the
//!   BPF side reads itself. Every row of such an FDE is `CFA_SIGNAL`, whatever its rules.
//! - [`CFA_END`]: the return address rule is `DW_CFA_undefined` (glibc's `_start`, the
//!   thread start of `clone`/`clone3`): the outermost frame, the walk stops cleanly.
//! - [`CFA_UNSUPPORTED`]: anything else (a CFA expression other than the PLT one, a CFA based
//!   on another register, an offset that does not fit `i16`, a return address not at CFA − 8).
//!   Counted in [`TableStats::unsupported`].
//!
//! `rbp_type` values: [`RBP_SAME`] (unchanged: `DW_CFA_same_value` or never mentioned),
//! [`RBP_OFFSET`] (saved at CFA + `rbp_offset`), [`RBP_UNSUPPORTED`] (undefined, in another
//! register, an expression, or an offset that does not fit `i16`). [`CFA_NONE`],
//! [`CFA_PLT`], [`CFA_SIGNAL`], [`CFA_END`] and [`CFA_UNSUPPORTED`] rows always carry
//! `RBP_SAME` and zero offsets, so that runs of them merge.
//!
//! # Why 12 bytes
//!
//! `pc` fits 32 bits because tables are relative to the object, not the process (objects
//! whose addresses reach 4 GiB are refused with [`UnwindError::AddressTooLarge`]), and the
//! stack offsets compilers emit nearly always fit 16 bits: only functions with stack buffers
//! of 32 KiB or more do not (2 of Debian libc's 28 274 rows, 4 of CPython 3.11's 63 583), and
//! those rows are [`CFA_UNSUPPORTED`]. The two `u8`s and two `i16`s pack behind `pc` without
//! padding and `reserved` rounds the struct to a multiple of its 4-byte alignment, so an
//! array of rows has no holes and the C and Rust layouts agree (checked by a test). The BPF
//! side reads one row per binary-search step, so a small row also means fewer cache lines
//! touched per frame. Memory is therefore exactly
//! **12 bytes per row**, see [`UnwindTable::bytes`]: 1 Mi rows take 12 MiB.
//!
//! # Why merged
//!
//! CFI emits a row at every instruction that changes any rule, including the saves of
//! callee-saved registers the unwinder ignores. Consecutive rows whose four rule fields are
//! equal are merged (the first is kept): the table shrinks, and the kernel's binary search
//! takes fewer steps. Merging never changes the answer of [`lookup`] for any pc.

mod build;
mod cache;
mod step;

pub use build::{build_id, build_table};
pub use cache::{CacheKey, CacheStats, DEFAULT_BUDGET_BYTES, TableCache};
pub use step::{Regs, Rule, Step, frame_pointer_step, step, walk};

/// No CFI covers this pc.
pub const CFA_NONE: u8 = 0;
/// CFA = rsp + cfa_offset.
pub const CFA_RSP: u8 = 1;
/// CFA = rbp + cfa_offset.
pub const CFA_RBP: u8 = 2;
/// CFA = rsp + 8 + ((rip & 15) >= 11 ? 8 : 0): a lazy-binding `.plt` entry.
pub const CFA_PLT: u8 = 3;
/// Signal trampoline: registers come from the ucontext on the stack.
pub const CFA_SIGNAL: u8 = 4;
/// Outermost frame: the return address is undefined, the walk ends here.
pub const CFA_END: u8 = 5;
/// A rule this format cannot express.
pub const CFA_UNSUPPORTED: u8 = 6;

/// rbp is unchanged in this frame.
pub const RBP_SAME: u8 = 0;
/// The caller's rbp is saved at CFA + rbp_offset.
pub const RBP_OFFSET: u8 = 1;
/// The caller's rbp cannot be recovered with this format.
pub const RBP_UNSUPPORTED: u8 = 2;

/// The `DW_CFA_def_cfa_expression` operand GCC/binutils emit for lazy `.plt` entries:
/// `DW_OP_breg7 (rsp) 8; DW_OP_breg16 (rip) 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11;
/// DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus`.
pub const PLT_CFA_EXPRESSION: [u8; 11] = [
    0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
];

/// One row of an unwind table; see the crate documentation for the format.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRow {
    pub pc: u32,
    pub cfa_type: u8,
    pub rbp_type: u8,
    pub cfa_offset: i16,
    pub rbp_offset: i16,
    pub reserved: u16,
}

impl UnwindRow {
    /// A row with only a type, for the kinds whose offsets are meaningless.
    pub const fn bare(pc: u32, cfa_type: u8) -> Self {
        UnwindRow {
            pc,
            cfa_type,
            rbp_type: RBP_SAME,
            cfa_offset: 0,
            rbp_offset: 0,
            reserved: 0,
        }
    }

    /// True when both rows unwind the same way (the pc aside): such neighbours merge.
    pub fn same_rule(&self, other: &UnwindRow) -> bool {
        (
            self.cfa_type,
            self.rbp_type,
            self.cfa_offset,
            self.rbp_offset,
        ) == (
            other.cfa_type,
            other.rbp_type,
            other.cfa_offset,
            other.rbp_offset,
        )
    }
}

/// The size of one row in the BPF array and in memory.
pub const ROW_BYTES: usize = size_of::<UnwindRow>();

/// Which section the rows came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CfiSource {
    #[default]
    EhFrame,
    DebugFrame,
}

/// What building a table met; for the record summary and the benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    pub source: CfiSource,
    /// FDEs turned into rows (zero-length ones excluded).
    pub fdes: usize,
    /// FDEs covering no address, skipped.
    pub empty_fdes: usize,
    /// FDEs whose CIE or instructions failed to parse or evaluate: no rows, a gap instead.
    pub fde_errors: usize,
    /// FDEs that start inside the previous one; the earlier FDE is cut at the later's start.
    pub overlapping_fdes: usize,
    /// FDEs of signal trampolines (CIE augmentation `S`).
    pub signal_fdes: usize,
    /// Rows produced before merging, gap rows included.
    pub rows_before_merge: usize,
    /// Rows in the table.
    pub rows: usize,
    /// Rows of the table with [`CFA_UNSUPPORTED`].
    pub unsupported: usize,
    /// Rows of the table with [`RBP_UNSUPPORTED`].
    pub rbp_unsupported: usize,
    /// Rows of the table with [`CFA_PLT`].
    pub plt_rows: usize,
    /// Rows of the table with [`CFA_END`].
    pub end_rows: usize,
}

/// The compiled unwind table of one object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnwindTable {
    /// Sorted by `pc`, strictly increasing, no two neighbours with the same rule.
    pub rows: Vec<UnwindRow>,
    pub stats: TableStats,
}

impl UnwindTable {
    /// Bytes the rows take, here and in the BPF array.
    pub fn bytes(&self) -> usize {
        self.rows.len() * ROW_BYTES
    }

    /// [`lookup`] on this table's rows.
    pub fn lookup(&self, pc: u32) -> Option<&UnwindRow> {
        lookup(&self.rows, pc)
    }
}

/// The row that applies to `pc`: the last row with `row.pc <= pc`, `None` before the first.
/// A [`CFA_NONE`] row is returned as is: it means "no unwind info here".
///
/// This is the reference for the BPF side's binary search.
pub fn lookup(rows: &[UnwindRow], pc: u32) -> Option<&UnwindRow> {
    let after = rows.partition_point(|r| r.pc <= pc);
    after.checked_sub(1).map(|i| &rows[i])
}

/// Why no table could be built.
#[derive(Debug, thiserror::Error)]
pub enum UnwindError {
    #[error("cannot read the object: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a parsable ELF object: {0}")]
    Object(#[from] object::Error),
    #[error("unsupported architecture {0:?}: only x86-64 is unwound")]
    Architecture(object::Architecture),
    #[error("no .eh_frame or .debug_frame section")]
    NoCfi,
    #[error("{section} is malformed at offset {offset:#x}: {source}")]
    Cfi {
        section: &'static str,
        offset: usize,
        source: gimli::Error,
    },
    #[error("address {0:#x} does not fit the 32-bit row pc")]
    AddressTooLarge(u64),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn row_layout_matches_the_bpf_struct() {
        assert_eq!(size_of::<UnwindRow>(), 12);
        assert_eq!(align_of::<UnwindRow>(), 4);
        assert_eq!(offset_of!(UnwindRow, pc), 0);
        assert_eq!(offset_of!(UnwindRow, cfa_type), 4);
        assert_eq!(offset_of!(UnwindRow, rbp_type), 5);
        assert_eq!(offset_of!(UnwindRow, cfa_offset), 6);
        assert_eq!(offset_of!(UnwindRow, rbp_offset), 8);
        assert_eq!(offset_of!(UnwindRow, reserved), 10);
    }

    fn row(pc: u32, cfa_offset: i16) -> UnwindRow {
        UnwindRow {
            pc,
            cfa_type: CFA_RSP,
            cfa_offset,
            ..UnwindRow::default()
        }
    }

    #[test]
    fn lookup_finds_the_last_row_at_or_before() {
        let rows = [
            row(0x100, 8),
            row(0x104, 16),
            UnwindRow::bare(0x120, CFA_NONE),
            row(0x130, 8),
        ];
        assert_eq!(lookup(&rows, 0xff), None);
        assert_eq!(lookup(&rows, 0x100).unwrap().cfa_offset, 8);
        assert_eq!(lookup(&rows, 0x103).unwrap().cfa_offset, 8);
        assert_eq!(lookup(&rows, 0x104).unwrap().cfa_offset, 16);
        assert_eq!(lookup(&rows, 0x11f).unwrap().cfa_offset, 16);
        assert_eq!(lookup(&rows, 0x120).unwrap().cfa_type, CFA_NONE);
        assert_eq!(lookup(&rows, 0x130).unwrap().pc, 0x130);
        assert_eq!(lookup(&rows, u32::MAX).unwrap().pc, 0x130);
        assert_eq!(lookup(&[], 5), None);
    }
}
