//! What a test run really did, read back after it: the skip ledger the tests append to (see
//! the skip-ledger crate), the per-test times of nextest's JUnit report, and the suite's
//! tests as `cargo nextest list` sees them, held against two checked-in files:
//!
//! - `tests/allowed-skips.toml`: what a machine of the CI's kind cannot have (a GPU), each with
//!   its reason. Under CI a skip for any other capability fails the run.
//! - `tests/manifest.txt`: every test of the workspace, `BINARY-ID TEST-NAME` a line, written
//!   by `cargo xtask manifest`. Under CI a test missing from the suite (deleted or renamed) or
//!   missing from the manifest (new) fails the run, so a test leaves only in a visible diff.
//!
//! The checks are pure functions of those inputs (`Findings::of`), so they are tested here on
//! small made-up runs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// A test: (binary id, test name), as nextest names them.
pub type TestId = (String, String);

/// `tests/allowed-skips.toml`.
pub const ALLOWED: &str = "tests/allowed-skips.toml";
/// `tests/manifest.txt`.
pub const MANIFEST: &str = "tests/manifest.txt";

/// One line of the skip ledger.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Skip {
    pub binary: String,
    pub test: String,
    pub capability: String,
    pub reason: String,
}

/// One entry of the allowed-skips file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allowed {
    /// A capability as the tests name it, or a prefix of names ending in `*` (`kernel:*`).
    pub capability: String,
    /// Why a machine of the CI's kind cannot have it.
    pub reason: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowedFile {
    #[serde(default)]
    allowed: Vec<Allowed>,
}

impl Allowed {
    fn matches(&self, capability: &str) -> bool {
        match self.capability.strip_suffix('*') {
            Some(prefix) => capability.starts_with(prefix),
            None => capability == self.capability,
        }
    }
}

/// Reads the allowed-skips file; every entry needs a reason.
pub fn read_allowed(path: &Path) -> Result<Vec<Allowed>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file: AllowedFile =
        toml::from_str(&text).with_context(|| format!("{} is not valid", path.display()))?;
    if let Some(bad) = file.allowed.iter().find(|a| a.reason.trim().is_empty()) {
        bail!(
            "{}: the allowed skip {} gives no reason",
            path.display(),
            bad.capability
        );
    }
    Ok(file.allowed)
}

/// Reads the skip ledger (absent: no skips).
pub fn read_ledger(path: &Path) -> Result<Vec<Skip>> {
    read_json_lines(path, "a skip")
}

/// Reads a file of one JSON value a line, as the tests append them (absent: none); `what`
/// names a line in the error for one that does not parse.
pub fn read_json_lines<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<Vec<T>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{} line {}: not {what}: {l}", path.display(), i + 1))
        })
        .collect()
}

/// Reads the manifest: `BINARY-ID TEST-NAME` lines; `#` starts a comment.
pub fn read_manifest(path: &Path) -> Result<BTreeSet<TestId>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read {} (`cargo xtask manifest` writes it)",
            path.display()
        )
    })?;
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            l.split_once(' ')
                .map(|(b, t)| (b.to_string(), t.trim().to_string()))
                .with_context(|| format!("{}: not `BINARY TEST`: {l}", path.display()))
        })
        .collect()
}

/// The manifest's text for `tests`.
pub fn manifest_text(tests: &BTreeSet<TestId>) -> String {
    let mut out = String::from(
        "# Every test of the workspace, as `cargo nextest list` names it: BINARY-ID TEST-NAME.\n\
         # Written by `cargo xtask manifest`; under CI, `cargo xtask test` fails when the suite\n\
         # differs from it. Regenerate it when a change adds, renames or removes a test.\n",
    );
    for (binary, test) in tests {
        out.push_str(&format!("{binary} {test}\n"));
    }
    out
}

/// The suite as `cargo nextest list --message-format json` printed it: every test that is
/// not `#[ignore]`d, and which of them the run's filter selected.
#[derive(Debug, Default)]
pub struct Listed {
    pub all: BTreeSet<TestId>,
    pub selected: BTreeSet<TestId>,
}

