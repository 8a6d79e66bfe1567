//! The one way a test of this workspace skips, in whole or in part: [`skip`] prints
//! `skipping: <reason>` (what a reader of the test's output sees) and, when the run names a
//! ledger in [`LEDGER_ENV`], appends one JSON line to it (binary, test, capability, reason)
//! that `cargo xtask test` prints at the end and, under CI, checks against
//! `tests/allowed-skips.toml`. A skip that is not written down is a pass nobody sees.
//!
//! No dependencies: the library crates' unit tests use it as a dev-dependency.

use std::fmt::Display;
use std::io::Write;

/// Names the file skips are appended to (`cargo xtask test` sets it under the target dir).
pub const LEDGER_ENV: &str = "PYROMETER_SKIP_LEDGER";

/// One skip, as a ledger line holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    /// The test binary (nextest's binary id, e.g. `pyrometer-e2e::kernels`).
    pub binary: String,
    /// The test's name within its binary (e.g. `kernel_forky`, `python::tests::offsets`).
    pub test: String,
    /// What the machine lacks, as a short key (`root`, `python:pyenv-3.12.1`, `forky-root`,
    /// `kernel:forky`, `tool:promtool`, `gpu`, ...): what the allowed-skips file names.
    pub capability: String,
    pub reason: String,
}

impl Skip {
    /// The ledger's line (without the newline).
    pub fn to_json(&self) -> String {
        format!(
            "{{\"binary\":{},\"test\":{},\"capability\":{},\"reason\":{}}}",
            json_string(&self.binary),
            json_string(&self.test),
            json_string(&self.capability),
            json_string(&self.reason)
        )
    }
}

/// Records that the calling test skips (all of it, or the part the caller leaves out) for
/// want of `capability`, and prints `skipping: <reason>`. Call it from the test's own thread:
/// the test's name is read from nextest's environment or, under `cargo test`, the thread.
pub fn skip(capability: &str, reason: impl Display) {
    let reason = reason.to_string();
    println!("skipping: {reason}");
    let entry = Skip {
        binary: binary(),
        test: test_name(),
        capability: capability.to_string(),
        reason,
    };
    let Some(path) = std::env::var_os(LEDGER_ENV) else {
        return;
    };
    // A skip that cannot be recorded must not pass quietly.
    if let Err(e) = append_line(std::path::Path::new(&path), &entry.to_json()) {
        panic!(
            "cannot record the skip in {}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}

/// Appends `line` and a newline to `path` in one write to a file opened for appending, so
/// that lines of tests running in parallel processes do not interleave.
pub fn append_line(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    let line = format!("{line}\n");
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
}

/// The calling test's binary and name, as a ledger line names them.
pub fn current_test() -> (String, String) {
    (binary(), test_name())
}

/// True when the run is CI's (`CI=true`, as CI services set it, or `CI=1`): set-up that
/// failed is then an error, not a reason to skip.
pub fn ci() -> bool {
    std::env::var("CI")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
}

fn test_name() -> String {
    if let Ok(name) = std::env::var("NEXTEST_TEST_NAME") {
        return name;
    }
    // libtest runs each test on a thread named after it.
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("<unknown test>")
        .to_string()
}

fn binary() -> String {
    if let Ok(id) = std::env::var("NEXTEST_BINARY_ID") {
        return id;
    }
    // Under `cargo test`: the executable's name without cargo's hash (`kernels-0a1b2c…`).
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| match s.rsplit_once('-') {
            Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
            _ => s,
        })
        .unwrap_or_else(|| "<unknown binary>".into())
}

/// `s` as a JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_json_with_its_strings_escaped() {
        let s = Skip {
            binary: "pyrometer-e2e::kernels".into(),
            test: "kernel_forky".into(),
            capability: "kernel:forky".into(),
            reason: "a \"quoted\"\tpath\\x\nand a bell \u{7}".into(),
        };
        assert_eq!(
            s.to_json(),
            r#"{"binary":"pyrometer-e2e::kernels","test":"kernel_forky","capability":"kernel:forky","reason":"a \"quoted\"\tpath\\x\nand a bell \u0007"}"#
        );
    }

    #[test]
    fn the_test_is_named_from_the_runner() {
        // nextest says which test runs; libtest's thread name says the same under cargo test.
        let name = test_name();
        assert!(
            name.ends_with("the_test_is_named_from_the_runner"),
            "{name}"
        );
        assert!(binary().starts_with("skip"), "{}", binary());
    }
}
