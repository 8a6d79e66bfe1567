//! What `record` says at the end (one line per source, the GIL table, the leak report) and
//! what it writes to `--stats`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use pyrometer::bpf::{Counters, ProgramStats};
use pyrometer::gpu::{self, summary::DeviceSummary};
use pyrometer::model::Profile;
use pyrometer::output::folded::frame_name;
use pyrometer::unwinder::UnwinderStats;

/// Everything the end of a recording reports.
pub struct RunReport {
    pub samples: u64,
    pub lost: u64,
    pub processes: usize,
    pub elapsed: Duration,
    pub unsymbolized: u64,
    pub output: PathBuf,
    pub counters: Counters,
    /// With --off-cpu: (intervals, ns blocked, the minimum counted).
    pub off_cpu: Option<(u64, u64, Duration)>,
    /// With --gil: the table, processes without the GIL view, contended waits and their ns.
    pub gil: Option<GilReport>,
    pub alloc: Option<AllocReport>,
    pub py_frames: (u64, u64),
}

pub struct GilReport {
    pub table: String,
    pub unavailable: Vec<(u32, String)>,
    /// Free-threaded processes (pid, command name): no GIL to show.
    pub free_threaded: Vec<(u32, String)>,
    pub wait_events: u64,
    pub wait_ns: u64,
}

pub struct AllocReport {
    pub mean: u64,
    pub samples: u64,
    pub frees: u64,
    /// Resizes of sampled blocks (their in-use entries moved).
    pub moves: u64,
    /// Uprobes attached on allocator functions (0 when every target preloads the sampler
    /// library), and copies of the library probed.
    pub uprobes: u64,
    pub preload_libraries: usize,
    pub objects: f64,
    pub bytes: f64,
    /// With --leaks: the minimum age of a block counted, and the top sites.
    pub leaks: Option<(Duration, Vec<LeakSite>)>,
    /// Processes whose allocator could not be probed, and why.
    pub unprobed: Vec<String>,
    pub live_dropped: u64,
}

/// In-use memory of one allocation site (innermost frames), estimated.
pub struct LeakSite {
    pub site: String,
    pub objects: f64,
    pub bytes: f64,
}

/// The sites with the most in-use bytes: each sample's three innermost frames, leaf first.
pub fn leak_sites(profile: &Profile, top: usize) -> Vec<LeakSite> {
    let (Ok(objects), Ok(bytes)) = (
        profile.type_index("inuse_objects"),
        profile.type_index("inuse_space"),
    ) else {
        return Vec::new();
    };
    let mut sites: HashMap<String, (f64, f64)> = HashMap::new();
    for s in &profile.samples {
        if s.values[bytes] <= 0 {
            continue;
        }
        let site = profile
            .stack_frames(s.stack)
            .filter(|f| f.kind != pyrometer::model::FrameKind::Kernel)
            .take(3)
            .map(frame_name)
            .collect::<Vec<_>>()
            .join(" <- ");
        let e = sites.entry(site).or_default();
        e.0 += s.values[objects] as f64;
        e.1 += s.values[bytes] as f64;
    }
    let mut out: Vec<LeakSite> = sites
        .into_iter()
        .map(|(site, (objects, bytes))| LeakSite {
            site,
            objects,
            bytes,
        })
        .collect();
    out.sort_by(|a, b| {
        b.bytes
            .total_cmp(&a.bytes)
            .then_with(|| a.site.cmp(&b.site))
    });
    out.truncate(top);
    out
}

/// `512 KiB`, `1.5 MiB`.
pub fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

impl RunReport {
    /// The lines after the recording, on stderr.
    pub fn print(&self) {
        let processes = self.processes;
        eprintln!(
            "pyrometer: {} samples ({} lost) from {processes} process{} in {:.1}s, {} unsymbolized frames; wrote {}",
            self.samples,
            self.lost,
            if processes == 1 { "" } else { "es" },
            self.elapsed.as_secs_f64(),
            self.unsymbolized,
            self.output.display()
        );
        let c = &self.counters;
        if let Some((events, ns, min)) = self.off_cpu {
            eprintln!(
                "pyrometer: off-CPU: {events} blocked intervals of at least {:.3}ms, {:.3}s blocked in all; dropped: {} (tracking map full), {} (ring buffer full, all records)",
                min.as_secs_f64() * 1e3,
                ns as f64 / 1e9,
                c.offcpu_map_full,
                c.ringbuf_drops
            );
        }
        if let Some(g) = &self.gil {
            self.print_gil(g);
        }
        if let Some(a) = &self.alloc {
            self.print_alloc(a);
        }
        if c.user_stack_errors + c.kernel_stack_errors + c.targets_full > 0 {
            eprintln!(
                "pyrometer: stack errors: {} user, {} kernel",
                c.user_stack_errors, c.kernel_stack_errors
            );
        }
    }

    fn print_gil(&self, g: &GilReport) {
        let c = &self.counters;
        if g.table.is_empty() {
            if g.unavailable.is_empty() && g.free_threaded.is_empty() {
                eprintln!("pyrometer: GIL: no Python thread took the GIL while probed");
            }
        } else {
            eprint!(
                "pyrometer: GIL over {:.1}s ({} contended waits sampled with their stacks, {:.3}s; dropped: {} (stack map full), {} (thread map full)):\n{}",
                self.elapsed.as_secs_f64(),
                g.wait_events,
                g.wait_ns as f64 / 1e9,
                c.python.gil_pending_full,
                c.python.gil_threads_full,
                g.table
            );
        }
        for (pid, reason) in &g.unavailable {
            eprintln!("pyrometer: GIL view unavailable for pid {pid}: {reason}");
        }
        for (pid, comm) in &g.free_threaded {
            eprintln!("pyrometer: GIL: pid {pid} ({comm}): free-threaded: no GIL");
        }
    }

