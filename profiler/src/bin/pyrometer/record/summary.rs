//! What `record` says at the end: one line per source, the GIL table, the leak report, how
//! the stacks unwound.

use pyrometer::record::report::{AllocReport, GilReport, RunReport};

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

/// The lines after the recording, on stderr.
pub fn print(report: &RunReport) {
    report.print_lines();
}

trait Print {
    fn print_lines(&self);
    fn print_gil(&self, g: &GilReport);
    fn print_alloc(&self, a: &AllocReport);
}

impl Print for RunReport {
    fn print_lines(&self) {
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
        if let Some(d) = &self.debuginfod {
            let s = &d.stats;
            eprintln!(
                "pyrometer: debuginfod: {} debug files fetched ({} bytes), {} from the cache, {} not found, {} failed downloads{} (cache {})",
                s.stored,
                s.bytes,
                s.hits,
                s.not_found,
                s.failures,
                if d.pending > 0 {
                    format!(", {} still on their way (named next time)", d.pending)
                } else {
                    String::new()
                },
                d.cache.display()
            );
            if let Some(e) = &d.last_error {
                eprintln!("pyrometer: debuginfod: last failure: {e}");
            }
        }
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
        if let Some(g) = &self.gc {
            let by_generation: Vec<String> = g
                .by_generation
                .iter()
                .map(|(generation, ns)| match generation {
                    Some(n) => format!("generation {n}: {:.3}s", *ns as f64 / 1e9),
                    None => format!("generation unknown: {:.3}s", *ns as f64 / 1e9),
                })
                .collect();
            eprintln!(
                "pyrometer: GC: {} collections, {:.3}s paused in all{}; dropped: {} (tracking map full)",
                g.events,
                g.ns as f64 / 1e9,
                if by_generation.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", by_generation.join(", "))
                },
                c.python.gc_pending_full,
            );
        }
        if let Some(a) = &self.alloc {
            self.print_alloc(a);
        }
        let py = &self.python;
        if py.unreadable_frames + py.map_full > 0 {
            let mut parts = Vec::new();
            if py.unreadable_frames > 0 {
                parts.push(format!(
                    "{} of {} frames unreadable (their code object freed or torn before its read)",
                    py.unreadable_frames, self.py_frames.0
                ));
            }
            if py.map_full > 0 {
                parts.push(format!(
                    "{} process{} with native frames only (the walker's process table was full)",
                    py.map_full,
                    if py.map_full == 1 { "" } else { "es" }
                ));
            }
            eprintln!("pyrometer: Python: {}", parts.join("; "));
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
        for (pid, comm, gil_enabled) in &g.free_threaded {
            if *gil_enabled {
                eprintln!(
                    "pyrometer: GIL: pid {pid} ({comm}): free-threaded build with its GIL \
                     enabled (PYTHON_GIL=1, -X gil=1, or an extension module that needs the \
                     GIL): not measured"
                );
            } else {
                eprintln!("pyrometer: GIL: pid {pid} ({comm}): free-threaded: no GIL");
            }
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
}

/// How the DWARF walks went, and which tables did not fit.
pub fn print_unwinding(report: &RunReport) {
    let uw = report.counters.unwind;
    if uw.samples > 0 {
        let by_frame_pointers = uw.by_frame_pointers();
        eprintln!(
            "pyrometer: DWARF unwinding: {:.1}% of {} stacks reached the outermost frame; stopped early: {} no mapping, {} no table, {} no CFI row, {} bad CFA, {} truncated, {} ended by frame pointers",
            100.0 * uw.complete as f64 / uw.samples as f64,
            uw.samples,
            uw.no_mapping,
            uw.no_table,
            uw.no_row,
            uw.bad_cfa,
            uw.truncated,
            by_frame_pointers
        );
    }
    let copies = report.stack_copies;
    if uw.stack_copies + uw.stack_copies_skipped > 0 {
        eprintln!(
            "pyrometer: {} samples taken before their unwind tables were in kept a copy of their stack: {} walked again further ({} to the outermost frame), {} as first walked ({} of all these counted before their tables came); {} more went without a copy (over the per-CPU rate or no room in the ring buffer)",
            uw.stack_copies,
            copies.rewalked,
            copies.complete,
            copies.unchanged,
            copies.early,
            uw.stack_copies_skipped
        );
    }
    let st = &report.unwinder;
    if st.tables_too_big > 0 || st.mappings_dropped > 0 {
        let mut parts = Vec::new();
        if st.tables_too_big > 0 {
            let what = if st.tables_too_big == 1 {
                "1 executable's table".to_string()
            } else {
                format!("{} executables' tables", st.tables_too_big)
            };
            parts.push(format!(
                "{what} did not fit in --unwind-rows {} (a larger value keeps them)",
                st.rows_capacity
            ));
        }
        if st.mappings_dropped > 0 {
            parts.push(format!(
                "{} executable mappings beyond {} in one process were left out",
                st.mappings_dropped,
                pyrometer::record::report::MAX_MAPPINGS
            ));
        }
        eprintln!(
            "pyrometer: unwind tables: {}; their frames are walked by frame pointers",
            parts.join(", and ")
        );
    }
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
