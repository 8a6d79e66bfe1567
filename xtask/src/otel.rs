//! The OpenTelemetry side of the tests and benchmark: a venv under `target/` with the
//! OpenTelemetry SDK, `opentelemetry-proto` and grpcio from the Python registry and this repository's
//! `python/pyrometer-otel` (installed editable, so a change to its Python needs no reinstall;
//! its C fast path, built in place by pip, is rebuilt when its source is newer).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The pinned OpenTelemetry packages (`opentelemetry-proto` 1.45.2 ships the
/// `profiles/v1development` messages the collector's vendored protos match).
pub const PACKAGES: &[&str] = &[
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-proto==1.45.2",
    // The OTLP test's receiver serves gRPC.
    "grpcio==1.76.0",
    "-e",
    "python/pyrometer-otel",
];

/// What the Ray venv gets beside Ray, for the traced Ray test (Ray's tracing start-up hook
/// needs the OpenTelemetry SDK in every worker).
const RAY_EXTRA: &[&str] = &["opentelemetry-sdk==1.45.2", "-e", "python/pyrometer-otel"];

/// `packages` with the local package's path made absolute (pip resolves an editable path
/// against its working directory).
fn absolute(root: &Path, packages: &[&str]) -> Vec<String> {
    let local = root.join("python/pyrometer-otel");
    packages
        .iter()
        .map(|p| {
            if *p == "python/pyrometer-otel" {
                local.to_string_lossy().into_owned()
            } else {
                p.to_string()
            }
        })
        .collect()
}

/// Makes (once) `target/otel-venv`.
pub fn venv(root: &Path) -> Result<PathBuf> {
    let packages = absolute(root, PACKAGES);
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    let venv = crate::python_venv(root, "otel-venv", &packages)?;
    // A linked venv (another checkout's) is not rebuilt from this checkout's source.
    if !venv.is_symlink() {
        fast_path(root, &venv);
    }
    Ok(venv)
}

/// The SDK and this repository's package for each free-threaded interpreter in
/// `interpreters` (`…/bin/python3.13t`): `target/otel-venv-3.13t`. No gRPC or proto
/// packages: the span-label tests on these builds need the SDK alone. The package's C fast
/// path refuses to load there (its calls assume the GIL), so no build of it is attempted.
pub fn free_threaded_venvs(root: &Path, interpreters: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let packages = absolute(root, FREE_THREADED_PACKAGES);
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    interpreters
        .iter()
        .map(|python| {
            let label = python
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("python"))
                .context("a free-threaded interpreter named python3.Nt")?;
            crate::python_venv_of(python, root, &format!("otel-venv-{label}"), &packages)
        })
        .collect()
}

/// What [`free_threaded_venvs`] installs.
const FREE_THREADED_PACKAGES: &[&str] =
    &["opentelemetry-sdk==1.45.2", "-e", "python/pyrometer-otel"];

/// Rebuilds the package's C extension (`_fastslot`, built in place next to its source by an
/// editable install) when it is missing or older than its source, as in a venv made before
/// the source changed. A failed build is said and left: the package then runs its
/// pure-Python path, and the tests that expect the fast one fail.
fn fast_path(root: &Path, venv: &Path) {
    let dir = root.join("python/pyrometer-otel/src/pyrometer_otel");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let Some(source) = modified(&dir.join("_fastslot.c")) else {
        return;
    };
    let built = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("_fastslot.") && name.ends_with(".so")
        })
        .filter_map(|e| modified(&e.path()))
        .max();
    if built.is_some_and(|b| b >= source) {
        return;
    }
    let made = crate::run(
        std::process::Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "-e",
            ])
            .arg(root.join("python/pyrometer-otel")),
    );
    if let Err(e) = made {
        eprintln!("cannot build pyrometer-otel's C fast path: {e:#}");
    }
}

/// Makes (once) `target/ray-venv`: Ray, and what its traced test needs.
pub fn ray_venv(root: &Path) -> Result<PathBuf> {
    let mut packages: Vec<&str> = crate::RAY_PACKAGES.to_vec();
    packages.extend_from_slice(RAY_EXTRA);
    let packages = absolute(root, &packages);
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    crate::python_venv(root, "ray-venv", &packages)
}
