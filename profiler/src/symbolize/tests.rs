//! Symbolizer tests against programs compiled at test time, so expected names, files and
//! lines are known by construction.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use object::{Object, ObjectSegment, ObjectSymbol};

use super::elf::FileCost;
use super::testutil::{TempDir, compile_c, compile_cxx, run};
use super::*;
use crate::os::procs::{ProcessRegistry, read_build_id};

/// (file offset, size) of a symbol in `.symtab` (or `.dynsym` when `dynamic`).
fn symbol(path: &Path, name: &str, dynamic: bool) -> (u64, u64) {
    let data = fs::read(path).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let mut syms = if dynamic {
        obj.dynamic_symbols()
    } else {
        obj.symbols()
    };
    let s = syms
        .find(|s| s.name() == Ok(name))
        .unwrap_or_else(|| panic!("{name} not in {}", path.display()));
    let va = s.address();
    let seg = obj
        .segments()
        .find(|g| g.address() <= va && va < g.address() + g.file_range().1)
        .unwrap();
    (va - seg.address() + seg.file_range().0, s.size())
}

/// A fake /proc where `pid` maps the whole of `bin` executable at 0x10_0000_0000.
fn fake_process(tmp: &TempDir, pid: u32, bin: &Path) -> (ProcessRegistry, u64) {
    let start = 0x10_0000_0000u64;
    let len = fs::metadata(bin).unwrap().len().div_ceil(4096) * 4096;
    let dir = tmp.path().join("proc").join(pid.to_string());
    fs::create_dir_all(&dir).unwrap();
    let maps = format!(
        "{start:x}-{:x} r-xp 00000000 00:00 0 {}\n",
        start + len,
        bin.display()
    );
    fs::write(dir.join("maps"), maps).unwrap();
    (
        ProcessRegistry::with_proc_root(tmp.path().join("proc")),
        start,
    )
}

const PROG: &str = r#"
static __attribute__((noinline)) int hidden_static(int x) {
    return x * 7 + 1;
}
__attribute__((noinline)) int known_function(int x) {
    return hidden_static(x) + 3;
}
int main(int argc, char **argv) { (void)argv; return known_function(argc); }
"#;

#[test]
fn names_a_function_from_its_file_offset() {
    let tmp = TempDir::new("sym-offset");
    let prog = compile_c(&tmp, "prog", PROG, &["-O0", "-g", "-Wl,--build-id"]);
    let (off, _) = symbol(&prog, "known_function", false);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    let frames = s.symbolize_elf(&prog, off + 4);
    assert_eq!(frames.len(), 1, "{frames:?}");
    let f = &frames[0];
    assert_eq!(f.function, "known_function");
    assert_eq!(f.kind, FrameKind::Native);
    assert!(!f.inlined);
    assert!(f.file.as_deref().unwrap().ends_with("prog.c"), "{f:?}");
    assert_eq!(f.line, Some(5));
    assert_eq!(f.address, off + 4);
    assert_eq!(f.build_id, read_build_id(&prog));
    assert_eq!(f.module.as_deref(), Some(prog.to_str().unwrap()));
    assert_eq!(s.stats().cache_misses, 1);
    assert_eq!(s.symbolize_elf(&prog, off + 4), frames);
    assert_eq!(s.stats().cache_hits, 1);
    assert_eq!(s.stats().symbolized, 2);

    // The ELF header is in the file but in no function.
    let unknown = s.symbolize_elf(&prog, 0x10);
    assert_eq!(unknown[0].function, "prog+0x10");
    assert_eq!(unknown[0].kind, FrameKind::Unknown);
    assert_eq!(s.stats().unsymbolized, 1);
}

