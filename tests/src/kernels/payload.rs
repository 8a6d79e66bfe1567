//! The payload every kernel runs: a shell script (the machine's /bin/sh, under qemu inside a
//! chroot into the machine's read-only root) that runs each step under `timeout` and leaves
//! its output, exit status and times in a results directory. The checks are made afterwards,
//! outside the guest, from those files (see `checks`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::checks::{self, Check};
use crate::python::{Interpreter, source};

/// Per-step limits (seconds) inside the kernel: under TCG the verifier and the user-space
/// unwinding-table builder run ~10x slower than on the machine.
pub const VERIFIER_LIMIT_S: u32 = 240;
pub const RECORD_LIMIT_S: u32 = 240;

/// Seconds of the C workload.
const NATIVE_SECONDS: u32 = 8;
/// How hard the payload samples and how long the Python workload runs.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    pub hz: u32,
    /// A round of py631.py is ~20 ms of CPU on the machine and ~1.3 s under TCG.
    pub python_rounds: u32,
}

/// On the machine the workloads share two busy cores: sample faster to get a few hundred
/// samples of each. A guest's clock runs while its vCPU waits for the machine, so 99 Hz gives
/// ~100 samples a guest second whatever else runs.
pub const HOST: Sizes = Sizes {
    hz: 499,
    python_rounds: 100,
};
pub const GUEST: Sizes = Sizes {
    hz: 99,
    python_rounds: 8,
};

/// The programs the payload runs, as paths on the machine (the guest sees the same root).
#[derive(Debug, Clone)]
pub struct Setup {
    pub pyrometer: PathBuf,
    pub nofp: PathBuf,
    pub python: PathBuf,
    pub script: PathBuf,
}

impl Setup {
    pub fn find() -> Setup {
        let pyenv = Interpreter::pyenv(11);
        let python = if pyenv.path.exists() {
            pyenv.path
        } else {
            crate::python::debian().path
        };
        Setup {
            pyrometer: crate::pyrometer_bin(),
            nofp: crate::fixture("cpu631-nofp"),
            python,
            script: source("py631.py"),
        }
    }
}

fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// The payload script for a results directory that the payload sees as `results`.
pub fn script(setup: &Setup, results: &Path, sizes: Sizes) -> String {
    let r = quote(results);
    let bin = quote(&setup.pyrometer);
    format!(
        r#"#!/bin/sh
# The kernel matrix's payload (tests/src/kernels/payload.rs). Each step leaves NAME.log
# (its output) and NAME.step ("EXIT_STATUS START END", seconds) in {r}.
R={r}
BIN={bin}
export HOME=/root
# pyrometer writes the full log of a program the verifier refused under $TMPDIR: keep them
# with the results (a guest's /tmp is gone when it powers off).
mkdir -p "$R/tmp"
export TMPDIR="$R/tmp"
date +%s.%N > "$R/started"
uname -r > "$R/uname"
step() {{
    name=$1; limit=$2; shift 2
    start=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
    rc=$?
    echo "$rc $start $(date +%s.%N)" > "$R/$name.step"
}}
if "$BIN" verifier --help > /dev/null 2>&1; then
    step verifier {verifier} "$BIN" verifier
else
    echo "pyrometer has no verifier subcommand yet (pyrometer verifier --help failed)" > "$R/verifier.log"
    echo absent > "$R/verifier.step"
fi
# One recording of both workloads (a shell runs them one after the other; `record -- CMD`
# follows its descendants): under TCG pyrometer's own start takes most of a minute.
step record {record} "$BIN" record -F {hz} -o "$R/record.folded" -- /bin/sh -c "{nofp} {secs} && {python} {script} {rounds}"
echo done > "$R/done"
"#,
        verifier = VERIFIER_LIMIT_S,
        record = RECORD_LIMIT_S,
        nofp = quote(&setup.nofp),
        secs = NATIVE_SECONDS,
        python = quote(&setup.python),
        script = quote(&setup.script),
        hz = sizes.hz,
        rounds = sizes.python_rounds,
    )
}

/// Longest the whole payload may take, plus `margin_s` for booting.
pub fn limit_s(margin_s: u32) -> u32 {
    VERIFIER_LIMIT_S + RECORD_LIMIT_S + 2 * 5 + margin_s
}

/// Empties `dir` (the results of an earlier run) and writes the payload for `seen_as`.
pub fn fresh_results(
    setup: &Setup,
    dir: &Path,
    seen_as: &Path,
    sizes: Sizes,
) -> std::io::Result<PathBuf> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    let path = dir.join("payload.sh");
    fs::write(&path, script(setup, seen_as, sizes))?;
    Ok(path)
}

/// Runs the payload on the machine's kernel, in `dir/results`.
pub fn run_on_host(setup: &Setup, dir: &Path) -> Vec<Check> {
    let results = dir.join("results");
    let started = Instant::now();
    let payload = match fresh_results(setup, &results, &results, HOST) {
        Ok(p) => p,
        Err(e) => {
            return vec![Check::fail(
                "payload",
                0.0,
                format!("{}: {e}", dir.display()),
            )];
        }
    };
    let status = Command::new("/bin/sh").arg(&payload).status();
    let seconds = started.elapsed().as_secs_f64();
    match status {
        Ok(s) if s.success() => checks::all(&results),
        Ok(s) => vec![Check::fail("payload", seconds, format!("exited {s}"))],
        Err(e) => vec![Check::fail(
            "payload",
            seconds,
            format!("cannot run /bin/sh: {e}"),
        )],
    }
}
