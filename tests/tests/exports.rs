//! Chrome trace and speedscope exports, checked by the tools that read them: the trace by its
//! structure and timing against a workload with a known idle gap, speedscope files against
//! the JSON schema the `speedscope` npm package ships and by loading them in that package's
//! viewer in headless Chromium. `cargo xtask deps` installs the npm packages into
//! target/npm; these tests install them there themselves when they are missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use pyrometer_e2e::*;
use serde_json::Value;

const SPEEDSCOPE: &str = "speedscope@1.25.0";
const AJV: &str = "ajv@8.17.1";

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn read_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

#[test]
fn chrome_trace_shows_the_idle_gap() {
    if !privileged() {
        return;
    }
    let dir = scratch("chrome-gap");
    let trace = dir.join("gap.trace.json");
    // The worker spins 1 s, sleeps 1 s, spins 1 s.
    let out = pyrometer(&[
        "record",
        "-F",
        "999",
        "-o",
        s(&trace),
        "--",
        s(&fixture("gap")),
        "1",
    ]);
    assert_ok(&out);
    let doc = read_json(&trace);
    let events = doc["traceEvents"].as_array().expect("traceEvents array");
    let meta = |name: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == name)
            .collect()
    };
    let process = meta("process_name");
    assert_eq!(process.len(), 1, "{process:?}");
    assert_eq!(process[0]["args"]["name"], "gap");
    let pid = process[0]["pid"].as_i64().unwrap();
    let worker = meta("thread_name")
        .into_iter()
        .find(|e| e["args"]["name"] == "worker")
        .expect("thread_name metadata for the worker thread");
    assert_eq!(worker["pid"].as_i64(), Some(pid));
    let tid = worker["tid"].as_i64().unwrap();

    let mut slices: Vec<(f64, f64)> = Vec::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        for key in ["name", "ts", "dur", "pid", "tid"] {
            assert!(!e[key].is_null(), "slice without {key}: {e}");
        }
        let stack = e["args"]["stack"].as_array().expect("stack in args");
        assert_eq!(stack[0], e["name"], "a slice is named by its leaf");
        if e["tid"].as_i64() == Some(tid) {
            let ts = e["ts"].as_f64().unwrap();
            slices.push((ts, ts + e["dur"].as_f64().unwrap()));
        }
    }
    assert!(slices.len() > 10, "only {} worker slices", slices.len());
    assert!(
        events
            .iter()
            .any(|e| e["tid"].as_i64() == Some(tid) && e["name"] == "spin"),
        "no spin slice on the worker track"
    );
    slices.sort_by(|a, b| a.0.total_cmp(&b.0));
    // The largest hole between one slice's end and the next one's start is the sleep.
    let (gap_at, gap_us) = slices
        .windows(2)
        .map(|w| (w[0].1, w[1].0 - w[0].1))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    assert!(
        (800_000.0..=1_300_000.0).contains(&gap_us),
        "largest gap on the worker track is {:.3} s, expected ~1 s",
        gap_us / 1e6
    );
    // Busy phases on both sides of it, so the gap is the sleep, not the start or the end.
    // Spans, not sums of slices: on a loaded machine the spinning thread shares its CPU.
    let first = slices.first().unwrap().0;
    let last = slices.iter().map(|s| s.1).fold(0.0, f64::max);
    let (before, after) = (gap_at - first, last - (gap_at + gap_us));
    assert!(
        before > 600_000.0 && after > 600_000.0,
        "busy for {before} µs before and {after} µs after the gap, expected ~1 s each"
    );
    assert_eq!(doc["otherData"]["samples_not_in_timeline"], 0);
}

#[test]
fn report_refuses_chrome_trace_with_one_line() {
    let dir = scratch("report-chrome");
    let input = dir.join("in.folded");
    std::fs::write(&input, "main;f 3\n").unwrap();
    for args in [
        vec!["report", s(&input), "-o", "/tmp/never.trace.json"],
        vec![
            "report",
            s(&input),
            "--format",
            "chrome",
            "-o",
            "/tmp/never.json",
        ],
    ] {
        let out = pyrometer(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("the Chrome trace needs per-sample times")
                && err.contains("pyrometer record"),
            "{err}"
        );
    }
    assert!(!Path::new("/tmp/never.trace.json").exists());
}