    fn print_alloc(&self, a: &AllocReport) {
        let c = &self.counters.alloc;
        let rate = if a.mean <= 1 {
            "every allocation".to_string()
        } else {
            format!("one every {} on average", bytes(a.mean as f64))
        };
        eprintln!(
            "pyrometer: allocations: {} sampled ({rate}), an estimated {} in {:.0} allocations; {} sampled blocks freed; dropped: {} (live table full), {} (thread table full), {} (ring buffer full, all records)",
            a.samples,
            bytes(a.bytes),
            a.objects,
            a.frees,
            c.live_full + a.live_dropped,
            c.threads_full,
            self.counters.ringbuf_drops
        );
        for line in &a.unprobed {
            eprintln!("pyrometer: {line}");
        }
        if let Some((min_age, sites)) = &a.leaks {
            if sites.is_empty() {
                eprintln!(
                    "pyrometer: leaks: nothing sampled is still in use {:.1}s after it was allocated",
                    min_age.as_secs_f64()
                );
                return;
            }
            eprintln!(
                "pyrometer: leaks: in use at the end, allocated at least {:.1}s before it (estimated):",
                min_age.as_secs_f64()
            );
            for s in sites {
                eprintln!(
                    "  {:>10} {:>10.0} objects  {}",
                    bytes(s.bytes),
                    s.objects,
                    s.site
                );
            }
        }
    }

    /// `--stats`: the counters as JSON.
    pub fn write_stats(
        &self,
        path: &Path,
        bpf: Option<ProgramStats>,
        unwinder: &UnwinderStats,
        capture_cpu_ns: u64,
        gpus: Option<&[DeviceSummary]>,
    ) -> anyhow::Result<()> {
        let c = &self.counters;
        let mut json = serde_json::json!({
            "samples": self.samples,
            "lost": self.lost,
            "kernel_samples": c.samples,
            "ringbuf_drops": c.ringbuf_drops,
            "user_stack_errors": c.user_stack_errors,
            "kernel_stack_errors": c.kernel_stack_errors,
            "user_stack_truncated": c.user_stack_truncated,
            "elapsed_ns": self.elapsed.as_nanos() as u64,
            "agent_cpu_ns": self_cpu_ns(),
            "agent_capture_cpu_ns": capture_cpu_ns,
            "bpf_run_time_ns": bpf.map(|b| b.run_time_ns),
            "bpf_sample_ns": c.sample_ns,
            "bpf_run_count": bpf.map(|b| b.run_count),
            "unwind_samples": c.unwind.samples,
            "unwind_complete": c.unwind.complete,
            "unwind_no_mapping": c.unwind.no_mapping,
            "unwind_no_table": c.unwind.no_table,
            "unwind_no_row": c.unwind.no_row,
            "unwind_bad_cfa": c.unwind.bad_cfa,
            "unwind_truncated": c.unwind.truncated,
            "unwind_tables_built": unwinder.tables_built,
            "unwind_tables_failed": unwinder.tables_failed,
            "unwind_tables_evicted": unwinder.tables_evicted,
            "unwind_rows_used": unwinder.rows_used,
            "unwind_rows_capacity": unwinder.rows_capacity,
            "unwind_table_bytes": unwinder.rows_used * 12,
            "unwind_build_ns": unwinder.build_ns,
            "offcpu_kernel_events": c.offcpu_events,
            "offcpu_map_full": c.offcpu_map_full,
            "python_frames": self.py_frames.0,
            "python_frames_unresolved": self.py_frames.1,
            "python_walks": c.python.walks,
            "python_no_thread": c.python.no_thread,
            "python_truncated": c.python.truncated,
            "python_read_errors": c.python.read_errors,
            "python_tstate_searches": c.python.tstate_searches,
            "gil_wait_events": c.python.gil_wait_events,
            "alloc_kernel_samples": c.alloc.samples,
            "alloc_kernel_frees": c.alloc.frees,
            "alloc_live_full": c.alloc.live_full,
            "alloc_threads_full": c.alloc.threads_full,
        });
        json["alloc_preload_frees"] = c.alloc.preload_frees.into();
        json["unwind_row_cache_hits"] = c.unwind.row_hits.into();
        json["unwind_row_searches"] = c.unwind.row_searches.into();
        json["bpf_python_ns"] = c.python_ns.into();
        json["unwind_tables_too_big"] = unwinder.tables_too_big.into();
        json["unwind_mappings_dropped"] = unwinder.mappings_dropped.into();
        if let Some(a) = &self.alloc {
            json["alloc_samples"] = a.samples.into();
            json["alloc_frees"] = a.frees.into();
            json["alloc_moves"] = a.moves.into();
            json["alloc_uprobes"] = a.uprobes.into();
            json["alloc_preload_libraries"] = a.preload_libraries.into();
            json["alloc_estimated_bytes"] = a.bytes.into();
            json["alloc_estimated_objects"] = a.objects.into();
        }
        if let Some(g) = gpus {
            json["gpus"] = gpu::summary::to_json(g);
        }
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))
    }
}

/// CPU time (user + system) this process has used so far.
pub fn self_cpu_ns() -> u64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(usage.ru_utime) + us(usage.ru_stime)) * 1000
}

/// A thread's kernel name, when it still exists.
pub fn thread_comm(pid: u32, tid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_read_well() {
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(512.0 * 1024.0), "512.0 KiB");
        assert_eq!(bytes(1.5 * 1024.0 * 1024.0), "1.5 MiB");
    }
}
