//! Where to put the garbage-collector probes in an interpreter binary, and how the start
//! probe finds the generation being collected.
//!
//! Builds configured `--with-dtrace` (Debian's, forky's 3.14 and 3.15) carry CPython's USDT
//! probes in `.note.stapsdt`: `python:gc__start` (its argument the generation) and
//! `python:gc__done`, each behind a semaphore the kernel raises while the probe is attached.
//! Builds without them (pyenv's) are probed at the collector function, whose copies DWARF
//! describes with the location of their `generation` parameter at entry: `collect` in 3.8
//! (two GCC copies, one with the generation a constant 2) and 3.9, `gc_collect_main` from
//! 3.10 (the wrappers that run `gc.callbacks` around it are inlined into their callers).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection};
use pyrometer_ebpf as shared;

use super::probe_target::ProbeTarget;
use crate::bpf::Uprobes;
use crate::os::elfsyms::{DebugFile, copy_with_debug, dwarf_sections, file_offset, loads};
use crate::os::procs::BinaryKey;

/// One probe site: a file offset of the binary, the cookie gc_start reads the generation
/// with, and the file offset of the USDT semaphore that guards it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcProbe {
    pub offset: u64,
    pub cookie: u64,
    pub semaphore: Option<u64>,
}

/// Where a binary's collections start and end.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GcSites {
    /// Starts: `gc__start` probes, or the collector function's entries.
    pub start: Vec<GcProbe>,
    /// Ends at `gc__done` probes (entry probes).
    pub done: Vec<GcProbe>,
    /// Ends at the collector function's returns (return probes on `start`'s offsets).
    pub returns: Vec<u64>,
    /// `usdt`, or the function probed.
    pub source: String,
}

/// Why a binary's collections cannot be probed, for the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GcError {
    #[error(
        "no gc__start/gc__done USDT probes and no collector function with its generation in the DWARF of {binary}{hint}"
    )]
    NoSites { binary: String, hint: String },
    #[error("cannot read {0}: {1}")]
    Read(String, String),
}

/// `--gc`: the probe sites of each interpreter binary, and which are attached.
pub struct GcProbes {
    pub debug_dirs: Vec<PathBuf>,
    sites: HashMap<BinaryKey, Result<GcSites, String>>,
    attached: HashSet<BinaryKey>,
    /// Registered processes whose collections cannot be probed, and why.
    pub unavailable: HashMap<u32, String>,
    /// The sites of every binary probed, for the summary.
    pub binaries: Vec<GcSites>,
}

impl GcProbes {
    pub fn new(debug_dirs: Vec<PathBuf>) -> Self {
        Self {
            debug_dirs,
            sites: HashMap::new(),
            attached: HashSet::new(),
            unavailable: HashMap::new(),
            binaries: Vec::new(),
        }
    }

    pub(super) fn is_attached(&self, key: &BinaryKey) -> bool {
        self.attached.contains(key)
    }

    /// What the searches of binaries found (failures included), by binary.
    pub(super) fn sites_mut(&mut self) -> &mut HashMap<BinaryKey, Result<GcSites, String>> {
        &mut self.sites
    }

    /// Attaches the probes at `sites` to `target`.
    pub(super) fn attach_sites(
        &mut self,
        target: &ProbeTarget,
        sites: GcSites,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        let path = &target.path;
        let [start, done, ret] = crate::bpf::GC_PROGRAMS;
        let mut attach = |program: &str, offset: u64, cookie: Option<u64>, semaphore| {
            probes
                .attach_uprobe_with(program, path, offset, cookie, semaphore)
                .map_err(|e| e.to_string())
        };
        for p in &sites.start {
            attach(start, p.offset, Some(p.cookie), p.semaphore)?;
        }
        for p in &sites.done {
            attach(done, p.offset, None, p.semaphore)?;
        }
        for &offset in &sites.returns {
            attach(ret, offset, None, None)?;
        }
        self.attached.insert(target.key.clone());
        self.binaries.push(sites);
        Ok(())
    }
}