#[test]
fn speedscope_from_record_and_report_loads_in_speedscope() {
    if !privileged() {
        return;
    }
    let dir = scratch("speedscope");
    let recorded = dir.join("gap.speedscope.json");
    let out = pyrometer(&[
        "record",
        "-F",
        "499",
        "-o",
        s(&recorded),
        "--",
        s(&fixture("gap")),
        "0.3",
    ]);
    assert_ok(&out);
    let pprof = dir.join("cpu.pb.gz");
    let out = pyrometer(&[
        "record",
        "-F",
        "499",
        "-o",
        s(&pprof),
        "--",
        s(&fixture("cpu631")),
        "0.5",
    ]);
    assert_ok(&out);
    let reported = dir.join("cpu.speedscope.json");
    assert_ok(&pyrometer(&["report", s(&pprof), "-o", s(&reported)]));
    let folded = dir.join("in.folded");
    std::fs::write(&folded, "main;work;leaf_a 6\nmain;work;leaf_b 3\n").unwrap();
    let from_folded = dir.join("folded.speedscope.json");
    assert_ok(&pyrometer(&[
        "report",
        s(&folded),
        "--format",
        "speedscope",
        "-o",
        s(&from_folded),
    ]));

    let pkg = speedscope_package();
    for (file, thread) in [
        (&recorded, "worker (tid "),
        (&reported, "cpu631 (tid "),
        (&from_folded, "all samples"),
    ] {
        validate_schema(&pkg, file);
        load_in_viewer(&pkg, file, thread);
    }
    // The worker thread has its own profile, and it is the one speedscope opens.
    let doc = read_json(&recorded);
    let active = doc["activeProfileIndex"].as_u64().unwrap() as usize;
    assert!(
        doc["profiles"][active]["name"]
            .as_str()
            .unwrap()
            .contains("/ worker (tid ")
    );
}

/// target/npm/node_modules, holding speedscope and ajv (installed when missing).
fn speedscope_package() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let prefix = target.join("npm");
    let modules = prefix.join("node_modules");
    if !modules.join("speedscope/package.json").exists()
        || !modules.join("ajv/package.json").exists()
    {
        std::fs::create_dir_all(&prefix).unwrap();
        let status = Command::new("npm")
            .args([
                "install",
                "--no-save",
                "--no-audit",
                "--no-fund",
                "--prefix",
            ])
            .arg(&prefix)
            .args([SPEEDSCOPE, AJV])
            .status()
            .expect("npm (Node.js) is needed for the speedscope check: run `cargo xtask deps`");
        assert!(status.success(), "npm install {SPEEDSCOPE} {AJV} failed");
    }
    modules
}

/// Validates against the schema in the speedscope package, with ajv (draft-07).
fn validate_schema(modules: &Path, file: &Path) {
    let schema = modules.join("speedscope/dist/release/file-format-schema.json");
    assert!(
        schema.exists(),
        "{} missing from the speedscope package",
        schema.display()
    );
    let script = r#"
        const [modules, schemaPath, file] = process.argv.slice(1);
        const Ajv = require(modules + '/ajv');
        const fs = require('fs');
        const validate = new Ajv({ strict: false, allErrors: true })
            .compile(JSON.parse(fs.readFileSync(schemaPath, 'utf8')));
        if (!validate(JSON.parse(fs.readFileSync(file, 'utf8')))) {
            console.error(JSON.stringify(validate.errors, null, 1));
            process.exit(1);
        }
    "#;
    let out = Command::new("node")
        .args(["-e", script])
        .arg(modules)
        .arg(&schema)
        .arg(file)
        .output()
        .expect("node is needed for the speedscope check: run `cargo xtask deps`");
    assert!(
        out.status.success(),
        "{} does not match speedscope's schema: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Opens the file in speedscope's own viewer the way its CLI does (a script calling
/// `speedscope.loadFileFromBase64`, named in the URL hash) and reads the rendered DOM: a
/// file speedscope rejects leaves "Something went wrong" and no profile name.
fn load_in_viewer(modules: &Path, file: &Path, thread: &str) {
    let index = modules.join("speedscope/dist/release/index.html");
    let bytes = std::fs::read(file).unwrap();
    let loader = file.with_extension("load.js");
    let name = file.file_name().unwrap().to_string_lossy();
    std::fs::write(
        &loader,
        format!(
            "speedscope.loadFileFromBase64({name:?}, {:?})",
            base64(&bytes)
        ),
    )
    .unwrap();
    let chromium = Path::new("/usr/bin/chromium");
    assert!(
        chromium.exists(),
        "/usr/bin/chromium is needed: run `cargo xtask deps`"
    );
    let profile_dir = file.with_extension("chromium");
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--allow-file-access-from-files",
        ])
        .arg(format!("--user-data-dir={}", profile_dir.display()))
        .args(["--virtual-time-budget=10000", "--dump-dom"])
        .arg(format!(
            "file://{}#localProfilePath={}",
            index.display(),
            loader.display()
        ))
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !dom.is_empty(),
        "chromium: {}",
        stderr(&out)
    );
    assert!(
        !dom.contains("Something went wrong"),
        "speedscope rejected {}",
        file.display()
    );
    let title = dom
        .split("<title>")
        .nth(1)
        .and_then(|t| t.split("</title>").next())
        .unwrap_or("");
    assert!(
        title.ends_with(" - speedscope"),
        "no profile loaded, title '{title}'"
    );
    assert!(
        dom.contains(thread),
        "speedscope does not show '{thread}' for {}",
        file.display()
    );
}

fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
