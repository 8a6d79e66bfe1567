//! The kernel matrix (tests/src/kernels): on Debian's 6.1, 6.12 and forky kernels booted under
//! qemu, and on the machine's own kernel, the verifier table, a `record` of cpu631 built
//! without frame pointers (complete DWARF stacks, 6:3:1) and of CPython 3.11 running py631.py
//! (Python frames, 6:3:1). A kernel that cannot be fetched prints `skipping: <reason>`; one
//! that boots but fails a check fails the test. Needs root (BPF, and qemu's 9p share of /).

use pyrometer_e2e::kernels::{self, Outcome, Status};
use pyrometer_e2e::privileged;

fn check(name: &str) {
    if !privileged() {
        return;
    }
    match kernels::run(name) {
        Outcome::Skipped(reason) => println!("skipping: kernel {name}: {reason}"),
        Outcome::Ran(report) => {
            println!("{}", report.table());
            for c in &report.checks {
                if c.status == Status::Skipped {
                    println!("skipping: {name} {}: {}", c.name, c.detail);
                }
            }
            assert!(report.ok(), "kernel {name} failed:\n{}", report.table());
        }
    }
}

#[test]
fn kernel_bookworm_6_1() {
    check("bookworm-6.1");
}

#[test]
fn kernel_bookworm_backports_6_12() {
    check("bookworm-backports-6.12");
}

#[test]
fn kernel_forky() {
    check("forky");
}

#[test]
fn kernel_host() {
    check("host");
}