/// The probe sites of `target`; its separate debug file (in its own root, then in
/// `debug_dirs`) is looked for only when the binary has no USDT probes of its own. Reads the
/// binary (and the debug file): run on a worker.
pub(super) fn find_target_sites(
    target: &ProbeTarget,
    debug_dirs: &[PathBuf],
) -> Result<GcSites, String> {
    let (path, shown) = (&target.path, &target.seen);
    find_sites(path, shown, None)
        .or_else(|_| find_sites(path, shown, target.debug_file(debug_dirs).as_ref()))
        .map_err(|e| e.to_string())
}

/// Finds the probe sites of `binary` (`shown` is its path for messages); `debug_file` is its
/// separate debug file, for the DWARF of a stripped build without USDT probes.
pub fn find_sites(
    binary: &Path,
    shown: &str,
    debug_file: Option<&DebugFile>,
) -> Result<GcSites, GcError> {
    let (data, debug_data) =
        copy_with_debug(binary, debug_file).map_err(|(f, e)| GcError::Read(f, e))?;
    let obj =
        object::File::parse(&*data).map_err(|e| GcError::Read(shown.into(), e.to_string()))?;
    let loads = loads(&obj);
    let usdt = usdt_sites(&obj, &loads);
    if !usdt.start.is_empty() && !usdt.done.is_empty() {
        return Ok(usdt);
    }
    let debug_obj = match &debug_data {
        Some(d) => Some(
            object::File::parse(&**d).map_err(|e| GcError::Read(shown.into(), e.to_string()))?,
        ),
        None => None,
    };
    let dwarf_obj = debug_obj.as_ref().unwrap_or(&obj);
    let entries = collector_entries(dwarf_obj).unwrap_or_default();
    let mut sites = GcSites::default();
    for (function, entry, generation) in entries {
        let Some(offset) = file_offset(&loads, entry) else {
            continue;
        };
        if sites.start.iter().any(|p| p.offset == offset) {
            continue;
        }
        sites.source = function;
        sites.start.push(GcProbe {
            offset,
            cookie: generation.cookie(),
            semaphore: None,
        });
        sites.returns.push(offset);
    }
    if sites.start.is_empty() {
        let hint = if debug_file.is_none() && shown.starts_with("/usr/bin/python3") {
            format!(
                " (stripped: install the interpreter's debug symbols, e.g. apt-get install {}-dbg)",
                shown.rsplit('/').next().unwrap_or("python3")
            )
        } else {
            String::new()
        };
        return Err(GcError::NoSites {
            binary: shown.to_string(),
            hint,
        });
    }
    sites.start.sort_unstable_by_key(|p| p.offset);
    sites.returns.sort_unstable();
    Ok(sites)
}

/// Where the generation is at a probe site.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    Unknown,
    Const(i32),
    /// A pt_regs register (`GC_REG_*`), its low `size` bytes.
    Register {
        reg: u32,
        size: u32,
    },
    /// `size` bytes at register + displacement.
    Memory {
        reg: u32,
        disp: i32,
        size: u32,
    },
}

impl Generation {
    /// gc_start's attach cookie (`GC_ARG_*` in shared.h).
    pub fn cookie(self) -> u64 {
        let pack = |kind: u32, reg: u32, size: u32, imm: i32| {
            u64::from(kind)
                | u64::from(reg & 0xff) << 8
                | u64::from(size & 0xff) << 16
                | u64::from(imm as u32) << 32
        };
        match self {
            Generation::Unknown => u64::from(shared::GC_ARG_NONE),
            Generation::Const(v) => pack(shared::GC_ARG_CONST, 0, 4, v),
            Generation::Register { reg, size } => pack(shared::GC_ARG_REG, reg, size, 0),
            Generation::Memory { reg, disp, size } => pack(shared::GC_ARG_MEM, reg, size, disp),
        }
    }
}

