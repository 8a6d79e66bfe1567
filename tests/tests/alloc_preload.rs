//! The preloaded sampler library (libpyrometer_alloc.so, alloc-preload/) under
//! `record --alloc -- CMD`: only sampled allocations and the frees of sampled blocks reach the
//! kernel, and the estimates hold through realloc, a fork + exec'd child, threads that exit
//! and a library loaded with dlopen. Ground truth is what the fixtures print they did.
//! Needs root (BPF, uprobes).

use pyrometer_e2e::alloc::{
    by_function, fixture_totals, install_preload, leak_report, read_stats, record_allocs,
    record_command, record_command_env,
};
use pyrometer_e2e::*;

/// Within ±20 % of the truth. At the default rate a function here gets ~350 samples, one
/// standard error ~5 %: ±15 % (under three) failed about one run in twenty across these tests.
fn assert_estimate(what: &str, got: f64, want: f64, stderr: &str) {
    assert!(
        (got - want).abs() <= 0.20 * want,
        "{what}: estimated {got:.0} bytes, allocated {want:.0}\n{stderr}"
    );
    println!("{what}: estimated {got:.0} of {want:.0} bytes");
}

/// The recording went through the library, not the uprobe fallback.
fn assert_preloaded(stderr: &str) {
    assert!(
        !stderr.contains("sampled with uprobes"),
        "the library was not preloaded\n{stderr}"
    );
}

/// The recording went through the library, and its estimate of each of `functions`' allocated
/// bytes is within ±20 % of what the fixture printed it allocated.
fn assert_preloaded_estimates(
    result: &std::process::Output,
    out: &std::path::Path,
    functions: &[&str],
) {
    let err = stderr(result);
    assert_preloaded(&err);
    let truth = fixture_totals(&result.stdout);
    let p = read_pprof(out);
    let samples = pprof_samples(&p);
    let space = pprof_type(&p, "alloc_space");
    for &f in functions {
        assert_estimate(f, by_function(&samples, space, f), truth[f].1, &err);
    }
}

