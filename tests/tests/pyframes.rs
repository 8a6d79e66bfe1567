//! Python frames in `pyrometer record` on every CPython on the machine (pyenv 3.8–3.13,
//! Debian's python3.11, forky's 3.14 and 3.15, the free-threaded 3.13t and 3.14t): the kernel
//! walks the interpreter's frames, the agent names them and splices them into the native
//! stack. Ground truth is fixtures/py631.py, whose six(), three()
//! and one() do 6:3:1 units of the same loop. Needs root (BPF); each interpreter that is missing
//! prints `skipping: …`.

use std::collections::HashMap;
use std::path::Path;

use pyrometer_e2e::python::{
    Interpreter, debian, forky, free_threaded, line_of, source, supported,
};
use pyrometer_e2e::*;

/// `function (file:line)` → the function.
fn function(frame: &str) -> &str {
    frame.split(" (").next().unwrap_or(frame)
}

/// Inclusive shares (0..=1) of Python functions among the samples that contain any of them.
fn python_shares(stacks: &[FoldedStack], names: &[&str]) -> Vec<f64> {
    let mut counts = vec![0u64; names.len()];
    for s in stacks {
        if let Some(i) = names
            .iter()
            .position(|n| s.frames.iter().any(|f| function(f) == *n))
        {
            counts[i] += s.count;
        }
    }
    let total: u64 = counts.iter().sum();
    assert!(total > 0, "none of {names:?} in any stack");
    counts.iter().map(|&c| c as f64 / total as f64).collect()
}

/// `pyrometer record -F 499 -o OUT ARGS -- PYTHON PY_ARGS...`, which must succeed; its stderr.
fn record_python(out: &Path, args: &[&str], python: &Path, py_args: &[&str]) -> String {
    let mut all: Vec<&str> = vec!["record", "-F", "499", "-o", out.to_str().unwrap()];
    all.extend_from_slice(args);
    all.push("--");
    all.push(python.to_str().unwrap());
    all.extend_from_slice(py_args);
    let result = pyrometer(&all);
    assert_ok(&result);
    stderr(&result)
}

/// Records fixtures/py631.py with `script_args`.
fn record(args: &[&str], out: &Path, python: &Interpreter, script_args: &[&str]) -> String {
    let script = source("py631.py");
    let mut py_args = vec![script.to_str().unwrap()];
    py_args.extend_from_slice(script_args);
    record_python(out, args, &python.path, &py_args)
}

/// The 6:3:1 split within ±5 pp, every stack through six/three/one reaching `<module>` on the
/// fixture's own lines, native frames below `_PyEval_EvalFrameDefault` (`--frames all`).
fn check_split(python: &Interpreter) {
    if !python.present() {
        return;
    }
    let label = &python.label;
    let dir = scratch(&format!("pyframes-{}", label.replace(' ', "-")));
    let out = dir.join("all.folded");
    // 300 rounds: ~1.8 s of work on Debian's PGO-built 3.11, the fastest interpreter here, so
    // even it gives well over the 300 samples checked below at 499 Hz (100 rounds gave 262
    // on an idle runner, where the work ends sooner and so gives fewer samples).
    let err = record(&["--frames", "all"], &out, python, &["300"]);
    let stacks = read_folded(&out);
    let shares = python_shares(&stacks, &["six", "three", "one"]);
    for (share, want, name) in [
        (shares[0], 0.6, "six"),
        (shares[1], 0.3, "three"),
        (shares[2], 0.1, "one"),
    ] {
        assert!(
            (share - want).abs() <= 0.05,
            "{label}: {name} has {:.1} % (want {:.0} % ± 5 pp); {shares:?}\n{err}",
            share * 100.0,
            want * 100.0
        );
    }
    let script = source("py631.py");
    let six = "six (";
    let six_line = format!(":{})", line_of(&script, "# SIX_LINE"));
    let six_def_line = format!(":{})", line_of(&script, "# SIX_LINE") - 1);
    let mut checked = 0;
    let mut unreadable = 0;
    for s in &stacks {
        let Some(at) = s
            .frames
            .iter()
            .position(|f| ["six", "three", "one"].contains(&function(f)))
        else {
            continue;
        };
        let Some(module) = s.frames[..at]
            .iter()
            .rposition(|f| f.starts_with("<module> ("))
        else {
            // A code object freed or changing while it was read is marked, never misnamed.
            assert!(
                s.frames[..at].iter().any(|f| f == "<unreadable frame>"),
                "{label}: no <module> above: {:?}",
                s.frames
            );
            unreadable += s.count;
            continue;
        };
        // Below <module>: the interpreter's eval loop and the C start-up code.
        let below = &s.frames[..module];
        assert!(
            below.iter().any(|f| f == "_PyEval_EvalFrameDefault"),
            "{label}: no eval frame below <module>: {:?}",
            s.frames
        );
        assert!(
            below.iter().any(|f| f == "main" || f == "Py_BytesMain"),
            "{label}: no C main below <module>: {:?}",
            s.frames
        );
        assert!(
            s.frames[module].contains("py631.py:"),
            "{label}: {:?}",
            s.frames
        );
        // A sample can land on a frame that was pushed but has not run its first
        // instruction yet: its line is then the `def` line, and nothing is above it.
        let entering = at + 1 == s.frames.len() && s.frames[at].ends_with(&six_def_line);
        if s.frames[at].starts_with(six) && !entering {
            assert!(
                s.frames[at].ends_with(&six_line),
                "{label}: six on line {six_line}: {:?}",
                s.frames
            );
        }
        checked += s.count;
    }
    assert!(
        checked > 300,
        "{label}: only {checked} samples in six/three/one"
    );
    assert!(
        unreadable * 100 <= checked,
        "{label}: {unreadable} stacks with unreadable frames of {checked}"
    );
    println!("{label}: six/three/one {shares:.3?} over {checked} samples");
}

