//! What the on-demand capture tests share: a process killed when the test ends, the
//! one-line failure check, and reading a capture's Chrome trace against a workload's own
//! account of its sleeps.

use std::process::{Child, Output};

/// A process of the test, killed when the test ends (or fails).
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One line on stderr (besides a request's progress), and the exit code.
pub fn one_line_failure(out: &Output, code: i32, says: &str) {
    let err = crate::stderr(out);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.starts_with("pyrometer: request "))
        .collect();
    assert_eq!(out.status.code(), Some(code), "{err}");
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].contains(says), "{err}");
}

/// The on-CPU slices of the main thread of process `pid` in a Chrome trace, `(start, end)`
/// in µs, sorted. Only the main thread's: a runtime's own threads (a Ray worker's gRPC and
/// event loops) wake while the workload sleeps.
pub fn slices_of(doc: &serde_json::Value, pid: u32) -> Vec<(f64, f64)> {
    let mut slices: Vec<(f64, f64)> = doc["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| {
            e["ph"] == "X"
                && e["pid"].as_i64() == Some(i64::from(pid))
                && e["tid"].as_i64() == Some(i64::from(pid))
        })
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (ts, ts + e["dur"].as_f64().unwrap_or(0.0))
        })
        .collect();
    slices.sort_by(|a, b| a.0.total_cmp(&b.0));
    slices
}

/// Gaps longer than `ms` between consecutive slices, `(start, end)` in µs.
pub fn idle_gaps(slices: &[(f64, f64)], ms: f64) -> Vec<(f64, f64)> {
    slices
        .windows(2)
        .map(|w| (w[0].1, w[1].0))
        .filter(|(a, b)| b - a > ms * 1000.0)
        .collect()
}

/// How far (ms) a run of idle gaps is from the sleeps the workload measured, aligned where
/// they agree best: the largest difference of a gap and its sleep at that alignment.
pub fn gaps_against_sleeps(gaps_ms: &[f64], slept_ms: &[f64]) -> f64 {
    (0..=slept_ms.len().saturating_sub(gaps_ms.len()))
        .map(|k| {
            gaps_ms
                .iter()
                .zip(&slept_ms[k..])
                .map(|(g, s)| (g - s).abs())
                .fold(0.0, f64::max)
        })
        .fold(f64::INFINITY, f64::min)
}

/// The numbers of a workload's file, one a line.
pub fn numbers(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}
