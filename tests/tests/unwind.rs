//! In-kernel DWARF unwinding of binaries without frame pointers (issue: native stacks without
//! frame pointers). Real BPF, real perf events, real .eh_frame tables; root only.

use std::path::Path;

use pyrometer_e2e::*;

fn record_folded(test: &str, args: &[&str]) -> (Vec<FoldedStack>, String) {
    let dir = scratch(test);
    let out_path = dir.join("out.folded");
    let mut all = vec!["record", "-F", "499", "-o", out_path.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = pyrometer(&all);
    assert_ok(&out);
    (read_folded(&out_path), stderr(&out))
}

/// pyenv's CPython 3.11 (a shared build without frame pointers), or None after saying why.
fn pyenv_311() -> Option<&'static str> {
    let python = "/root/.pyenv/versions/3.11.7/bin/python3.11";
    if Path::new(python).exists() {
        Some(python)
    } else {
        skip("python:3.11", format!("{python} is not installed"));
        None
    }
}

fn fixture_str(name: &str) -> String {
    fixture(name).to_string_lossy().into_owned()
}

fn count(stacks: &[FoldedStack], pred: impl Fn(&FoldedStack) -> bool) -> u64 {
    stacks.iter().filter(|s| pred(s)).map(|s| s.count).sum()
}

fn index_of(s: &FoldedStack, name: &str) -> Option<usize> {
    s.frames.iter().position(|f| f == name)
}

#[test]
fn omit_frame_pointer_stacks_are_complete() {
    if !privileged() {
        return;
    }
    let (stacks, err) = record_folded("nofp", &["--", &fixture_str("cpu631-nofp"), "3"]);
    let total = count(&stacks, |_| true);
    // Complete: the chain goes from _start through libc's start code to main and work.
    let complete = count(&stacks, |s| {
        matches!(
            (index_of(s, "_start"), index_of(s, "__libc_start_call_main"), index_of(s, "main")),
            (Some(a), Some(b), Some(c)) if a < b && b < c
        )
    });
    assert!(
        complete as f64 >= 0.99 * total as f64,
        "only {complete}/{total} samples have a complete stack; {err}\n{:?}",
        stacks
            .iter()
            .filter(|s| index_of(s, "_start").is_none())
            .take(5)
            .collect::<Vec<_>>()
    );
    let shares = relative_shares(&stacks, &["leaf_a", "leaf_b", "leaf_c"]);
    assert!((shares["leaf_a"] - 0.6).abs() <= 0.05, "{shares:?}");
    // The first samples of the process may come before its tables are loaded (a few ms):
    // those are walked by frame pointer, which cannot see past the leaf here.
    let leaves = count(&stacks, |s| s.frames.iter().any(|f| f.starts_with("leaf_")));
    let under_work = count(&stacks, |s| {
        s.frames.iter().any(|f| f.starts_with("leaf_")) && index_of(s, "work").is_some()
    });
    assert!(
        under_work as f64 >= 0.99 * leaves as f64,
        "only {under_work}/{leaves} leaf samples have work above them"
    );
    assert!(
        err.contains("DWARF unwinding"),
        "summary lacks unwinding counters: {err}"
    );
}

#[test]
fn recursion_100_deep_is_recovered() {
    if !privileged() {
        return;
    }
    let stats_path = scratch("recurse-stats").join("stats.json");
    let (stacks, err) = record_folded(
        "recurse",
        &[
            "--stats",
            stats_path.to_str().unwrap(),
            "--",
            &fixture_str("recurse"),
            "2",
            "100",
        ],
    );
    let in_bottom = count(&stacks, |s| index_of(s, "bottom").is_some());
    let full = count(&stacks, |s| {
        index_of(s, "bottom").is_some()
            && s.frames.iter().filter(|f| *f == "rec").count() == 100
            && index_of(s, "main").is_some()
    });
    assert!(
        in_bottom > 100,
        "too few samples in bottom: {in_bottom}; {err}"
    );
    assert!(
        full as f64 >= 0.95 * in_bottom as f64,
        "only {full}/{in_bottom} samples in bottom show all 100 rec frames and main; {err}"
    );
    // The same ~105 return addresses in every sample: after the first samples, the kernel's
    // per-CPU row cache gives their rows (each checked against the table) without a search.
    let stats: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&stats_path).unwrap()).unwrap();
    let hits = stats["unwind_row_cache_hits"].as_u64().unwrap();
    let searches = stats["unwind_row_searches"].as_u64().unwrap();
    assert!(
        hits >= 100 * in_bottom && hits >= 20 * searches,
        "row cache: {hits} hits, {searches} searches for {in_bottom} samples in bottom"
    );
}