/// The fixture frees ~50k blocks; the kernel hears of the sampled ones only: never more frees
/// than sampled allocations, and a small fraction of the frees made.
#[test]
fn unsampled_frees_never_reach_the_kernel() {
    if !privileged() {
        return;
    }
    let stats = scratch("alloc-preload-frees-stats").join("stats.json");
    let (result, _) = record_allocs(
        "alloc-preload-frees",
        &["--alloc", "--stats", stats.to_str().unwrap()],
        &["totals", "0.5"],
    );
    let err = stderr(&result);
    assert_preloaded(&err);
    // The fixture's allocator calls: an allocation and a free each.
    let calls: f64 = err
        .lines()
        .find_map(|l| l.strip_prefix("calls "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no calls line\n{err}"));
    let frees = calls / 2.0;
    let json = read_stats(&stats);
    let reported = json["alloc_preload_frees"].as_f64().unwrap();
    let sampled = json["alloc_kernel_samples"].as_f64().unwrap();
    println!("{frees} frees made, {reported} reported, {sampled} allocations sampled");
    assert!(
        reported > 0.0,
        "the frees of sampled blocks are reported\n{err}"
    );
    assert!(
        reported <= sampled,
        "{reported} frees reached the kernel for {sampled} sampled blocks\n{err}"
    );
    assert!(
        reported < 0.05 * frees,
        "{reported} of {frees} frees reached the kernel\n{err}"
    );
}

/// A command that lives a few milliseconds (a twentieth of the totals work): the library holds
/// it between the dynamic loader's work and its main until record has loaded the unwind
/// tables of its libraries, so every allocation's stack is unwound to the outermost frame.
/// Without the hold record learns of libc's mapping only from the first samples that pass
/// through it, and most of this command's stacks stopped there ("no mapping").
#[test]
fn a_short_command_is_unwound_from_its_first_allocation() {
    if !privileged() {
        return;
    }
    let stats = scratch("alloc-preload-short-stats").join("stats.json");
    let (result, out) = record_allocs(
        "alloc-preload-short",
        &["--alloc", "--stats", stats.to_str().unwrap()],
        &["totals", "0.05"],
    );
    let err = stderr(&result);
    assert_preloaded(&err);
    let json = read_stats(&stats);
    let walked = json["unwind_samples"].as_f64().unwrap();
    let complete = json["unwind_complete"].as_f64().unwrap();
    let no_mapping = json["unwind_no_mapping"].as_f64().unwrap();
    println!("{complete} of {walked} stacks complete, {no_mapping} stopped at an unknown mapping");
    assert!(walked >= 20.0, "too few samples to judge: {walked}\n{err}");
    assert!(
        no_mapping == 0.0 && complete >= 0.97 * walked,
        "{complete} of {walked} stacks complete, {no_mapping} stopped at an unknown mapping\n{err}"
    );
    // Named, not estimated: a twentieth of the work is ~60 samples of make_600.
    let p = read_pprof(&out);
    let named = by_function(
        &pprof_samples(&p),
        pprof_type(&p, "alloc_space"),
        "make_600",
    );
    assert!(named > 0.0, "no allocation under make_600\n{err}");
}

/// keep_1k() keeps 102400 blocks of 1 KiB, regrow() resizes each to 2 KiB, drop_half() frees
/// every other one (sampled every 64 KiB, ~800 blocks in use sampled, for a tight estimate):
/// a sampled block's in-use entry moves with its resize, so what is in use is
/// 51200 blocks of 2 KiB under keep_1k(), the stack that allocated them (estimated within
/// ±20 %, objects and bytes: the weight stays the 1 KiB allocation's, the size is the new
/// one), the freed half is gone, and nothing is in use under regrow(). The resizes count as
/// allocations under regrow() (200 MiB), once: keep_1k() allocated its 100 MiB only.
#[test]
fn realloc_moves_sampled_blocks() {
    check_realloc_moves(false);
}

/// The same through uprobes on the allocator (the library hidden): the views are the same.
#[test]
fn realloc_moves_sampled_blocks_through_uprobes() {
    check_realloc_moves(true);
}

fn check_realloc_moves(uprobes: bool) {
    if !privileged() {
        return;
    }
    let name = format!("alloc-preload-regrow-{uprobes}");
    let stats = scratch(&format!("{name}-stats")).join("stats.json");
    let bin = fixture("allocs");
    let hidden = [("PYROMETER_ALLOC_LIB", "/nonexistent/libpyrometer_alloc.so")];
    let mut args = vec![
        "--leaks",
        "--min-age",
        "1s",
        "--alloc-sample-bytes",
        "65536",
        "--stats",
        stats.to_str().unwrap(),
    ];
    if uprobes {
        args.push("--alloc-uprobes");
    }
    let (result, out) = record_command_env(
        &name,
        &args,
        &[bin.to_str().unwrap(), "regrow"],
        if uprobes { &hidden } else { &[] },
    );
    let err = stderr(&result);
    if uprobes {
        assert!(err.contains("sampled with uprobes"), "{err}");
    } else {
        assert_preloaded(&err);
    }
    let truth = fixture_totals(&result.stdout);
    let p = read_pprof(&out);
    let samples = pprof_samples(&p);
    let (inuse, objects) = (
        pprof_type(&p, "inuse_space"),
        pprof_type(&p, "inuse_objects"),
    );
    // keep_1k() also holds its array of 102400 pointers (800 KiB, 0.8 % of the blocks).
    let (kept, kept_objects) = (
        by_function(&samples, inuse, "keep_1k"),
        by_function(&samples, objects, "keep_1k"),
    );
    let (want, want_objects) = (
        truth["drop_half"].1,
        truth["regrow"].0 - truth["drop_half"].0,
    );
    assert_estimate("in use under keep_1k", kept, want, &err);
    assert!(
        (kept_objects - want_objects).abs() <= 0.2 * want_objects,
        "keep_1k: {kept_objects:.0} blocks in use, {want_objects:.0} kept\n{err}"
    );
    let regrown = by_function(&samples, inuse, "regrow");
    assert!(
        regrown < 0.02 * want,
        "regrow: {regrown:.0} bytes in use: the resized blocks belong to keep_1k\n{err}"
    );
    let space = pprof_type(&p, "alloc_space");
    assert_estimate(
        "allocated by regrow",
        by_function(&samples, space, "regrow"),
        truth["regrow"].1,
        &err,
    );
    assert_estimate(
        "allocated by keep_1k",
        by_function(&samples, space, "keep_1k"),
        truth["keep_1k"].1,
        &err,
    );
    let json = read_stats(&stats);
    // Each sampled 1 KiB block moved once.
    let moves = json["alloc_moves"].as_f64().unwrap();
    let sampled = truth["keep_1k"].0 * (1.0 - (-1024.0f64 / 65536.0).exp());
    assert!(
        (moves - sampled).abs() <= 0.25 * sampled,
        "{moves} moves of ~{sampled:.0} sampled blocks\n{err}"
    );
    assert!(
        leak_report(&err)
            .first()
            .is_some_and(|l| l.contains("keep_1k")),
        "{err}"
    );
}

/// `sh -c 'allocs totals; true'` forks and execs the fixture: the child inherits the library
/// and its allocations are estimated as well as the command's own.
#[test]
fn a_forked_and_execed_child_keeps_sampling() {
    if !privileged() {
        return;
    }
    let script = format!("{} totals; true", fixture("allocs").display());
    let (result, out) = record_command(
        "alloc-preload-child",
        &["--alloc"],
        &["/bin/sh", "-c", &script],
    );
    assert_preloaded_estimates(&result, &out, &["make_200", "make_600"]);
}

/// `record --alloc -- launch.sh`, a `#!` shell script that runs the fixture: the script is
/// no ELF file, but its interpreter and the command it starts inherit `LD_PRELOAD`, so both
/// sample in process: the estimates hold and no uprobe goes on any allocator.
#[test]
fn a_launcher_script_is_preloaded() {
    if !privileged() {
        return;
    }
    let dir = scratch("alloc-preload-script-files");
    let (stats, script) = (dir.join("stats.json"), dir.join("launch.sh"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\"{}\" totals\necho launched\n",
            fixture("allocs").display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (result, out) = record_command(
        "alloc-preload-script",
        &["--alloc", "--stats", stats.to_str().unwrap()],
        &[script.to_str().unwrap()],
    );
    assert_preloaded_estimates(&result, &out, &["make_200", "make_600"]);
    let json = read_stats(&stats);
    assert_eq!(json["alloc_uprobes"], 0, "no allocator uprobes\n{json}");
    assert_eq!(json["alloc_preload_libraries"], 1, "{json}");
    assert!(
        json["alloc_preload_frees"].as_u64().unwrap() > 0,
        "the sampled frees came through the library\n{json}"
    );
}

/// Four threads, one after the other, each allocate 100 MB and exit: what they allocated is
/// all there after they are gone.
#[test]
fn threads_that_exit_lose_nothing() {
    if !privileged() {
        return;
    }
    let (result, out) = record_allocs("alloc-preload-threads", &["--alloc"], &["threads"]);
    assert_preloaded_estimates(&result, &out, &["thread_work"]);
}

/// dlopener loads libdlalloc.so after it started and calls it for a second: the library's
/// allocations (through the same malloc) are sampled and named.
#[test]
fn a_dlopened_library_is_sampled() {
    if !privileged() {
        return;
    }
    let (lib, bin) = (fixture("libdlalloc.so"), fixture("dlopener"));
    let (result, out) = record_command(
        "alloc-preload-dlopen",
        &["--alloc"],
        &[bin.to_str().unwrap(), lib.to_str().unwrap(), "0.2", "1"],
    );
    assert_preloaded_estimates(&result, &out, &["dl_churn"]);
}

/// `record --alloc --pid` decides per process: one started with `LD_PRELOAD` of the library
/// (written out by `install-preload`) samples in process (its sampled frees come through the
/// library); one without it is refused, saying how to start it with the library or that
/// --alloc-uprobes samples it, and with that flag gets uprobes on its allocator and a line
/// saying so. Both estimate make_600 within ±20 % (`assert_estimate`).
#[test]
fn pid_targets_use_the_library_when_they_load_it() {
    if !privileged() {
        return;
    }
    use pyrometer_e2e::alloc::{paused_allocs, record_until_sampling};
    use std::io::Write;
    let library = install_preload(&scratch("alloc-preload-pid-lib"));
    for preloaded in [true, false] {
        let dir = scratch(&format!("alloc-preload-pid-{preloaded}"));
        let (out, stats) = (dir.join("alloc.pb.gz"), dir.join("stats.json"));
        let env: &[(&str, &std::path::Path)] = if preloaded {
            &[("LD_PRELOAD", &library)]
        } else {
            &[]
        };
        let mut workload = paused_allocs(&fixture("allocs"), &["totals", "0.3"], env);
        let pid = workload.id().to_string();
        if !preloaded {
            // Uprobes are not chosen without being asked for.
            let refused = pyrometer(&[
                "record",
                "--alloc",
                "--pid",
                &pid,
                "-o",
                out.to_str().unwrap(),
            ]);
            let err = stderr(&refused);
            assert_eq!(refused.status.code(), Some(2), "{err}");
            assert!(
                err.contains(&format!("pid {pid} does not load libpyrometer_alloc.so"))
                    && err.contains("start it with LD_PRELOAD=/")
                    && err.contains("add --alloc-uprobes"),
                "{err}"
            );
            assert_eq!(err.lines().count(), 1, "{err}");
        }
        let mut args = vec!["record", "--alloc", "-o", out.to_str().unwrap()];
        args.extend(["--stats", stats.to_str().unwrap(), "--pid", &pid]);
        if !preloaded {
            args.push("--alloc-uprobes");
        }
        let (mut record, mut err, mut text) = record_until_sampling(&args);
        workload.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let stdout = workload.wait_with_output().unwrap().stdout;
        std::io::Read::read_to_string(&mut err, &mut text).unwrap();
        assert!(record.wait().unwrap().success(), "{text}");
        let note = text.contains("does not load libpyrometer_alloc.so")
            && text.contains("start it with LD_PRELOAD=/")
            && text.contains("sampled with uprobes on the allocator (--alloc-uprobes)");
        assert_eq!(note, !preloaded, "preloaded {preloaded}:\n{text}");
        let json = read_stats(&stats);
        let through_library = json["alloc_preload_frees"].as_u64().unwrap() > 0;
        assert_eq!(through_library, preloaded, "{json}\n{text}");
        let truth = fixture_totals(&stdout);
        let p = read_pprof(&out);
        let space = pprof_type(&p, "alloc_space");
        let got = by_function(&pprof_samples(&p), space, "make_600");
        assert_estimate("make_600", got, truth["make_600"].1, &text);
    }
}

/// A Python process keeps 400k one-item lists: pymalloc serves every block from its own
/// arenas, never through malloc, and the library's wrapper of the interpreter's allocators
/// samples them: the leak report names grow_small() and its line, and the in-use estimate is
/// at least 80 % of the lists' sizes (their ints and GC headers come on top). It then makes
/// and drops as many: their frees reached the kernel (a sampled small block is made by the C
/// allocator, and pymalloc frees it through free()), so hardly any is in use.
#[test]
fn pymalloc_blocks_are_sampled() {
    if !privileged() {
        return;
    }
    use pyrometer_e2e::python::{Interpreter, line_of, source};
    let python = Interpreter::pyenv(11);
    if !python.present() {
        return;
    }
    let dir = scratch("alloc-preload-pymalloc");
    let out = dir.join("leak.pb.gz");
    let script = source("py_small_leak.py");
    let mut child = std::process::Command::new(pyrometer_bin())
        .args([
            "record",
            "--leaks",
            "--min-age",
            "300ms",
            "--duration",
            "12s",
        ])
        .args(["-o", out.to_str().unwrap(), "--"])
        .arg(&python.path)
        .arg(&script)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut kept = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut kept,
    )
    .unwrap();
    let status = child.wait().unwrap();
    // The script sleeps on (record leaves a command running at --duration) holding the
    // stderr pipe: it goes before the pipe is read to its end.
    let _ = std::process::Command::new("pkill")
        .args(["-f", script.to_str().unwrap()])
        .status();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    assert_preloaded(&err);
    let kept: f64 = kept
        .strip_prefix("kept ")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no kept line: {kept:?}\n{err}"));
    let line = line_of(&script, "# SMALL_LINE");
    let top = leak_report(&err)
        .first()
        .copied()
        .unwrap_or_default()
        .to_string();
    assert!(
        top.contains(&format!("grow_small ({}:{line})", script.display())),
        "the top leak is grow_small() on line {line}: {top}\n{err}"
    );
    let p = read_pprof(&out);
    let inuse = pprof_type(&p, "inuse_space");
    let in_grow = by_function(&pprof_samples(&p), inuse, "grow_small");
    assert!(
        in_grow >= 0.8 * kept && in_grow <= 3.0 * kept,
        "{in_grow:.0} bytes in use under grow_small(), the lists alone are {kept:.0}\n{err}"
    );
    let samples = pprof_samples(&p);
    let churned = by_function(&samples, pprof_type(&p, "alloc_space"), "churn_small");
    let churn_in_use = by_function(&samples, inuse, "churn_small");
    assert!(
        churned >= 0.8 * kept,
        "{churned:.0} bytes allocated under churn_small(), the lists alone are {kept:.0}\n{err}"
    );
    assert!(
        churn_in_use <= 0.05 * churned,
        "{churn_in_use:.0} of churn_small()'s {churned:.0} bytes still in use: its frees were lost\n{err}"
    );
}

/// Every Python block sampled (a mean of one byte) and no profiler: each small block is then
/// made by the C allocator and freed by pymalloc through free(), zeroed ones (bytes(n) is a
/// calloc) included; the interpreter's own tests of its containers pass.
#[test]
fn python_runs_correctly_with_every_block_sampled() {
    use pyrometer_e2e::python::Interpreter;
    let python = Interpreter::pyenv(11);
    if !python.present() {
        return;
    }
    let dir = scratch("alloc-preload-every-python-block");
    let library = install_preload(&dir);
    let out = std::process::Command::new(&python.path)
        .args(["-c", CHECKS])
        .env("LD_PRELOAD", &library)
        .env("PYROMETER_ALLOC_SAMPLE_BYTES", "1")
        .current_dir(&dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{:?}\n{text}", out.status);
    assert!(text.contains("checked"), "{text}");
}

/// Waits for the library to wrap the interpreter's object allocator (from another thread, once
/// Python is initialised), checks that pymalloc's free was left in place, then makes zeroed,
/// grown and freed blocks and checks their contents.
const CHECKS: &str = r#"
import ctypes, time

class Allocator(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", ctypes.c_void_p),
                ("calloc", ctypes.c_void_p), ("realloc", ctypes.c_void_p),
                ("free", ctypes.c_void_p)]

def library():
    for line in open("/proc/self/maps"):
        if "libpyrometer_alloc.so" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            yield lo, hi

def ours(address):
    return any(lo <= address < hi for lo, hi in library())

def obj_allocator():
    a = Allocator()
    ctypes.pythonapi.PyMem_GetAllocator(2, ctypes.byref(a))
    return a

start = time.monotonic()
while not ours(obj_allocator().malloc) and time.monotonic() - start < 10:
    time.sleep(0.01)
a = obj_allocator()
assert ours(a.malloc), "the object allocator was never wrapped"
assert not ours(a.free), "under pymalloc, free is pymalloc's own"
for n in range(1, 3000):
    b = bytes(n % 400 + 1)
    assert b == b"\0" * len(b), n
    l = []
    for i in range(n % 50):
        l.append((i, str(i)))
    assert sum(x for x, _ in l) == (n % 50) * (n % 50 - 1) // 2
    d = {str(i): [i] * (i % 7) for i in range(n % 30)}
    assert all(len(v) == int(k) % 7 for k, v in d.items())
print("checked")
"#;