/// The budget counts DWARF as the reader holds it: a compressed section inflated.
#[test]
fn dwarf_past_the_budget_is_left_unread_counting_it_inflated() {
    let tmp = TempDir::new("sym-dwarf-budget");
    let prog = compile_c(
        &tmp,
        "prog",
        PROG,
        &["-O0", "-g", "-gz=zlib", "-Wl,--build-id"],
    );
    let (off, _) = symbol(&prog, "known_function", false);
    let cost = FileCost::of(&prog);
    assert!(
        cost.dwarf_stored > 0 && cost.dwarf > cost.dwarf_stored,
        "compressed DWARF: {cost:?}"
    );
    let mut within = Symbolizer::new()
        .with_debug_dirs(vec![])
        .with_dwarf_budget(cost.dwarf);
    let f = &within.symbolize_elf(&prog, off + 4)[0];
    assert_eq!((f.function.as_str(), f.line), ("known_function", Some(5)));
    assert_eq!(within.stats().dwarf_skipped_files, 0);
    // Its stored (compressed) size fits, the inflated one does not.
    let mut past = Symbolizer::new()
        .with_debug_dirs(vec![])
        .with_dwarf_budget(cost.dwarf - 1);
    let f = &past.symbolize_elf(&prog, off + 4)[0];
    assert_eq!(f.function, "known_function", "named from .symtab");
    assert_eq!((f.file.as_deref(), f.line), (None, None), "no DWARF read");
    assert_eq!(past.stats().dwarf_skipped_files, 1);
    assert_eq!(past.symbolize_elf(&prog, off + 5)[0].line, None);
    assert_eq!(past.stats().dwarf_skipped_files, 1, "counted per opening");
}

/// The files open at once share the budget: one that does not fit in what the others left
/// is read without DWARF until it is let go, and what a let-go file held is free again.
#[test]
fn the_dwarf_budget_is_shared_by_the_files_open_at_once() {
    let tmp = TempDir::new("sym-dwarf-shared");
    let [a, b, c] = ["a", "b", "c"].map(|n| compile_c(&tmp, n, PROG, &["-O0", "-g"]));
    let (off, _) = symbol(&a, "known_function", false);
    let one = FileCost::of(&a).dwarf;
    assert!(one > 0);
    let mut s = Symbolizer::new()
        .with_debug_dirs(vec![])
        .with_dwarf_budget(one * 3 / 2);
    let line = |s: &mut Symbolizer, f: &Path, k: u64| s.symbolize_elf(f, off + k)[0].line;
    assert_eq!(line(&mut s, &a, 4), Some(5), "a fits");
    assert_eq!(line(&mut s, &b, 4), None, "b does not fit beside a");
    assert_eq!(s.stats().dwarf_skipped_files, 1);
    // b stays in use, a goes unused until it is let go.
    for k in 0..=KEEP_OPEN_PERIODS {
        line(&mut s, &b, 5 + k);
        s.release_files();
    }
    assert!(!s.is_open(&a) && s.is_open(&b));
    assert_eq!(line(&mut s, &b, 100), None, "b stays as it was opened");
    assert_eq!(line(&mut s, &c, 4), Some(5), "what a held is free for c");
    assert_eq!(s.stats().dwarf_skipped_files, 1);
}

/// A read still running when the wait for reads ran out leaves its frame unnamed for now and
/// counted; its answer is kept and names the frame when asked again, without reading again.
#[test]
fn a_read_past_the_wait_names_its_frame_when_asked_again() {
    let tmp = TempDir::new("sym-deferred");
    let prog = compile_c(&tmp, "prog", PROG, &["-O0", "-g"]);
    let (off, _) = symbol(&prog, "known_function", false);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    // No time left to wait: the layout read is started and not waited for.
    s.wait_for_reads_until(std::time::Instant::now());
    let first = &s.symbolize_elf(&prog, off + 4)[0];
    assert_ne!(first.function, "known_function", "{first:?}");
    assert_eq!(s.stats().deferred_reads, 1);
    // Asked again with time to wait: the layout's answer (kept meanwhile) and the copy's.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let named = loop {
        s.wait_for_reads_until(until);
        let f = s.symbolize_elf(&prog, off + 4)[0].clone();
        if f.function == "known_function" || std::time::Instant::now() > until {
            break f;
        }
    };
    assert_eq!(
        (named.function.as_str(), named.line),
        ("known_function", Some(5))
    );
    assert_eq!(s.stats().stalled_reads, 0);
    assert!(
        s.stats().deferred_reads <= 2,
        "the layout read once, the copy at most once: {:?}",
        s.stats()
    );
}