/// Frames hundreds of bytes to kilobytes apart (~40 KB of stack): the walk's copy of the stack
/// is refilled page after page, each time from just behind the return address it needs.
#[test]
fn large_frames_over_many_pages_are_recovered() {
    if !privileged() {
        return;
    }
    let (stacks, err) = record_folded("bigframes", &["--", &fixture_str("bigframes"), "2"]);
    let in_bottom = count(&stacks, |s| index_of(s, "bottom").is_some());
    let chain: Vec<String> = (0..24).map(|i| format!("big{i:02}")).collect();
    let full = count(&stacks, |s| {
        let at: Vec<Option<usize>> = chain.iter().map(|f| index_of(s, f)).collect();
        index_of(s, "main").is_some()
            && at.iter().all(Option::is_some)
            && at.windows(2).all(|w| w[0] < w[1])
            && index_of(s, "bottom") > at[23]
    });
    assert!(
        in_bottom > 100,
        "too few samples in bottom: {in_bottom}; {err}"
    );
    assert!(
        full as f64 >= 0.95 * in_bottom as f64,
        "only {full}/{in_bottom} samples in bottom show main, big00..big23 in order and bottom; {err}"
    );
}

#[test]
fn through_libc_qsort_to_the_callback() {
    if !privileged() {
        return;
    }
    let (stacks, err) = record_folded("qsort", &["--", &fixture_str("sorter"), "2"]);
    let in_compare = count(&stacks, |s| index_of(s, "compare").is_some());
    let through = count(&stacks, |s| {
        let (Some(m), Some(c)) = (index_of(s, "main"), index_of(s, "compare")) else {
            return false;
        };
        s.frames[m + 1..c]
            .iter()
            .any(|f| f.contains("qsort") || f.contains("msort"))
    });
    assert!(
        in_compare > 100,
        "too few samples in compare: {in_compare}; {err}"
    );
    assert!(
        through as f64 >= 0.95 * in_compare as f64,
        "only {through}/{in_compare} compare samples show main -> qsort -> compare; {err}\n{:?}",
        stacks.iter().take(3).collect::<Vec<_>>()
    );
}

#[test]
fn library_dlopened_during_capture_is_unwound() {
    if !privileged() {
        return;
    }
    let lib = fixture_str("libdlwork.so");
    let (stacks, err) = record_folded(
        "dlopen",
        &["--", &fixture_str("dlopener"), &lib, "0.5", "2.5"],
    );
    let in_lib = count(&stacks, |s| index_of(s, "dl_inner").is_some());
    let unwound = count(&stacks, |s| {
        matches!(
            (index_of(s, "main"), index_of(s, "call_library"), index_of(s, "dl_work"), index_of(s, "dl_inner")),
            (Some(a), Some(b), Some(c), Some(d)) if a < b && b < c && c < d
        )
    });
    assert!(
        in_lib > 100,
        "too few samples in the library: {in_lib}; {err}"
    );
    // The first samples after dlopen may predate the table: allow a 10 % warm-up.
    assert!(
        unwound as f64 >= 0.9 * in_lib as f64,
        "only {unwound}/{in_lib} library samples unwound to main; {err}"
    );
}

#[test]
fn cpython_311_native_stack_reaches_main() {
    if !privileged() {
        return;
    }
    let Some(python) = pyenv_311() else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/busy.py");
    // Every native frame: the default view leaves the interpreter's own frames out.
    let (stacks, err) = record_folded(
        "cpython",
        &[
            "--frames",
            "all",
            "--",
            python,
            script.to_str().unwrap(),
            "2",
        ],
    );
    let eval = count(&stacks, |s| {
        index_of(s, "_PyEval_EvalFrameDefault").is_some()
    });
    // python3.11's main() tail-calls Py_BytesMain, so main itself is not on the stack: the
    // walk must reach Py_BytesMain and go on to the outermost frame, _start.
    let to_main = count(&stacks, |s| {
        matches!(
            (index_of(s, "_start"), index_of(s, "Py_BytesMain"), index_of(s, "_PyEval_EvalFrameDefault")),
            (Some(a), Some(b), Some(c)) if a < b && b < c
        )
    });
    assert!(eval > 200, "too few interpreter samples: {eval}; {err}");
    assert!(
        to_main as f64 >= 0.95 * eval as f64,
        "only {to_main}/{eval} interpreter samples reach Py_BytesMain and _start; {err}"
    );
}