pub fn parse_list(json: &str) -> Result<Listed> {
    let v: serde_json::Value =
        serde_json::from_str(json).context("cargo nextest list printed no JSON")?;
    let suites = v["rust-suites"]
        .as_object()
        .context("cargo nextest list: no rust-suites")?;
    let mut listed = Listed::default();
    for (binary, suite) in suites {
        let Some(cases) = suite["testcases"].as_object() else {
            continue;
        };
        for (name, case) in cases {
            if case["ignored"].as_bool() == Some(true) {
                continue;
            }
            let id = (binary.clone(), name.clone());
            if case["filter-match"]["status"] == "matches" {
                listed.selected.insert(id.clone());
            }
            listed.all.insert(id);
        }
    }
    Ok(listed)
}

/// One test case of nextest's JUnit report.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub binary: String,
    pub test: String,
    pub seconds: f64,
    pub failed: bool,
}

/// The `<testcase>` elements of a JUnit report (nextest writes one per test run: `classname`
/// is the binary id, `name` the test, `time` its seconds; a failure has a `<failure>` or
/// `<error>` child).
pub fn parse_junit(xml: &str) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut rest = xml;
    while let Some(at) = rest.find("<testcase") {
        rest = &rest[at + "<testcase".len()..];
        let Some(end) = rest.find('>') else { break };
        let tag = &rest[..end];
        let self_closing = tag.ends_with('/');
        let body = if self_closing {
            ""
        } else {
            rest.find("</testcase>")
                .map_or("", |close| &rest[end..close])
        };
        let attr = |name: &str| attribute(tag, name).unwrap_or_default();
        cases.push(Case {
            binary: attr("classname"),
            test: attr("name"),
            seconds: attr("time").parse().unwrap_or(0.0),
            failed: body.contains("<failure") || body.contains("<error"),
        });
    }
    cases
}

