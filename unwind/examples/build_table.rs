//! Times `build_table` on the given objects and prints the table size, e.g.
//! `cargo run --release -p pyrometer-unwind --example build_table -- /lib/x86_64-linux-gnu/libc.so.6`.
//! Without arguments it measures Debian's libc and CPython 3.11's libpython when present.

use std::path::PathBuf;
use std::time::Instant;

const DEFAULT_PATHS: &[&str] = &[
    "/lib/x86_64-linux-gnu/libc.so.6",
    "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0",
];

/// Builds are repeated and the fastest kept: the first run also pays for page faults.
const RUNS: usize = 5;

fn main() {
    let mut paths: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if paths.is_empty() {
        paths = DEFAULT_PATHS
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .collect();
    }
    let mut failed = false;
    for path in &paths {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                failed = true;
                continue;
            }
        };
        let mut best = None;
        let mut table = None;
        for _ in 0..RUNS {
            let started = Instant::now();
            let built = pyrometer_unwind::build_table(&bytes);
            let elapsed = started.elapsed();
            best = Some(best.map_or(elapsed, |b: std::time::Duration| b.min(elapsed)));
            table = Some(built);
        }
        match table.expect("RUNS > 0") {
            Ok(t) => {
                let s = &t.stats;
                println!(
                    "{}: {:.2} ms, {} rows, {} bytes ({} FDEs, {} rows before merge, \
                     {} unsupported, {} rbp unsupported, {} PLT, {} end, {} signal FDEs)",
                    path.display(),
                    best.unwrap_or_default().as_secs_f64() * 1e3,
                    s.rows,
                    t.bytes(),
                    s.fdes,
                    s.rows_before_merge,
                    s.unsupported,
                    s.rbp_unsupported,
                    s.plt_rows,
                    s.end_rows,
                    s.signal_fdes,
                );
            }
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