#[test]
fn signal_handler_unwinds_through_the_signal_frame() {
    if !privileged() {
        return;
    }
    let (stacks, err) = record_folded("signal", &["--", &fixture_str("sighandler"), "2"]);
    let in_handler = count(&stacks, |s| index_of(s, "on_signal").is_some());
    let through = count(&stacks, |s| {
        matches!(
            (index_of(s, "main"), index_of(s, "signal_loop"), index_of(s, "on_signal")),
            (Some(a), Some(b), Some(c)) if a < b && b < c
        )
    });
    assert!(
        in_handler > 100,
        "too few samples in the handler: {in_handler}; {err}"
    );
    assert!(
        through as f64 >= 0.9 * in_handler as f64,
        "only {through}/{in_handler} handler samples unwind through the signal frame to main; {err}\n{:?}",
        stacks
            .iter()
            .filter(|s| index_of(s, "on_signal").is_some())
            .take(3)
            .collect::<Vec<_>>()
    );
}

/// A table that does not fit in `--unwind-rows` is reported on one line and in `--stats`,
/// its frames go to frame pointers, and the summary's stop reasons account for every walk
/// that did not reach the outermost frame. 60,000 rows hold the C library's table (28k) but
/// not libpython 3.11's (64k).
#[test]
fn tables_that_do_not_fit_are_reported() {
    if !privileged() {
        return;
    }
    let Some(python) = pyenv_311() else {
        return;
    };
    let dir = scratch("unwind-rows-small");
    let stats_path = dir.join("stats.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/busy.py");
    let (_, err) = record_folded(
        "unwind-rows-small",
        &[
            "--unwind-rows",
            "60000",
            "--stats",
            stats_path.to_str().unwrap(),
            "--",
            python,
            script.to_str().unwrap(),
            "1",
        ],
    );
    assert!(
        err.contains("did not fit in --unwind-rows 60000")
            && err.contains("walked by frame pointers"),
        "{err}"
    );
    let stats: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&stats_path).unwrap()).unwrap();
    assert!(
        stats["unwind_tables_too_big"].as_u64().unwrap() >= 1,
        "{stats}"
    );
    // "N% of S stacks reached the outermost frame; stopped early: a no mapping, b no table,
    // c no CFI row, d bad CFA, e truncated, f ended by frame pointers": the complete walks
    // (from --stats) and a..f add up to S.
    let line = err
        .lines()
        .find(|l| l.contains("DWARF unwinding"))
        .unwrap_or_else(|| panic!("no unwinding summary: {err}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .filter(|w| !w.is_empty() && !w.contains('.'))
        .map(|w| w.parse().unwrap())
        .collect();
    let samples = numbers[0];
    let stops: u64 = numbers[1..].iter().sum();
    let complete = stats["unwind_complete"].as_u64().unwrap();
    assert_eq!(complete + stops, samples, "{line}; {complete} complete");
    assert!(samples > 100, "{line}");
}

/// A table that did not fit is built once rows free up, for the process that is still
/// running: with 140,000 rows, a 3.12 interpreter (libpython 69k rows) holds the rows that a
/// 3.11 started beside it needs for its libpython (64k); once the 3.12 exits, the 3.11's
/// samples in late() unwind through libpython to `_start`, where those in early() could not.
#[test]
fn tables_that_did_not_fit_are_built_once_rows_free_up() {
    if !privileged() {
        return;
    }
    let Some(py311) = pyenv_311() else {
        return;
    };
    let py312 = "/root/.pyenv/versions/3.12.1/bin/python3.12";
    if !Path::new(py312).exists() {
        skip("python:3.12", format!("{py312} is not installed"));
        return;
    }
    // Its own directory: record_folded's scratch directory is made afresh.
    let flags = scratch("unwind-rows-retry-flags");
    let holder = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/rows_holder.py");
    let waiter = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/rows_waiter.py");
    let script = format!(
        "{py312} {holder} {f} & \
         i=0; while [ ! -e {f}/holder-started ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; \
         {py311} {waiter} {f}; wait",
        holder = holder.display(),
        waiter = waiter.display(),
        f = flags.display(),
    );
    let (stacks, err) = record_folded(
        "unwind-rows-retry",
        &[
            "--unwind-rows",
            "140000",
            "--frames",
            "all",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    let complete = |s: &FoldedStack| index_of(s, "_start").is_some();
    let share = |function: &str| {
        let all = count(&stacks, |s| {
            s.frames.iter().any(|f| f.starts_with(function))
        });
        let done = count(&stacks, |s| {
            complete(s) && s.frames.iter().any(|f| f.starts_with(function))
        });
        (done, all)
    };
    let (early_done, early) = share("early (");
    let (late_done, late) = share("late (");
    assert!(
        err.contains("did not fit in --unwind-rows 140000"),
        "libpython 3.11 fitted beside 3.12's: {err}"
    );
    assert!(
        early > 20 && early_done * 2 < early,
        "early(): {early_done} of {early} complete; {err}"
    );
    // The 3.12's tables are released when it is seen gone (every 2 s), and the 3.11's
    // libpython is built at its next sync (the retry that follows, or a map refresh): most
    // of late()'s 6 s unwinds. A table that did not fit used to be given up for good.
    assert!(
        late > 300 && late_done * 2 > late,
        "late(): {late_done} of {late} complete; {err}"
    );
}

/// A thread that hits a uprobe runs the probed instruction out of line, in the process's
/// `[uprobes]` page, and traps back into the kernel: CPU samples taken then (most of a
/// program's samples under `--alloc-uprobes`, which probes every allocator call) have their
/// pc in that page, which no table covers. The walk starts from the probed instruction the
/// slot stands for instead, so such samples go through the allocator function to `_start`
/// in a program without frame pointers; before, their stacks lost the allocator and went
/// astray through frame pointers (a sixth of a renamed interpreter's samples under the
/// agent's `--alloc-comm`).
#[test]
fn samples_in_an_allocator_probes_step_unwind_through_the_allocator() {
    if !privileged() {
        return;
    }
    use pyrometer_e2e::alloc::{paused_allocs, record_until_sampling};
    use std::io::Write;
    let dir = scratch("unwind-uprobe-step");
    let out = dir.join("cpu.folded");
    let mut workload = paused_allocs(&fixture("allocs-nofp"), &["totals", "1"], &[]);
    let pid = workload.id().to_string();
    let args = [
        "record",
        "--alloc",
        "--alloc-uprobes",
        "-F",
        "999",
        "--type",
        "samples",
        "--pid",
        &pid,
        "-o",
        out.to_str().unwrap(),
    ];
    let (mut record, mut err, mut text) = record_until_sampling(&args);
    workload.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(workload.wait().unwrap().success());
    let status = record.wait().unwrap();
    std::io::Read::read_to_string(&mut err, &mut text).unwrap();
    assert!(status.success(), "{text}");
    let (mut stepping, mut through) = (0, 0);
    let mut bad = Vec::new();
    for s in read_folded(&out) {
        let Some(k) = s.frames.iter().position(|f| f == "asm_exc_debug_[k]") else {
            continue;
        };
        stepping += s.count;
        let allocator = k > 0
            && ["malloc", "free", "calloc", "realloc"]
                .iter()
                .any(|a| s.frames[k - 1].contains(a));
        if allocator && s.frames.iter().any(|f| f == "_start") {
            through += s.count;
        } else if bad.len() < 8 {
            bad.push(format!("{} {}", s.frames.join(";"), s.count));
        }
    }
    println!("{through} of {stepping} samples in a probe's step went through the allocator");
    // Most of the program's CPU time goes to the probes' traps: at 999 Hz hundreds of samples.
    assert!(
        stepping >= 50,
        "{stepping} samples in a probe's out-of-line step: this kernel may emulate the probed \
         instructions, which leaves nothing to test here\n{text}"
    );
    assert!(
        through as f64 >= 0.99 * stepping as f64,
        "{through} of {stepping} samples in a probe's step went through the allocator to _start:\n{}\n{text}",
        bad.join("\n")
    );
}
