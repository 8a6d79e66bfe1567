//! `cargo xtask kernels [NAME...]`: runs the kernel matrix (all kernels, or those named) one
//! after another and prints kernel × check → ok/FAIL/skip with times. Exit 1 when a check
//! failed (or, under CI, a kernel could not be fetched), 2 on an unknown kernel name.
//! `--fetch` only fetches the kernels that are not cached (the test command's set-up step).

use pyrometer_e2e::kernels::{self, Outcome};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--fetch") {
        fetch_all();
    }
    let known = kernels::names();
    if let Some(bad) = args.iter().find(|a| !known.contains(&a.as_str())) {
        eprintln!("unknown kernel {bad}; known: {}", known.join(", "));
        std::process::exit(2);
    }
    let chosen: Vec<&str> = if args.is_empty() {
        known
    } else {
        args.iter().map(String::as_str).collect()
    };
    let mut failed = false;
    let mut summary = Vec::new();
    for name in chosen {
        eprintln!("kernel {name}: running …");
        match kernels::run(name) {
            Outcome::Skipped(reason) => {
                // Under CI an unavailable kernel fails the matrix, as it fails the tests.
                if let Some(failure) = kernels::unavailable(name, &reason) {
                    println!("{failure}\n");
                    failed = true;
                }
                summary.push(format!("{name:<24} unavailable ({reason})"));
            }
            Outcome::Ran(report) => {
                println!("{}", report.table());
                failed |= !report.ok();
                let cells: Vec<String> = report
                    .checks
                    .iter()
                    .map(|c| format!("{} {} {:.0}s", c.name, c.status.word(), c.seconds))
                    .collect();
                summary.push(format!(
                    "{name:<24} {:<22} {:>5.0}s  {}",
                    report.release,
                    report.seconds,
                    cells.join(" | ")
                ));
            }
        }
    }
    println!("summary:");
    for line in summary {
        println!("  {line}");
    }
    std::process::exit(i32::from(failed));
}

/// `--fetch`: fetches every kernel of the matrix that is not cached (the test command's
/// set-up), printing each one's release; exit 1 when one cannot be fetched.
fn fetch_all() -> ! {
    let mut failed = false;
    for k in kernels::KERNELS {
        match kernels::fetch(k.name) {
            Ok(release) => println!("kernel {}: {release}", k.name),
            Err(why) => {
                eprintln!(
                    "kernel {}: cannot fetch it: {why} (if the suite has moved to another \
                     series, update KERNELS in tests/src/kernels/mod.rs)",
                    k.name
                );
                failed = true;
            }
        }
    }
    std::process::exit(i32::from(failed));
}