#[test]
fn inlined_function_yields_two_frames_with_lines() {
    let tmp = TempDir::new("sym-inline");
    let src = "static inline __attribute__((always_inline)) int inner(int x) { volatile int y = x * 3; return y + 1; }
__attribute__((noinline)) int outer(int x) {
    return inner(x) + 2;
}
int main(int argc, char **argv) { (void)argv; return outer(argc); }
";
    let prog = compile_c(&tmp, "inl", src, &["-O2", "-g"]);
    let (off, size) = symbol(&prog, "outer", false);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    let expanded = (off..off + size)
        .map(|o| s.symbolize_elf(&prog, o))
        .find(|f| f.len() == 2)
        .expect("some address of outer is inside the inlined inner");
    assert_eq!(expanded[0].function, "inner");
    assert!(expanded[0].inlined);
    assert_eq!(expanded[0].line, Some(1));
    assert!(expanded[0].file.as_deref().unwrap().ends_with("inl.c"));
    assert_eq!(expanded[1].function, "outer");
    assert!(!expanded[1].inlined);
    assert_eq!(expanded[1].line, Some(3), "call site of inner");
    assert_eq!(expanded[0].address, expanded[1].address);
}

/// `prog` built with debug info, its debug-only copy and a stripped copy, and the file offset
/// of `hidden_static` (not in `.dynsym`, so only the debug file can name it).
fn stripped_fixture(tmp: &TempDir) -> (PathBuf, PathBuf, u64) {
    let prog = compile_c(tmp, "prog", PROG, &["-O0", "-g", "-Wl,--build-id"]);
    let debug = tmp.path().join("prog.debug");
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&prog)
        .arg(&debug));
    let stripped = tmp.path().join("stripped");
    run(Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&stripped)
        .arg(&prog));
    let (off, _) = symbol(&prog, "hidden_static", false);
    (stripped, debug, off)
}

/// Puts a copy of `debug` where a debug dir under `tmp` holds it for `stripped`'s build id:
/// (that debug dir, the copy).
fn place_by_build_id(tmp: &TempDir, stripped: &Path, debug: &Path) -> (PathBuf, PathBuf) {
    let id = read_build_id(stripped).expect("build-id");
    let debug_dir = tmp.path().join("debug");
    let by_id = debug_dir.join(".build-id").join(&id[..2]);
    fs::create_dir_all(&by_id).unwrap();
    let placed = by_id.join(format!("{}.debug", &id[2..]));
    fs::copy(debug, &placed).unwrap();
    (debug_dir, placed)
}

#[test]
fn stripped_binary_uses_debug_file_found_by_build_id() {
    let tmp = TempDir::new("sym-buildid");
    let (stripped, debug, off) = stripped_fixture(&tmp);
    let id = read_build_id(&stripped).expect("build-id");
    let (debug_dir, _) = place_by_build_id(&tmp, &stripped, &debug);

    let mut without = Symbolizer::new().with_debug_dirs(vec![]);
    assert_eq!(
        without.symbolize_elf(&stripped, off)[0].function,
        format!("stripped+0x{off:x}")
    );
    let mut with = Symbolizer::new().with_debug_dirs(vec![debug_dir]);
    let f = &with.symbolize_elf(&stripped, off)[0];
    assert_eq!(f.function, "hidden_static");
    assert_eq!(f.line, Some(2));
    assert_eq!(f.build_id.as_deref(), Some(id.as_str()));
}

#[test]
fn stripped_binary_uses_debuglink_with_matching_crc() {
    let tmp = TempDir::new("sym-debuglink");
    let (stripped, debug, off) = stripped_fixture(&tmp);
    let bin_dir = tmp.path().join("bin");
    fs::create_dir_all(bin_dir.join(".debug")).unwrap();
    let linked = bin_dir.join("linked");
    run(Command::new("objcopy")
        .arg(format!("--add-gnu-debuglink={}", debug.display()))
        .arg(&stripped)
        .arg(&linked));
    let name = |s: &mut Symbolizer| s.symbolize_elf(&linked, off)[0].function.clone();

    // <bin dir>/.debug/<link>
    fs::copy(&debug, bin_dir.join(".debug/prog.debug")).unwrap();
    assert_eq!(
        name(&mut Symbolizer::new().with_debug_dirs(vec![])),
        "hidden_static"
    );

    // <debug dir>/<bin dir>/<link>
    fs::remove_file(bin_dir.join(".debug/prog.debug")).unwrap();
    let debug_dir = tmp.path().join("debug");
    let under = debug_dir.join(bin_dir.strip_prefix("/").unwrap());
    fs::create_dir_all(&under).unwrap();
    fs::copy(&debug, under.join("prog.debug")).unwrap();
    assert_eq!(
        name(&mut Symbolizer::new().with_debug_dirs(vec![debug_dir.clone()])),
        "hidden_static"
    );

    // A debug file whose CRC does not match the link is not used.
    let mut bytes = fs::read(&debug).unwrap();
    bytes.push(0);
    fs::write(under.join("prog.debug"), bytes).unwrap();
    assert_eq!(
        name(&mut Symbolizer::new().with_debug_dirs(vec![debug_dir])),
        format!("linked+0x{off:x}")
    );
}

