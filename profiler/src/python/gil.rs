//! Where to put the GIL probes in an interpreter binary. `take_gil` and `drop_gil` are static
//! functions: they are in `.symtab` (pyenv's builds) or only in the separate debug file
//! (Debian's stripped `/usr/bin/python3.11`, with `python3.11-dbg`). Compilers also copy and
//! inline them: GCC's `take_gil.constprop.0` (3.8), LTO's `take_gil.lto_priv.0` (Debian), and
//! Debian's LTO build inlines `drop_gil` into `PyEval_SaveThread` and four I/O functions, so
//! every out-of-line copy gets a probe (never the `.cold` halves, which are jumped into, not
//! called) and every inlined copy of `drop_gil` that DWARF records gets one at its entry.
//!
//! An inlined `take_gil` could not get a return probe; none of the builds here has one, and one
//! found is counted so the summary can say so.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSymbol};

use crate::os::elfsyms::{
    DebugFile, copy_with_debug, dwarf_sections, file_offset, is_copy_of, loads,
};

/// Probe sites of one interpreter binary, as file offsets of the binary (what uprobes take).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GilSites {
    /// Entries of take_gil's out-of-line copies (entry and return probes).
    pub take: Vec<u64>,
    /// Entries of drop_gil's copies, out-of-line and inlined.
    pub drop: Vec<u64>,
    /// How many of `drop` are inlined copies.
    pub drop_inlined: usize,
    /// Inlined copies of take_gil, which cannot be probed for their return.
    pub take_inlined: usize,
    /// Where the symbols came from (the binary or its debug file).
    pub symbols_from: PathBuf,
}

/// Why a binary's GIL cannot be probed, for the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GilError {
    #[error("no take_gil/drop_gil symbols in {binary} (stripped, and no debug file found{hint})")]
    NoSymbols { binary: String, hint: String },
    #[error("cannot read {0}: {1}")]
    Read(String, String),
}

/// Finds the probe sites of `binary` (`shown` is its path for messages). `debug_file` is its
/// separate debug file when it has one; the binary's own `.symtab` is used otherwise.
pub fn find_sites(
    binary: &Path,
    shown: &str,
    debug_file: Option<&DebugFile>,
) -> Result<GilSites, GilError> {
    let (data, debug_data) =
        copy_with_debug(binary, debug_file).map_err(|(f, e)| GilError::Read(f, e))?;
    let obj = object::File::parse(&*data)
        .map_err(|e| GilError::Read(shown.to_string(), e.to_string()))?;
    let loads = loads(&obj);
    let debug_obj = match &debug_data {
        Some(d) => Some(
            object::File::parse(&**d)
                .map_err(|e| GilError::Read(shown.to_string(), e.to_string()))?,
        ),
        None => None,
    };
    // The debug file's symbols are the binary's: same addresses.
    let (symbols, symbols_from) = match &debug_obj {
        Some(d) if d.symbols().next().is_some() => {
            (d, debug_file.map_or(binary, |f| f.path.as_path()))
        }
        _ => (&obj, binary),
    };
    let mut sites = GilSites {
        symbols_from: symbols_from.to_path_buf(),
        ..GilSites::default()
    };
    let mut seen = HashSet::new();
    for sym in symbols.symbols() {
        let Ok(name) = sym.name() else { continue };
        let list = if is_copy_of(name, "take_gil") {
            &mut sites.take
        } else if is_copy_of(name, "drop_gil") {
            &mut sites.drop
        } else {
            continue;
        };
        if sym.address() != 0
            && seen.insert(sym.address())
            && let Some(off) = file_offset(&loads, sym.address())
        {
            list.push(off);
        }
    }
    if sites.take.is_empty() || sites.drop.is_empty() {
        let hint = if shown.starts_with("/usr/bin/python3") {
            format!(
                "; install the interpreter's debug symbols, e.g. apt-get install {}-dbg",
                shown.rsplit('/').next().unwrap_or("python3")
            )
        } else {
            String::new()
        };
        return Err(GilError::NoSymbols {
            binary: shown.to_string(),
            hint,
        });
    }
    let dwarf_obj = debug_obj.as_ref().unwrap_or(&obj);
    if let Ok(inlined) = inlined_copies(dwarf_obj) {
        for (function, entry) in inlined {
            let Some(off) = file_offset(&loads, entry) else {
                continue;
            };
            if function == "drop_gil" {
                if seen.insert(entry) {
                    sites.drop.push(off);
                    sites.drop_inlined += 1;
                }
            } else {
                sites.take_inlined += 1;
            }
        }
    }
    sites.take.sort_unstable();
    sites.drop.sort_unstable();
    Ok(sites)
}

