//! `.eh_frame` / `.debug_frame` → sorted, merged [`UnwindRow`]s.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, CommonInformationEntry, DebugFrame, EhFrame, EndianSlice,
    FrameDescriptionEntry, RegisterRule, RunTimeEndian, UnwindContext, UnwindOffset, UnwindSection,
    UnwindTableRow, X86_64,
};
use object::{Object, ObjectSection};

use crate::{
    CFA_END, CFA_NONE, CFA_PLT, CFA_RBP, CFA_RSP, CFA_SIGNAL, CFA_UNSUPPORTED, CfiSource,
    PLT_CFA_EXPRESSION, RBP_OFFSET, RBP_SAME, RBP_UNSUPPORTED, TableStats, UnwindError, UnwindRow,
    UnwindTable,
};

type Reader<'a> = EndianSlice<'a, RunTimeEndian>;

/// Where on the stack x86-64 CFI keeps the return address, relative to the CFA.
const RA_OFFSET: i64 = -8;

/// Compiles the CFI of an x86-64 ELF object into an [`UnwindTable`].
///
/// All FDEs of `.eh_frame` are evaluated (`.eh_frame_hdr` is not needed: it only indexes
/// them); `.debug_frame` is used only when there is no `.eh_frame`, as in objects whose
/// `.eh_frame` was stripped. An FDE that fails to parse or evaluate leaves a gap
/// ([`TableStats::fde_errors`]); a malformed section structure fails the whole object.
pub fn build_table(elf: &[u8]) -> Result<UnwindTable, UnwindError> {
    let file = object::File::parse(elf)?;
    if file.architecture() != object::Architecture::X86_64 {
        return Err(UnwindError::Architecture(file.architecture()));
    }
    let endian = if file.is_little_endian() {
        RunTimeEndian::Little
    } else {
        RunTimeEndian::Big
    };
    let mut collected = Collected::default();

    if let Some((address, data)) = section_data(&file, ".eh_frame")? {
        let mut bases = BaseAddresses::default().set_eh_frame(address);
        // Pointer encodings relative to these sections (datarel, textrel) appear in
        // hand-written CFI; resolving them needs their addresses.
        if let Some(s) = file.section_by_name(".eh_frame_hdr") {
            bases = bases.set_eh_frame_hdr(s.address());
        }
        if let Some(s) = file.section_by_name(".text") {
            bases = bases.set_text(s.address());
        }
        if let Some(s) = file.section_by_name(".got") {
            bases = bases.set_got(s.address());
        }
        let mut section = EhFrame::new(&data, endian);
        section.set_address_size(8);
        collected.collect(&section, &bases, ".eh_frame")?;
    } else if let Some((_, data)) = section_data(&file, ".debug_frame")? {
        collected.stats.source = CfiSource::DebugFrame;
        let mut section = DebugFrame::new(&data, endian);
        section.set_address_size(8);
        collected.collect(&section, &BaseAddresses::default(), ".debug_frame")?;
    } else {
        return Err(UnwindError::NoCfi);
    }
    Ok(collected.finish())
}

/// The GNU build-id of an ELF object as lowercase hex, the preferred [`crate::CacheKey`].
pub fn build_id(elf: &[u8]) -> Option<String> {
    let file = object::File::parse(elf).ok()?;
    let id = file.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// A section's address and contents.
type SectionData<'d> = (u64, Cow<'d, [u8]>);

/// An empty section counts as absent: some toolchains leave a zero-size `.eh_frame` behind
/// when the CFI went to `.debug_frame`.
fn section_data<'d>(
    file: &object::File<'d>,
    name: &str,
) -> Result<Option<SectionData<'d>>, UnwindError> {
    let Some(section) = file.section_by_name(name) else {
        return Ok(None);
    };
    // `.debug_frame` may be SHF_COMPRESSED.
    let data = section.uncompressed_data()?;
    Ok((!data.is_empty()).then(|| (section.address(), data)))
}

struct Fde {
    start: u64,
    end: u64,
    rows: Range<usize>,
}

#[derive(Default)]
struct Collected {
    fdes: Vec<Fde>,
    /// The rows of all FDEs, in section order; `Fde::rows` indexes into it.
    rows: Vec<UnwindRow>,
    stats: TableStats,
}

