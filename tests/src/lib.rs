//! Helpers for the end-to-end tests: where the built `pyrometer` and the C fixtures are, a
//! privilege probe that records why a test is skipped, and readers for what `record` writes.

pub mod alloc;
pub mod captures;
#[path = "../../collector/tests/common/certs.rs"]
pub mod certs;
#[path = "../../collector/tests/common/clickhouse_server.rs"]
pub mod clickhouse_server;
pub mod cluster;
pub mod frame_tally;
pub mod fuse;
pub mod gil_table;
pub mod gpu_kernels;
pub mod kernels;
pub mod otel;
pub mod python;
pub mod ray_cluster;
pub mod wait;

/// The one way a test skips (see the skip-ledger crate): `skip(capability, reason)`.
pub use skip_ledger::{ci, skip};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Directory holding the fixtures built by `build.rs`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("FIXTURE_DIR")).join(name)
}

/// Copies an executable for a test to run under its own name, with `cp`: a copy written by
/// this process leaves its write descriptor, for a moment, in the children other test threads
/// fork meanwhile, and running the copy then fails with "Text file busy" (ETXTBSY); it failed
/// an agent test once on a busy machine.
pub fn copy_executable(from: &Path, to: &Path) {
    let status = std::process::Command::new("cp")
        .arg(from)
        .arg(to)
        .status()
        .unwrap_or_else(|e| panic!("cp {}: {e}", from.display()));
    assert!(
        status.success(),
        "cp {} {}: {status}",
        from.display(),
        to.display()
    );
}

/// The NVML test double (`fixtures/nvml_testdouble.c`): scripted GPUs for machines without one.
pub fn nvml_testdouble() -> PathBuf {
    fixture("libnvml-testdouble.so")
}

/// The build-id debug directory for `cpu631-stripped`.
pub fn fixture_debug_dir() -> PathBuf {
    PathBuf::from(env!("FIXTURE_DEBUG_DIR"))
}