#[test]
fn split_3_8() {
    if privileged() {
        check_split(&Interpreter::pyenv(8));
    }
}

#[test]
fn split_3_9() {
    if privileged() {
        check_split(&Interpreter::pyenv(9));
    }
}

#[test]
fn split_3_10() {
    if privileged() {
        check_split(&Interpreter::pyenv(10));
    }
}

#[test]
fn split_3_11() {
    if privileged() {
        check_split(&Interpreter::pyenv(11));
    }
}

#[test]
fn split_3_12() {
    if privileged() {
        check_split(&Interpreter::pyenv(12));
    }
}

#[test]
fn split_3_13() {
    if privileged() {
        check_split(&Interpreter::pyenv(13));
    }
}

/// Debian forky's 3.14 in its chroot: frames from its own description, `f_executable` a
/// tagged stack reference.
#[test]
fn split_forky_3_14() {
    if privileged() {
        check_split(&forky(14));
    }
}

/// Debian forky's 3.15 in its chroot.
#[test]
fn split_forky_3_15() {
    if privileged() {
        check_split(&forky(15));
    }
}

/// Free-threaded 3.13t (`--disable-gil`): a larger object header, code objects with deferred
/// reference counts, all read from its own description.
#[test]
fn split_3_13t() {
    if privileged() {
        check_split(&free_threaded(13));
    }
}

/// Free-threaded 3.14t: `f_executable` tagged with the free-threaded tag bits, bytecode in
/// per-thread copies.
#[test]
fn split_3_14t() {
    if privileged() {
        check_split(&free_threaded(14));
    }
}

/// The chroot's stripped python3.14 is named from the debug file of python3.14-dbg inside the
/// chroot (by build-id under the process's own root), which the host lacks: its frames are
/// names, not `python3.14+0x…`, and the eval loop shows under each Python frame.
#[test]
fn chroot_debug_files_name_the_interpreter() {
    if !privileged() {
        return;
    }
    let python = forky(14);
    if !python.present() {
        return;
    }
    let dir = scratch("pyframes-forky-debug");
    let out = dir.join("all.folded");
    // 300 rounds, as in check_split: 100 gave 299 samples of the 300 checked below on an idle
    // runner.
    let err = record(&["--frames", "all"], &out, &python, &["300"]);
    let stacks = read_folded(&out);
    let (mut total, mut unnamed, mut eval) = (0, 0, 0);
    for s in stacks
        .iter()
        .filter(|s| s.frames.first().is_some_and(|f| f == "python3.14"))
    {
        total += s.count;
        if s.frames.iter().any(|f| f.starts_with("python3.14+0x")) {
            unnamed += s.count;
        }
        if s.frames.iter().any(|f| f == "_PyEval_EvalFrameDefault") {
            eval += s.count;
        }
    }
    assert!(total > 300, "only {total} samples of python3.14:\n{err}");
    assert!(
        unnamed * 20 <= total,
        "{unnamed} of {total} samples with unnamed python3.14 frames:\n{err}"
    );
    assert!(
        eval * 10 >= total * 9,
        "{eval} of {total} with the eval loop"
    );
}

