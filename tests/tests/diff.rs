//! `pyrometer diff` as a CI gate, on real recordings of a workload with a known regression:
//! `regress` splits its time evenly between crunch() and steady(); `regress-slow` is the same
//! source with crunch() doing twice the work, so crunch's self share grows from ~50 % to
//! ~67 % (+16.7 pts). Each run does a fixed number of rounds, so its sample count is set by
//! its CPU time whatever else the machine runs. Recordings need root; without it each test
//! prints `skipping: …`.
//!
//! Why these sample counts cannot flap: the gate needs a growth of more than 5 pts *and* a
//! two-proportion z-test p-value below 0.001 (z > 3.29). At -F 999 a run gives several
//! hundred samples per second of CPU. The baseline at ~900 samples and the slowed build at
//! ~1300 have an expected z of about 16.7 / sqrt(0.6 * 0.4 * (1/900 + 1/1300)) ≈ 7.9, more
//! than 4.5 standard errors above the bar: it is missed with odds below 1e-5. Two runs of one
//! build (~350 samples each) exceed the bar by chance with
//! probability about 0.001 per pair (only crunch and steady hold enough samples to move
//! 5 pts), so two or more of 20 pairs fail with probability below 2e-4.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pyrometer_e2e::*;

/// Records `fixture -r ROUNDS` at 999 Hz into `out` (a pprof file). A fixed amount of work,
/// not a fixed time: samples count CPU time, so the count is known however loaded the
/// machine is, and the slowed build yields more of them.
fn record(fixture_name: &str, rounds: &str, out: &Path) -> Command {
    let mut cmd = Command::new(pyrometer_bin());
    cmd.args(["record", "-F", "999", "-o"])
        .arg(out)
        .arg("--")
        .arg(fixture(fixture_name))
        .args(["-r", rounds]);
    cmd
}

/// Recordings made at once, as CI jobs sharing a runner would make them.
fn record_all(runs: &[(&str, &Path)], rounds: &str) {
    let children: Vec<_> = runs
        .iter()
        .map(|(name, out)| {
            record(name, rounds, out)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start pyrometer")
        })
        .collect();
    for child in children {
        assert_ok(&child.wait_with_output().expect("wait for pyrometer"));
    }
}

