//! Readers for the allocation tests: the fixtures' own accounts and `record --leaks`'s report.

use std::collections::HashMap;

use crate::{PprofSample, assert_ok, fixture, pyrometer_bin, scratch};

/// The fixture's own account: function -> (allocations, bytes).
pub fn fixture_totals(stdout: &[u8]) -> HashMap<String, (f64, f64)> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let name = f.next()?.to_string();
            let count: f64 = f.next()?.parse().ok()?;
            let bytes: f64 = f.next()?.parse().ok()?;
            Some((name, (count, bytes)))
        })
        .collect()
}

/// Total of a sample type over the samples whose stack holds `function`.
pub fn by_function(samples: &[PprofSample], index: usize, function: &str) -> f64 {
    samples
        .iter()
        .filter(|s| s.functions.iter().any(|f| f == function))
        .map(|s| s.values[index] as f64)
        .sum()
}

/// The standard deviation, as a share of the truth, of a byte total estimated from samples
/// taken every `rate` bytes on average: about 1/sqrt(samples expected). Bounds of four of
/// these hold in all but about one run in 15,000 per total checked; fixed percentages either
/// cannot fail at large totals or fail now and then at small ones.
pub fn sampling_spread(bytes: f64, rate: f64) -> f64 {
    1.0 / (bytes / rate).sqrt()
}

/// The lines of `record --leaks`'s report, the largest site first.
pub fn leak_report(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .skip_while(|l| !l.starts_with("pyrometer: leaks:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect()
}

/// Runs `record ARGS -o DIR/alloc.pb.gz -- allocs FIXTURE_ARGS` (fixtures/allocs.c), which must
/// succeed; returns its output and the profile's path.
pub fn record_allocs(
    name: &str,
    args: &[&str],
    fixture_args: &[&str],
) -> (std::process::Output, std::path::PathBuf) {
    let bin = fixture("allocs");
    let mut command = vec![bin.to_str().unwrap()];
    command.extend_from_slice(fixture_args);
    record_command(name, args, &command)
}

/// Runs `record ARGS -o DIR/alloc.pb.gz -- COMMAND` in a scratch directory named for `name`,
/// which must succeed; returns its output and the profile's path.
pub fn record_command(
    name: &str,
    args: &[&str],
    command: &[&str],
) -> (std::process::Output, std::path::PathBuf) {
    record_command_env(name, args, command, &[])
}

/// [`record_command`] with `env` added to `record`'s environment.
pub fn record_command_env(
    name: &str,
    args: &[&str],
    command: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Output, std::path::PathBuf) {
    let dir = scratch(name);
    let out = dir.join("alloc.pb.gz");
    let mut all = vec!["record", "-o", out.to_str().unwrap()];
    all.extend_from_slice(args);
    all.push("--");
    all.extend_from_slice(command);
    let result = std::process::Command::new(pyrometer_bin())
        .args(&all)
        .envs(env.iter().copied())
        .output()
        .expect("run pyrometer");
    assert_ok(&result);
    (result, out)
}

/// `pyrometer install-preload DIR`: the sampler library the built `pyrometer` carries,
/// written into `dir`, for a process to preload; its path (which the command prints).
pub fn install_preload(dir: &std::path::Path) -> std::path::PathBuf {
    let out = std::process::Command::new(pyrometer_bin())
        .arg("install-preload")
        .arg(dir)
        .output()
        .expect("run pyrometer");
    assert_ok(&out);
    let path = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert_eq!(path, dir.join("libpyrometer_alloc.so"));
    path
}

/// The `--stats` file `record` wrote.
pub fn read_stats(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `bin` (a build of fixtures/allocs.c) started as `bin pause ARGS`, with `env` set: it waits
/// for a line on its stdin in main, and is returned once its C library is mapped (so its
/// allocator can be probed). Its stdout is piped (its totals).
pub fn paused_allocs(
    bin: &std::path::Path,
    args: &[&str],
    env: &[(&str, &std::path::Path)],
) -> std::process::Child {
    use std::process::{Command, Stdio};
    let workload = Command::new(bin)
        .arg("pause")
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let maps = format!("/proc/{}/maps", workload.id());
    crate::wait::wait_until(
        std::time::Duration::from_secs(30),
        "the workload's C library mapped",
        || std::fs::read_to_string(&maps).is_ok_and(|m| m.contains("libc.so")),
    );
    workload
}

/// `pyrometer ARGS` started, its standard error read until it says it samples: the process,
/// the rest of its standard error, and what it said so far.
pub fn record_until_sampling(
    args: &[&str],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStderr>,
    String,
) {
    use std::io::BufRead;
    let mut record = std::process::Command::new(crate::pyrometer_bin())
        .args(args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(record.stderr.take().unwrap());
    let mut text = String::new();
    while !text.contains("pyrometer: sampling") {
        assert!(err.read_line(&mut text).unwrap() > 0, "{text}");
    }
    (record, err, text)
}
