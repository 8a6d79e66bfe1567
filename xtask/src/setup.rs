//! The set-up steps of `cargo xtask demo` and `cargo xtask test`, each timed. A step the
//! tests depend on that fails (an interpreter missing, a venv, the forky root, a kernel image,
//! ClickHouse, Chromium) fails the run under CI (`CI=true`), naming every such step, instead
//! of leaving its tests to skip; elsewhere it is a warning and the skip ledger shows what it
//! cost.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{apt, cargo, run};

/// What building and profiling need (the demo): clang and the kernel headers for the BPF
/// programs, gcc and the C library's headers for ring's C parts and the demo's workload.
pub const DEMO_PACKAGES: &[(&str, &str)] = &[
    ("clang", "/usr/bin/clang"),
    // bindgen reads the kernel ABI header (ebpf/build.rs).
    ("libclang-dev", "/usr/share/doc/libclang-dev"),
    ("libbpf-dev", "/usr/include/bpf/bpf_helpers.h"),
    ("linux-libc-dev", "/usr/include/linux/bpf.h"),
    ("gcc", "/usr/bin/gcc"),
    ("libc6-dev", "/usr/include/stdio.h"),
];

/// What only the tests (and benchmarks) need, each with a file that shows it is installed.
/// The kernel matrix's qemu and busybox are not here: they are unpacked under target/qemu.
pub const TEST_PACKAGES: &[(&str, &str)] = &[
    ("binutils", "/usr/bin/objcopy"),
    // The kernel-side C is checked by clang-format (.clang-format).
    ("clang-format", "/usr/bin/clang-format"),
    ("util-linux", "/usr/bin/setpriv"),
    ("golang-go", "/usr/bin/go"),
    // promtool checks the agent's and collector's /metrics.
    ("prometheus", "/usr/bin/promtool"),
    // The speedscope export is checked in the real viewer (npm package), in headless Chromium.
    ("chromium", "/usr/bin/chromium"),
    ("nodejs", "/usr/bin/node"),
    ("npm", "/usr/bin/npm"),
    // elfutils' debuginfod server, which the debuginfod tests fetch debug files from.
    ("debuginfod", "/usr/bin/debuginfod"),
    // The CPython offset table is checked against each build's DWARF through gdb.
    ("gdb", "/usr/bin/gdb"),
    // The separate debug file of Debian's python3.11 (the GIL probes' symbols); installing it
    // upgrades python3.11 to the matching build.
    ("python3.11-dbg", "/usr/share/doc/python3.11-dbg"),
    // Allocators other than glibc's, preloaded by the allocation tests.
    ("libjemalloc2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
    (
        "libtcmalloc-minimal4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    ),
    // For the e2e tests' OpenSSL-made TLS certificates and HTTPS queries.
    ("openssl", "/usr/bin/openssl"),
    ("curl", "/usr/bin/curl"),
    // `pyrometer top` is tested in a real terminal: tmux, read back with capture-pane.
    ("tmux", "/usr/bin/tmux"),
    // The generated man pages are rendered with groff in a test.
    ("groff-base", "/usr/bin/groff"),
    // The Kubernetes manifests are parsed with PyYAML; the agent image is built and run by a
    // private dockerd of the test's own.
    (
        "python3-yaml",
        "/usr/lib/python3/dist-packages/yaml/__init__.py",
    ),
    ("docker.io", "/usr/sbin/dockerd"),
    // The kernel matrix (tests/src/kernels): depmod, xz and zstd prepare the guest kernels'
    // modules.
    ("kmod", "/usr/bin/kmod"),
    ("xz-utils", "/usr/bin/xz"),
    ("zstd", "/usr/bin/zstd"),
    // The collector's shared store: the tests start it by hand on loopback with a private
    // data directory (no system service runs it).
    ("clickhouse-server", "/usr/sbin/clickhouse-server"),
    // The Debian forky root with CPython 3.14 and 3.15 (forky.rs).
    ("debootstrap", "/usr/sbin/debootstrap"),
    // The free-threaded CPython builds (cpython.rs): their zlib module, which the tests call
    // for a C function under its Python caller.
    ("zlib1g-dev", "/usr/include/zlib.h"),
];

/// pyenv's CPython builds the tests run (shared builds with symbols, made with `pyenv install
/// VERSION`; the machine image provides them): 3.6 and 3.7 for the refusals, 3.8-3.13 for
/// everything else.
pub const PYENV_VERSIONS: &[&str] = &[
    "3.6.15", "3.7.16", "3.8.18", "3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0",
];

/// cargo-nextest, installed at this version when missing (the run-alone groups and the JUnit
/// report the ledger reads are nextest's).
pub const NEXTEST_VERSION: &str = "0.9.143";

/// Timed steps; the failures of those the tests depend on are kept for [`Steps::finish`].
pub struct Steps {
    ci: bool,
    times: Vec<(String, Duration, bool)>,
    failed: Vec<String>,
}

impl Steps {
    pub fn new(ci: bool) -> Steps {
        Steps {
            ci,
            times: Vec::new(),
            failed: Vec::new(),
        }
    }

    /// Runs a step the run cannot go on without: its failure is returned at once.
    pub fn must<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let result = f();
        self.record(name, started.elapsed(), result.is_ok());
        result.with_context(|| format!("set-up step '{name}' failed"))
    }

    /// Runs a step tests depend on: a failure is said now and, under CI, fails the run at
    /// [`Steps::finish`]; elsewhere the tests that need it skip.
    pub fn needed<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Option<T> {
        let started = Instant::now();
        let result = f();
        self.record(name, started.elapsed(), result.is_ok());
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                let why = format!("{name}: {e:#}");
                eprintln!(
                    "set-up step failed: {why}{}",
                    if self.ci {
                        ""
                    } else {
                        " (the tests that need it will skip; under CI=true this fails the run)"
                    }
                );
                self.failed.push(why);
                None
            }
        }
    }

    fn record(&mut self, name: &str, took: Duration, ok: bool) {
        eprintln!(
            "step {name}: {:.1} s{}",
            took.as_secs_f64(),
            if ok { "" } else { " (failed)" }
        );
        self.times.push((name.to_string(), took, ok));
    }

    /// Under CI, fails naming every step the tests need that failed.
    pub fn finish(&self) -> Result<()> {
        if self.ci && !self.failed.is_empty() {
            bail!(
                "the test set-up is incomplete, and under CI its tests may not skip:\n  {}",
                self.failed.join("\n  ")
            );
        }
        Ok(())
    }

    /// Each step's time, in the order they ran.
    pub fn table(&self) -> String {
        let mut out = String::from("step times:\n");
        for (name, took, ok) in &self.times {
            out.push_str(&format!(
                "  {:>7.1} s  {name}{}\n",
                took.as_secs_f64(),
                if *ok { "" } else { "  (failed)" }
            ));
        }
        out
    }
}

