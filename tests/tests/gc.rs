//! `pyrometer record --gc` against fixtures/gc_pauses.py, which forces full collections over
//! a large object graph from full_collections(), sets young collections off by allocating in
//! churn(), and times every collection itself with `gc.callbacks`: the gc time is under
//! full_collections(), each full collection's pause (a slice of the Chrome trace) is within
//! ±10 % of the fixture's own measure, and the generation is a label. On Debian's python3.11
//! (the gc__start/gc__done USDT probes), pyenv's 3.8–3.13 and the free-threaded 3.13t and
//! 3.14t (uprobes on the collector function) and forky's 3.14 and 3.15 in their chroot (USDT). Needs root (uprobes, BPF).

use std::path::Path;

use pyrometer_e2e::python::{Interpreter, debian, forky, free_threaded, source};
use pyrometer_e2e::*;
use serde_json::Value;

/// Objects of the fixture's graph (three containers per node) and full collections forced.
const NODES: &str = "100000";
const ROUNDS: &str = "6";

/// A collection as the fixture's gc.callbacks timed it.
#[derive(Debug)]
struct Pause {
    phase: String,
    generation: u64,
    ns: u64,
}

/// Runs the fixture under `record --gc` into `out`; returns its own account of the pauses
/// and record's stderr.
fn record_gc(python: &Interpreter, out: &Path) -> (Vec<Pause>, String) {
    let script = source("gc_pauses.py");
    let result = pyrometer(&[
        "record",
        "--gc",
        "-F",
        "49",
        "-o",
        out.to_str().unwrap(),
        "--",
        python.path.to_str().unwrap(),
        script.to_str().unwrap(),
        NODES,
        ROUNDS,
    ]);
    assert_ok(&result);
    let stdout = String::from_utf8_lossy(&result.stdout);
    let last = stdout
        .lines()
        .last()
        .unwrap_or_else(|| panic!("{}: the fixture printed nothing", python.label));
    let doc: Value = serde_json::from_str(last).expect("the fixture's JSON line");
    let pauses = doc["pauses"]
        .as_array()
        .expect("pauses")
        .iter()
        .map(|p| Pause {
            phase: p["phase"].as_str().unwrap().to_string(),
            generation: p["generation"].as_u64().unwrap(),
            ns: p["ns"].as_u64().unwrap(),
        })
        .collect();
    (pauses, stderr(&result))
}

/// The gc type's share under full_collections() and the generation labels in pprof; the
/// pauses of full collections as slices of the Chrome trace against the fixture's own.
fn check_full_collections(python: &Interpreter) {
    if !python.present() {
        return;
    }
    let label = &python.label;
    let dir = scratch(&format!("gc-{}", label.replace(' ', "-")));

    let out = dir.join("gc.pb.gz");
    let (_, err) = record_gc(python, &out);
    let p = read_pprof(&out);
    let gc = pprof_type(&p, "gc");
    let (mut total, mut under, mut full_gen2) = (0i64, 0i64, 0i64);
    for s in pprof_samples(&p) {
        let v = s.values[gc];
        if v == 0 {
            continue;
        }
        let generation = s.labels.get("gc_generation").cloned();
        assert!(
            generation.is_some(),
            "{label}: a gc sample without its generation: {s:?}"
        );
        total += v;
        if s.functions
            .iter()
            .any(|f| f.starts_with("full_collections"))
        {
            under += v;
            assert_eq!(
                generation.as_deref(),
                Some("2"),
                "{label}: gc.collect() collects generation 2: {s:?}"
            );
            full_gen2 += v;
        }
    }
    assert!(total > 0, "{label}: no gc time:\n{err}");
    assert!(
        under as f64 >= 0.9 * total as f64,
        "{label}: {under} of {total} ns of gc time under full_collections():\n{err}"
    );
    assert!(full_gen2 > 0, "{label}:\n{err}");

    let trace = dir.join("gc.trace.json");
    let (pauses, err) = record_gc(python, &trace);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"]
        .as_array()
        .or_else(|| doc.as_array())
        .expect("trace events");
    let slices: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e["cat"] == "gc")
        .filter(|e| {
            e["args"]["stack"].as_array().is_some_and(|s| {
                s.iter()
                    .any(|f| f.as_str().unwrap_or("").starts_with("full_collections"))
            })
        })
        .map(|e| {
            assert_eq!(e["args"]["generation"], "2", "{label}: {e}");
            assert!(
                e["name"]
                    .as_str()
                    .unwrap()
                    .starts_with("GC: full_collections"),
                "{label}: {e}"
            );
            (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap() * 1e3)
        })
        .collect();
    let mut slices = slices;
    slices.sort_by(|a, b| a.0.total_cmp(&b.0));
    let measured: Vec<u64> = pauses
        .iter()
        .filter(|p| p.phase == "full")
        .map(|p| {
            assert_eq!(p.generation, 2);
            p.ns
        })
        .collect();
    assert_eq!(
        slices.len(),
        measured.len(),
        "{label}: one GC slice per full collection: {slices:?} against {measured:?}\n{err}"
    );
    for ((_, ns), want) in slices.iter().zip(&measured) {
        let ratio = ns / *want as f64;
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{label}: a pause of {ns} ns where gc.callbacks measured {want} ns\n{err}"
        );
    }
    // Young collections start in churn()'s allocations, and are attributed there. 3.13
    // enters its collector with the generation still to be chosen (GENERATION_AUTO), so
    // without USDT probes (pyenv's build) an automatic collection's is unknown.
    let young: Vec<&Value> = events
        .iter()
        .filter(|e| e["cat"] == "gc")
        .filter(|e| {
            e["args"]["stack"].as_array().is_some_and(|s| {
                s.iter()
                    .any(|f| f.as_str().unwrap_or("").starts_with("churn"))
            })
        })
        .collect();
    // The fixture's own count of them: the free-threaded builds' collector starts a young
    // collection only once the new objects outnumber a quarter of the long-lived ones (the
    // graph's 300,000 here), which churn()'s 100,000 lists do not: none there.
    let churned = pauses.iter().filter(|p| p.phase == "churn").count();
    assert_eq!(
        young.is_empty(),
        churned == 0,
        "{label}: {} collections under churn(), {churned} by gc.callbacks",
        young.len()
    );
    let auto = python.minor == 13 && !python.in_forky();
    for e in &young {
        let g = e["args"]["generation"].as_str().unwrap_or("");
        assert!(
            g == "0" || g == "1" || (auto && g == "unknown"),
            "{label}: an automatic collection of generation {g}: {e}"
        );
    }
    println!(
        "{label}: {} full collections, pauses {:?} ns, gc.callbacks {:?} ns",
        slices.len(),
        slices.iter().map(|s| s.1 as u64).collect::<Vec<_>>(),
        measured
    );
}

