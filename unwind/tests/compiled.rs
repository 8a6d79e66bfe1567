//! Tables of C programs compiled here with gcc, checked at known functions and against
//! readelf's own interpretation of the same CFI.

mod support;

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Arc;

use pyrometer_unwind::*;
use support::*;

const MAIN_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int fp_func(int x);

__attribute__((noinline)) int compare(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Needs callee-saved registers and a stack buffer: pushes, then a large sub. */
__attribute__((noinline)) long busy(long n) {
    char buf[256];
    long acc = 0;
    for (long i = 0; i < n; i++) {
        snprintf(buf, sizeof buf, "%ld", i * 7);
        acc += (long)strlen(buf) * i;
    }
    return acc;
}

int main(int argc, char **argv) {
    int a[64];
    for (int i = 0; i < 64; i++) a[i] = rand();
    qsort(a, 64, sizeof a[0], compare);
    printf("%d %ld %d\n", a[0], busy(argc * 100), fp_func(argc));
    return 0;
}
"#;

const FP_C: &str = "int fp_func(int x) { volatile int y = x * 3; return y + 1; }\n";

const NO_FP: &[&str] = &["-O2", "-fomit-frame-pointer"];
const WITH_FP: &[&str] = &["-O0", "-fno-omit-frame-pointer"];

struct Program {
    _dir: tempfile::TempDir,
    path: PathBuf,
    elf: Vec<u8>,
    table: UnwindTable,
}

impl Program {
    fn symbol(&self, name: &str) -> (u64, u64) {
        *symbols(&self.elf)
            .get(name)
            .unwrap_or_else(|| panic!("no symbol {name}"))
    }
}

fn program_with(main_flags: &[&str], link_flags: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let units = [
        Unit {
            name: "main.c",
            source: MAIN_C,
            flags: main_flags,
        },
        Unit {
            name: "fp.c",
            source: FP_C,
            flags: WITH_FP,
        },
    ];
    let path = gcc(dir.path(), "prog", &units, link_flags);
    (dir, path)
}

fn program() -> Program {
    let (dir, path) = program_with(NO_FP, &[]);
    let elf = std::fs::read(&path).unwrap();
    let table = build_table(&elf).unwrap();
    assert_well_formed(&table);
    Program {
        _dir: dir,
        path,
        elf,
        table,
    }
}

fn rsp(offset: i16) -> UnwindRow {
    UnwindRow {
        cfa_type: CFA_RSP,
        cfa_offset: offset,
        ..UnwindRow::default()
    }
}

#[test]
fn function_entry_is_rsp_plus_8_and_the_body_deeper() {
    let p = program();
    let (busy, size) = p.symbol("busy");
    let rows = rows_in(&p.table, busy, size);
    assert!(rows[0].same_rule(&rsp(8)), "busy entry: {:?}", rows[0]);
    let deepest = rows
        .iter()
        .filter(|r| r.cfa_type == CFA_RSP)
        .map(|r| r.cfa_offset)
        .max()
        .unwrap();
    // 256 bytes of buffer plus the pushes.
    assert!(deepest > 8 + 256, "busy rows: {rows:?}");
    assert!(rows.iter().all(|r| r.cfa_type == CFA_RSP), "{rows:?}");

    // A leaf without stack use: one rule all through.
    let (compare, size) = p.symbol("compare");
    let rows = rows_in(&p.table, compare, size);
    assert_eq!(rows.len(), 1, "compare rows: {rows:?}");
    assert!(rows[0].same_rule(&rsp(8)));
}

#[test]
fn frame_pointer_function_has_rbp_rows() {
    let p = program();
    let (fp, size) = p.symbol("fp_func");
    let rows = rows_in(&p.table, fp, size);
    let after_push = UnwindRow {
        rbp_type: RBP_OFFSET,
        rbp_offset: -16,
        ..rsp(16)
    };
    let body = UnwindRow {
        cfa_type: CFA_RBP,
        ..after_push
    };
    assert!(rows.len() >= 4, "fp_func rows: {rows:?}");
    assert!(rows[0].same_rule(&rsp(8)), "{rows:?}");
    assert!(rows[1].same_rule(&after_push), "{rows:?}");
    assert!(rows[2].same_rule(&body), "{rows:?}");
    // After `pop %rbp`, at the `ret`.
    let at_ret = row_at(&p.table, fp + size - 1);
    assert_eq!((at_ret.cfa_type, at_ret.cfa_offset), (CFA_RSP, 8));
}

#[test]
fn plt_entries_use_the_plt_rule() {
    let p = program();
    let (plt, data) = section(&p.elf, ".plt").expect("the test program has a lazy .plt");
    let end = plt + data.len() as u64;
    assert!(data.len() >= 32, "PLT0 and at least one entry");
    // PLT0 pushes the GOT entry then jumps: plain rsp rows.
    assert!(row_at(&p.table, plt).same_rule(&rsp(16)));
    assert!(row_at(&p.table, plt + 6).same_rule(&rsp(24)));
    for pc in plt + 16..end {
        assert_eq!(row_at(&p.table, pc).cfa_type, CFA_PLT, "at {pc:#x}");
    }
    assert_ne!(row_at(&p.table, end).cfa_type, CFA_PLT);
    assert_eq!(p.table.stats.plt_rows, 1);
}

#[test]
fn start_is_the_outermost_frame() {
    let p = program();
    let (start, size) = p.symbol("_start");
    // glibc's _start marks the return address undefined; `call __libc_start_main` returns
    // to its last byte.
    assert_eq!(row_at(&p.table, start).cfa_type, CFA_END);
    assert_eq!(row_at(&p.table, start + size - 1).cfa_type, CFA_END);
    assert!(p.table.stats.end_rows >= 1);
}

#[test]
fn agrees_with_readelf_everywhere() {
    let p = program();
    let compared = compare_with_readelf(&p.path, &p.table, 1);
    assert!(compared >= 20, "only {compared} rows compared");
    let first = p.table.rows[0].pc;
    assert_eq!(p.table.lookup(first - 1), None);
    assert_eq!(p.table.stats.unsupported, 0);
    assert_eq!(p.table.stats.source, CfiSource::EhFrame);
}

#[test]
fn debug_frame_is_used_without_eh_frame() {
    let flags = [
        NO_FP,
        &[
            "-g",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
        ],
    ]
    .concat();
    let (dir, built) = program_with(&flags, &[]);
    let path = dir.path().join("prog-debug-frame");
    run(std::process::Command::new("objcopy")
        .args([
            "--remove-section=.eh_frame",
            "--remove-section=.eh_frame_hdr",
        ])
        .arg(&built)
        .arg(&path));
    let elf = std::fs::read(&path).unwrap();
    assert!(section(&elf, ".eh_frame").is_none());
    let table = build_table(&elf).unwrap();
    assert_well_formed(&table);
    assert_eq!(table.stats.source, CfiSource::DebugFrame);
    let (busy, size) = symbols(&elf)["busy"];
    let rows = rows_in(&table, busy, size);
    assert!(rows[0].same_rule(&rsp(8)));
    assert!(
        rows.iter()
            .any(|r| r.cfa_type == CFA_RSP && r.cfa_offset > 8 + 256)
    );
    assert!(compare_with_readelf(&path, &table, 1) >= 10);
}

#[test]
fn addresses_beyond_4_gib_are_refused() {
    // Still PIE (the default), linked to run at 4 GiB.
    let (_dir, path) = program_with(NO_FP, &["-Wl,-Ttext-segment=0x100000000"]);
    let elf = std::fs::read(&path).unwrap();
    match build_table(&elf) {
        Err(UnwindError::AddressTooLarge(a)) => assert!(a > u64::from(u32::MAX)),
        other => panic!("expected AddressTooLarge, got {other:?}"),
    }
}

#[test]
fn objects_without_cfi_or_not_elf_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("plain.c");
    std::fs::write(&src, FP_C).unwrap();
    let obj = dir.path().join("plain.o");
    run(std::process::Command::new("gcc")
        .args([
            "-O2",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-c",
        ])
        .arg(&src)
        .arg("-o")
        .arg(&obj));
    let elf = std::fs::read(&obj).unwrap();
    assert!(matches!(build_table(&elf), Err(UnwindError::NoCfi)));
    assert!(matches!(
        build_table(b"definitely not an ELF file"),
        Err(UnwindError::Object(_))
    ));
}

