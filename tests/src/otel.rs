//! The OpenTelemetry venv `cargo xtask test` makes (`target/otel-venv`: the OpenTelemetry SDK
//! and `opentelemetry-proto` from the Python registry, and python/pyrometer-otel).

use std::path::{Path, PathBuf};

/// The venv's Python, or None after recording why the test skips.
pub fn python() -> Option<PathBuf> {
    let venv = std::env::var_os("PYROMETER_OTEL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/otel-venv"));
    let python = venv.join("bin/python");
    let ready = std::process::Command::new(&python)
        .args(["-c", "import pyrometer_otel, opentelemetry.proto"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ready {
        Some(python)
    } else {
        crate::skip(
            "otel-venv",
            format!(
                "no OpenTelemetry venv at {} (cargo xtask test makes it from the Python registry)",
                venv.display()
            ),
        );
        None
    }
}