fn diff(args: &[&str]) -> Output {
    pyrometer(&[&["diff"], args].concat())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn slowed_function_fails_the_gate_and_is_named() {
    if !privileged() {
        return;
    }
    let dir = scratch("diff-regression");
    let (base, new) = (dir.join("base.pb.gz"), dir.join("new.pb.gz"));
    // ~0.9 s of CPU for the baseline, ~1.3 s for the candidate.
    record_all(&[("regress", &base), ("regress-slow", &new)], "3000");
    let svg = dir.join("diff.svg");
    let out = diff(&[s(&base), s(&new), "--fail-above", "5", "--svg", s(&svg)]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(
        err.contains("regression: self share grew by more than 5 pts") && err.contains("crunch ("),
        "{err}"
    );
    assert!(
        !err.contains("steady ("),
        "steady shrank, it did not regress: {err}"
    );
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table
        .lines()
        .find(|l| l.ends_with(" crunch"))
        .unwrap_or_else(|| panic!("no crunch row:\n{table}"));
    assert!(row.starts_with("REGRESSION"), "{table}");

    // The differential flame graph: crunch is drawn red (grown), steady blue (shrunk).
    let svg = std::fs::read_to_string(&svg).expect("differential SVG written");
    let (r, g, b) = fill_of(&svg, "crunch");
    assert!(
        r > g && r > b,
        "crunch not marked as grown: rgb({r},{g},{b})"
    );
    let (r, g, b) = fill_of(&svg, "steady");
    assert!(
        b > r && b > g,
        "steady not marked as shrunk: rgb({r},{g},{b})"
    );
    let title = svg_title(&svg, "crunch");
    assert!(title.contains("; +"), "no growth in the tooltip: {title}");

    // JSON for machines names the same function, and the gate's settings.
    let out = diff(&[s(&base), s(&new), "--fail-above", "5", "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(j["regressions"], serde_json::json!(["crunch"]));
    assert_eq!(j["alpha"], 0.001);
    let crunch = j["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["function"] == "crunch")
        .unwrap();
    let delta = crunch["self_delta_pts"].as_f64().unwrap();
    assert!(
        (8.0..25.0).contains(&delta),
        "crunch grew {delta} pts, expected ~16.7"
    );

    // Inclusive: work() contains both, so only crunch (and nothing above it) regresses.
    let out = diff(&[
        s(&base),
        s(&new),
        "--fail-above",
        "5",
        "--inclusive",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["regressions"], serde_json::json!(["crunch"]));

    // Without a gate, or with one above the growth, the same diff passes.
    assert_eq!(diff(&[s(&base), s(&new)]).status.code(), Some(0));
    assert_eq!(
        diff(&[s(&base), s(&new), "--fail-above", "40"])
            .status
            .code(),
        Some(0)
    );
    // --min-samples above crunch's count (a few hundred) makes it too thin to judge, and
    // above a profile's total the gate refuses to judge at all.
    let out = diff(&[
        s(&base),
        s(&new),
        "--fail-above",
        "5",
        "--min-samples",
        "100000",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("fewer than --min-samples 100000"));
}

#[test]
fn same_build_passes_the_gate_19_of_20_times() {
    if !privileged() {
        return;
    }
    let dir = scratch("diff-noise");
    let mut failures = Vec::new();
    // Ten rounds of two pairs, four recordings at once: a busy runner, and a modest wall time.
    for round in 0..10 {
        let path = |what: &str, i: usize| dir.join(format!("{what}{}.pb.gz", 2 * round + i));
        let pairs = [(path("a", 0), path("b", 0)), (path("a", 1), path("b", 1))];
        let runs: Vec<(&str, &Path)> = pairs
            .iter()
            .flat_map(|(a, b)| [("regress", a.as_path()), ("regress", b.as_path())])
            .collect();
        record_all(&runs, "1200");
        for (a, b) in &pairs {
            let out = diff(&[s(a), s(b), "--fail-above", "5"]);
            match out.status.code() {
                Some(0) => {}
                Some(1) => failures.push(stderr(&out)),
                _ => panic!("diff failed: {}", stderr(&out)),
            }
        }
    }
    assert!(
        failures.len() <= 1,
        "{} of 20 same-build pairs failed the gate:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn ci_gate_script_end_to_end() {
    if !privileged() {
        return;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/ci-gate.sh");
    let dir = scratch("ci-gate");
    let run = |candidate_flags: &str| {
        Command::new("bash")
            .arg(&script)
            .env("PYROMETER", pyrometer_bin())
            .env("WORK_DIR", &dir)
            .env("CANDIDATE_CFLAGS", candidate_flags)
            .env("ROUNDS", "3000")
            .output()
            .expect("run scripts/ci-gate.sh")
    };
    let out = run("-DCRUNCH_FACTOR=2");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("crunch ("), "{err}");
    assert!(dir.join("diff.svg").exists());
    let out = run("");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn diff_errors_exit_2() {
    let dir = scratch("diff-errors");
    let a = dir.join("a.folded");
    std::fs::write(&a, "main;f 10\n").unwrap();
    let missing = dir.join("missing.pb.gz");
    let out = diff(&[s(&a), s(&missing)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
    let out = diff(&[s(&a), s(&a), "--type", "cpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no sample type 'cpu'; it has: samples"),
        "{}",
        stderr(&out)
    );
    let out = diff(&[s(&a), s(&a), "--fail-above", "five"]);
    assert_eq!(out.status.code(), Some(2));
    // Identical inputs: nothing changed, the gate passes.
    let out = diff(&[s(&a), s(&a), "--fail-above", "1", "--min-samples", "5"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 0, "{}", stderr(&out));
}

/// Where the widest flame graph frame named `name` starts. Stacks that lost their outer frames
/// (a sample taken mid-prologue) add thin frames of the same name at other places; those carry
/// a handful of samples and say nothing about the change.
fn widest_frame(svg: &str, name: &str) -> usize {
    let needle = format!("<title>{name} (");
    svg.match_indices(&needle)
        .map(|(at, _)| {
            let rest = &svg[at + needle.len()..];
            let count: u64 = rest[..rest.find(' ').unwrap()]
                .replace(',', "")
                .parse()
                .unwrap();
            (count, at)
        })
        .max()
        .unwrap_or_else(|| panic!("no frame {name}"))
        .1
}

/// The `fill` colour of the widest flame graph frame named `name`.
fn fill_of(svg: &str, name: &str) -> (u8, u8, u8) {
    let rest = &svg[widest_frame(svg, name)..];
    let start = rest.find("fill=\"rgb(").unwrap() + "fill=\"rgb(".len();
    let end = start + rest[start..].find(')').unwrap();
    let rgb: Vec<u8> = rest[start..end]
        .split(',')
        .map(|c| c.trim().parse().unwrap())
        .collect();
    (rgb[0], rgb[1], rgb[2])
}

fn svg_title(svg: &str, name: &str) -> String {
    let rest = &svg[widest_frame(svg, name) + "<title>".len()..];
    rest[..rest.find("</title>").unwrap()].to_string()
}