/// Attribute `name` of a tag's text, unescaped.
fn attribute(tag: &str, name: &str) -> Option<String> {
    let mut rest = tag;
    loop {
        let at = rest.find(name)?;
        let before = rest[..at].chars().last();
        let after = &rest[at + name.len()..];
        rest = after;
        if !before.is_some_and(char::is_whitespace) {
            continue;
        }
        let Some(value) = after.trim_start().strip_prefix('=') else {
            continue;
        };
        let value = value.trim_start();
        let quote = value.chars().next()?;
        if quote != '"' && quote != '\'' {
            continue;
        }
        let value = &value[1..];
        let end = value.find(quote)?;
        return Some(unescape(&value[..end]));
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let Some(end) = rest.find(';') else { break };
        let entity = &rest[1..end];
        let c = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            e => e
                .strip_prefix("#x")
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .or_else(|| e.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match c {
            Some(c) => {
                out.push(c);
                rest = &rest[end + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// What the checks found in one run.
#[derive(Debug, Default)]
pub struct Findings {
    /// Skips whose capability the allowed-skips file does not list.
    pub not_allowed: Vec<Skip>,
    /// In the manifest, not in the suite: deleted or renamed.
    pub gone: Vec<TestId>,
    /// In the suite, not in the manifest: new.
    pub unlisted: Vec<TestId>,
    /// Selected by the run's filter but absent from its report: never ran.
    pub did_not_run: Vec<TestId>,
}

impl Findings {
    pub fn of(
        skips: &[Skip],
        allowed: &[Allowed],
        manifest: &BTreeSet<TestId>,
        listed: &Listed,
        cases: &[Case],
    ) -> Findings {
        let ran: BTreeSet<TestId> = cases
            .iter()
            .map(|c| (c.binary.clone(), c.test.clone()))
            .collect();
        Findings {
            not_allowed: skips
                .iter()
                .filter(|s| !allowed.iter().any(|a| a.matches(&s.capability)))
                .cloned()
                .collect(),
            gone: manifest.difference(&listed.all).cloned().collect(),
            unlisted: listed.all.difference(manifest).cloned().collect(),
            did_not_run: listed.selected.difference(&ran).cloned().collect(),
        }
    }

    pub fn clean(&self) -> bool {
        self.not_allowed.is_empty()
            && self.gone.is_empty()
            && self.unlisted.is_empty()
            && self.did_not_run.is_empty()
    }

    /// One paragraph per kind of finding, each saying what to do.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let list = |ids: &[TestId]| {
            ids.iter()
                .map(|(b, t)| format!("    {b} {t}\n"))
                .collect::<String>()
        };
        if !self.not_allowed.is_empty() {
            out.push_str(&format!(
                "{} skip(s) for a capability {ALLOWED} does not allow: make the set-up provide \
                 it, or (only for what a machine of this kind cannot have) allow it there with \
                 its reason:\n",
                self.not_allowed.len()
            ));
            for s in &self.not_allowed {
                out.push_str(&format!(
                    "    {} {} [{}]: {}\n",
                    s.binary, s.test, s.capability, s.reason
                ));
            }
        }
        if !self.gone.is_empty() {
            out.push_str(&format!(
                "{} test(s) of {MANIFEST} are no longer in the suite (deleted or renamed): if \
                 that is meant, run `cargo xtask manifest` and commit the change:\n{}",
                self.gone.len(),
                list(&self.gone)
            ));
        }
        if !self.unlisted.is_empty() {
            out.push_str(&format!(
                "{} test(s) of the suite are not in {MANIFEST}: run `cargo xtask manifest` and \
                 commit the change:\n{}",
                self.unlisted.len(),
                list(&self.unlisted)
            ));
        }
        if !self.did_not_run.is_empty() {
            out.push_str(&format!(
                "{} selected test(s) have no result in the run's report (the run stopped early?):\n{}",
                self.did_not_run.len(),
                list(&self.did_not_run)
            ));
        }
        out
    }
}

/// The ledger as a table, allowed or not: `binary test [capability] reason`.
pub fn ledger_table(skips: &[Skip], allowed: &[Allowed]) -> String {
    if skips.is_empty() {
        return "skip ledger: no test skipped anything\n".into();
    }
    let mut out = format!("skip ledger: {} skip(s)\n", skips.len());
    let mut sorted: Vec<&Skip> = skips.iter().collect();
    sorted.sort_by(|a, b| (&a.binary, &a.test).cmp(&(&b.binary, &b.test)));
    for s in sorted {
        let verdict = match allowed.iter().find(|a| a.matches(&s.capability)) {
            Some(_) => "allowed",
            None => "NOT ALLOWED",
        };
        out.push_str(&format!(
            "  {} {} [{}] {verdict}: {}\n",
            s.binary, s.test, s.capability, s.reason
        ));
    }
    out
}

/// Every test's time, slowest first, with the binaries' totals.
pub fn durations_table(cases: &[Case]) -> String {
    let mut sorted: Vec<&Case> = cases.iter().collect();
    sorted.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let total: f64 = cases.iter().map(|c| c.seconds).sum();
    let mut out = format!(
        "per-test durations: {} tests, {:.0} s of test time in all (slowest first)\n",
        cases.len(),
        total
    );
    for c in sorted {
        out.push_str(&format!(
            "  {:>8.2} s  {} {}{}\n",
            c.seconds,
            c.binary,
            c.test,
            if c.failed { "  FAILED" } else { "" }
        ));
    }
    let mut per_binary: BTreeMap<&str, f64> = BTreeMap::new();
    for c in cases {
        *per_binary.entry(&c.binary).or_default() += c.seconds;
    }
    let mut binaries: Vec<(&str, f64)> = per_binary.into_iter().collect();
    binaries.sort_by(|a, b| b.1.total_cmp(&a.1));
    out.push_str("per-binary test time:\n");
    for (b, s) in binaries {
        out.push_str(&format!("  {s:>8.1} s  {b}\n"));
    }
    out
}

/// Where a run's files are.
pub struct RunFiles {
    pub ledger: PathBuf,
    pub junit: PathBuf,
    /// The Python frames of the profiles the tests read ([`crate::frame_tally`]).
    pub frames: PathBuf,
}

impl RunFiles {
    pub fn under(target: &Path) -> RunFiles {
        RunFiles {
            ledger: target.join("skip-ledger.jsonl"),
            junit: target.join("nextest/default/junit.xml"),
            frames: target.join("python-frames.jsonl"),
        }
    }
}

/// Prints the ledger and the durations of the run in `files`, then checks it against the
/// allowed skips and the manifest (`listed`: the suite and what the run's filter selected).
/// Findings fail under CI; elsewhere they are printed as warnings.
pub fn report(root: &Path, files: &RunFiles, listed: &Listed, ci: bool) -> Result<()> {
    let skips = read_ledger(&files.ledger)?;
    let allowed = read_allowed(&root.join(ALLOWED))?;
    let manifest = read_manifest(&root.join(MANIFEST))?;
    let junit = std::fs::read_to_string(&files.junit)
        .with_context(|| format!("cannot read nextest's report {}", files.junit.display()))?;
    let cases = parse_junit(&junit);
    println!("\n{}", durations_table(&cases));
    println!("{}", ledger_table(&skips, &allowed));
    println!(
        "{}\n",
        crate::frame_tally::summary(&crate::frame_tally::read(&files.frames)?)
    );
    let findings = Findings::of(&skips, &allowed, &manifest, listed, &cases);
    if findings.clean() {
        println!(
            "every skip is allowed by {ALLOWED}; the suite matches {MANIFEST} ({} tests, {} run)",
            manifest.len(),
            cases.len()
        );
        return Ok(());
    }
    let text = findings.explain();
    if ci {
        bail!("the run is not what CI accepts:\n{text}");
    }
    eprintln!("warning (an error under CI=true):\n{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(b: &str, t: &str) -> TestId {
        (b.to_string(), t.to_string())
    }

    fn skip(capability: &str) -> Skip {
        Skip {
            binary: "pyrometer-e2e::python".into(),
            test: "version_3_12".into(),
            capability: capability.into(),
            reason: "3.12: /root/.pyenv/versions/3.12.1/bin/python3.12 is missing".into(),
        }
    }

    const JUNIT: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<testsuites name="nextest-run" tests="3" failures="1" errors="0" uuid="x" timestamp="t" time="9.5">
    <testsuite name="pyrometer-e2e::kernels" tests="2" disabled="0" errors="0" failures="1">
        <testcase name="kernel_forky" classname="pyrometer-e2e::kernels" timestamp="t" time="300.25">
            <failure type="test failure">kernel forky failed</failure>
        </testcase>
        <testcase name="kernel_host" classname="pyrometer-e2e::kernels" timestamp="t" time="20.5"/>
    </testsuite>
    <testsuite name="skip-ledger" tests="1" disabled="0" errors="0" failures="0">
        <testcase name="tests::a &amp; &lt;b&gt; &#x41;" classname="skip-ledger" timestamp="t" time="0.01">
        </testcase>
    </testsuite>
</testsuites>"#;

    #[test]
    fn junit_cases_carry_binary_name_time_and_failure() {
        let cases = parse_junit(JUNIT);
        assert_eq!(
            cases,
            [
                Case {
                    binary: "pyrometer-e2e::kernels".into(),
                    test: "kernel_forky".into(),
                    seconds: 300.25,
                    failed: true
                },
                Case {
                    binary: "pyrometer-e2e::kernels".into(),
                    test: "kernel_host".into(),
                    seconds: 20.5,
                    failed: false
                },
                Case {
                    binary: "skip-ledger".into(),
                    test: "tests::a & <b> A".into(),
                    seconds: 0.01,
                    failed: false
                },
            ]
        );
        let table = durations_table(&cases);
        let forky = table.find("kernel_forky").unwrap();
        let host = table.find("kernel_host").unwrap();
        assert!(forky < host, "slowest first: {table}");
        assert!(table.contains("FAILED"), "{table}");
    }

    #[test]
    fn a_skip_is_allowed_only_by_its_capability_or_a_prefix() {
        let allowed = vec![
            Allowed {
                capability: "gpu".into(),
                reason: "no GPU on this kind".into(),
            },
            Allowed {
                capability: "kernel:*".into(),
                reason: "r".into(),
            },
        ];
        let skips = [skip("gpu"), skip("kernel:forky"), skip("python:3.12")];
        let f = Findings::of(&skips, &allowed, &BTreeSet::new(), &Listed::default(), &[]);
        assert_eq!(f.not_allowed, [skip("python:3.12")]);
        assert!(f.explain().contains("[python:3.12]"), "{}", f.explain());
        assert!(!f.clean());
        let table = ledger_table(&skips, &allowed);
        assert!(table.contains("[gpu] allowed"), "{table}");
        assert!(table.contains("[python:3.12] NOT ALLOWED"), "{table}");
    }

    /// A test deleted (or renamed) without `cargo xtask manifest` is named, and so is a new
    /// one; a filtered run is judged on what its filter selected.
    #[test]
    fn the_suite_is_held_against_the_manifest() {
        let manifest: BTreeSet<TestId> = [id("a", "one"), id("a", "two"), id("b", "three")]
            .into_iter()
            .collect();
        let listed = Listed {
            all: [id("a", "one"), id("b", "three"), id("b", "four")]
                .into_iter()
                .collect(),
            selected: [id("b", "three"), id("b", "four")].into_iter().collect(),
        };
        let cases = [Case {
            binary: "b".into(),
            test: "three".into(),
            seconds: 1.0,
            failed: false,
        }];
        let f = Findings::of(&[], &[], &manifest, &listed, &cases);
        assert_eq!(f.gone, [id("a", "two")]);
        assert_eq!(f.unlisted, [id("b", "four")]);
        assert_eq!(f.did_not_run, [id("b", "four")]);
        let text = f.explain();
        assert!(text.contains("no longer in the suite"), "{text}");
        assert!(text.contains("    a two\n"), "{text}");
        assert!(text.contains("cargo xtask manifest"), "{text}");

        let text = manifest_text(&listed.all);
        let written: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(written, ["a one", "b four", "b three"]);
    }

    #[test]
    fn the_list_keeps_what_runs_and_what_the_filter_chose() {
        let json = r#"{"rust-suites": {"b": {"testcases": {
            "t1": {"kind": "test", "ignored": false, "filter-match": {"status": "matches"}},
            "t2": {"kind": "test", "ignored": false, "filter-match": {"status": "mismatch", "reason": "expression"}},
            "t3": {"kind": "test", "ignored": true, "filter-match": {"status": "mismatch", "reason": "ignored"}}
        }}}}"#;
        let listed = parse_list(json).unwrap();
        assert_eq!(
            listed.all,
            [id("b", "t1"), id("b", "t2")].into_iter().collect()
        );
        assert_eq!(listed.selected, [id("b", "t1")].into_iter().collect());
    }

    #[test]
    fn ledger_lines_are_read_back() {
        let dir = std::env::temp_dir().join(format!("xtask-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.jsonl");
        assert!(read_ledger(&path).unwrap().is_empty(), "absent: no skips");
        // As the tests' side writes them, quotes and all.
        let mut s = skip("python:3.12");
        s.reason = "a \"quoted\" reason\nover two lines".into();
        let written = skip_ledger::Skip {
            binary: s.binary.clone(),
            test: s.test.clone(),
            capability: s.capability.clone(),
            reason: s.reason.clone(),
        };
        std::fs::write(
            &path,
            format!("{}\n{}\n", written.to_json(), written.to_json()),
        )
        .unwrap();
        assert_eq!(read_ledger(&path).unwrap(), [s.clone(), s]);
        std::fs::write(&path, "not json\n").unwrap();
        assert!(read_ledger(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_checked_in_files_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let allowed = read_allowed(&root.join(ALLOWED)).unwrap();
        assert!(allowed.iter().any(|a| a.capability == "gpu"));
        let manifest = read_manifest(&root.join(MANIFEST)).unwrap();
        assert!(
            manifest.contains(&id(
                "xtask::bin/xtask",
                "ledger::tests::the_checked_in_files_are_valid"
            )),
            "this test is in the manifest"
        );
    }
}