/// (function, entry address) of every inlined copy of take_gil or drop_gil DWARF records.
fn inlined_copies(obj: &object::File<'_>) -> Result<Vec<(&'static str, u64)>, gimli::Error> {
    let sections = dwarf_sections(obj)?;
    let dwarf = sections.borrow(|s| gimli::EndianSlice::new(s, gimli::RunTimeEndian::Little));
    // Abstract instances (by .debug_info offset) named take_gil/drop_gil, and every inlined
    // copy's origin with its entry: matched after the walk, since LTO puts the abstract
    // instance and its copies in different units.
    let mut named: Vec<(gimli::DebugInfoOffset, &'static str)> = Vec::new();
    let mut copies: Vec<(gimli::DebugInfoOffset, u64)> = Vec::new();
    let mut units = dwarf.units();
    while let Some(header) = units.next()? {
        let unit = dwarf.unit(header)?;
        let mut entries = unit.entries();
        while let Some(entry) = entries.next_dfs()? {
            match entry.tag() {
                gimli::DW_TAG_subprogram => {
                    let Some(name) = entry.attr_value(gimli::DW_AT_name) else {
                        continue;
                    };
                    let Ok(name) = dwarf.attr_string(&unit, name) else {
                        continue;
                    };
                    let function = match &*name.to_string_lossy() {
                        "take_gil" => "take_gil",
                        "drop_gil" => "drop_gil",
                        _ => continue,
                    };
                    if let Some(off) = entry.offset().to_debug_info_offset(&unit.header) {
                        named.push((off, function));
                    }
                }
                gimli::DW_TAG_inlined_subroutine => {
                    let origin = match entry.attr_value(gimli::DW_AT_abstract_origin) {
                        Some(gimli::AttributeValue::UnitRef(r)) => {
                            r.to_debug_info_offset(&unit.header)
                        }
                        Some(gimli::AttributeValue::DebugInfoRef(r)) => Some(r),
                        _ => None,
                    };
                    let Some(origin) = origin else { continue };
                    if let Some(pc) = entry_pc(&dwarf, &unit, entry)? {
                        copies.push((origin, pc));
                    }
                }
                _ => {}
            }
        }
    }
    Ok(copies
        .into_iter()
        .filter_map(|(origin, pc)| {
            named
                .iter()
                .find(|(off, _)| *off == origin)
                .map(|&(_, f)| (f, pc))
        })
        .collect())
}

type Reader<'a> = gimli::EndianSlice<'a, gimli::RunTimeEndian>;

/// Where an inlined copy starts: DW_AT_entry_pc, else its low_pc, else its first range.
fn entry_pc<'a>(
    dwarf: &gimli::Dwarf<Reader<'a>>,
    unit: &gimli::Unit<Reader<'a>>,
    entry: &gimli::DebuggingInformationEntry<Reader<'a>>,
) -> Result<Option<u64>, gimli::Error> {
    if let Some(v) = entry.attr_value(gimli::DW_AT_entry_pc) {
        match v {
            gimli::AttributeValue::Addr(a) => return Ok(Some(a)),
            gimli::AttributeValue::DebugAddrIndex(i) => return Ok(Some(dwarf.address(unit, i)?)),
            // DWARF 5 allows the entry as an offset from low_pc.
            gimli::AttributeValue::Udata(delta) => {
                if let Some(low) = low_pc(dwarf, unit, entry)? {
                    return Ok(Some(low + delta));
                }
            }
            _ => {}
        }
    }
    if let Some(low) = low_pc(dwarf, unit, entry)? {
        return Ok(Some(low));
    }
    let mut ranges = dwarf.die_ranges(unit, entry)?;
    Ok(ranges.next()?.map(|r| r.begin))
}

fn low_pc<'a>(
    dwarf: &gimli::Dwarf<Reader<'a>>,
    unit: &gimli::Unit<Reader<'a>>,
    entry: &gimli::DebuggingInformationEntry<Reader<'a>>,
) -> Result<Option<u64>, gimli::Error> {
    Ok(match entry.attr_value(gimli::DW_AT_low_pc) {
        Some(gimli::AttributeValue::Addr(a)) => Some(a),
        Some(gimli::AttributeValue::DebugAddrIndex(i)) => Some(dwarf.address(unit, i)?),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the machine's interpreters: pyenv's builds have symbols of their own (3.8 a
    /// second take_gil copy); Debian's python3.11 needs its debug file and has drop_gil inlined.
    #[test]
    fn sites_of_the_installed_interpreters() {
        for (dir, minor, takes) in [
            ("3.8.18", 8, 2),
            ("3.9.18", 9, 1),
            ("3.11.7", 11, 1),
            ("3.13.0", 13, 1),
        ] {
            let Some(lib) = crate::python::pyenv_libpython(dir, minor) else {
                continue;
            };
            let s = find_sites(&lib, &lib.to_string_lossy(), None).unwrap();
            assert_eq!(s.take.len(), takes, "3.{minor}: {s:?}");
            assert!(!s.drop.is_empty(), "3.{minor}: {s:?}");
        }
        let debian = Path::new("/usr/bin/python3.11");
        let Some(id) = crate::os::procs::read_build_id(debian) else {
            skip_ledger::skip(
                "python:debian-3.11",
                format!("Debian 3.11: {} is missing", debian.display()),
            );
            return;
        };
        let debug = PathBuf::from(format!(
            "/usr/lib/debug/.build-id/{}/{}.debug",
            &id[..2],
            &id[2..]
        ));
        let without = find_sites(debian, "/usr/bin/python3.11", None).unwrap_err();
        assert!(
            without
                .to_string()
                .contains("apt-get install python3.11-dbg"),
            "{without}"
        );
        if !debug.exists() {
            skip_ledger::skip(
                "python:debian-3.11-dbg",
                format!("Debian 3.11 with symbols: {} is missing", debug.display()),
            );
            return;
        }
        let s = find_sites(
            debian,
            "/usr/bin/python3.11",
            Some(&DebugFile::named(&debug)),
        )
        .unwrap();
        assert_eq!(s.take.len(), 1, "{s:?}");
        assert!(s.drop_inlined >= 1, "drop_gil's inlined copies: {s:?}");
        assert_eq!(s.take_inlined, 0);
    }
}
