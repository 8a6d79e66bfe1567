//! The OpenTelemetry venvs `cargo xtask test` makes (`target/otel-venv`: the OpenTelemetry SDK
//! and `opentelemetry-proto` from the Python registry, and python/pyrometer-otel; and
//! `target/otel-venv-3.13t`, `-3.14t`: the SDK and the package on the free-threaded builds).

use std::path::{Path, PathBuf};

/// The venv's Python, or None after recording why the test skips.
pub fn python() -> Option<PathBuf> {
    let venv = std::env::var_os("PYROMETER_OTEL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/otel-venv"));
    ready(
        &venv,
        "import pyrometer_otel, opentelemetry.proto",
        "cargo xtask test makes it from the Python registry",
    )
}

/// The Python of the free-threaded 3.MINOR venv (`target/otel-venv-3.MINORt`), or None after
/// recording why the test skips.
pub fn free_threaded_python(minor: u32) -> Option<PathBuf> {
    let venv =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/otel-venv-3.{minor}t"));
    ready(
        &venv,
        "import pyrometer_otel, opentelemetry.sdk.trace",
        "cargo xtask test makes it once the free-threaded CPython builds are there",
    )
}

/// `venv`'s Python when `imports` run there; else None, the skip recorded with `how` to make it.
fn ready(venv: &Path, imports: &str, how: &str) -> Option<PathBuf> {
    let python = venv.join("bin/python");
    let ready = std::process::Command::new(&python)
        .args(["-c", imports])
        .output()
        .is_ok_and(|o| o.status.success());
    if ready {
        Some(python)
    } else {
        crate::skip(
            "otel-venv",
            format!("no OpenTelemetry venv at {} ({how})", venv.display()),
        );
        None
    }
}
