//! The kernel matrix (tests/src/kernels): on Debian's 6.1, 6.12 and forky kernels booted under
//! qemu, and on the machine's own kernel, the verifier table, a `record` of cpu631 built
//! without frame pointers (complete DWARF stacks, 6:3:1) and of CPython 3.11 running py631.py
//! (Python frames, 6:3:1). A kernel that cannot be fetched is a skip in the ledger, and a
//! failure under CI (`CI=true`); one that boots but fails a check fails the test. Needs root
//! (BPF, and qemu's 9p share of /).

use pyrometer_e2e::kernels::{self, Outcome, Status};
use pyrometer_e2e::{privileged, skip};

fn check(name: &str) {
    if !privileged() {
        return;
    }
    match kernels::run(name) {
        Outcome::Skipped(reason) => {
            if let Some(failure) = kernels::unavailable(name, &reason) {
                panic!("{failure}");
            }
        }
        Outcome::Ran(report) => {
            println!("{}", report.table());
            println!(
                "kernel {name} booted {}{}",
                report.release,
                kernels::series(name)
                    .map(|s| format!(" (pinned series {})", s.trim_end_matches('.')))
                    .unwrap_or_default()
            );
            for c in &report.checks {
                if c.status == Status::Skipped {
                    skip(
                        &format!("kernel:{name}:{}", c.name),
                        format!("{name} {}: {}", c.name, c.detail),
                    );
                }
            }
            assert!(report.ok(), "kernel {name} failed:\n{}", report.table());
            if let Some(series) = kernels::series(name) {
                assert!(
                    report.release.starts_with(series),
                    "kernel {name} booted {}, not the pinned {series} series",
                    report.release
                );
            }
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

/// A guest that never powers off is killed at its limit and reported with its serial console,
/// never a hang: booted with an /init that prints a line and sleeps.
#[test]
fn kernel_hung_guest_is_killed() {
    if !privileged() {
        return;
    }
    let init = "#!/bin/busybox sh\n\
                /bin/busybox echo pyrometer-init: hanging on purpose\n\
                exec /bin/busybox sleep 100000\n";
    let limit_s = 40;
    let started = std::time::Instant::now();
    let name = "bookworm-backports-6.12";
    match kernels::boot_with_init(name, init, limit_s) {
        Outcome::Skipped(reason) => {
            if let Some(failure) = kernels::unavailable(name, &reason) {
                panic!("{failure}");
            }
        }
        Outcome::Ran(report) => {
            let waited = started.elapsed().as_secs();
            let boot = &report.checks[0];
            println!("{}", report.table());
            assert_eq!(boot.status, Status::Fail, "{}", report.table());
            assert!(boot.detail.contains("killed"), "{}", boot.detail);
            assert!(
                boot.detail.contains("hanging on purpose"),
                "the log's tail is missing: {}",
                boot.detail
            );
            assert!(
                waited < limit_s + 30,
                "took {waited} s for a {limit_s} s limit"
            );
            assert!(!report.ok());
        }
    }
}
