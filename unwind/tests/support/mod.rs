//! Shared by the integration tests: compiling C programs, reading symbols, and an
//! independent reading of the CFI through `readelf --debug-dump=frames-interp`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use object::{Object, ObjectSection, ObjectSymbol};
use pyrometer_unwind::*;

/// One translation unit: file name, source, compiler flags.
pub struct Unit<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub flags: &'a [&'a str],
}

/// Compiles the units separately (so each keeps its own flags) and links them.
pub fn gcc(dir: &Path, exe: &str, units: &[Unit], link_flags: &[&str]) -> PathBuf {
    let mut objects = Vec::new();
    for unit in units {
        let src = dir.join(unit.name);
        std::fs::write(&src, unit.source).unwrap();
        let obj = src.with_extension("o");
        run(Command::new("gcc")
            .args(unit.flags)
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&obj));
        objects.push(obj);
    }
    let out = dir.join(exe);
    run(Command::new("gcc")
        .args(&objects)
        .args(link_flags)
        .arg("-o")
        .arg(&out));
    out
}

pub fn run(cmd: &mut Command) -> String {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (the unwind tests need gcc and binutils)"));
    assert!(
        output.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Function symbols (symbol table, else dynamic symbols) → (address, size).
pub fn symbols(elf: &[u8]) -> HashMap<String, (u64, u64)> {
    let file = object::File::parse(elf).unwrap();
    let mut out = HashMap::new();
    for sym in file.symbols().chain(file.dynamic_symbols()) {
        if let Ok(name) = sym.name() {
            let name = name.split('@').next().unwrap_or(name);
            out.entry(name.to_string())
                .or_insert((sym.address(), sym.size()));
        }
    }
    out
}

pub fn section(elf: &[u8], name: &str) -> Option<(u64, Vec<u8>)> {
    let file = object::File::parse(elf).unwrap();
    let s = file.section_by_name(name)?;
    Some((s.address(), s.data().unwrap().to_vec()))
}

pub fn row_at(table: &UnwindTable, pc: u64) -> UnwindRow {
    *table
        .lookup(u32::try_from(pc).unwrap())
        .unwrap_or_else(|| panic!("no row at {pc:#x}"))
}

/// A function's rows: every distinct rule from its entry to its last byte.
pub fn rows_in(table: &UnwindTable, start: u64, size: u64) -> Vec<UnwindRow> {
    let mut out = vec![row_at(table, start)];
    out.extend(
        table
            .rows
            .iter()
            .filter(|r| u64::from(r.pc) > start && u64::from(r.pc) < start + size),
    );
    out
}

pub struct ReadelfFde {
    pub start: u64,
    pub end: u64,
    pub signal: bool,
    /// (pc, CFA column, rbp column if the FDE has one, ra column)
    pub rows: Vec<(u64, String, Option<String>, String)>,
}

/// Parses `readelf --debug-dump=frames-interp`: CIE lines give the augmentation, FDE lines
/// the range, the `LOC CFA ...` header the columns of the rows that follow.
pub fn readelf_fdes(path: &Path) -> Vec<ReadelfFde> {
    let text = run(Command::new("readelf")
        // A separate debug file found through .gnu_debuglink has NOBITS sections, and
        // readelf then exits 1 after printing everything.
        .arg("--debug-dump=no-follow-links")
        .arg("--debug-dump=frames-interp")
        .arg("-W")
        .arg(path));
    let mut signal_cies = HashMap::new();
    let mut fdes: Vec<ReadelfFde> = Vec::new();
    let mut in_fde = false;
    let mut columns: Vec<String> = Vec::new();
    for line in text.lines() {
        // A rule "in register N" prints as `r9 (r9)`: one column, two words.
        let line = line.replace(" (", "(");
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() >= 5 && words[3] == "CIE" {
            let augmentation = words[4].trim_matches('"');
            signal_cies.insert(words[0].to_string(), augmentation.contains('S'));
            in_fde = false;
        } else if words.len() >= 6 && words[3] == "FDE" {
            let cie = words[4].trim_start_matches("cie=");
            let (start, end) = words[5].trim_start_matches("pc=").split_once("..").unwrap();
            fdes.push(ReadelfFde {
                start: u64::from_str_radix(start, 16).unwrap(),
                end: u64::from_str_radix(end, 16).unwrap(),
                signal: signal_cies.get(cie).copied().unwrap_or(false),
                rows: Vec::new(),
            });
            in_fde = true;
        } else if words.get(1) == Some(&"ZERO") {
            in_fde = false;
        } else if words.first() == Some(&"LOC") {
            columns = words.iter().map(|w| w.to_string()).collect();
        } else if in_fde
            && words.len() == columns.len()
            && words[0].len() == 16
            && let Ok(pc) = u64::from_str_radix(words[0], 16)
        {
            let col = |name: &str| {
                columns
                    .iter()
                    .position(|c| c == name)
                    .map(|i| words[i].to_string())
            };
            let fde = fdes.last_mut().unwrap();
            // Several rows at one pc: only the last applies.
            if fde.rows.last().is_some_and(|r| r.0 == pc) {
                fde.rows.pop();
            }
            fde.rows.push((
                pc,
                col("CFA").unwrap(),
                col("rbp"),
                col("ra").unwrap_or_else(|| "u".into()),
            ));
        }
    }
    assert!(
        !fdes.is_empty(),
        "readelf found no FDE in {}",
        path.display()
    );
    fdes
}

/// What the row for a readelf row must be. `plt` is the `.plt` section range, where the
/// only CFA expression this crate understands lives.
pub fn expected_row(
    signal: bool,
    pc: u64,
    cfa: &str,
    rbp: Option<&str>,
    ra: &str,
    plt: Option<(u64, u64)>,
) -> UnwindRow {
    let pc32 = pc as u32;
    if signal {
        return UnwindRow::bare(pc32, CFA_SIGNAL);
    }
    if ra == "u" {
        return UnwindRow::bare(pc32, CFA_END);
    }
    if ra != "c-8" {
        return UnwindRow::bare(pc32, CFA_UNSUPPORTED);
    }
    if cfa == "exp" {
        let in_plt = plt.is_some_and(|(a, b)| (a..b).contains(&pc));
        return UnwindRow::bare(pc32, if in_plt { CFA_PLT } else { CFA_UNSUPPORTED });
    }
    let parsed = cfa
        .strip_prefix("rsp+")
        .map(|n| (CFA_RSP, n))
        .or_else(|| cfa.strip_prefix("rbp+").map(|n| (CFA_RBP, n)));
    let Some((cfa_type, n)) = parsed else {
        return UnwindRow::bare(pc32, CFA_UNSUPPORTED);
    };
    let Ok(cfa_offset) = n.parse::<i16>() else {
        return UnwindRow::bare(pc32, CFA_UNSUPPORTED);
    };
    let (rbp_type, rbp_offset) = match rbp {
        None | Some("u") | Some("s") => (RBP_SAME, 0),
        Some(r) => match r.strip_prefix('c').and_then(|n| n.parse::<i16>().ok()) {
            Some(off) => (RBP_OFFSET, off),
            None => (RBP_UNSUPPORTED, 0),
        },
    };
    UnwindRow {
        pc: pc32,
        cfa_type,
        rbp_type,
        cfa_offset,
        rbp_offset,
        reserved: 0,
    }
}

/// Checks `lookup` against readelf for every `step`-th FDE: each readelf row's pc gets the
/// same rule, and each FDE's end is a gap row unless another FDE starts there.
/// Returns how many rows were compared.
pub fn compare_with_readelf(path: &Path, table: &UnwindTable, step: usize) -> usize {
    let elf = std::fs::read(path).unwrap();
    let plt = section(&elf, ".plt").map(|(a, d)| (a, a + d.len() as u64));
    let fdes = readelf_fdes(path);
    let starts: std::collections::HashSet<u64> = fdes.iter().map(|f| f.start).collect();
    let mut compared = 0;
    for fde in fdes.iter().filter(|f| f.end > f.start).step_by(step) {
        // readelf prints no rows when the FDE only inherits the CIE's initial rules.
        for (pc, cfa, rbp, ra) in &fde.rows {
            let want = expected_row(fde.signal, *pc, cfa, rbp.as_deref(), ra, plt);
            let got = row_at(table, *pc);
            assert!(
                got.same_rule(&want),
                "{}: at {pc:#x} (FDE {:#x}..{:#x}, readelf CFA {cfa} rbp {rbp:?} ra {ra}) \
                 expected {want:?}, got {got:?}",
                path.display(),
                fde.start,
                fde.end
            );
            compared += 1;
        }
        if !starts.contains(&fde.end) {
            assert_eq!(
                row_at(table, fde.end).cfa_type,
                CFA_NONE,
                "{}: no gap row at the end {:#x} of FDE {:#x}",
                path.display(),
                fde.end,
                fde.start
            );
        }
    }
    compared
}

/// Invariants the BPF binary search relies on.
pub fn assert_well_formed(table: &UnwindTable) {
    assert!(!table.rows.is_empty());
    for pair in table.rows.windows(2) {
        assert!(pair[0].pc < pair[1].pc, "not strictly sorted: {pair:?}");
        assert!(!pair[0].same_rule(&pair[1]), "not merged: {pair:?}");
    }
    assert!(table.rows.iter().all(|r| r.reserved == 0));
    assert_eq!(table.stats.rows, table.rows.len());
    assert_eq!(table.bytes(), table.rows.len() * 12);
    assert!(table.stats.rows_before_merge >= table.stats.rows);
    let unsupported = table
        .rows
        .iter()
        .filter(|r| r.cfa_type == CFA_UNSUPPORTED)
        .count();
    assert_eq!(table.stats.unsupported, unsupported);
}
