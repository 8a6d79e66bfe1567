//! CPython garbage-collector pauses on the agent's `/metrics` (`agent --gc`): per process, a
//! Prometheus histogram of pause durations, whose `_count` is the number of pauses.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Upper bounds of the histogram's buckets, in seconds: a young collection takes
/// microseconds to a millisecond, a full one over a large heap tens to hundreds of
/// milliseconds.
pub const BUCKETS: [f64; 12] = [
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Processes with a histogram at once; pauses of further processes are counted in `dropped`.
pub const MAX_PROCESSES: usize = 1024;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub comm: String,
    /// The process was gone at the last check: its series goes at the next one, so a
    /// process that collected just before it exited is still scraped once.
    pub gone: bool,
    /// Pauses at or under each bound of [`BUCKETS`] (not cumulative).
    pub buckets: [u64; BUCKETS.len()],
    pub count: u64,
    pub sum_ns: u64,
}

/// The histograms of the processes seen collecting, by pid.
#[derive(Debug, Default)]
pub struct GcPauses {
    pub by_pid: BTreeMap<u32, Histogram>,
    /// Pauses of processes past [`MAX_PROCESSES`].
    pub dropped: u64,
    /// Interpreter binaries whose collections are probed.
    pub probed_binaries: u64,
}

impl GcPauses {
    /// Adds the pauses (ns) of process `pid`, named `comm`.
    pub fn add(&mut self, pid: u32, comm: &str, pauses: &[u64]) {
        if !self.by_pid.contains_key(&pid) && self.by_pid.len() >= MAX_PROCESSES {
            self.dropped += pauses.len() as u64;
            return;
        }
        let h = self.by_pid.entry(pid).or_default();
        if h.comm != comm {
            h.comm = comm.to_string();
        }
        for &ns in pauses {
            let secs = ns as f64 / 1e9;
            if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
                h.buckets[i] += 1;
            }
            h.count += 1;
            h.sum_ns = h.sum_ns.saturating_add(ns);
        }
    }

    /// Forgets the processes found gone at the previous call (their series end with them)
    /// and marks those gone now.
    pub fn forget_exited(&mut self, proc_root: &Path) {
        self.by_pid.retain(|pid, h| {
            let gone = !proc_root.join(pid.to_string()).exists();
            let keep = !(gone && h.gone);
            h.gone = gone;
            keep
        });
    }

    /// The Prometheus text of every histogram.
    pub fn render(&self, o: &mut String) {
        let _ = write!(
            o,
            "# HELP pyrometer_agent_gc_probed_binaries Python interpreter binaries whose garbage collections are probed (agent --gc).\n\
             # TYPE pyrometer_agent_gc_probed_binaries gauge\n\
             pyrometer_agent_gc_probed_binaries {}\n",
            self.probed_binaries
        );
        if self.by_pid.is_empty() && self.dropped == 0 {
            return;
        }
        let _ = write!(
            o,
            "# HELP pyrometer_agent_gc_pause_seconds CPython garbage-collection pauses per process (agent --gc).\n\
             # TYPE pyrometer_agent_gc_pause_seconds histogram\n"
        );
        for (pid, h) in &self.by_pid {
            let comm = h.comm.replace('\\', "\\\\").replace('"', "\\\"");
            let labels = format!("pid=\"{pid}\",comm=\"{comm}\"");
            let mut cumulative = 0;
            for (bound, n) in BUCKETS.iter().zip(h.buckets) {
                cumulative += n;
                let _ = writeln!(
                    o,
                    "pyrometer_agent_gc_pause_seconds_bucket{{{labels},le=\"{bound}\"}} {cumulative}"
                );
            }
            let _ = write!(
                o,
                "pyrometer_agent_gc_pause_seconds_bucket{{{labels},le=\"+Inf\"}} {}\n\
                 pyrometer_agent_gc_pause_seconds_sum{{{labels}}} {}\n\
                 pyrometer_agent_gc_pause_seconds_count{{{labels}}} {}\n",
                h.count,
                h.sum_ns as f64 / 1e9,
                h.count,
            );
        }
        let _ = write!(
            o,
            "# HELP pyrometer_agent_gc_pauses_dropped_total Pauses of processes beyond the {MAX_PROCESSES} with a histogram.\n\
             # TYPE pyrometer_agent_gc_pauses_dropped_total counter\n\
             pyrometer_agent_gc_pauses_dropped_total {}\n",
            self.dropped
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_fall_in_cumulative_buckets() {
        let mut g = GcPauses::default();
        g.add(7, "py\"x", &[50_000, 3_000_000, 80_000_000, 2_000_000_000]);
        let mut o = String::new();
        g.render(&mut o);
        let line = |s: &str| o.lines().any(|l| l == s);
        let l = "pid=\"7\",comm=\"py\\\"x\"";
        assert!(
            line(&format!(
                "pyrometer_agent_gc_pause_seconds_bucket{{{l},le=\"0.0001\"}} 1"
            )),
            "{o}"
        );
        assert!(line(&format!(
            "pyrometer_agent_gc_pause_seconds_bucket{{{l},le=\"0.005\"}} 2"
        )));
        assert!(line(&format!(
            "pyrometer_agent_gc_pause_seconds_bucket{{{l},le=\"1\"}} 3"
        )));
        assert!(line(&format!(
            "pyrometer_agent_gc_pause_seconds_bucket{{{l},le=\"+Inf\"}} 4"
        )));
        assert!(line(&format!(
            "pyrometer_agent_gc_pause_seconds_count{{{l}}} 4"
        )));
        assert!(line(&format!(
            "pyrometer_agent_gc_pause_seconds_sum{{{l}}} 2.08305"
        )));
    }

    #[test]
    fn processes_are_bounded() {
        let mut g = GcPauses::default();
        for pid in 0..(MAX_PROCESSES as u32 + 3) {
            g.add(pid, "p", &[1]);
        }
        assert_eq!((g.by_pid.len(), g.dropped), (MAX_PROCESSES, 3));
        g.add(0, "p", &[1]);
        assert_eq!(g.by_pid[&0].count, 2, "a known process still counts");
    }

    #[test]
    fn an_exited_process_is_kept_for_one_more_check() {
        let dir = std::env::temp_dir().join(format!("gc-metrics-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("1")).unwrap();
        let mut g = GcPauses::default();
        g.add(1, "a", &[1]);
        g.add(2, "b", &[1]);
        g.forget_exited(&dir);
        assert_eq!(g.by_pid.len(), 2, "pid 2 was seen gone once");
        g.forget_exited(&dir);
        assert_eq!(g.by_pid.keys().copied().collect::<Vec<_>>(), [1]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