#[test]
fn full_collections_debian_3_11() {
    if privileged() {
        check_full_collections(&debian());
    }
}

#[test]
fn full_collections_3_8() {
    if privileged() {
        check_full_collections(&Interpreter::pyenv(8));
    }
}

#[test]
fn full_collections_3_9() {
    if privileged() {
        check_full_collections(&Interpreter::pyenv(9));
    }
}

#[test]
fn full_collections_3_10() {
    if privileged() {
        check_full_collections(&Interpreter::pyenv(10));
    }
}

#[test]
fn full_collections_3_11() {
    if privileged() {
        check_full_collections(&Interpreter::pyenv(11));
    }
}

#[test]
fn full_collections_3_12() {
    if privileged() {
        check_full_collections(&Interpreter::pyenv(12));
    }
}

#[test]
fn full_collections_3_13() {
    if privileged() {
        check_full_collections(&Interpreter::pyenv(13));
    }
}

/// Debian forky's 3.14 in its chroot: its USDT probes, in the binary as the chroot has it.
#[test]
fn full_collections_forky_3_14() {
    if privileged() {
        check_full_collections(&forky(14));
    }
}

#[test]
fn full_collections_forky_3_15() {
    if privileged() {
        check_full_collections(&forky(15));
    }
}

/// The free-threaded builds (pyenv-like, no USDT probes): uprobes on their own collector,
/// which stops the world where the default build's holds the GIL.
#[test]
fn full_collections_3_13t() {
    if privileged() {
        check_full_collections(&free_threaded(13));
    }
}

#[test]
fn full_collections_3_14t() {
    if privileged() {
        check_full_collections(&free_threaded(14));
    }
}

/// Without --gc nothing changes: no gc type.
#[test]
fn without_gc_there_is_no_gc_type() {
    if !privileged() {
        return;
    }
    let python = Interpreter::pyenv(11);
    if !python.present() {
        return;
    }
    let dir = scratch("gc-without");
    let out = dir.join("out.pb.gz");
    let script = source("gc_pauses.py");
    let result = pyrometer(&[
        "record",
        "-o",
        out.to_str().unwrap(),
        "--",
        python.path.to_str().unwrap(),
        script.to_str().unwrap(),
        "20000",
        "1",
    ]);
    assert_ok(&result);
    let p = read_pprof(&out);
    assert!(
        !p.sample_type
            .iter()
            .any(|t| p.string_table[t.r#type as usize] == "gc"),
        "a gc type without --gc"
    );
}
