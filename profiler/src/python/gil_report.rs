//! `record --gil`'s per-thread table: for each thread of the probed Python processes, the share
//! of its time it spent on a CPU (sampled), holding the GIL and waiting for it (timed by the
//! take_gil/drop_gil probes, exact up to the probes' own cost). A thread's time runs from its
//! first take_gil to its last GIL event (to the end of the recording while it still holds or
//! waits), so threads that start late or end early are not diluted by the rest of the run; a
//! thread that never took the GIL is measured against the whole recording.
//!
//! `preempted` is the thread's run-queue delay (`run_delay::RunDelays`): time it was runnable
//! but had no CPU. On a busy machine that time hides inside "holds" (a holder preempted) and
//! "waits" (a thread handed the GIL, waiting for a CPU), and a thread that dropped the GIL waits
//! in drop_gil, neither holding nor waiting, until its successor gets a CPU.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use pyrometer_ebpf::GilThread;

/// One thread's line.
#[derive(Debug, Clone, PartialEq)]
pub struct GilRow {
    pub pid: u32,
    pub tid: u32,
    pub name: String,
    pub on_cpu_ns: u64,
    pub hold_ns: u64,
    pub wait_ns: u64,
    pub acquisitions: u64,
    pub contended: u64,
    /// The thread's time with the GIL probes (first take_gil to its last event), if any.
    pub life_ns: Option<u64>,
    /// Time runnable but not running, when its scheduler statistics could be read.
    pub preempted_ns: Option<u64>,
}

/// The rows: every thread the GIL probes saw, and every sampled thread of the same processes
/// (a native thread that never takes the GIL still shows its CPU). Waits and holds still open
/// at `now_ns` count up to it. `samples` is (pid, name, on-CPU samples) by tid;
/// `preempted_of` gives a thread's run-queue delay.
pub fn rows(
    threads: &[(u32, GilThread)],
    samples: &HashMap<u32, (u32, String, u64)>,
    period_ns: u64,
    now_ns: u64,
    mut name_of: impl FnMut(u32, u32) -> Option<String>,
    preempted_of: impl Fn(u32, u32) -> Option<u64>,
) -> Vec<GilRow> {
    let open = |start: u64| {
        if start != 0 && now_ns > start {
            now_ns - start
        } else {
            0
        }
    };
    let mut rows: BTreeMap<(u32, u32), GilRow> = BTreeMap::new();
    for &(tid, g) in threads {
        let end = if g.hold_start != 0 || g.wait_start != 0 {
            now_ns
        } else {
            g.last_ns
        };
        rows.insert(
            (g.pid, tid),
            GilRow {
                pid: g.pid,
                tid,
                name: String::new(),
                on_cpu_ns: 0,
                hold_ns: g.hold_ns + open(g.hold_start),
                wait_ns: g.wait_ns + open(g.wait_start),
                acquisitions: g.acquisitions,
                contended: g.contended,
                life_ns: (g.first_ns != 0 && end > g.first_ns).then(|| end - g.first_ns),
                preempted_ns: None,
            },
        );
    }
    let pids: std::collections::HashSet<u32> = rows.keys().map(|&(p, _)| p).collect();
    for (&tid, (pid, name, n)) in samples {
        if !pids.contains(pid) {
            continue;
        }
        let row = rows.entry((*pid, tid)).or_insert_with(|| GilRow {
            pid: *pid,
            tid,
            name: String::new(),
            on_cpu_ns: 0,
            hold_ns: 0,
            wait_ns: 0,
            acquisitions: 0,
            contended: 0,
            life_ns: None,
            preempted_ns: None,
        });
        row.on_cpu_ns = n.saturating_mul(period_ns);
        row.name = name.clone();
    }
    rows.into_values()
        .map(|mut r| {
            // A name known now beats the label of the thread's samples, which may be its comm
            // from before `threading` had registered it.
            if let Some(name) = name_of(r.pid, r.tid) {
                r.name = name;
            } else if r.name.is_empty() {
                r.name = "?".into();
            }
            r.preempted_ns = preempted_of(r.pid, r.tid);
            r
        })
        .collect()
}