/// `~/.pyenv/versions/VERSION/bin/python3.X`.
pub fn pyenv(version: &str) -> std::path::PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let minor = version.rsplit_once('.').map_or(version, |(m, _)| m);
    Path::new(&home).join(format!(".pyenv/versions/{version}/bin/python{minor}"))
}

/// Every interpreter the tests run: pyenv's builds and Debian's python3.11.
pub fn interpreters() -> Result<()> {
    let mut missing: Vec<String> = PYENV_VERSIONS
        .iter()
        .map(|v| pyenv(v))
        .filter(|p| !p.exists())
        .map(|p| format!("{} (pyenv install {})", p.display(), version_of(&p)))
        .collect();
    if !Path::new("/usr/bin/python3.11").exists() {
        missing.push("/usr/bin/python3.11 (Debian's python3.11)".into());
    }
    if !missing.is_empty() {
        bail!("missing interpreters: {}", missing.join(", "));
    }
    Ok(())
}

fn version_of(python: &Path) -> String {
    python
        .ancestors()
        .nth(2)
        .and_then(|d| d.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// cargo-nextest, installed (pinned, `--locked`) when `cargo nextest` is missing.
pub fn nextest() -> Result<()> {
    let has = cargo()
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has {
        return Ok(());
    }
    eprintln!("cargo-nextest is missing: installing {NEXTEST_VERSION}");
    run(cargo().args([
        "install",
        "cargo-nextest",
        "--locked",
        "--version",
        NEXTEST_VERSION,
    ]))
}

/// Fetches (or finds cached) every kernel of the matrix, so a download that fails is a set-up
/// failure, with its reason, before the tests run.
pub fn kernel_images() -> Result<()> {
    crate::kernels::matrix(&["--fetch".to_string()])
}

/// A program the tests run answers `args` (e.g. `--version`) with success.
pub fn answers(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A file the tests need exists.
pub fn present(path: &str) -> Result<()> {
    if !Path::new(path).exists() {
        bail!("{path} is missing");
    }
    Ok(())
}

/// Installs what the demo needs (apt's plan checked first).
pub fn demo_packages() -> Result<()> {
    apt::install(DEMO_PACKAGES)
}

/// Installs what the demo and the tests need (apt's plan checked first).
pub fn all_packages() -> Result<()> {
    let all: Vec<(&str, &str)> = DEMO_PACKAGES.iter().chain(TEST_PACKAGES).copied().collect();
    apt::install(&all)
}

/// What a whole `cargo xtask test` from a clean clone leaves under target/ (the debug build
/// and its test binaries, the forky root, kernel images, venvs): about 14 GB measured.
const TEST_DISK_BYTES: u64 = 16 << 30;

/// Says up front when the file system of `dir` has less free space than a whole run needs, so
/// a build that would stop on "No space left on device" halfway is explained before it starts.
pub fn warn_if_short_of_disk(dir: &std::path::Path) {
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: statvfs is plain data, for which all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid C string and `st` a struct statvfs the call fills in.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return;
    }
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    if free < TEST_DISK_BYTES {
        eprintln!(
            "warning: {:.1} GB free under {}; a whole test run needs about {} GB (free some \
             space, or the build may stop with \"No space left on device\")",
            free as f64 / 1e9,
            dir.display(),
            TEST_DISK_BYTES >> 30
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pyenv_paths_name_their_minor_version() {
        let p = pyenv("3.12.1");
        assert!(
            p.ends_with(".pyenv/versions/3.12.1/bin/python3.12"),
            "{}",
            p.display()
        );
        assert_eq!(version_of(&p), "3.12.1");
    }

    /// A step the tests need that failed fails `finish` under CI, naming it, and only there.
    #[test]
    fn a_needed_step_that_failed_fails_only_under_ci() {
        for ci in [false, true] {
            let mut steps = Steps::new(ci);
            assert_eq!(steps.needed("fine", || Ok(1)), Some(1));
            let none: Option<()> = steps.needed("forky root", || bail!("debootstrap failed"));
            assert!(none.is_none());
            let table = steps.table();
            assert!(table.contains("forky root  (failed)"), "{table}");
            match steps.finish() {
                Ok(()) => assert!(!ci),
                Err(e) => {
                    assert!(ci);
                    let text = format!("{e:#}");
                    assert!(text.contains("forky root: debootstrap failed"), "{text}");
                }
            }
        }
        let mut steps = Steps::new(false);
        let err = steps.must("apt", || -> Result<()> { bail!("no apt") });
        assert!(format!("{:#}", err.unwrap_err()).contains("'apt' failed: no apt"));
    }
}