impl Collected {
    fn collect<'a, S>(
        &mut self,
        section: &S,
        bases: &BaseAddresses,
        name: &'static str,
    ) -> Result<(), UnwindError>
    where
        S: UnwindSection<Reader<'a>>,
        S::Offset: UnwindOffset<usize>,
    {
        let mut ctx = Box::new(UnwindContext::new());
        // Parsing the CIE again for each of thousands of FDEs would dominate the build.
        let mut cies: HashMap<usize, CommonInformationEntry<Reader<'a>>> = HashMap::new();
        let mut entries = section.entries(bases);
        let mut last_offset = 0;
        loop {
            let entry = match entries.next() {
                Ok(Some(entry)) => entry,
                Ok(None) => return Ok(()),
                Err(source) => {
                    return Err(UnwindError::Cfi {
                        section: name,
                        offset: last_offset,
                        source,
                    });
                }
            };
            let partial = match entry {
                CieOrFde::Cie(cie) => {
                    last_offset = cie.offset();
                    continue;
                }
                CieOrFde::Fde(partial) => partial,
            };
            last_offset = partial.offset();
            let fde = partial.parse(|section, bases, offset| {
                let key = UnwindOffset::into(offset);
                if let Some(cie) = cies.get(&key) {
                    return Ok(cie.clone());
                }
                let cie = section.cie_from_offset(bases, offset)?;
                cies.insert(key, cie.clone());
                Ok(cie)
            });
            let Ok(fde) = fde else {
                self.stats.fde_errors += 1;
                continue;
            };
            let (start, end) = (fde.initial_address(), fde.end_address());
            if end <= start {
                self.stats.empty_fdes += 1;
                continue;
            }
            // The gap row at `end` must fit too.
            if end > u64::from(u32::MAX) {
                return Err(UnwindError::AddressTooLarge(end));
            }
            let first = self.rows.len();
            match self.fde_rows(section, bases, &mut ctx, &fde) {
                Ok(()) => self.fdes.push(Fde {
                    start,
                    end,
                    rows: first..self.rows.len(),
                }),
                Err(_) => {
                    self.rows.truncate(first);
                    self.stats.fde_errors += 1;
                }
            }
        }
    }

    fn fde_rows<'a, S>(
        &mut self,
        section: &S,
        bases: &BaseAddresses,
        ctx: &mut UnwindContext<usize>,
        fde: &FrameDescriptionEntry<Reader<'a>>,
    ) -> gimli::Result<()>
    where
        S: UnwindSection<Reader<'a>>,
    {
        // The addresses were checked against u32::MAX by the caller.
        let start = fde.initial_address() as u32;
        if fde.is_signal_trampoline() {
            // The rules describe the ucontext layout with expressions; the BPF side knows
            // that layout, so one row for the whole trampoline is enough.
            self.stats.signal_fdes += 1;
            self.rows.push(UnwindRow::bare(start, CFA_SIGNAL));
            return Ok(());
        }
        let ra_column_ok = fde.cie().return_address_register() == X86_64::RA;
        let mut table = fde.rows(section, bases, ctx)?;
        while let Some(row) = table.next_row()? {
            // Rows emptied by `DW_CFA_advance_loc 0`, or past the FDE's end, apply nowhere.
            if row.start_address() >= row.end_address() || row.start_address() >= fde.end_address()
            {
                continue;
            }
            let pc = row.start_address() as u32;
            self.rows.push(convert(row, section, ra_column_ok, pc));
        }
        Ok(())
    }

    fn finish(self) -> UnwindTable {
        let Collected {
            mut fdes,
            rows,
            mut stats,
        } = self;
        fdes.sort_by_key(|f| (f.start, f.end));
        stats.fdes = fdes.len();

        let mut sorted = Vec::with_capacity(rows.len() + fdes.len());
        for (i, fde) in fdes.iter().enumerate() {
            let next_start = fdes.get(i + 1).map(|n| n.start);
            // Overlaps come from duplicated or bogus FDEs; the later FDE wins so that every
            // pc keeps exactly one rule and the rows stay strictly increasing.
            let limit = match next_start {
                Some(next) if next < fde.end => {
                    stats.overlapping_fdes += 1;
                    next
                }
                _ => fde.end,
            };
            sorted.extend(
                rows[fde.rows.clone()]
                    .iter()
                    .filter(|r| u64::from(r.pc) < limit),
            );
            if next_start != Some(limit) {
                sorted.push(UnwindRow::bare(limit as u32, CFA_NONE));
            }
        }
        debug_assert!(sorted.windows(2).all(|w| w[0].pc < w[1].pc));
        stats.rows_before_merge = sorted.len();

        let mut merged: Vec<UnwindRow> = Vec::with_capacity(sorted.len());
        for row in sorted {
            if !merged.last().is_some_and(|last| last.same_rule(&row)) {
                merged.push(row);
            }
        }
        merged.shrink_to_fit();

        stats.rows = merged.len();
        for row in &merged {
            match row.cfa_type {
                CFA_UNSUPPORTED => stats.unsupported += 1,
                CFA_PLT => stats.plt_rows += 1,
                CFA_END => stats.end_rows += 1,
                _ => {}
            }
            if row.rbp_type == RBP_UNSUPPORTED {
                stats.rbp_unsupported += 1;
            }
        }
        UnwindTable {
            rows: merged,
            stats,
        }
    }
}

fn convert<'a, S>(
    row: &UnwindTableRow<usize>,
    section: &S,
    ra_column_ok: bool,
    pc: u32,
) -> UnwindRow
where
    S: UnwindSection<Reader<'a>>,
{
    let unsupported = UnwindRow::bare(pc, CFA_UNSUPPORTED);
    match row.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => return UnwindRow::bare(pc, CFA_END),
        Some(RegisterRule::Offset(RA_OFFSET)) if ra_column_ok => {}
        _ => return unsupported,
    }
    let (cfa_type, cfa_offset) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let cfa_type = match *register {
                X86_64::RSP => CFA_RSP,
                X86_64::RBP => CFA_RBP,
                _ => return unsupported,
            };
            match i16::try_from(*offset) {
                Ok(offset) => (cfa_type, offset),
                Err(_) => return unsupported,
            }
        }
        CfaRule::Expression(expression) => {
            let is_plt = expression
                .get(section)
                .is_ok_and(|e| e.0.slice() == PLT_CFA_EXPRESSION);
            if !is_plt {
                return unsupported;
            }
            // A PLT entry does not touch rbp; a row that says otherwise is not a PLT.
            return match row.register(X86_64::RBP) {
                None | Some(RegisterRule::SameValue) => UnwindRow::bare(pc, CFA_PLT),
                Some(_) => unsupported,
            };
        }
    };
    let (rbp_type, rbp_offset) = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::SameValue) => (RBP_SAME, 0),
        Some(RegisterRule::Offset(offset)) => match i16::try_from(offset) {
            Ok(offset) => (RBP_OFFSET, offset),
            Err(_) => (RBP_UNSUPPORTED, 0),
        },
        Some(_) => (RBP_UNSUPPORTED, 0),
    };
    UnwindRow {
        pc,
        cfa_type,
        rbp_type,
        cfa_offset,
        rbp_offset,
        reserved: 0,
    }
}