/// The USDT probes `python:gc__start` and `python:gc__done` of `.note.stapsdt`.
fn usdt_sites(obj: &object::File<'_>, loads: &[(u64, u64, u64)]) -> GcSites {
    let mut sites = GcSites {
        source: "usdt".into(),
        ..GcSites::default()
    };
    let Some(notes) = obj
        .section_by_name(".note.stapsdt")
        .and_then(|s| s.data().ok())
    else {
        return sites;
    };
    // Prelinking moves the probes; `.stapsdt.base`'s address says by how much.
    let actual_base = obj.section_by_name(".stapsdt.base").map(|s| s.address());
    for note in stapsdt_notes(notes) {
        if note.provider != "python" {
            continue;
        }
        let adjust = |addr: u64| match actual_base {
            Some(actual) if note.base != 0 => addr.wrapping_add(actual).wrapping_sub(note.base),
            _ => addr,
        };
        let Some(offset) = file_offset(loads, adjust(note.pc)) else {
            continue;
        };
        let semaphore = (note.semaphore != 0)
            .then(|| file_offset(loads, adjust(note.semaphore)))
            .flatten();
        let generation = note
            .args
            .split_whitespace()
            .next()
            .map_or(Generation::Unknown, usdt_argument);
        match note.name {
            "gc__start" => sites.start.push(GcProbe {
                offset,
                cookie: generation.cookie(),
                semaphore,
            }),
            "gc__done" => sites.done.push(GcProbe {
                offset,
                cookie: 0,
                semaphore,
            }),
            _ => {}
        }
    }
    sites
}

struct StapNote<'a> {
    pc: u64,
    base: u64,
    semaphore: u64,
    provider: &'a str,
    name: &'a str,
    args: &'a str,
}

/// The notes of a `.note.stapsdt` section (owner `stapsdt`, type 3): three 8-byte addresses,
/// then the provider, name and argument strings. A malformed note ends the walk.
fn stapsdt_notes(data: &[u8]) -> Vec<StapNote<'_>> {
    let u32_at = |at: usize| {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()) as usize)
    };
    let align = |n: usize| n.div_ceil(4) * 4;
    let mut out = Vec::new();
    let mut at = 0;
    while let (Some(namesz), Some(descsz), Some(kind)) =
        (u32_at(at), u32_at(at + 4), u32_at(at + 8))
    {
        let name_at = at + 12;
        let desc_at = name_at + align(namesz);
        let Some(desc) = data.get(desc_at..desc_at.saturating_add(descsz)) else {
            break;
        };
        let owner = data.get(name_at..name_at + namesz).unwrap_or_default();
        at = desc_at + align(descsz);
        if kind != 3 || owner != b"stapsdt\0" || desc.len() < 24 {
            continue;
        }
        let addr = |i: usize| u64::from_le_bytes(desc[i * 8..i * 8 + 8].try_into().unwrap());
        let mut strings = desc[24..]
            .split(|&b| b == 0)
            .map(|s| std::str::from_utf8(s).unwrap_or(""));
        out.push(StapNote {
            pc: addr(0),
            base: addr(1),
            semaphore: addr(2),
            provider: strings.next().unwrap_or(""),
            name: strings.next().unwrap_or(""),
            args: strings.next().unwrap_or(""),
        });
    }
    out
}

