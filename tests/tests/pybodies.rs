//! Module bodies on every CPython on the machine (pyenv 3.8–3.13, Debian's python3.11,
//! forky's 3.14 and 3.15, the free-threaded 3.13t and 3.14t). A module's body runs once and is
//! freed, usually before `record` reads the samples taken in it, and the next body of the same
//! size takes its address: read late, it is another module's body (all start on line 1) or
//! nothing. Ground truth is fixtures/py_bodies.py: rounds of three new modules whose bodies do
//! 6, 3 and 1 units of the same loop, a few milliseconds each. Named by what the address held
//! when it was read, the split came out as 6 : 1.4 : 1.1 on 3.11 and half the bodies'
//! samples were `<unreadable frame>`. Needs root (BPF); a missing interpreter prints
//! `skipping: …`.

use std::collections::HashMap;
use std::path::Path;

use pyrometer_e2e::python::{Interpreter, debian, forky, free_threaded, source};
use pyrometer_e2e::*;

/// The leaf kinds of the fixture and their shares of the work.
const KINDS: [(&str, f64); 3] = [("six", 0.6), ("three", 0.3), ("one", 0.1)];

/// importlib's frame right below the body it runs (every version since 3.3).
const RUNS_BODY: &str = "_call_with_frames_removed";

/// `<module> (…/six_012.py:2)` or, named from its module once freed, `<module> (…/six_012.py)`
/// → `six`.
fn body_kind(frame: &str) -> Option<&'static str> {
    let file = frame.strip_prefix("<module> (")?.strip_suffix(')')?;
    let file = file.split(':').next()?;
    let name = file.rsplit('/').next()?.strip_suffix(".py")?;
    let (kind, round) = name.rsplit_once('_')?;
    if round.len() != 3 || !round.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    KINDS.iter().map(|(k, _)| *k).find(|k| *k == kind)
}

/// `pyrometer record -F 499 --frames python -o OUT --stats OUT.json -- PYTHON
/// fixtures/SCRIPT`, which must succeed; its stderr.
fn record(python: &Interpreter, script: &str, out: &Path) -> String {
    let script = source(script);
    let stats = out.with_extension("json");
    let result = pyrometer(&[
        "record",
        "-F",
        "499",
        "--frames",
        "python",
        "-o",
        out.to_str().unwrap(),
        "--stats",
        stats.to_str().unwrap(),
        "--",
        python.path.to_str().unwrap(),
        script.to_str().unwrap(),
    ]);
    assert_ok(&result);
    stderr(&result)
}

/// Every sample in an imported body (the frame above importlib's last `RUNS_BODY`) names a
/// body of the fixture, `<unreadable frame>` in at most 1 % of them, and the split of the
/// bodies' samples within ±5 pp of 6:3:1 (each named by its own module, not the one at its
/// address later).
fn check_bodies(python: &Interpreter) {
    if !python.present() {
        return;
    }
    let label = &python.label;
    let dir = scratch(&format!("pybodies-{}", label.replace(' ', "-")));
    let out = dir.join("bodies.folded");
    let said = record(python, "py_bodies.py", &out);
    let stacks = read_folded(&out);
    let stats = pyrometer_e2e::alloc::read_stats(&out.with_extension("json"));
    check_counters(label, &stacks, &stats, &said);
    let mut bodies: HashMap<&str, u64> = HashMap::new();
    let mut unreadable = 0;
    let mut without_line = 0;
    let mut elsewhere: HashMap<String, u64> = HashMap::new();
    for s in &stacks {
        let Some(at) = s.frames.iter().rposition(|f| f.starts_with(RUNS_BODY)) else {
            continue;
        };
        // Nothing above it: the source being compiled, in C.
        let Some(body) = s.frames.get(at + 1) else {
            continue;
        };
        if let Some(kind) = body_kind(body) {
            *bodies.entry(kind).or_default() += s.count;
            if !body.contains(".py:") {
                without_line += s.count;
            }
        } else if body.starts_with("<unreadable frame>") {
            unreadable += s.count;
        } else {
            // The fixture's own imports (tempfile, shutil) at start-up.
            *elsewhere.entry(body.clone()).or_default() += s.count;
        }
    }
    let total: u64 = bodies.values().sum();
    println!(
        "{label}: {bodies:?}, {without_line} named without a line, {unreadable} unreadable; other bodies {elsewhere:?}"
    );
    assert!(
        total >= 300,
        "{label}: {total} samples in the bodies\n{said}"
    );
    assert!(
        unreadable as f64 <= 0.01 * (total + unreadable) as f64,
        "{label}: {unreadable} unreadable frames among {} samples in the bodies: {bodies:?}\n{said}",
        total + unreadable
    );
    for (kind, share) in KINDS {
        let got = bodies.get(kind).copied().unwrap_or(0) as f64 / total as f64;
        assert!(
            (got - share).abs() <= 0.05,
            "{label}: {kind} has {:.1} % of the bodies' samples (want {:.0} % ± 5 pp): {bodies:?}",
            got * 100.0,
            share * 100.0
        );
    }
}