#[test]
fn split_debian_3_11() {
    if privileged() {
        check_split(&debian());
    }
}

/// `mixed` (the default) keeps no interpreter frame and starts at `<module>`; `python` keeps
/// Python frames only.
#[test]
fn views() {
    if !privileged() {
        return;
    }
    let python = Interpreter::pyenv(12);
    if !python.present() {
        return;
    }
    let dir = scratch("pyframes-views");
    let mixed = dir.join("mixed.folded");
    record(&[], &mixed, &python, &["80"]);
    let stacks = read_folded(&mixed);
    let mut with_python = 0;
    let mut unreadable = 0;
    for s in &stacks {
        // The script's stacks: start-up imports (`site`) run from the interpreter's C
        // initialization, with no module above them.
        if !s.frames.iter().any(|f| f.contains("py631.py:")) {
            continue;
        }
        with_python += s.count;
        // A code object freed or changing while it was read is marked, never misnamed
        // (bounded below, as in check_split).
        if s.frames[1] == "<unreadable frame>" {
            unreadable += s.count;
            continue;
        }
        assert!(
            s.frames[1].starts_with("<module> (") && s.frames[1].contains("py631.py:"),
            "mixed: the stack starts at <module>: {:?}",
            s.frames
        );
        assert!(
            !s.frames
                .iter()
                .any(|f| f.starts_with("_PyEval") || f.starts_with("Py")),
            "mixed: an interpreter frame: {:?}",
            s.frames
        );
    }
    assert!(
        with_python > 300,
        "{with_python} samples with Python frames"
    );
    assert!(
        unreadable * 100 <= with_python,
        "{unreadable} of {with_python} stacks start at an unreadable frame"
    );

    let py_only = dir.join("python.folded");
    record(&["--frames", "python"], &py_only, &python, &["40"]);
    for s in read_folded(&py_only) {
        if s.frames.iter().any(|f| f.starts_with("<module> (")) {
            // `<unreadable frame>` is a Python frame whose code object was freed or changing
            // while it was read (start-up imports, in one CI run), and `<module> (FILE)` a
            // module body named from its module without a line (docs/src/python.md, "Module
            // bodies"): still no native frame.
            assert!(
                s.frames[1..].iter().all(|f| f.contains(".py:")
                    || f.contains(" (<")
                    || f == "<unreadable frame>"
                    || (f.starts_with("<module> (") && f.ends_with(".py)"))),
                "python: only Python frames: {:?}",
                s.frames
            );
        }
    }
}

/// zlib.compress on large buffers: deflate (libz) sits under zlib's C function, under the
/// Python function that called it (pyenv 3.11, Debian's 3.11, forky's 3.14 and 3.15, the
/// free-threaded 3.13t and 3.14t).
#[test]
fn native_extension_under_its_python_caller() {
    if !privileged() {
        return;
    }
    let mut ran = 0;
    for python in [
        Interpreter::pyenv(11),
        debian(),
        forky(14),
        forky(15),
        free_threaded(13),
        free_threaded(14),
    ] {
        if !python.present() {
            continue;
        }
        let dir = scratch(&format!("pyframes-zlib-{}", python.label.replace(' ', "-")));
        let out = dir.join("zlib.folded");
        let script = dir.join("squeeze.py");
        std::fs::write(
            &script,
            "import os, zlib\n\
             data = os.urandom(1 << 20) * 2\n\
             def squeeze():\n\
             \x20   for _ in range(12):\n\
             \x20       zlib.compress(data, 9)  # COMPRESS_LINE\n\
             squeeze()\n",
        )
        .unwrap();
        record_python(&out, &[], &python.path, &[script.to_str().unwrap()]);
        let stacks = read_folded(&out);
        let total: u64 = stacks.iter().map(|s| s.count).sum();
        let (mut in_deflate, mut unwalked) = (0, 0);
        for s in &stacks {
            let Some(d) = s.frames.iter().position(|f| f == "deflate") else {
                continue;
            };
            in_deflate += s.count;
            // Samples taken before the profiler had read the interpreter's layout (a chrooted
            // interpreter's is found through its own root, seconds into a loaded run) carry no
            // Python frame at all: counted, and bounded below.
            if !s.frames.iter().any(|f| f.contains(".py:")) {
                unwalked += s.count;
                continue;
            }
            let caller = s.frames[..d]
                .iter()
                .rposition(|f| f.starts_with("squeeze ("))
                .unwrap_or_else(|| {
                    panic!("{}: deflate without squeeze: {:?}", python.label, s.frames)
                });
            assert!(
                s.frames[caller].ends_with(":5)"),
                "{}: the compress line: {:?}",
                python.label,
                s.frames
            );
            // pyenv builds zlib as an extension module (lib-dynload); Debian (bookworm's 3.11,
            // forky's 3.14 and 3.15) links it into the interpreter, whose own frames the
            // mixed view leaves out.
            let extension = !python.label.starts_with("Debian") && !python.in_forky();
            assert_eq!(
                s.frames[caller..d]
                    .iter()
                    .any(|f| f.starts_with("zlib_compress")),
                extension,
                "{}: zlib's C function between: {:?}",
                python.label,
                s.frames
            );
        }
        assert!(
            in_deflate * 2 > total,
            "{}: {in_deflate} of {total} samples in deflate",
            python.label
        );
        assert!(
            unwalked * 4 < in_deflate,
            "{}: {unwalked} of {in_deflate} samples in deflate without Python frames",
            python.label
        );
        ran += 1;
    }
    assert!(ran > 0, "no interpreter to check was present");
}