/// A USDT argument as the assembler wrote it: `-4@%edi`, `-4@112(%rsp)`, `-4@-228(%rbp)`,
/// `4@$2`, or without the size (`%edi`).
pub fn usdt_argument(arg: &str) -> Generation {
    let (size, operand) = match arg.split_once('@') {
        Some((size, operand)) => (size.trim_start_matches('-').parse().unwrap_or(8), operand),
        None => (8, arg),
    };
    if let Some(value) = operand.strip_prefix('$') {
        return value.parse().map_or(Generation::Unknown, Generation::Const);
    }
    if let Some(reg) = operand.strip_prefix('%') {
        return register(reg).map_or(Generation::Unknown, |reg| Generation::Register {
            reg,
            size,
        });
    }
    if let Some((disp, rest)) = operand.split_once('(')
        && let Some(reg) = rest.strip_suffix(')').and_then(|r| r.strip_prefix('%'))
    {
        let disp = if disp.is_empty() {
            Some(0)
        } else {
            disp.parse().ok()
        };
        if let (Some(disp), Some(reg)) = (disp, register(reg)) {
            return Generation::Memory { reg, disp, size };
        }
    }
    Generation::Unknown
}

/// The pt_regs slot of an x86-64 register, by any of its names.
fn register(name: &str) -> Option<u32> {
    let named = |names: &[&str]| names.contains(&name);
    let legacy = [
        (["rax", "eax", "ax", "al"], shared::GC_REG_RAX),
        (["rbx", "ebx", "bx", "bl"], shared::GC_REG_RBX),
        (["rcx", "ecx", "cx", "cl"], shared::GC_REG_RCX),
        (["rdx", "edx", "dx", "dl"], shared::GC_REG_RDX),
        (["rsi", "esi", "si", "sil"], shared::GC_REG_RSI),
        (["rdi", "edi", "di", "dil"], shared::GC_REG_RDI),
        (["rbp", "ebp", "bp", "bpl"], shared::GC_REG_RBP),
        (["rsp", "esp", "sp", "spl"], shared::GC_REG_RSP),
        (["rip", "eip", "ip", "ip"], shared::GC_REG_RIP),
    ];
    if let Some(&(_, reg)) = legacy.iter().find(|(names, _)| named(names)) {
        return Some(reg);
    }
    // r8..r15, with their d/w/b suffixes.
    let n: u32 = name
        .strip_prefix('r')?
        .trim_end_matches(['d', 'w', 'b'])
        .parse()
        .ok()?;
    dwarf_register(n)
}

/// The pt_regs slot of a DWARF x86-64 register number (0-15).
fn dwarf_register(n: u32) -> Option<u32> {
    Some(match n {
        0 => shared::GC_REG_RAX,
        1 => shared::GC_REG_RDX,
        2 => shared::GC_REG_RCX,
        3 => shared::GC_REG_RBX,
        4 => shared::GC_REG_RSI,
        5 => shared::GC_REG_RDI,
        6 => shared::GC_REG_RBP,
        7 => shared::GC_REG_RSP,
        8 => shared::GC_REG_R8,
        9 => shared::GC_REG_R9,
        10 => shared::GC_REG_R10,
        11 => shared::GC_REG_R11,
        12 => shared::GC_REG_R12,
        13 => shared::GC_REG_R13,
        14 => shared::GC_REG_R14,
        15 => shared::GC_REG_R15,
        _ => return None,
    })
}

/// The collector functions CPython has had, whose entry starts one collection.
const COLLECTORS: [&str; 2] = ["collect", "gc_collect_main"];

type Reader<'a> = gimli::EndianSlice<'a, gimli::RunTimeEndian>;