/// A debug file is read for its symbols only if it is the file whose build id was checked:
/// one renamed over it after the check (a program whose function at the same offset is
/// `canary_static`) is refused and counted, and the frame keeps its module and offset.
#[test]
fn a_debug_file_replaced_after_its_check_is_not_read() {
    let tmp = TempDir::new("sym-replaced");
    let (stripped, debug, off) = stripped_fixture(&tmp);
    let (debug_dir, placed) = place_by_build_id(&tmp, &stripped, &debug);
    let canary = compile_c(
        &tmp,
        "canary",
        &PROG.replace("hidden_static", "canary_static"),
        &["-O0", "-g", "-Wl,--build-id"],
    );
    assert_eq!(
        symbol(&canary, "canary_static", false).0,
        off,
        "the canary's function must sit where hidden_static does, for its name to show if read"
    );
    let canary_debug = tmp.path().join("canary.debug");
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&canary)
        .arg(&canary_debug));

    let mut control = Symbolizer::new().with_debug_dirs(vec![debug_dir.clone()]);
    assert_eq!(
        control.symbolize_elf(&stripped, off)[0].function,
        "hidden_static"
    );

    let mut s = Symbolizer::new().with_debug_dirs(vec![debug_dir]);
    let key = BinaryKey::Path(stripped.clone());
    let seen = stripped.to_string_lossy().to_string();
    let info = s
        .elf_info(0, &key, &stripped, stripped.parent(), &seen, None, None)
        .ok()
        .flatten()
        .expect("the stripped binary's layout");
    assert_eq!(info.source, placed, "found by build id");
    fs::rename(&canary_debug, &placed).unwrap();
    let resolved = s.resolve(0, &info, off).ok().flatten();
    assert!(
        resolved.is_none(),
        "read the file put there since: {resolved:?}"
    );
    assert_eq!(s.stats().refused_files, 1);
}

#[test]
fn return_addresses_are_looked_up_one_byte_back() {
    let tmp = TempDir::new("sym-ret");
    let prog = compile_c(&tmp, "prog", PROG, &["-O0", "-g"]);
    let (off, size) = symbol(&prog, "known_function", false);
    let (mut reg, start) = fake_process(&tmp, 31337, &prog);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    let end = start + off + size;
    // As a leaf, the byte after known_function is not known_function...
    let leaf = s.user(&mut reg, 31337, &[end]);
    assert_ne!(leaf[0].function, "known_function");
    // ...but as a return address (a call ending the function) it is.
    let frames = s.user(&mut reg, 31337, &[start + off, end, 0x42]);
    assert_eq!(frames.len(), 3, "{frames:?}");
    assert_eq!(frames[0].function, "known_function");
    assert_eq!(frames[1].function, "known_function");
    assert_eq!(frames[1].address, off + size, "un-adjusted file offset");
    assert_eq!(frames[1].module.as_deref(), Some(prog.to_str().unwrap()));
    assert_eq!(frames[2].function, UNKNOWN);
    assert_eq!(frames[2].kind, FrameKind::Unknown);
}

/// A fake process `pid` under `tmp/proc` with anonymous executable memory at 0x7f0000000000
/// and a root of its own; returns where its perf map goes in that root.
fn jit_process(tmp: &TempDir, pid: u32) -> PathBuf {
    let dir = tmp.path().join("proc").join(pid.to_string());
    fs::create_dir_all(&dir).unwrap();
    fs::write(
        dir.join("maps"),
        "7f0000000000-7f0000100000 rwxp 00000000 00:00 0 \n",
    )
    .unwrap();
    let rootfs = tmp.path().join("rootfs");
    fs::create_dir_all(rootfs.join("tmp")).unwrap();
    std::os::unix::fs::symlink(&rootfs, dir.join("root")).unwrap();
    rootfs.join(format!("tmp/perf-{pid}.map"))
}

