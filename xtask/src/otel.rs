//! The OpenTelemetry side of the tests and benchmark: a venv under `target/` with the
//! OpenTelemetry SDK, `opentelemetry-proto` and grpcio from the Python registry and this repository's
//! `python/pyrometer-otel` (installed editable, so a change to it needs no reinstall).

use std::path::{Path, PathBuf};

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

/// Makes (once) `target/otel-venv`; None after saying why when it cannot.
pub fn venv(root: &Path) -> Option<PathBuf> {
    // pip resolves the editable path against its working directory: give it in full.
    let local = root.join("python/pyrometer-otel");
    let packages: Vec<String> = PACKAGES
        .iter()
        .map(|p| {
            if *p == "python/pyrometer-otel" {
                local.to_string_lossy().into_owned()
            } else {
                p.to_string()
            }
        })
        .collect();
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    crate::python_venv(root, "otel-venv", &packages)
}
