//! The cost of python/pyrometer-otel's span processor per span start + end (issue #19 asks
//! for at most 1 µs): its own hooks on a real SDK span, and whole SDK spans with and without
//! it, in alternating rounds on pyenv's 3.11 (the OpenTelemetry venv). Prints medians.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

pub fn bench(root: &Path, pairs: usize) -> Result<()> {
    let venv = match crate::otel::venv(root) {
        Ok(v) => v,
        Err(e) => {
            println!("otel: skipped (no OpenTelemetry venv: {e:#})");
            return Ok(());
        }
    };
    let out = Command::new(venv.join("bin/python"))
        .arg(root.join("python/pyrometer-otel/bench/span_cost.py"))
        .arg(pairs.to_string())
        .output()
        .context("run the span processor benchmark")?;
    if !out.status.success() {
        bail!(
            "span processor benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    print!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}
