//! The kernel matrix: the same payload (the verifier table, a `record` of a C program without
//! frame pointers and one of CPython 3.11) on Debian kernels booted under qemu and on the
//! machine's own kernel. Kernels are fetched as Debian packages, never installed: see
//! `fetch`. Everything lives under `target/kernels/` (see docs/src/kernel-matrix.md).

mod checks;
mod cpio;
mod fetch;
mod payload;
mod qemu;
mod tools;

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use checks::{Check, Status};

/// A Debian kernel of the matrix: the newest generic amd64 kernel that `suite`'s
/// `linux-image-amd64` meta-package points at, which must belong to `series`.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    /// Name used by the tests, `cargo xtask kernels NAME` and the cache directory.
    pub name: &'static str,
    pub suite: &'static str,
    /// Version prefix the resolved kernel must have: the series, never the exact version,
    /// which the archive drops at its next upload. When the suite moves to another series the
    /// kernel is unavailable with a message to update this table (a failure under CI).
    pub series: &'static str,
}

/// The kernels of the matrix, in one place. Bookworm's 6.1 and its backported 6.12 are the
/// kernels most of today's fleet runs; forky (testing) carries the newest verifier (7.2 as of
/// 2026-12-05).
pub const KERNELS: &[Kernel] = &[
    Kernel {
        name: "bookworm-6.1",
        suite: "bookworm",
        series: "6.1.",
    },
    Kernel {
        name: "bookworm-backports-6.12",
        suite: "bookworm-backports",
        series: "6.12.",
    },
    Kernel {
        name: "forky",
        suite: "forky",
        series: "7.2.",
    },
];

/// The machine's own kernel, run without qemu.
pub const HOST: &str = "host";

/// Names `run` accepts: the matrix's kernels and `host`.
pub fn names() -> Vec<&'static str> {
    KERNELS
        .iter()
        .map(|k| k.name)
        .chain(std::iter::once(HOST))
        .collect()
}

/// The series `name`'s kernel is pinned to (None for `host` or an unknown name).
pub fn series(name: &str) -> Option<&'static str> {
    KERNELS.iter().find(|k| k.name == name).map(|k| k.series)
}

/// What a kernel that could not be fetched means for this run: under CI a failure (the table
/// or the network needs a look), elsewhere a skip in the ledger. Returns the failure's text.
pub fn unavailable(name: &str, reason: &str) -> Option<String> {
    let text = format!(
        "kernel {name} is unavailable: {reason} (if the suite has moved to another series, \
         update KERNELS in tests/src/kernels/mod.rs)"
    );
    if crate::ci() {
        Some(text)
    } else {
        crate::skip(&format!("kernel:{name}"), text);
        None
    }
}

/// What running the payload on one kernel gave.
#[derive(Debug)]
pub enum Outcome {
    /// The kernel could not be fetched for a reason outside this code (no network, package
    /// gone, the suite moved to another series): a skip in the ledger, a failure under CI.
    Skipped(String),
    Ran(Report),
}

/// The checks of one kernel.
#[derive(Debug)]
pub struct Report {
    pub kernel: String,
    /// `uname -r` as the payload saw it (empty when it never ran).
    pub release: String,
    pub checks: Vec<Check>,
    /// Serial console (qemu) or the payload's directory (host).
    pub log: PathBuf,
    pub seconds: f64,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.status != Status::Fail)
    }

    /// One line per check: `kernel  check  status  seconds  detail`.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{} ({}), {:.0} s, log {}\n",
            self.kernel,
            if self.release.is_empty() {
                "did not run"
            } else {
                &self.release
            },
            self.seconds,
            self.log.display()
        );
        for c in &self.checks {
            // A multi-line detail (the verifier's table, a log's tail) is indented below.
            let detail = c.detail.replace('\n', "\n      ");
            out.push_str(&format!(
                "  {:<9} {:<5} {:>6.1} s  {detail}\n",
                c.name,
                c.status.word(),
                c.seconds,
            ));
        }
        out
    }
}

/// Where the matrix keeps downloads, unpacked kernels, logs and results.
pub fn cache_root() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
            tests.parent().unwrap_or(tests).join("target")
        })
        .join("kernels")
}

/// Fetches kernel `name` of the matrix unless it is cached: its release, or why not.
pub fn fetch(name: &str) -> Result<String, String> {
    let kernel = KERNELS
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| format!("unknown kernel {name}; known: {:?}", names()))?;
    fetch::prepare(kernel, &cache_root())
        .map(|p| p.release)
        .map_err(|e| e.to_string())
}

/// Fetches (or reuses) kernel `name`, boots it with the payload and checks the results; `host`
/// runs the payload on the machine's kernel. Panics only on an unknown name.
pub fn run(name: &str) -> Outcome {
    let started = Instant::now();
    let root = cache_root();
    let setup = payload::Setup::find();
    if name == HOST {
        let dir = root.join(HOST);
        let checks = payload::run_on_host(&setup, &dir);
        return Outcome::Ran(report(name, &dir, dir.join("results"), checks, started));
    }
    let kernel = KERNELS
        .iter()
        .find(|k| k.name == name)
        .unwrap_or_else(|| panic!("unknown kernel {name}; known: {:?}", names()));
    let prepared = match fetch::prepare(kernel, &root) {
        Ok(p) => p,
        Err(fetch::FetchError::Unavailable(reason)) => return Outcome::Skipped(reason),
        Err(e) => {
            let check = Check::fail("fetch", 0.0, e.to_string());
            let dir = root.join(name);
            return Outcome::Ran(report(name, &dir, dir.clone(), vec![check], started));
        }
    };
    let dir = root.join(name);
    let checks = qemu::boot(&prepared, &setup, &dir);
    Outcome::Ran(report(name, &dir, dir.join("serial.log"), checks, started))
}

/// Boots kernel `name` as `run` does, but with `init` as the initramfs's /init (no payload)
/// and qemu killed after `limit_s` seconds: for the tests of the runner itself. Logs go to
/// `target/kernels/NAME-custom/`.
pub fn boot_with_init(name: &str, init: &str, limit_s: u64) -> Outcome {
    let started = Instant::now();
    let root = cache_root();
    let kernel = KERNELS
        .iter()
        .find(|k| k.name == name)
        .unwrap_or_else(|| panic!("unknown kernel {name}; known: {:?}", names()));
    let prepared = match fetch::prepare(kernel, &root) {
        Ok(p) => p,
        Err(fetch::FetchError::Unavailable(reason)) => return Outcome::Skipped(reason),
        Err(e) => panic!("cannot prepare {name}: {e}"),
    };
    let dir = root.join(format!("{name}-custom"));
    let limit = std::time::Duration::from_secs(limit_s);
    let checks = qemu::boot_with(&prepared, None, init, &[], &dir, limit);
    Outcome::Ran(report(name, &dir, dir.join("serial.log"), checks, started))
}

fn report(name: &str, dir: &Path, log: PathBuf, checks: Vec<Check>, started: Instant) -> Report {
    let release = std::fs::read_to_string(dir.join("results/uname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    Report {
        kernel: name.to_string(),
        release,
        checks,
        log,
        seconds: started.elapsed().as_secs_f64(),
    }
}