/// The `pyrometer` binary of this workspace (`cargo xtask test` builds it first; set
/// PYROMETER_BIN to test another build).
pub fn pyrometer_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PYROMETER_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join("debug/pyrometer");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p pyrometer` first (cargo xtask test does)",
        bin.display()
    );
    static FRESH: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if let Some(stale) = FRESH.get_or_init(|| stale_against_sources(&bin)) {
        panic!("{stale}");
    }
    bin
}

/// Why `bin` cannot be the build of this checkout's sources: a source file of a crate it is
/// built from is newer (`cargo nextest run` rebuilds the tests, not the binary they run, so
/// after an edit they would test the previous build without saying so).
fn stale_against_sources(bin: &Path) -> Option<String> {
    let built = std::fs::metadata(bin).and_then(|m| m.modified()).ok()?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    let mut dirs: Vec<PathBuf> = [
        "profiler/src",
        "ebpf/src",
        "unwind/src",
        "proto/src",
        "diff/src",
        // Carried inside the binary (profiler/build.rs).
        "alloc-preload/src",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                dirs.push(path);
            } else if let Ok(t) = meta.modified()
                && newest.as_ref().is_none_or(|(n, _)| t > *n)
            {
                newest = Some((t, path));
            }
        }
    }
    let (t, path) = newest?;
    (t > built).then(|| {
        format!(
            "{} is older than {}: run `cargo build --bins` first (cargo xtask test does), or these tests run the previous build",
            bin.display(),
            path.display()
        )
    })
}

/// True when sampling can run; otherwise prints the reason the calling test skips.
pub fn privileged() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let needed = [(39, "CAP_BPF"), (38, "CAP_PERFMON"), (19, "CAP_SYS_PTRACE")];
    let missing: Vec<&str> = needed
        .iter()
        .filter(|(bit, _)| eff & (1u64 << bit) == 0)
        .map(|(_, n)| *n)
        .collect();
    if missing.is_empty() {
        true
    } else {
        skip(
            "root",
            format!("needs {} (run the tests as root)", missing.join(", ")),
        );
        false
    }
}

/// A fresh scratch directory for one test, removed when the test process exits unless a test
/// in it failed (kept for a look) or `PYROMETER_KEEP_SCRATCH` is set.
pub fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pyrometer-e2e-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    scratch_cleanup::remove_at_exit(&dir);
    dir
}

/// Removal of passing tests' scratch directories at process exit: thousands of them
/// accumulated in /tmp on a developer's machine.
mod scratch_cleanup {
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    static PANICKED: AtomicBool = AtomicBool::new(false);
    static INSTALLED: std::sync::Once = std::sync::Once::new();

    pub fn remove_at_exit(dir: &Path) {
        INSTALLED.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                PANICKED.store(true, Ordering::Relaxed);
                previous(info);
            }));
            // SAFETY: registers a plain function with no arguments to run at exit(3).
            unsafe { libc::atexit(remove_all) };
        });
        DIRS.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(dir.to_path_buf());
    }

    extern "C" fn remove_all() {
        if PANICKED.load(Ordering::Relaxed) || std::env::var_os("PYROMETER_KEEP_SCRATCH").is_some()
        {
            return;
        }
        // A file system a test left mounted inside (FUSE that never answers, a bind mount)
        // would make the removal hang or reach outside: such a directory is left alone.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
        for dir in dirs.iter() {
            let under = mounts
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .any(|m| Path::new(m).starts_with(dir));
            if !under {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

/// Runs `pyrometer ARGS`, returning its output; panics only if it cannot be started.
pub fn pyrometer(args: &[&str]) -> Output {
    Command::new(pyrometer_bin())
        .args(args)
        .output()
        .expect("run pyrometer")
}

/// Panics with stderr unless the command succeeded.
pub fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "pyrometer failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts `cmd` with its standard output piped and waits for the first line it prints (a
/// fixture's "ready"), returned trimmed.
pub fn spawn_until_line(cmd: &mut std::process::Command) -> (std::process::Child, String) {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("piped")),
        &mut line,
    )
    .expect("read its first line");
    (child, line.trim().to_string())
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// One folded line: frames root first, and its count.
#[derive(Debug, Clone)]
pub struct FoldedStack {
    pub frames: Vec<String>,
    pub count: u64,
}

/// Inclusive sample counts of Python functions in a folded profile (`name (file:line)`
/// frames), by function name.
pub fn folded_counts(folded: &str, names: &[&str]) -> Vec<u64> {
    let mut counts = vec![0u64; names.len()];
    for line in folded.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else {
            continue;
        };
        let n: u64 = n.parse().unwrap_or(0);
        for (i, name) in names.iter().enumerate() {
            if stack
                .split(';')
                .any(|f| f.split(" (").next() == Some(*name))
            {
                counts[i] += n;
            }
        }
    }
    counts
}

pub fn read_folded(path: &Path) -> Vec<FoldedStack> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (stack, count) = l.rsplit_once(' ').expect("folded line has a count");
            FoldedStack {
                frames: stack.split(';').map(str::to_string).collect(),
                count: count.parse().expect("integer count"),
            }
        })
        .collect()
}

/// Share (0..=1) of all samples whose stack contains `function` (inclusive).
pub fn inclusive_share(stacks: &[FoldedStack], function: &str) -> f64 {
    let total: u64 = stacks.iter().map(|s| s.count).sum();
    let hit: u64 = stacks
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == function))
        .map(|s| s.count)
        .sum();
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

/// Inclusive shares of `functions`, relative to the samples that contain any of them.
pub fn relative_shares(stacks: &[FoldedStack], functions: &[&str]) -> HashMap<String, f64> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut total = 0;
    for s in stacks {
        if let Some(f) = functions.iter().find(|f| s.frames.iter().any(|x| x == *f)) {
            *counts.entry(f.to_string()).or_default() += s.count;
            total += s.count;
        }
    }
    functions
        .iter()
        .map(|f| {
            let c = counts.get(*f).copied().unwrap_or(0);
            (
                f.to_string(),
                if total == 0 {
                    0.0
                } else {
                    c as f64 / total as f64
                },
            )
        })
        .collect()
}

/// Decodes a (gzipped) pprof file with the proto crate.
pub fn read_pprof(path: &Path) -> pyrometer_proto::Profile {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let p = pyrometer_proto::decode(&bytes).expect("valid pprof");
    frame_tally::tally(&p);
    p
}

/// One pprof sample as the tests look at it: its labels (numbers as text), its function
/// names leaf first (inlined ones included), and its values.
#[derive(Debug, Clone)]
pub struct PprofSample {
    pub labels: HashMap<String, String>,
    pub functions: Vec<String>,
    pub values: Vec<i64>,
}

/// Every sample of a decoded pprof profile, resolved to names.
pub fn pprof_samples(p: &pyrometer_proto::Profile) -> Vec<PprofSample> {
    let s = |i: i64| p.string_table[i as usize].clone();
    let functions: HashMap<u64, String> = p.function.iter().map(|f| (f.id, s(f.name))).collect();
    let locations: HashMap<u64, Vec<String>> = p
        .location
        .iter()
        .map(|l| {
            let names = l
                .line
                .iter()
                .filter_map(|line| functions.get(&line.function_id).cloned())
                .collect();
            (l.id, names)
        })
        .collect();
    p.sample
        .iter()
        .map(|smp| PprofSample {
            labels: smp
                .label
                .iter()
                .map(|l| {
                    let value = if l.str != 0 {
                        s(l.str)
                    } else {
                        l.num.to_string()
                    };
                    (s(l.key), value)
                })
                .collect(),
            functions: smp
                .location_id
                .iter()
                .flat_map(|id| locations.get(id).cloned().unwrap_or_default())
                .collect(),
            values: smp.value.clone(),
        })
        .collect()
}

/// `go tool pprof -top` of the profile at `path`, with Go's caches under `dir` (a test's
/// scratch directory); panics when it fails.
pub fn go_pprof_top(path: &Path, dir: &Path) -> String {
    let go = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(path)
        .env("HOME", dir)
        .env("GOCACHE", dir.join("gocache"))
        .output()
        .expect("go is installed by `cargo xtask test` (Debian's golang-go)");
    assert!(
        go.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&go.stderr)
    );
    String::from_utf8_lossy(&go.stdout).into_owned()
}

/// The index of sample type `name` in a decoded pprof profile.
pub fn pprof_type(p: &pyrometer_proto::Profile, name: &str) -> usize {
    p.sample_type
        .iter()
        .position(|t| p.string_table[t.r#type as usize] == name)
        .unwrap_or_else(|| panic!("no sample type {name}"))
}