#[test]
fn cache_builds_each_key_once() {
    let p = program();
    let key = CacheKey::for_object(&p.elf, 1, 2, &p.path);
    assert!(matches!(key, CacheKey::BuildId(ref id) if id.len() >= 16));
    let mut cache = TableCache::new();
    let reads = Cell::new(0);
    let read = || {
        reads.set(reads.get() + 1);
        std::fs::read(&p.path)
    };
    let first = cache.get_or_build(&key, read).unwrap();
    let second = cache.get_or_build(&key, read).unwrap();
    assert_eq!(reads.get(), 1);
    assert!(Arc::ptr_eq(&first, &second));
    assert_eq!(*first, p.table);
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.tables), (1, 1, 1));
    assert_eq!(stats.bytes, p.table.bytes());
}

#[test]
fn cache_evicts_least_recently_used_over_budget() {
    let p = program();
    let mut cache = TableCache::with_budget(2 * p.table.bytes());
    let key = |n: u64| CacheKey::File {
        dev: 8,
        inode: n,
        path: p.path.clone(),
    };
    let read = || Ok(p.elf.as_slice());
    cache.get_or_build(&key(1), read).unwrap();
    cache.get_or_build(&key(2), read).unwrap();
    cache.get_or_build(&key(1), read).unwrap();
    cache.get_or_build(&key(3), read).unwrap();
    assert!(cache.contains(&key(1)) && cache.contains(&key(3)));
    assert!(!cache.contains(&key(2)));
    assert_eq!(cache.take_evicted(), vec![key(2)]);
    let stats = cache.stats();
    assert_eq!((stats.evictions, stats.tables), (1, 2));
    assert!(stats.bytes <= cache.budget());
}

