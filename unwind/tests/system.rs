//! Tables of the system's own libraries: Debian's libc (no frame pointers, hand-written
//! assembly, a signal trampoline) and CPython's libpython.

mod support;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use pyrometer_unwind::*;
use support::*;

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";
const LIBPYTHON: &str = "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0";

fn libc() -> (Vec<u8>, UnwindTable) {
    let elf = std::fs::read(LIBC).expect("Debian's libc");
    let table = build_table(&elf).unwrap();
    assert_well_formed(&table);
    (elf, table)
}

fn assert_unwindable(table: &UnwindTable, what: &str, vaddr: u64) {
    let row = row_at(table, vaddr);
    assert!(
        matches!(row.cfa_type, CFA_RSP | CFA_RBP),
        "{what} at {vaddr:#x}: {row:?}"
    );
}

#[test]
fn libc_builds_and_agrees_with_readelf() {
    let (_, table) = libc();
    assert!(table.stats.fdes > 1000, "{:?}", table.stats);
    assert!(table.rows.len() > 10_000);
    // Unsupported rules are rare in libc: a handful of hand-written expressions.
    assert!(table.stats.unsupported < 50, "{:?}", table.stats);
    let compared = compare_with_readelf(Path::new(LIBC), &table, 1);
    assert!(compared > 10_000, "only {compared} rows compared");
}

#[test]
fn libc_qsort_and_memcpy_family_have_rows() {
    let (elf, table) = libc();
    let syms = symbols(&elf);
    for name in [
        "qsort",
        "qsort_r",
        "memcpy",
        "memmove",
        "memset",
        "__memcpy_chk",
    ] {
        let (addr, size) = syms[name];
        assert_unwindable(&table, name, addr);
        assert_unwindable(&table, name, addr + size - 1);
    }
    // qsort_r calls the comparison function from deep inside its own frame.
    let (addr, size) = syms["qsort_r"];
    assert!(
        rows_in(&table, addr, size)
            .iter()
            .any(|r| r.cfa_type == CFA_RSP && r.cfa_offset > 8),
        "qsort_r never grows its frame?"
    );
}

unsafe extern "C" {
    fn memcpy(d: *mut u8, s: *const u8, n: usize) -> *mut u8;
    fn memmove(d: *mut u8, s: *const u8, n: usize) -> *mut u8;
    fn memset(d: *mut u8, c: i32, n: usize) -> *mut u8;
    fn strlen(s: *const u8) -> usize;
}

/// The libc this process runs with, and where it is loaded (its first segment has vaddr 0).
fn loaded_libc() -> (PathBuf, u64) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() == 6 && fields[5].ends_with("/libc.so.6") && fields[2] == "00000000" {
            let start = fields[0].split('-').next().unwrap();
            return (fields[5].into(), u64::from_str_radix(start, 16).unwrap());
        }
    }
    panic!("libc.so.6 is not mapped in the test process");
}

#[test]
fn libc_ifunc_implementations_have_rows() {
    // The string functions this process really runs are the IFUNC-selected variants
    // (`__memmove_avx_unaligned_erms`…), local symbols the stripped libc does not name;
    // their addresses come from the dynamic linker.
    let (path, base) = loaded_libc();
    let same_file =
        std::fs::metadata(&path).unwrap().ino() == std::fs::metadata(LIBC).unwrap().ino();
    assert!(same_file, "{} is not {LIBC}", path.display());
    let (elf, table) = libc();
    let (text, data) = section(&elf, ".text").unwrap();
    let functions = [
        ("memcpy", memcpy as *const () as usize),
        ("memmove", memmove as *const () as usize),
        ("memset", memset as *const () as usize),
        ("strlen", strlen as *const () as usize),
    ];
    for (name, addr) in functions {
        let vaddr = addr as u64 - base;
        assert!(
            (text..text + data.len() as u64).contains(&vaddr),
            "{name} resolved outside libc's .text: {addr:#x}"
        );
        assert_unwindable(&table, name, vaddr);
        let row = row_at(&table, vaddr);
        assert_eq!((row.cfa_type, row.cfa_offset), (CFA_RSP, 8), "{name}");
    }
}

#[test]
fn libc_restore_rt_is_a_signal_frame() {
    let (elf, table) = libc();
    // __restore_rt is `mov $15, %rax; syscall` (rt_sigreturn); stripped libc has no symbol.
    let code = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];
    let (text, data) = section(&elf, ".text").unwrap();
    let found: Vec<u64> = data
        .windows(code.len())
        .enumerate()
        .filter(|(_, w)| *w == code)
        .map(|(i, _)| text + i as u64)
        .collect();
    assert!(!found.is_empty(), "no rt_sigreturn trampoline in libc");
    for pc in found {
        // The unwinder looks up return address - 1: glibc starts the FDE one byte early.
        for pc in [pc - 1, pc, pc + code.len() as u64 - 1] {
            assert_eq!(row_at(&table, pc).cfa_type, CFA_SIGNAL, "at {pc:#x}");
        }
    }
    assert_eq!(table.stats.signal_fdes, 1);
}

#[test]
fn libc_thread_start_is_the_outermost_frame() {
    let (elf, table) = libc();
    // clone's child side marks the return address undefined before calling the thread
    // function.
    let (addr, size) = symbols(&elf)["clone"];
    let rows = rows_in(&table, addr, size);
    assert!(
        rows.iter().any(|r| r.cfa_type == CFA_END),
        "clone: {rows:?}"
    );
    assert!(table.stats.end_rows >= 2, "{:?}", table.stats);
}

#[test]
fn libc_plt_has_plt_rows() {
    let (elf, table) = libc();
    let (plt, data) = section(&elf, ".plt").unwrap();
    assert_eq!(row_at(&table, plt + 16).cfa_type, CFA_PLT);
    assert_eq!(
        row_at(&table, plt + data.len() as u64 - 1).cfa_type,
        CFA_PLT
    );
}

#[test]
fn libpython_builds_and_agrees_with_readelf() {
    let path = Path::new(LIBPYTHON);
    if !path.exists() {
        skip_ledger::skip("python:3.11", format!("{LIBPYTHON} is not installed"));
        return;
    }
    let elf = std::fs::read(path).unwrap();
    let table = build_table(&elf).unwrap();
    assert_well_formed(&table);
    assert!(table.stats.fdes > 1000, "{:?}", table.stats);
    let syms = symbols(&elf);
    for name in [
        "_PyEval_EvalFrameDefault",
        "Py_BytesMain",
        "PyEval_EvalCode",
    ] {
        let (addr, size) = syms[name];
        assert!(row_at(&table, addr).same_rule(&UnwindRow {
            cfa_type: CFA_RSP,
            cfa_offset: 8,
            ..UnwindRow::default()
        }));
        for row in rows_in(&table, addr, size) {
            assert!(matches!(row.cfa_type, CFA_RSP | CFA_RBP), "{name}: {row:?}");
        }
    }
    let compared = compare_with_readelf(path, &table, 1);
    assert!(compared > 10_000, "only {compared} rows compared");
}
