//! Bad input gets a one-line message and the documented exit code (README "Exit codes").

use std::process::Command;

use pyrometer_e2e::*;

fn assert_fails(out: &std::process::Output, code: i32, message: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    assert!(err.contains(message), "expected '{message}' in: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
}

#[test]
fn unknown_pid() {
    let dir = scratch("unknown-pid");
    let out = pyrometer(&[
        "record",
        "--pid",
        "4000000",
        "-o",
        dir.join("x.svg").to_str().unwrap(),
    ]);
    assert_fails(&out, 2, "no such process: 4000000");
}

#[test]
fn unwritable_output_fails_before_capture() {
    let dir = scratch("unwritable");
    let marker = dir.join("ran");
    let out = pyrometer(&[
        "record",
        "-o",
        "/nonexistent/dir/x.svg",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]);
    assert_fails(&out, 2, "cannot write /nonexistent/dir/x.svg");
    assert!(
        !marker.exists(),
        "the command ran although the output is unwritable"
    );
}

#[test]
fn unknown_format_lists_valid_ones() {
    let out = pyrometer(&["record", "--format", "xyz", "-o", "/tmp/x", "--", "true"]);
    assert_fails(
        &out,
        2,
        "unknown format 'xyz'; valid formats: folded, svg, pprof, speedscope, chrome",
    );
}

#[test]
fn unknown_type_lists_valid_ones() {
    let out = pyrometer(&[
        "record",
        "--type",
        "alloc_space",
        "-o",
        "/tmp/x.svg",
        "--",
        "true",
    ]);
    assert_fails(&out, 2, "it has: samples, cpu");
}

#[test]
fn nothing_to_profile() {
    let out = pyrometer(&["record"]);
    assert_fails(&out, 2, "nothing to profile");
}

#[test]
fn missing_privileges_are_named() {
    if !privileged() {
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip("tool:setpriv", "setpriv (util-linux) is not installed");
        return;
    }
    let dir = scratch("nopriv");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ])
        .arg(pyrometer_bin())
        .args(["record", "-o"])
        .arg(dir.join("x.svg"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_fails(
        &out,
        3,
        "missing privileges: CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE",
    );
}

#[test]
fn kernel_without_btf() {
    if !privileged() {
        return;
    }
    let dir = scratch("nobtf");
    let out = pyrometer(&[
        "record",
        "--btf-path",
        "/nonexistent/vmlinux",
        "-o",
        dir.join("x.svg").to_str().unwrap(),
        "--",
        "true",
    ]);
    assert_fails(&out, 3, "kernel BTF not found at /nonexistent/vmlinux");
}

#[test]
fn corrupt_profile_file() {
    let dir = scratch("corrupt");
    let bad = dir.join("bad.pb.gz");
    // A gzip header followed by garbage.
    std::fs::write(&bad, [0x1f, 0x8b, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    let out = pyrometer(&["report", bad.to_str().unwrap(), "--top", "5"]);
    assert_fails(&out, 2, "corrupt profile file");
    let empty = dir.join("empty.folded");
    std::fs::write(&empty, b"").unwrap();
    let out = pyrometer(&["report", empty.to_str().unwrap(), "--top", "5"]);
    assert_fails(&out, 2, "is empty");
    let missing = pyrometer(&["report", "/nonexistent.pb.gz", "--top", "5"]);
    assert_eq!(missing.status.code(), Some(2));
}
