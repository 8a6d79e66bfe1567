//! OpenTelemetry spans on samples: python/pyrometer-otel publishes each thread's active span,
//! the kernel reads it at sample time and `record` labels the samples `trace_id`, `span_id`
//! and `span_name`. Ground truth is fixtures/otel_spans.py: heavy() and light() do 2:1 units
//! of the same loop in two spans on two threads, outside() runs in no span, and nested spans
//! hand the thread back to their parent when they end. Needs root (BPF) and the OpenTelemetry
//! venv (`cargo xtask test` makes it); prints `skipping: …` without them.

use std::collections::HashMap;
use std::path::Path;

use pyrometer_e2e::*;

/// Records the fixture into `out` (pprof); the span ids it printed, by span name.
fn record_spans(out: &Path, python: &Path) -> HashMap<String, (String, String)> {
    let script = pyrometer_e2e::python::source("otel_spans.py");
    let result = pyrometer(&[
        "record",
        "-F",
        "499",
        "-o",
        out.to_str().unwrap(),
        "--",
        python.to_str().unwrap(),
        script.to_str().unwrap(),
        "30",
    ]);
    assert_ok(&result);
    let stdout = String::from_utf8_lossy(&result.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no span ids printed: {stdout}\n{}", stderr(&result)));
    let ids: serde_json::Value = serde_json::from_str(line).unwrap();
    ids.as_object()
        .unwrap()
        .iter()
        .map(|(name, v)| {
            let s = |k: &str| v[k].as_str().unwrap().to_string();
            (name.clone(), (s("trace_id"), s("span_id")))
        })
        .collect()
}

/// Samples (weighted by count) whose stack holds `function`, and how many of them carry
/// `span_id`.
fn carrying(samples: &[PprofSample], count: usize, function: &str, span_id: &str) -> (i64, i64) {
    let mut total = 0;
    let mut with = 0;
    for s in samples
        .iter()
        .filter(|s| s.functions.iter().any(|f| f == function))
    {
        total += s.values[count];
        if s.labels.get("span_id").map(String::as_str) == Some(span_id) {
            with += s.values[count];
        }
    }
    (total, with)
}

#[test]
fn span_labels_split_two_threads_two_to_one() {
    if !privileged() {
        return;
    }
    let Some(python) = otel::python() else {
        return;
    };
    let dir = scratch("otel-split");
    let out = dir.join("spans.pb.gz");
    let ids = record_spans(&out, &python);
    let profile = read_pprof(&out);
    let count = pprof_type(&profile, "samples");
    let samples = pprof_samples(&profile);

    let by_span = |span: &str| -> i64 {
        samples
            .iter()
            .filter(|s| s.labels.get("span_id").map(String::as_str) == Some(span))
            .map(|s| s.values[count])
            .sum()
    };
    let heavy = by_span(&ids["heavy"].1);
    let light = by_span(&ids["light"].1);
    assert!(
        heavy + light > 100,
        "too few span samples: {heavy} + {light}"
    );
    let share = heavy as f64 / (heavy + light) as f64;
    assert!(
        (share - 2.0 / 3.0).abs() <= 0.08,
        "span heavy has {:.1} % of the two spans' samples (want 66.7 % ± 8 pp): {heavy} vs {light}",
        share * 100.0
    );

    // Each function's samples carry the span it ran in (the innermost one, the parent's again
    // once a child ended), and the span's name and trace.
    for (function, span) in [
        ("heavy", "heavy"),
        ("light", "light"),
        ("outer_before", "outer"),
        ("inner_work", "inner"),
        ("outer_after", "outer"),
    ] {
        let (total, with) = carrying(&samples, count, function, &ids[span].1);
        assert!(total > 10, "too few samples in {function}: {total}");
        assert!(
            with as f64 >= 0.95 * total as f64,
            "{with} of {total} samples in {function} carry span {span}'s id"
        );
        for s in samples
            .iter()
            .filter(|s| s.functions.iter().any(|f| f == function))
            .filter(|s| s.labels.get("span_id") == Some(&ids[span].1))
        {
            assert_eq!(s.labels.get("trace_id"), Some(&ids[span].0), "{function}");
            assert_eq!(s.labels.get("span_name").map(String::as_str), Some(span));
        }
    }
    assert_eq!(
        ids["inner"].0, ids["outer"].0,
        "a child span shares its trace"
    );
    assert_ne!(ids["heavy"].0, ids["light"].0, "two root spans, two traces");

    // Samples outside any span carry no span label at all.
    let outside: Vec<_> = samples
        .iter()
        .filter(|s| s.functions.iter().any(|f| f == "outside"))
        .collect();
    let outside_samples: i64 = outside.iter().map(|s| s.values[count]).sum();
    assert!(
        outside_samples > 10,
        "too few samples in outside(): {outside_samples}"
    );
    for s in outside {
        for key in ["trace_id", "span_id", "span_name"] {
            assert!(
                !s.labels.contains_key(key),
                "outside() sample has {key}: {s:?}"
            );
        }
    }
}