#[test]
fn jit_frames_come_from_the_perf_map_through_the_process_root() {
    let tmp = TempDir::new("sym-jit");
    let pid = 4_000_123;
    let map = jit_process(&tmp, pid);
    fs::write(
        &map,
        "7f0000001000 100 jitted_a\n0x7f0000002000 0x10 jitted b\n",
    )
    .unwrap();

    let mut reg = ProcessRegistry::with_proc_root(tmp.path().join("proc"));
    let mut s = Symbolizer::new().with_perf_map_interval(Duration::from_secs(3600));
    let f = s.user(&mut reg, pid, &[0x7f0000001010, 0x7f0000002010]);
    assert_eq!(f[0].function, "jitted_a");
    assert_eq!(f[0].kind, FrameKind::Jit);
    assert_eq!(f[0].address, 0x7f0000001010);
    assert_eq!(f[1].function, "jitted b", "return address at the end of b");

    fs::write(&map, "7f0000001000 100 jitted_a\n7f0000003000 10 later\n").unwrap();
    let f = s.user(&mut reg, pid, &[0x7f0000003004]);
    assert_eq!(f[0].function, UNKNOWN, "re-read is rate-limited");
    assert_eq!(f[0].module.as_deref(), Some("[anon]"));
    let mut s = s.with_perf_map_interval(Duration::ZERO);
    assert_eq!(
        s.user(&mut reg, pid, &[0x7f0000003004])[0].function,
        "later"
    );
}

/// What was read for a process (its perf map) and its binaries goes once the registry has
/// forgotten them, and a binary met again is read again.
#[test]
fn forget_exited_lets_go_of_gone_processes_and_binaries() {
    let tmp = TempDir::new("sym-forget");
    let prog = compile_c(&tmp, "prog", PROG, &["-O0", "-g"]);
    let (off, _) = symbol(&prog, "known_function", false);
    let pid = 4_000_321;
    let (mut reg, start) = fake_process(&tmp, pid, &prog);
    let dir = tmp.path().join("proc").join(pid.to_string());
    fs::write(dir.join("stat"), format!("{pid} (prog) R 1 0 0")).unwrap();
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    // A file address (its binary read), and one in no mapping (its perf map looked for).
    let f = s.user(&mut reg, pid, &[start + off + 4, 0x7f00_0000_0000]);
    assert_eq!(f[0].function, "known_function");
    assert_eq!(s.held(), (1, 1));
    reg.forget_exited();
    s.forget_exited(&reg);
    assert_eq!(s.held(), (1, 1), "alive: kept");

    fs::remove_dir_all(&dir).unwrap();
    reg.forget_exited();
    s.forget_exited(&reg);
    assert_eq!(s.held(), (0, 0), "gone: let go");

    let (mut reg, start) = fake_process(&tmp, pid + 1, &prog);
    // A new address (one already symbolized is answered from the results).
    let f = s.user(&mut reg, pid + 1, &[start + off + 5]);
    assert_eq!(f[0].function, "known_function", "read again");
    assert_eq!(s.held(), (0, 1));
}

#[test]
fn live_process_function_and_shared_libc_cache() {
    let tmp = TempDir::new("sym-live");
    let src = r#"#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) int live_target(int x) { return x + getpid(); }
int main(void) { printf("%p\n", (void *)live_target); fflush(stdout); sleep(10); return live_target(1); }
"#;
    let prog = compile_c(&tmp, "live", src, &["-O0", "-g"]);
    let mut child = Command::new(&prog).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = u64::from_str_radix(line.trim().trim_start_matches("0x"), 16).unwrap();
    let pid = child.id();

    let mut reg = ProcessRegistry::new();
    let mut s = Symbolizer::new();
    let f = s.user(&mut reg, pid, &[addr + 1]);
    assert_eq!(f[0].function, "live_target", "{f:?}");
    assert_eq!(f[0].module.as_deref(), Some(prog.to_str().unwrap()));
    assert!(f[0].build_id.is_some());

    // getpid in libc: symbolized once, answered from the cache for the second process.
    let me = std::process::id();
    reg.observe(me).unwrap();
    let libc = |reg: &ProcessRegistry, pid| {
        reg.get(pid)
            .unwrap()
            .mappings()
            .iter()
            .find(|m| m.path.contains("libc.so"))
            .unwrap()
            .clone()
    };
    let lm = libc(&reg, me);
    let (goff, _) = symbol(lm.binary().unwrap().path(), "getpid", true);
    let misses = s.stats().cache_misses;
    for p in [me, pid] {
        let m = libc(&reg, p);
        let f = s.user(&mut reg, p, &[m.start + goff - m.offset]);
        assert!(f[0].function.contains("getpid"), "{f:?}");
        assert_eq!(f[0].address, goff);
    }
    assert_eq!(s.stats().cache_misses, misses + 1);
    child.kill().unwrap();
    child.wait().unwrap();
    // The process is gone; what was recorded still symbolizes.
    let f = s.user(&mut reg, pid, &[addr]);
    assert_eq!(f[0].function, "live_target");
}