/// The run's counters own up to what its profile shows: every `<unreadable frame>` in it is
/// counted in `--stats` (and said in a line when there are any), and each body named from its
/// module (`<module> (FILE)`, no line) is counted as one.
fn check_counters(label: &str, stacks: &[FoldedStack], stats: &serde_json::Value, said: &str) {
    let counter = |name: &str| {
        stats[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{label}: no {name} in --stats: {stats}"))
    };
    let frames = |pred: &dyn Fn(&str) -> bool| -> u64 {
        stacks
            .iter()
            .map(|s| s.count * s.frames.iter().filter(|f| pred(f)).count() as u64)
            .sum()
    };
    let unreadable = frames(&|f| f.starts_with("<unreadable frame>"));
    let named = frames(&|f| body_kind(f).is_some() && !f.contains(".py:"));
    let (counted_unreadable, counted_named) = (
        counter("python_unreadable_frames"),
        counter("python_module_bodies_named"),
    );
    println!(
        "{label}: counters: {counted_unreadable} unreadable (profile {unreadable}), {counted_named} bodies named from their module (profile {named}), {} code objects read",
        counter("python_code_reads")
    );
    assert!(counter("python_processes") >= 1, "{label}: {stats}");
    assert!(counter("python_code_reads") > 0, "{label}: {stats}");
    assert!(
        counted_unreadable >= unreadable,
        "{label}: {unreadable} unreadable frames in the profile, {counted_unreadable} counted"
    );
    assert!(
        counted_named >= named,
        "{label}: {named} bodies named from their module in the profile, {counted_named} counted"
    );
    assert_eq!(
        said.contains("pyrometer: Python: ") && said.contains("frames unreadable"),
        counted_unreadable > 0,
        "{label}: the summary and the counter disagree:\n{said}"
    );
}

#[test]
fn bodies_3_8() {
    if privileged() {
        check_bodies(&Interpreter::pyenv(8));
    }
}

#[test]
fn bodies_3_9() {
    if privileged() {
        check_bodies(&Interpreter::pyenv(9));
    }
}

#[test]
fn bodies_3_10() {
    if privileged() {
        check_bodies(&Interpreter::pyenv(10));
    }
}

#[test]
fn bodies_3_11() {
    if privileged() {
        check_bodies(&Interpreter::pyenv(11));
    }
}

#[test]
fn bodies_3_12() {
    if privileged() {
        check_bodies(&Interpreter::pyenv(12));
    }
}

#[test]
fn bodies_3_13() {
    if privileged() {
        check_bodies(&Interpreter::pyenv(13));
    }
}

#[test]
fn bodies_debian_3_11() {
    if privileged() {
        check_bodies(&debian());
    }
}

#[test]
fn bodies_forky_3_14() {
    if privileged() {
        check_bodies(&forky(14));
    }
}

#[test]
fn bodies_forky_3_15() {
    if privileged() {
        check_bodies(&forky(15));
    }
}

#[test]
fn bodies_3_13t() {
    if privileged() {
        check_bodies(&free_threaded(13));
    }
}

#[test]
fn bodies_3_14t() {
    if privileged() {
        check_bodies(&free_threaded(14));
    }
}

/// A function on line 1 of code `exec` ran in the module's namespace (fixtures/py_exec_fn.py,
/// as dataclasses makes `__init__`) starts on line 1 like a module body, in the module's
/// globals, with a file that is not the module's: it keeps its own name and lines, never
/// `<module>` of the script.
#[test]
fn an_exec_function_on_line_one_keeps_its_name() {
    if !privileged() {
        return;
    }
    let python = Interpreter::pyenv(12);
    if !python.present() {
        return;
    }
    let dir = scratch("pybodies-exec-function");
    let out = dir.join("exec.folded");
    let said = record(&python, "py_exec_fn.py", &out);
    let script = source("py_exec_fn.py");
    let stacks = read_folded(&out);
    // Named from the module, the function would be the script's `<module>` without a line.
    let misnamed = format!("<module> ({})", script.display());
    let (mut spin, mut wrong) = (0, 0);
    for s in &stacks {
        if s.frames.iter().any(|f| f.starts_with("spin (<generated>:")) {
            spin += s.count;
        }
        if s.frames.contains(&misnamed) {
            wrong += s.count;
        }
    }
    println!("{spin} samples in spin, {wrong} under {misnamed}");
    assert!(
        spin >= 200 && wrong == 0,
        "{spin} samples in spin, {wrong} under {misnamed}\n{said}"
    );
}
