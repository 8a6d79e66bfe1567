//! `cargo xtask kernels [NAME...]`: runs the kernel matrix (all kernels, or those named) one
//! after another and prints kernel × check → ok/FAIL/skip with times. Exit 1 when a check
//! failed, 2 on an unknown kernel name.

use pyrometer_e2e::kernels::{self, Outcome};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
                println!("skipping: kernel {name}: {reason}\n");
                summary.push(format!("{name:<24} skipped ({reason})"));
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