/// (function, entry address, generation at entry) of every out-of-line copy of a collector
/// function that has a `generation` parameter.
fn collector_entries(
    obj: &object::File<'_>,
) -> Result<Vec<(String, u64, Generation)>, gimli::Error> {
    let sections = dwarf_sections(obj)?;
    let dwarf = sections.borrow(|s| gimli::EndianSlice::new(s, gimli::RunTimeEndian::Little));
    let mut out = Vec::new();
    let mut units = dwarf.units();
    while let Some(header) = units.next()? {
        let unit = dwarf.unit(header)?;
        let mut entries = unit.entries();
        // The collector copy whose parameters are being read: its depth, name and entry.
        let mut current: Option<(isize, String, u64)> = None;
        while let Some(entry) = entries.next_dfs()? {
            let depth = entry.depth();
            if current.as_ref().is_some_and(|(d, _, _)| depth <= *d) {
                current = None;
            }
            match entry.tag() {
                gimli::DW_TAG_subprogram => {
                    let Some(gimli::AttributeValue::Addr(low)) =
                        entry.attr_value(gimli::DW_AT_low_pc)
                    else {
                        continue;
                    };
                    let name = die_name(&dwarf, &unit, entry);
                    if let Some(name) = name.filter(|n| COLLECTORS.contains(&n.as_str())) {
                        current = Some((depth, name, low));
                    }
                }
                gimli::DW_TAG_formal_parameter => {
                    let Some((d, function, low)) = current.as_ref() else {
                        continue;
                    };
                    if depth != d + 1
                        || die_name(&dwarf, &unit, entry).as_deref() != Some("generation")
                    {
                        continue;
                    }
                    let generation = at_entry(&dwarf, &unit, entry, *low)?;
                    out.push((function.clone(), *low, generation));
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// A DIE's name, its own or its abstract origin's (within the unit: the copies of a static
/// function sit in the unit that defines it).
fn die_name(
    dwarf: &gimli::Dwarf<Reader<'_>>,
    unit: &gimli::Unit<Reader<'_>>,
    entry: &gimli::DebuggingInformationEntry<Reader<'_>>,
) -> Option<String> {
    if let Some(v) = entry.attr_value(gimli::DW_AT_name) {
        return dwarf
            .attr_string(unit, v)
            .ok()
            .map(|s| s.to_string_lossy().into_owned());
    }
    let origin = match entry.attr_value(gimli::DW_AT_abstract_origin)? {
        gimli::AttributeValue::UnitRef(r) => r,
        _ => return None,
    };
    let origin = unit.entry(origin).ok()?;
    let v = origin.attr_value(gimli::DW_AT_name)?;
    dwarf
        .attr_string(unit, v)
        .ok()
        .map(|s| s.to_string_lossy().into_owned())
}

/// Where a parameter is at the function's entry `pc`: a constant, or a register.
fn at_entry(
    dwarf: &gimli::Dwarf<Reader<'_>>,
    unit: &gimli::Unit<Reader<'_>>,
    entry: &gimli::DebuggingInformationEntry<Reader<'_>>,
    pc: u64,
) -> Result<Generation, gimli::Error> {
    if let Some(v) = entry.attr_value(gimli::DW_AT_const_value) {
        return Ok(v
            .sdata_value()
            .or_else(|| v.udata_value().map(|u| u as i64))
            .and_then(|v| i32::try_from(v).ok())
            .map_or(Generation::Unknown, Generation::Const));
    }
    let register_of = |expr: gimli::Expression<Reader<'_>>| -> Generation {
        let mut ops = expr.operations(unit.encoding());
        match (ops.next(), ops.next()) {
            (Ok(Some(gimli::Operation::Register { register })), Ok(None)) => {
                dwarf_register(u32::from(register.0)).map_or(Generation::Unknown, |reg| {
                    Generation::Register { reg, size: 4 }
                })
            }
            _ => Generation::Unknown,
        }
    };
    match entry.attr_value(gimli::DW_AT_location) {
        Some(gimli::AttributeValue::Exprloc(expr)) => Ok(register_of(expr)),
        Some(gimli::AttributeValue::LocationListsRef(offset)) => {
            let mut locations = dwarf.locations(unit, offset)?;
            while let Some(loc) = locations.next()? {
                if loc.range.begin <= pc && pc < loc.range.end {
                    return Ok(register_of(loc.data));
                }
            }
            Ok(Generation::Unknown)
        }
        _ => Ok(Generation::Unknown),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usdt_arguments_are_read() {
        let rsp = shared::GC_REG_RSP;
        assert_eq!(
            usdt_argument("-4@112(%rsp)"),
            Generation::Memory {
                reg: rsp,
                disp: 112,
                size: 4
            }
        );
        assert_eq!(
            usdt_argument("-4@-228(%rbp)"),
            Generation::Memory {
                reg: shared::GC_REG_RBP,
                disp: -228,
                size: 4
            }
        );
        assert_eq!(
            usdt_argument("-4@%edi"),
            Generation::Register {
                reg: shared::GC_REG_RDI,
                size: 4
            }
        );
        assert_eq!(
            usdt_argument("-4@%r12d"),
            Generation::Register {
                reg: shared::GC_REG_R12,
                size: 4
            }
        );
        assert_eq!(usdt_argument("4@$2"), Generation::Const(2));
        assert_eq!(usdt_argument("-4@%xmm0"), Generation::Unknown);
        assert_eq!(usdt_argument("garbage"), Generation::Unknown);
        let c = Generation::Memory {
            reg: rsp,
            disp: -228,
            size: 4,
        }
        .cookie();
        assert_eq!(c & 0xff, u64::from(shared::GC_ARG_MEM));
        assert_eq!((c >> 8) & 0xff, u64::from(rsp));
        assert_eq!((c >> 32) as u32 as i32, -228);
    }

    #[test]
    fn truncated_notes_end_the_walk() {
        assert!(stapsdt_notes(&[]).is_empty());
        assert!(stapsdt_notes(&[8, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f, 3, 0, 0, 0]).is_empty());
    }

    /// Against the machine's interpreters: pyenv's builds are probed at their collector
    /// function (3.8 in two copies, one collecting generation 2 only), Debian's python3.11
    /// at its USDT probes, whose semaphores are in its data.
    #[test]
    fn sites_of_the_installed_interpreters() {
        let rdi = Generation::Register {
            reg: shared::GC_REG_RDI,
            size: 4,
        };
        let rsi = Generation::Register {
            reg: shared::GC_REG_RSI,
            size: 4,
        };
        for (dir, minor, function, generations) in [
            ("3.8.18", 8, "collect", vec![rdi, Generation::Const(2)]),
            ("3.9.18", 9, "collect", vec![rsi]),
            ("3.10.13", 10, "gc_collect_main", vec![rsi]),
            ("3.11.7", 11, "gc_collect_main", vec![rsi]),
            ("3.12.1", 12, "gc_collect_main", vec![rsi]),
            ("3.13.0", 13, "gc_collect_main", vec![rsi]),
        ] {
            let Some(lib) = crate::python::pyenv_libpython(dir, minor) else {
                continue;
            };
            let s = find_sites(&lib, &lib.to_string_lossy(), None).unwrap();
            assert_eq!(s.source, function, "3.{minor}: {s:?}");
            assert_eq!(s.returns.len(), s.start.len(), "3.{minor}: {s:?}");
            let mut found: Vec<u64> = s.start.iter().map(|p| p.cookie).collect();
            let mut want: Vec<u64> = generations.iter().map(|g| g.cookie()).collect();
            found.sort_unstable();
            want.sort_unstable();
            assert_eq!(found, want, "3.{minor}: {s:?}");
        }
        let debian = Path::new("/usr/bin/python3.11");
        if !debian.exists() {
            skip_ledger::skip(
                "python:debian-3.11",
                format!("Debian 3.11: {} is missing", debian.display()),
            );
            return;
        }
        let s = find_sites(debian, "/usr/bin/python3.11", None).unwrap();
        assert_eq!(s.source, "usdt");
        assert_eq!((s.start.len(), s.done.len()), (1, 1), "{s:?}");
        assert!(s.returns.is_empty());
        assert!(s.start[0].semaphore.is_some() && s.done[0].semaphore.is_some());
        assert_eq!(s.start[0].cookie & 0xff, u64::from(shared::GC_ARG_MEM));
    }
}