/// Unsupported interpreters get one line saying so, and native frames.
#[test]
fn unsupported_version_is_named() {
    if !privileged() {
        return;
    }
    let python = pyrometer_e2e::python::pyenv("3.7.16");
    if !python.exists() {
        skip("python:3.7", format!("{} is missing", python.display()));
        return;
    }
    let dir = scratch("pyframes-37");
    let out = dir.join("out.folded");
    let err = record_python(
        &out,
        &[],
        &python,
        &["-c", "x = 0\nfor i in range(3000000): x += i"],
    );
    assert!(
        err.contains("Python 3.7.16 is not supported (3.8 and newer are): native frames only"),
        "{err}"
    );
    let stacks = read_folded(&out);
    assert!(
        stacks
            .iter()
            .any(|s| s.frames.iter().any(|f| f == "_PyEval_EvalFrameDefault")),
        "native frames remain"
    );
    assert!(
        !stacks
            .iter()
            .any(|s| s.frames.iter().any(|f| f.contains(".py:"))),
        "no Python frames"
    );
}

/// Python threads are labelled with their `threading` names (pprof `thread` label).
#[test]
fn thread_names_label_samples() {
    if !privileged() {
        return;
    }
    let mut ran = 0;
    for python in supported() {
        if !python.present() || python.minor != 11 && python.minor != 8 {
            continue;
        }
        let dir = scratch(&format!(
            "pyframes-names-{}",
            python.label.replace(' ', "-")
        ));
        let out = dir.join("out.pb.gz");
        // ~0.4 s of work: two CI runs had no sample in a 0.1-0.2 s spin (the worker sampled
        // as it started, before it set its thread_id, had its Python frames hidden for
        // 200 ms; see late_native_threads_get_their_python_frames_at_once).
        let log = record_python(
            &out,
            &[],
            &python.path,
            &[
                "-c",
                "import threading\n\
                 def spin():\n\
                 \x20   x = 0\n\
                 \x20   for i in range(12000000): x += i\n\
                 t = threading.Thread(target=spin, name='cruncher-1')\n\
                 t.start(); t.join()\n",
            ],
        );
        // The worker's own samples (those under `spin`) carry its name from its first one:
        // the names are read as soon as a new thread is seen. A check of the whole profile's
        // share instead depended on how long start-up took beside the ~60 ms of work.
        let samples = pprof_samples(&read_pprof(&out));
        let thread = |smp: &PprofSample| smp.labels.get("thread").cloned().unwrap_or_default();
        let spin: Vec<&PprofSample> = samples
            .iter()
            .filter(|smp| smp.functions.iter().any(|f| f == "spin"))
            .collect();
        let spin_total: i64 = spin.iter().map(|smp| smp.values[0]).sum();
        let spin_named: i64 = spin
            .iter()
            .filter(|smp| thread(smp) == "cruncher-1")
            .map(|smp| smp.values[0])
            .sum();
        assert!(
            spin_total >= 10,
            "{}: only {spin_total} samples in spin; record said:\n{log}",
            python.label
        );
        assert!(
            spin_named * 10 >= spin_total * 9,
            "{}: {spin_named} of spin's {spin_total} samples labelled cruncher-1: {:?}",
            python.label,
            spin.iter().map(|smp| thread(smp)).collect::<Vec<_>>()
        );
        // And the name is the worker's alone: no other thread's sample carries it. (Not "no
        // sample without spin() carries it": the worker's samples whose innermost frame the
        // kernel sent with a stale first line are `<unreadable frame>` there, up to 100 ms of
        // them, when spin()'s code object took the address of a start-up code object sampled
        // on that CPU just before; see py_code_lines in docs/src/kernel-side.md.)
        let tid = |smp: &PprofSample| smp.labels.get("tid").cloned().unwrap_or_default();
        let worker = tid(spin[0]);
        let elsewhere: Vec<String> = samples
            .iter()
            .filter(|smp| thread(smp) == "cruncher-1" && tid(smp) != worker)
            .map(|smp| format!("tid {} {:?}", tid(smp), smp.functions))
            .collect();
        assert!(
            elsewhere.is_empty(),
            "{}: samples of other threads than the worker (tid {worker}) labelled cruncher-1: \
             {elsewhere:?}",
            python.label
        );
        ran += 1;
    }
    assert!(ran > 0, "no interpreter to check was present");
}