#[test]
fn vdso_functions_are_named() {
    let Some(vdso) = elf::Vdso::read_self() else {
        skip_ledger::skip("vdso", "cannot read our own vDSO");
        return;
    };
    let (name, off) = vdso.symbols().next().expect("vDSO exports functions");
    let me = std::process::id();
    let mut reg = ProcessRegistry::new();
    reg.observe(me).unwrap();
    let m = reg
        .get(me)
        .unwrap()
        .mappings()
        .iter()
        .find(|m| m.kind == MappingKind::Vdso)
        .unwrap()
        .clone();
    let mut s = Symbolizer::new();
    let f = s.user(&mut reg, me, &[m.start + off - m.offset]);
    assert_eq!(f[0].function, name);
    assert_eq!(f[0].module.as_deref(), Some("[vdso]"));
    assert_eq!(f[0].kind, FrameKind::Native);
}

#[test]
fn kernel_addresses_from_kallsyms() {
    let text = fs::read_to_string("/proc/kallsyms").unwrap_or_default();
    let addr_of = |name: &str| {
        text.lines().find_map(|l| {
            let mut p = l.split_whitespace();
            let a = p.next()?;
            let _ = p.next()?;
            (p.next()? == name).then(|| u64::from_str_radix(a, 16).unwrap())
        })
    };
    let Some(addr) = addr_of("do_sys_openat2").filter(|&a| a != 0) else {
        skip_ledger::skip(
            "kallsyms",
            "/proc/kallsyms shows no address for do_sys_openat2",
        );
        return;
    };
    let aliases: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{addr:016x} ")))
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    let mut s = Symbolizer::new();
    assert!(s.kernel_available() && !s.kernel_restricted());
    let f = s.kernel(&[addr + 2, addr + 1]);
    for frame in &f {
        assert!(
            aliases.contains(&frame.function.as_str()),
            "{frame:?} {aliases:?}"
        );
        assert_eq!(frame.kind, FrameKind::Kernel);
        assert_eq!(frame.module.as_deref(), Some(KERNEL_MODULE));
    }
    assert_eq!(f[1].address, addr + 1);
}

#[test]
fn kernel_return_addresses_use_the_calling_function() {
    let tmp = TempDir::new("sym-kall");
    let path = tmp.path().join("kallsyms");
    fs::write(
        &path,
        "ffffffff81001000 T first\nffffffff81002000 t second\n",
    )
    .unwrap();
    let mut s = Symbolizer::new().with_kallsyms(&path);
    let f = s.kernel(&[0xffffffff81002000, 0xffffffff81002000, 0x10]);
    let names: Vec<&str> = f.iter().map(|f| f.function.as_str()).collect();
    assert_eq!(names, ["second", "first", UNKNOWN]);
    assert_eq!(f[2].kind, FrameKind::Unknown);
    assert_eq!((s.stats().symbolized, s.stats().unsymbolized), (2, 1));

    let hidden = tmp.path().join("hidden");
    fs::write(&hidden, "0000000000000000 T first\n").unwrap();
    let mut s = Symbolizer::new().with_kallsyms(&hidden);
    assert!(!s.kernel_available());
    assert!(s.kernel_restricted());
}

#[test]
fn cxx_names_are_demangled() {
    let tmp = TempDir::new("sym-cxx");
    let src = "namespace ns { struct Klass { int method(int x); };
__attribute__((noinline)) int Klass::method(int x) { return x * 2 + 1; } }
int main(int argc, char **) { ns::Klass k; return k.method(argc); }
";
    for (name, args) in [("plain", &["-O0"][..]), ("dwarf", &["-O0", "-g"][..])] {
        let prog = compile_cxx(&tmp, name, src, args);
        let (off, _) = symbol(&prog, "_ZN2ns5Klass6methodEi", false);
        let f = Symbolizer::new().symbolize_elf(&prog, off + 1);
        assert!(
            f[0].function.starts_with("ns::Klass::method"),
            "{name}: {f:?}"
        );
        if name == "plain" {
            assert_eq!(f[0].function, "ns::Klass::method(int)");
        }
    }
}

