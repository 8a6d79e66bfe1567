//! The GIL table `record --gil` and `capture --gil` print, read back.

use std::collections::HashMap;

/// One line of the GIL table.
#[derive(Debug, Clone)]
pub struct Row {
    /// The thread's time in seconds (its first GIL event to its last).
    pub time: f64,
    pub on_cpu: f64,
    pub holds: f64,
    pub waits: f64,
    /// Runnable but not running; None when the scheduler's statistics were not readable.
    pub preempted: Option<f64>,
}

/// The table's thread lines, by thread name:
/// `name tid time on-CPU% holds% waits% preempted% contended/acquisitions`.
pub fn table(stderr: &str) -> HashMap<String, Row> {
    let mut rows = HashMap::new();
    let mut inside = false;
    for line in stderr.lines() {
        // `record --gil`'s header, or `capture --gil`'s for a node.
        if line.starts_with("pyrometer: ") && line.contains("GIL over") {
            inside = true;
            continue;
        }
        if !inside || !line.starts_with("    ") || line.trim_start().starts_with("thread ") {
            if inside && !line.starts_with("  ") {
                inside = false;
            }
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let n = fields.len();
        if n < 8 {
            continue;
        }
        let pct = |s: &str| s.trim_end_matches('%').parse::<f64>().unwrap();
        let name = fields[..n - 7].join(" ");
        rows.insert(
            name,
            Row {
                time: fields[n - 6].trim_end_matches('s').parse().unwrap(),
                on_cpu: pct(fields[n - 5]),
                holds: pct(fields[n - 4]),
                waits: pct(fields[n - 3]),
                preempted: (fields[n - 2] != "-").then(|| pct(fields[n - 2])),
            },
        );
    }
    rows
}