/// Python's bracketed names (`<module>`, `<lambda>`) reach `go tool pprof -top` as they are:
/// pprof takes a function whose system name is its name for an undemangled one and strips
/// `<…>` as C++ template arguments, which left these frames nameless (`[[python]]`).
#[test]
fn bracketed_python_names_survive_go_pprof() {
    if !privileged() {
        return;
    }
    let python = Interpreter::pyenv(12);
    if !python.present() {
        return;
    }
    let dir = scratch("pyframes-go-pprof");
    let out = dir.join("out.pb.gz");
    let script = source("py_toplevel.py");
    record_python(&out, &[], &python.path, &[script.to_str().unwrap(), "6"]);
    let text = go_pprof_top(&out, &dir);
    // Cumulative time: the loop under `<module>`, the map's calls under `<lambda>`; each
    // well above a few samples (about 0.7 s of work in all on 3.12).
    let cum_ms = |name: &str| -> f64 {
        let v = text
            .lines()
            .find(|l| l.split_whitespace().last() == Some(name))
            .and_then(|l| l.split_whitespace().nth(3))
            .unwrap_or_else(|| panic!("{name} missing from go tool pprof -top:\n{text}"));
        match v.strip_suffix("ms") {
            Some(ms) => ms.parse::<f64>().unwrap(),
            None => v.trim_end_matches('s').parse::<f64>().unwrap() * 1000.0,
        }
    };
    assert!(cum_ms("<module>") >= 200.0, "{text}");
    assert!(cum_ms("<lambda>") >= 40.0, "{text}");
    assert!(!text.contains("[[python]]"), "{text}");
}

/// Native threads that become Python threads late (fixtures/late_thread.py: a C thread spins
/// 0.1 s, another 0.3 s, then each calls into Python through ctypes): every sample of a
/// thread's Python work carries its Python frames. The kernel caches that a thread has no
/// thread state; the cache held for 200 ms whatever happened, so the first thread's Python
/// work had no Python frame (a `threading` thread sampled as it started lost the same 200 ms,
/// its whole life in two CI runs), and the second's lost what ran before the entry expired.
#[test]
fn late_native_threads_get_their_python_frames_at_once() {
    if !privileged() {
        return;
    }
    let script = source("late_thread.py");
    let lib = fixture("liblatethread.so");
    let mut ran = 0;
    for python in supported().into_iter().chain([debian()]) {
        if !python.present() {
            continue;
        }
        let label = &python.label;
        let dir = scratch(&format!("pyframes-late-{}", label.replace(' ', "-")));
        let out = dir.join("late.folded");
        let log = record_python(
            &out,
            &["--frames", "all"],
            &python.path,
            &[script.to_str().unwrap(), lib.to_str().unwrap()],
        );
        let stacks = read_folded(&out);
        // The threads' Python work: their stacks from the callback on (past native_spin).
        let callback = |s: &&FoldedStack| {
            s.frames.iter().any(|f| f == "late_thread_main")
                && !s.frames.iter().any(|f| f == "native_spin")
                && s.frames
                    .iter()
                    .any(|f| f.contains("_PyEval_EvalFrameDefault"))
        };
        for work in ["young_work", "late_work"] {
            let named: u64 = stacks
                .iter()
                .filter(callback)
                .filter(|s| s.frames.iter().any(|f| function(f) == work))
                .map(|s| s.count)
                .sum();
            assert!(
                named >= 10,
                "{label}: {named} samples in {work}; record said:\n{log}"
            );
        }
        let evaluating: u64 = stacks.iter().filter(callback).map(|s| s.count).sum();
        let with_python: u64 = stacks
            .iter()
            .filter(callback)
            .filter(|s| s.frames.iter().any(|f| f.contains(".py:")))
            .map(|s| s.count)
            .sum();
        assert!(
            with_python * 10 >= evaluating * 9,
            "{label}: {with_python} of {evaluating} samples evaluating Python in the late threads have Python frames; record said:\n{log}"
        );
        ran += 1;
    }
    assert!(ran > 0, "no interpreter to check was present");
}