/// The table, one block per process: percentages of each thread's time (`duration_ns` for a
/// thread the probes never saw).
pub fn render(rows: &[GilRow], duration_ns: u64, comm_of: impl Fn(u32) -> String) -> String {
    let width = rows
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(6)
        .clamp(6, 40);
    let mut out = String::new();
    let mut pid = None;
    for r in rows {
        if pid != Some(r.pid) {
            pid = Some(r.pid);
            let _ = writeln!(out, "  pid {} ({}):", r.pid, comm_of(r.pid));
            let _ = writeln!(
                out,
                "    {:<width$} {:>8} {:>8} {:>8} {:>10} {:>14} {:>10} {:>12}",
                "thread",
                "tid",
                "time",
                "on-CPU",
                "holds GIL",
                "waits for GIL",
                "preempted",
                "contended"
            );
        }
        let life = r.life_ns.unwrap_or(duration_ns).max(1);
        let pct = |ns: u64| 100.0 * ns as f64 / life as f64;
        let name: String = r.name.chars().take(width).collect();
        let preempted = r
            .preempted_ns
            .map_or_else(|| "-".to_string(), |ns| format!("{:.1}%", pct(ns)));
        let _ = writeln!(
            out,
            "    {:<width$} {:>8} {:>7.2}s {:>7.1}% {:>9.1}% {:>13.1}% {:>10} {:>12}",
            name,
            r.tid,
            life as f64 / 1e9,
            pct(r.on_cpu_ns),
            pct(r.hold_ns),
            pct(r.wait_ns),
            preempted,
            format!("{}/{}", r.contended, r.acquisitions),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_intervals_count_up_to_now_and_samples_join() {
        let g = |pid, wait_ns, hold_ns, wait_start, hold_start| GilThread {
            pid,
            wait_ns,
            hold_ns,
            wait_start,
            hold_start,
            acquisitions: 10,
            contended: 4,
            first_ns: 500,
            last_ns: 800,
            ..GilThread::default()
        };
        let threads = [(11, g(10, 300, 200, 0, 900)), (12, g(10, 100, 0, 950, 0))];
        let mut samples = HashMap::new();
        samples.insert(11, (10, "MainThread".to_string(), 3));
        samples.insert(13, (10, "native".to_string(), 1));
        samples.insert(99, (98, "other process".to_string(), 5));
        // Names known at the end beat the samples' labels (tid 11 was sampled as MainThread
        // before it was named); tid 13 has only its samples' label.
        let rows = rows(
            &threads,
            &samples,
            10,
            1000,
            |_, tid| match tid {
                11 => Some("worker".to_string()),
                12 => Some(format!("t{tid}")),
                _ => None,
            },
            |_, tid| (tid == 11).then_some(125),
        );
        assert_eq!(rows.len(), 3, "{rows:?}");
        assert_eq!(
            (
                rows[0].tid,
                rows[0].name.as_str(),
                rows[0].hold_ns,
                rows[0].on_cpu_ns
            ),
            (11, "worker", 300, 30)
        );
        assert_eq!((rows[1].name.as_str(), rows[1].wait_ns), ("t12", 150));
        assert_eq!(
            (rows[2].tid, rows[2].name.as_str(), rows[2].on_cpu_ns),
            (13, "native", 10)
        );
        assert_eq!(rows[0].life_ns, Some(500), "still holding: up to now");
        let text = render(&rows, 1000, |_| "python3".into());
        assert!(text.contains("pid 10 (python3):"), "{text}");
        // 300 ns held of the 500 ns it lived; the native thread's 10 ns of the 1000 recorded.
        assert!(text.contains("60.0%") && text.contains("4/10"), "{text}");
        assert!(text.contains("1.0%"), "{text}");
        // 125 ns runnable of the 500 ns; no statistics for the others.
        assert_eq!(rows[0].preempted_ns, Some(125));
        assert!(text.contains("25.0%"), "{text}");
        let line = |tid: &str| text.lines().find(|l| l.contains(tid)).unwrap();
        assert_eq!(line("t12").split_whitespace().nth(6), Some("-"), "{text}");
    }
}