#[test]
fn release_files_keeps_files_in_use_within_the_budget() {
    let tmp = TempDir::new("sym-release");
    let prog = compile_c(&tmp, "prog", PROG, &["-O0", "-g"]);
    let (known, _) = symbol(&prog, "known_function", false);
    let (hidden, _) = symbol(&prog, "hidden_static", false);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    assert_eq!(s.symbolize_elf(&prog, known)[0].function, "known_function");
    assert_eq!(s.open_files(), 1);
    s.release_files();
    assert_eq!(s.open_files(), 1, "used in the period: stays open");
    // A new address of a kept file is read from the open file (and named right).
    assert_eq!(s.symbolize_elf(&prog, hidden)[0].function, "hidden_static");
    // Kept through periods without a new address, up to KEEP_OPEN_PERIODS of them.
    for _ in 0..KEEP_OPEN_PERIODS {
        s.release_files();
        assert_eq!(
            s.open_files(),
            1,
            "used within KEEP_OPEN_PERIODS: stays open"
        );
    }
    s.release_files();
    assert_eq!(s.open_files(), 0, "unused for KEEP_OPEN_PERIODS: let go");
    // Opened again on a later miss.
    assert_eq!(
        s.symbolize_elf(&prog, hidden + 1)[0].function,
        "hidden_static"
    );
    assert_eq!(s.open_files(), 1);

    // A file bigger than the budget is let go even though it was used.
    let pad = KEEP_OPEN_BYTES + (1 << 20);
    let big_src = format!("__attribute__((used)) static const char pad[{pad}] = {{1}};\n{PROG}");
    let big = compile_c(&tmp, "big", &big_src, &["-O0", "-g"]);
    let (big_known, _) = symbol(&big, "known_function", false);
    assert_eq!(
        s.symbolize_elf(&big, big_known)[0].function,
        "known_function"
    );
    assert_eq!(s.open_files(), 2);
    s.release_files();
    assert_eq!(s.open_files(), 1, "prog kept, big over the budget let go");
    s.symbolize_elf(&prog, hidden + 2);
    s.release_files();
    assert_eq!(s.open_files(), 1, "big not reopened: prog only");
}

/// Within the budget the most recently used files stay: of two files not used in this period,
/// the one used in the one before stays rather than the one used earlier.
#[test]
fn release_files_prefers_the_most_recently_used() {
    let tmp = TempDir::new("sym-release-recent");
    // Three files, any two of which fit in the budget.
    let pad = KEEP_OPEN_BYTES * 2 / 5;
    let src = format!("__attribute__((used)) static const char pad[{pad}] = {{1}};\n{PROG}");
    let [a, b, c] = ["a", "b", "c"].map(|n| compile_c(&tmp, n, &src, &["-O0", "-g"]));
    let (known, _) = symbol(&a, "known_function", false);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    for (i, f) in [&a, &b, &c].into_iter().enumerate() {
        // Each used in a period of its own, `a` the most.
        for k in 0..(3 - i as u64) * 4 {
            s.symbolize_elf(f, known + k);
        }
        s.release_files();
    }
    assert_eq!(s.open_files(), 2);
    assert!(s.is_open(&c) && s.is_open(&b), "the two most recent kept");
    assert!(!s.is_open(&a), "the oldest let go");
}