/// A thread sampled before `threading` knows it gets the name it registers under later:
/// started with `_thread`, it spins in `before()` unregistered, then registers through
/// `threading.current_thread()`, renames itself and spins in `after()`. Its samples in
/// `before()` were labelled with the command name until the profile named them at the end.
/// `before()` spins ~0.7 s: one CI run had no `before()` frame at all when it spun 0.2 s
/// (likely the thread sampled as it started: see
/// late_native_threads_get_their_python_frames_at_once). `after()` spins 1.5 s of wall time:
/// a thread unnamed for over a second has its process's names read again once a second
/// (the tracker's NAME_REFRESH), so a thread that registers after that is named within the
/// second; on a loaded machine `before()` outlasts that second, and a shorter `after()`
/// could end, with its process, before any read saw the name.
#[test]
fn samples_before_a_thread_registers_get_its_later_name() {
    if !privileged() {
        return;
    }
    let python = Interpreter::pyenv(11);
    if !python.present() {
        return;
    }
    let dir = scratch("pyframes-late-name");
    let out = dir.join("out.pb.gz");
    record_python(
        &out,
        &[],
        &python.path,
        &[
            "-c",
            "import _thread, threading, time\n\
             done = threading.Event()\n\
             def before():\n\
             \x20   x = 0\n\
             \x20   for i in range(10000000): x += i\n\
             def after():\n\
             \x20   x, end = 0, time.monotonic() + 1.5\n\
             \x20   while time.monotonic() < end: x += 1\n\
             def work():\n\
             \x20   before()\n\
             \x20   threading.current_thread().name = 'late-named'\n\
             \x20   after()\n\
             \x20   done.set()\n\
             _thread.start_new_thread(work, ())\n\
             done.wait()\n",
        ],
    );
    let samples = pprof_samples(&read_pprof(&out));
    for function in ["before", "after"] {
        let mut labels: HashMap<String, i64> = HashMap::new();
        for smp in samples
            .iter()
            .filter(|smp| smp.functions.iter().any(|f| f == function))
        {
            *labels
                .entry(smp.labels.get("thread").cloned().unwrap_or_default())
                .or_default() += smp.values[0];
        }
        let total: i64 = labels.values().sum();
        assert!(total >= 10, "only {total} samples in {function}");
        assert_eq!(
            labels.get("late-named").copied().unwrap_or(0),
            total,
            "{function}: {labels:?}"
        );
    }
}

/// A code object freed and another made at its address (fixtures/reuse_code.py: `first`
/// spins 1 s, is freed, `second` lands at its address and spins 1 s) are told apart by their
/// first lines: the kernel sends a code object's first line with its frames, at most 100 ms old
/// (see `py_code_lines` in python.h), and the agent reads a cached code object again when the
/// line differs. Named by address alone, all of it would be `first`.
#[test]
fn a_reused_code_address_is_named_again() {
    if !privileged() {
        return;
    }
    let python = Interpreter::pyenv(11);
    if !python.present() {
        return;
    }
    let dir = scratch("pyframes-reused-code");
    let out = dir.join("reused.folded");
    let script = source("reuse_code.py");
    let said = record_python(&out, &[], &python.path, &[script.to_str().unwrap(), "1.0"]);
    assert!(said.contains("reused 0x"), "no address was reused: {said}");
    let stacks = read_folded(&out);
    let count = |name: &str| -> u64 {
        stacks
            .iter()
            .filter(|s| s.frames.iter().any(|f| function(f) == name))
            .map(|s| s.count)
            .sum()
    };
    let (first, second) = (count("first"), count("second"));
    let share = second as f64 / (first + second).max(1) as f64;
    // Each spins 1 s; the first 100 ms of `second` may still carry `first`'s line.
    assert!(
        first + second > 200 && (0.35..=0.65).contains(&share),
        "first {first} samples, second {second} ({:.0} %)\n{}",
        share * 100.0,
        said
    );
}
