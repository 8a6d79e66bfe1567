//! The suite's tally of Python frames (written by the end-to-end tests' `read_pprof`, see
//! tests/src/frame_tally.rs): how many frames of the profiles the tests read were Python
//! frames, and how many of those could not be read, over the whole run and per test. The
//! bound on unreadable frames (0.1 %) is a property of the suite as a whole, so it is
//! reported here rather than asserted by any one test.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde::Deserialize;

/// The share of unreadable Python frames the suite as a whole is held to, in percent.
pub const BOUND_PERCENT: f64 = 0.1;

/// One profile's line of the tally.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Entry {
    pub binary: String,
    pub test: String,
    pub python: u64,
    pub unreadable: u64,
}

/// Reads the tally; a run that read no profile with Python frames leaves none.
pub fn read(path: &Path) -> Result<Vec<Entry>> {
    crate::ledger::read_json_lines(path, "a tally line")
}

/// The tally as printed after the run: the suite's total and share, then each test whose
/// profiles held unreadable frames, most first.
pub fn summary(entries: &[Entry]) -> String {
    let mut per_test: BTreeMap<(&str, &str), (u64, u64)> = BTreeMap::new();
    for e in entries {
        let t = per_test.entry((&e.binary, &e.test)).or_default();
        t.0 += e.python;
        t.1 += e.unreadable;
    }
    let python: u64 = per_test.values().map(|t| t.0).sum();
    let unreadable: u64 = per_test.values().map(|t| t.1).sum();
    if python == 0 {
        return "Python frames: no profile the tests read had any".into();
    }
    let share = 100.0 * unreadable as f64 / python as f64;
    let mut out = format!(
        "Python frames in the {} profiles {} tests read: {python}, unreadable {unreadable} \
         ({share:.3} %; the suite's bound is {BOUND_PERCENT} %{})",
        entries.len(),
        per_test.len(),
        if share > BOUND_PERCENT {
            ": OVER IT"
        } else {
            ""
        }
    );
    let mut worst: Vec<_> = per_test.iter().filter(|(_, t)| t.1 > 0).collect();
    worst.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(a.0.cmp(b.0)));
    for ((binary, test), (p, u)) in worst {
        out.push_str(&format!(
            "\n  {binary} {test}: {u} of {p} ({:.3} %)",
            100.0 * *u as f64 / *p as f64
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(test: &str, python: u64, unreadable: u64) -> Entry {
        Entry {
            binary: "pyrometer-e2e::pyframes".into(),
            test: test.into(),
            python,
            unreadable,
        }
    }

    #[test]
    fn the_summary_sums_per_test_and_names_those_with_unreadable_frames() {
        let text = summary(&[
            entry("views", 5_000, 2),
            entry("views", 5_000, 1),
            entry("leaf", 10_000, 0),
            entry("deep", 20_000, 5),
        ]);
        assert!(
            text.starts_with(
                "Python frames in the 4 profiles 3 tests read: 40000, unreadable 8 (0.020 %;"
            ),
            "{text}"
        );
        assert!(!text.contains("OVER"), "{text}");
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(
            lines,
            [
                "  pyrometer-e2e::pyframes deep: 5 of 20000 (0.025 %)",
                "  pyrometer-e2e::pyframes views: 3 of 10000 (0.030 %)",
            ]
        );
        assert!(
            summary(&[entry("x", 1_000, 2)])
                .contains("0.200 %; the suite's bound is 0.1 %: OVER IT")
        );
        assert_eq!(
            summary(&[]),
            "Python frames: no profile the tests read had any"
        );
    }

    #[test]
    fn lines_are_read_back_as_the_tests_write_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("frames.jsonl");
        std::fs::write(
            &path,
            "{\"binary\":\"b\",\"test\":\"t \\\"q\\\"\",\"python\":7,\"unreadable\":1}\n",
        )
        .unwrap();
        let read = read(&path).unwrap();
        assert_eq!(
            read,
            [Entry {
                binary: "b".into(),
                test: "t \"q\"".into(),
                python: 7,
                unreadable: 1
            }]
        );
        assert!(super::read(&dir.path().join("none")).unwrap().is_empty());
    }
}