/// A perf map the process made a FIFO (which a blocking open would wait on forever) or a link
/// to a host file is refused and counted; the JIT frame is left unnamed.
#[test]
fn hostile_perf_maps_are_refused_without_hanging() {
    let tmp = TempDir::new("sym-jit-hostile");
    let pid = 4_000_124;
    let map = jit_process(&tmp, pid);
    let canary = tmp.path().join("canary.map");
    fs::write(&canary, "7f0000001000 100 host_canary\n").unwrap();

    let fifo = std::ffi::CString::new(map.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let mut reg = ProcessRegistry::with_proc_root(tmp.path().join("proc"));
    let mut s = Symbolizer::new().with_perf_map_interval(Duration::ZERO);
    let f = s.user(&mut reg, pid, &[0x7f0000001010]);
    assert_eq!(f[0].function, UNKNOWN);
    assert_eq!(s.stats().refused_files, 1);

    fs::remove_file(&map).unwrap();
    std::os::unix::fs::symlink(&canary, &map).unwrap();
    let f = s.user(&mut reg, pid, &[0x7f0000001010]);
    assert_eq!(
        f[0].function, UNKNOWN,
        "the host file behind the link is not read"
    );
    assert_eq!(s.stats().refused_files, 2);
}

/// blazesym reads the profiler's copy of a binary, never a mapping of the file: a binary
/// truncated after it was opened still has its functions named from the copy, one truncated
/// before it is opened costs its names, and neither raises SIGBUS in the profiler.
#[test]
fn a_binary_truncated_under_the_symbolizer_is_no_sigbus() {
    let tmp = TempDir::new("sym-truncate");
    let prog = compile_c(&tmp, "prog", PROG, &["-O0", "-g"]);
    let (known, _) = symbol(&prog, "known_function", false);
    let (hidden, _) = symbol(&prog, "hidden_static", false);
    let mut s = Symbolizer::new().with_debug_dirs(vec![]);
    assert_eq!(s.symbolize_elf(&prog, known)[0].function, "known_function");
    fs::File::options()
        .write(true)
        .open(&prog)
        .unwrap()
        .set_len(200)
        .unwrap();
    // A mapping of the file would fault on any page past the first now.
    let f = &s.symbolize_elf(&prog, hidden)[0];
    assert_eq!(f.function, "hidden_static");
    assert_eq!(f.line, Some(2), "{f:?}");
    let mut fresh = Symbolizer::new().with_debug_dirs(vec![]);
    let f = &fresh.symbolize_elf(&prog, known)[0];
    assert_eq!(f.kind, FrameKind::Unknown, "{f:?}");
}

/// A process whose perf map costs more than its budget is degraded: once found over it, each
/// of its user stacks is one `[budget]` frame, its perf map is let go, and it is counted once;
/// a process within the budget beside it keeps its names.
#[test]
fn a_process_over_its_budget_has_budget_frames_and_is_counted() {
    let tmp = TempDir::new("sym-budget");
    let (big, small) = (4_000_321, 4_000_322);
    let map = jit_process(&tmp, big);
    let lines: String = (0..2000u64)
        .map(|i| {
            format!(
                "{:x} 10 jitted_function_number_{i}\n",
                0x7f00_0000_1000 + i * 16
            )
        })
        .collect();
    fs::write(&map, lines).unwrap();
    let small_dir = tmp.path().join("proc").join(small.to_string());
    fs::create_dir_all(&small_dir).unwrap();
    fs::copy(
        tmp.path().join("proc").join(big.to_string()).join("maps"),
        small_dir.join("maps"),
    )
    .unwrap();
    std::os::unix::fs::symlink(tmp.path().join("rootfs"), small_dir.join("root")).unwrap();
    fs::write(
        tmp.path().join(format!("rootfs/tmp/perf-{small}.map")),
        "7f0000001000 100 small_jitted\n",
    )
    .unwrap();

    let mut reg = ProcessRegistry::with_proc_root(tmp.path().join("proc"));
    let mut s = Symbolizer::new()
        .with_perf_map_interval(Duration::from_secs(3600))
        .with_process_budget(64 << 10);
    // Read (and named) once; the read puts it over its budget.
    let f = s.user(&mut reg, big, &[0x7f0000001004]);
    assert_eq!(f[0].function, "jitted_function_number_0");
    assert_eq!(s.stats().processes_over_budget, 0);
    for _ in 0..3 {
        let f = s.user(&mut reg, big, &[0x7f0000001004, 0x7f0000001014]);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].function, OVER_BUDGET);
        assert_eq!(f[0].kind, FrameKind::Budget);
    }
    assert_eq!(s.stats().processes_over_budget, 1, "counted once");
    assert_eq!(s.held().0, 0, "its perf map was let go");
    let f = s.user(&mut reg, small, &[0x7f0000001004]);
    assert_eq!(f[0].function, "small_jitted");
    let f = s.user(&mut reg, small, &[0x7f0000001004]);
    assert_eq!(f[0].kind, FrameKind::Jit, "within its budget");
}