#[test]
fn cache_evict_drops_the_table_and_failures_are_not_cached() {
    let p = program();
    let key = CacheKey::BuildId("feed".into());
    let mut cache = TableCache::new();
    let read = || Ok(p.elf.clone());
    cache.get_or_build(&key, read).unwrap();
    assert!(cache.evict(&key));
    assert!(!cache.evict(&key));
    assert!(!cache.contains(&key) && cache.is_empty());
    assert_eq!(cache.stats().bytes, 0);
    assert_eq!(cache.stats().removals, 1);
    assert!(
        cache.take_evicted().is_empty(),
        "explicit evictions are the caller's"
    );
    cache.get_or_build(&key, read).unwrap();
    assert_eq!(cache.stats().misses, 2);

    let missing = CacheKey::BuildId("missing".into());
    let err = cache.get_or_build(&missing, || std::fs::read("/nonexistent/object"));
    assert!(matches!(err, Err(UnwindError::Io(_))));
    assert!(!cache.contains(&missing));
    assert_eq!(cache.stats().failures, 1);
}

#[test]
fn frames_too_big_for_i16_are_unsupported_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let source = r#"
#include <string.h>
__attribute__((noinline)) int huge(const char *s) {
    char buf[40000];
    strcpy(buf, s);
    return buf[39999] + (int)strlen(buf);
}
int main(int argc, char **argv) { return huge(argv[0]); }
"#;
    let unit = Unit {
        name: "huge.c",
        source,
        flags: NO_FP,
    };
    let path = gcc(dir.path(), "huge", &[unit], &[]);
    let elf = std::fs::read(&path).unwrap();
    let table = build_table(&elf).unwrap();
    assert_well_formed(&table);
    let (huge, size) = symbols(&elf)["huge"];
    let rows = rows_in(&table, huge, size);
    assert!(rows[0].same_rule(&rsp(8)));
    assert!(
        rows.iter().any(|r| r.cfa_type == CFA_UNSUPPORTED),
        "{rows:?}"
    );
    assert!(table.stats.unsupported >= 1);
    compare_with_readelf(&path, &table, 1);
}
