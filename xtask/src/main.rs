//! `cargo xtask`: the project's tasks. Each installs what it needs first, so it works on a
//! fresh Debian machine run as root, and none removes or downgrades a package the machine has
//! (apt.rs).
//!
//! - `deps`  install the Debian packages the build, the tests and the benchmarks need
//! - `demo`  install what building and profiling need, build pyrometer, profile a bundled
//!   CPU-bound workload, write a flame graph
//! - `test`  the tests' set-up (setup.rs), fmt check, clippy `-D warnings`, the book, the man
//!   pages into `man/`, the whole suite with nextest, then the skip ledger and per-test times,
//!   checked under CI against tests/allowed-skips.toml and tests/manifest.txt (ledger.rs),
//!   and the share of unreadable Python frames in the profiles the tests read (frame_tally.rs)
//! - `manifest` rewrite tests/manifest.txt from `cargo nextest list`
//! - `ledger [FILTER...]` the ledger and checks of the last nextest run (with its filter)
//! - `arch`  the architecture rules: no import cycles, layers downward, the binary on the
//!   library's public API, file and function sizes (see arch/mod.rs)
//! - `bench` overhead figures measured side by side (see bench.rs)
//! - `book`  check the book's links and build it into `target/book` (also part of `test`)
//! - `verifier` the BPF verifier table of the running kernel (see bpfcost.rs)
//! - `kernels [NAME...]` the kernel matrix under qemu, with a summary table (see kernels.rs)
//! - `forky-root` the Debian forky root with CPython 3.14/3.15 the tests chroot into (forky.rs)
//! - `cuda-headers` the CUDA headers the GPU-kernel library builds against (cuda.rs)
//! - `free-threaded` the free-threaded CPython builds the tests run, cached outside the checkout
//!   (cpython.rs)

mod agentbench;
mod allocbench;
mod apt;
mod arch;
mod bench;
mod book;
mod bpfcost;
mod busybench;
mod capturebench;
mod cformat;
mod cpython;
mod cuda;
mod forky;
mod frame_tally;
mod kernels;
mod ledger;
mod man;
mod otel;
mod otelbench;
mod pybench;
mod quickbench;
mod setup;
mod tachyonbench;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    match args.first().map(String::as_str) {
        Some("deps") => deps(),
        Some("demo") => demo(&root),
        Some("test") => test(&args[1..]),
        Some("manifest") => manifest(&root),
        Some("ledger") => {
            let listed = list(&args[1..])?;
            let files = ledger::RunFiles::under(&build_dir());
            ledger::report(&root, &files, &listed, skip_ledger::ci())
        }
        Some("book") => book::check(&root),
        Some("arch") => arch::check(&root),
        Some("bench") => {
            deps()?;
            bench::bench(&root)
        }
        Some("verifier") => {
            deps()?;
            bpfcost::verifier(&root)
        }
        Some("kernels") => kernels::kernels(&args[1..]),
        Some("free-threaded") => cpython::command(),
        Some("forky-root") => {
            deps()?;
            let made = forky::ensure(&root)?;
            println!("{}", made.display());
            Ok(())
        }
        Some("cuda-headers") => {
            let include = cuda::ensure(&root).context("the CUDA headers were not fetched")?;
            println!("{}", include.display());
            Ok(())
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <deps|demo|test|manifest|ledger|arch|bench|book|verifier|kernels [NAME...]|forky-root|cuda-headers|free-threaded>"
            );
            std::process::exit(2);
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {}", display(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {}", display(cmd)))?;
    if !status.success() {
        bail!("{} failed: {status}", display(cmd));
    }
    Ok(())
}

fn display(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// npm packages the e2e tests use, pinned: the speedscope viewer and its file-format schema,
/// and ajv to validate against that schema. Installed into target/npm.
const NPM_DEPS: &[&str] = &["speedscope@1.25.0", "ajv@8.17.1"];

/// Installs the Debian packages of the demo, the tests and the benchmarks (needs root, as the
/// README says; apt's plan is checked first), then the npm packages.
fn deps() -> Result<()> {
    setup::all_packages()?;
    npm_deps()
}

fn npm_deps() -> Result<()> {
    let prefix = workspace_root().join("target/npm");
    let installed = NPM_DEPS.iter().all(|spec| {
        let (name, version) = spec.rsplit_once('@').expect("name@version");
        std::fs::read_to_string(prefix.join("node_modules").join(name).join("package.json"))
            .is_ok_and(|json| json.contains(&format!("\"version\": \"{version}\"")))
    });
    if installed {
        return Ok(());
    }
    std::fs::create_dir_all(&prefix)?;
    run(Command::new("npm")
        .args([
            "install",
            "--no-save",
            "--no-audit",
            "--no-fund",
            "--prefix",
        ])
        .arg(&prefix)
        .args(NPM_DEPS))
}

/// Where cargo puts its builds: `$CARGO_TARGET_DIR` when set, else `target/`.
pub(crate) fn build_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Where cargo puts debug binaries.
pub(crate) fn debug_dir() -> PathBuf {
    build_dir().join("debug")
}

/// Where cargo puts release binaries.
pub(crate) fn release_dir() -> PathBuf {
    build_dir().join("release")
}

pub(crate) fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Builds the release `pyrometer` and the bundled 6:3:1 workload (tests/fixtures/cpu631.c)
/// into `dir`; returns the workload's path.
pub fn build_release_and_workload(root: &Path, dir: &Path) -> Result<PathBuf> {
    build_pyrometer_and_workload(root, dir, true)
}

/// Builds `pyrometer` (release, or the dev profile the tests use) and the bundled workload
/// into `dir`, returning the workload's path.
fn build_pyrometer_and_workload(root: &Path, dir: &Path, release: bool) -> Result<PathBuf> {
    let mut build = cargo();
    build.arg("build");
    if release {
        build.arg("--release");
    }
    run(build.args(["-p", "pyrometer", "--bin", "pyrometer"]))?;
    std::fs::create_dir_all(dir)?;
    let workload = dir.join("cpu631");
    run(Command::new("gcc")
        .args([
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-fno-inline",
            "-fno-optimize-sibling-calls",
        ])
        .arg(root.join("tests/fixtures/cpu631.c"))
        .arg("-o")
        .arg(&workload))?;
    Ok(workload)
}

/// Installs only what building and profiling need, builds the binary and the bundled workload,
/// records it, writes a flame graph; prints each step's time. The binary is the dev profile's,
/// the one the tests run (its parsers optimized: see the workspace's Cargo.toml): 254 s of
/// CPU from an empty target/ where the release build takes 415 s, which on two cores is the
/// difference between under and over three minutes to the flame graph, and `cargo xtask
/// test` afterwards reuses it.
fn demo(root: &Path) -> Result<()> {
    let mut steps = setup::Steps::new(false);
    steps.must(
        "apt (clang, libclang-dev, libbpf-dev, linux-libc-dev, gcc, libc6-dev)",
        setup::demo_packages,
    )?;
    let out = root.join("target/demo");
    let workload = steps.must("build (pyrometer, the workload)", || {
        build_pyrometer_and_workload(root, &out, false)
    })?;
    let svg = out.join("flame.svg");
    steps.must("record", || {
        run(Command::new(debug_dir().join("pyrometer"))
            .args(["record", "-F", "199", "-o"])
            .arg(&svg)
            .arg("--")
            .arg(&workload)
            .arg("3"))
    })?;
    eprint!("{}", steps.table());
    println!("flame graph: {}", svg.display());
    Ok(())
}

/// The CPython the Python-side tools are installed for (pyenv's shared 3.11 build, which the
/// tests and benchmarks profile).
pub(crate) fn pyenv_python() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    Path::new(&home).join(".pyenv/versions/3.11.7/bin/python3.11")
}

/// A virtual environment under `target/` with `packages` from the Python registry, made once
/// (a marker file records what was installed). A `target/NAME` that is a link (a worktree
/// sharing the main checkout's venvs) is used as it is and never remade: `venv --clear`
/// through the link would empty the other checkout's venv. Made with pyenv's 3.11.
pub fn python_venv(root: &Path, name: &str, packages: &[&str]) -> Result<PathBuf> {
    python_venv_of(&pyenv_python(), root, name, packages)
}

/// [`python_venv`] made with the interpreter `python`.
pub fn python_venv_of(
    python: &Path,
    root: &Path,
    name: &str,
    packages: &[&str],
) -> Result<PathBuf> {
    let venv = root.join("target").join(name);
    let marker = venv.join(".pyrometer-installed");
    let want = packages.join(" ");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == want) {
        return Ok(venv);
    }
    if venv.is_symlink() {
        let to = std::fs::read_link(&venv).unwrap_or_default();
        if marker.exists() && venv.join("bin/python").exists() {
            eprintln!(
                "{} links to {}, made for another checkout: used as it is",
                venv.display(),
                to.display()
            );
            return Ok(venv);
        }
        bail!(
            "{} links to {}, which holds no complete venv; it is not remade through the link: \
             remove the link to make one of this checkout's own",
            venv.display(),
            to.display()
        );
    }
    if !python.exists() {
        bail!(
            "{} is missing: cannot make {} ({want})",
            python.display(),
            venv.display()
        );
    }
    run(Command::new(python)
        .args(["-m", "venv", "--clear"])
        .arg(&venv))
    .and_then(|()| {
        run(Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(packages))
    })
    .with_context(|| format!("cannot make {} ({want})", venv.display()))?;
    std::fs::write(&marker, &want)?;
    Ok(venv)
}

/// Ray for the real-cluster test (`tests/tests/ray.rs`), pinned.
pub const RAY_PACKAGES: &[&str] = &["ray==2.60.0"];

/// The tests' set-up, fmt, clippy, the book, the build, the man pages and the whole suite,
/// then the skip ledger and per-test times. Extra arguments go to nextest (e.g. a filter).
fn test(extra: &[String]) -> Result<()> {
    let root = workspace_root();
    let ci = skip_ledger::ci();
    let mut steps = setup::Steps::new(ci);
    setup::warn_if_short_of_disk(&root);
    steps.must("apt (build, tests)", setup::all_packages)?;
    steps.must("nextest (installed?)", setup::nextest)?;
    steps.must("npm", npm_deps)?;
    steps.needed(
        "interpreters (pyenv, Debian's python3.11)",
        setup::interpreters,
    );
    steps.needed("Ray venv", || otel::ray_venv(&root));
    steps.needed("OpenTelemetry venv", || otel::venv(&root));
    steps.needed("forky root", || forky::ensure(&root));
    // Before any build: the GPU-kernel library and its stand-in libcupti build against them.
    steps.needed("CUDA headers (target/cuda-headers)", || cuda::ensure(&root));
    let free_threaded = steps.needed("free-threaded CPython builds", cpython::ensure_all);
    steps.needed("OpenTelemetry venvs (free-threaded)", || {
        otel::free_threaded_venvs(&root, free_threaded.as_deref().unwrap_or_default())
    });
    steps.needed("kernel matrix qemu (target/qemu)", || {
        apt::matrix_tools(&build_dir())
    });
    steps.needed("kernel images", setup::kernel_images);
    steps.needed("ClickHouse", || {
        setup::present("/usr/sbin/clickhouse-server")
    });
    steps.needed("Chromium", || setup::answers("chromium", &["--version"]));
    steps.needed("Docker", || setup::answers("dockerd", &["--version"]));
    steps.finish()?;
    steps.must("fmt", || {
        run(cargo().args(["fmt", "--all", "--", "--check"]))
    })?;
    steps.must("clang-format", || cformat::check(&root))?;
    steps.must("architecture", || arch::check(&root))?;
    steps.must("clippy", || {
        run(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    steps.must("book", || book::check(&root))?;
    // The end-to-end tests run the real binary.
    steps.must("build", || {
        run(cargo().args([
            "build",
            "-p",
            "pyrometer",
            "--bin",
            "pyrometer",
            "-p",
            "pyrometer-collector",
            "--bin",
            "pyrometer-collector",
        ]))
    })?;
    steps.must("man pages", || man::generate(&root))?;
    // The kernel in front of us: every program in every configuration within budget.
    steps.must("verifier", || {
        run(Command::new(debug_dir().join("pyrometer")).arg("verifier"))
    })?;
    let files = ledger::RunFiles::under(&build_dir());
    let _ = std::fs::remove_file(&files.ledger);
    let _ = std::fs::remove_file(&files.junit);
    let _ = std::fs::remove_file(&files.frames);
    // Listed before the run, from the build the run then uses: the `cargo install` test
    // builds into the same build directory with the installed package's own features, after
    // which a list would rebuild much of the workspace (5 to 6 minutes on two cores).
    let listed = steps.must("nextest list", || list(extra))?;
    let suite = steps.must("nextest run", || {
        Ok(run(cargo()
            .args(["nextest", "run", "--workspace", "--no-fail-fast"])
            .args(extra)
            .env(skip_ledger::LEDGER_ENV, &files.ledger)
            .env("PYROMETER_FRAME_TALLY", &files.frames)
            // record honours it, as perf does: a developer's (Debian sets one for login
            // shells) would send every recording's stripped binaries to that server.
            .env_remove("DEBUGINFOD_URLS")))
    })?;
    eprint!("{}", steps.table());
    let checked = ledger::report(&root, &files, &listed, ci);
    suite?;
    checked
}

/// The suite as `cargo nextest list` sees it, with what `filter` (nextest's arguments)
/// selects. A filtered list leaves out the binaries the filter rules out, so the whole suite
/// comes from a list of its own.
fn list(filter: &[String]) -> Result<ledger::Listed> {
    let listed = |args: &[String]| -> Result<ledger::Listed> {
        let out = cargo()
            .args(["nextest", "list", "--workspace", "--message-format", "json"])
            .args(args)
            .stderr(std::process::Stdio::inherit())
            .output()
            .context("cannot run cargo nextest list")?;
        if !out.status.success() {
            bail!("cargo nextest list failed: {}", out.status);
        }
        ledger::parse_list(&String::from_utf8_lossy(&out.stdout))
    };
    let mut all = listed(&[])?;
    if !filter.is_empty() {
        all.selected = listed(filter)?.selected;
    }
    Ok(all)
}

/// Rewrites tests/manifest.txt from the suite as it is now.
fn manifest(root: &Path) -> Result<()> {
    let listed = list(&[])?;
    let path = root.join(ledger::MANIFEST);
    let before = ledger::read_manifest(&path).unwrap_or_default();
    std::fs::write(&path, ledger::manifest_text(&listed.all))?;
    let added = listed.all.difference(&before).count();
    let removed = before.difference(&listed.all).count();
    println!(
        "{}: {} tests ({added} added, {removed} removed); commit it with the change",
        path.display(),
        listed.all.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A venv linked from another checkout is never remade through the link: an incomplete
    /// one is an error that leaves the other checkout's files alone, a complete one is used.
    #[test]
    fn a_linked_venv_is_used_or_refused_never_remade() {
        let dir = std::env::temp_dir().join(format!("xtask-venv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let theirs = dir.join("main/target/ray-venv");
        std::fs::create_dir_all(&theirs).unwrap();
        std::fs::write(theirs.join("keep"), "another checkout's file").unwrap();
        let ours = dir.join("worktree");
        std::fs::create_dir_all(ours.join("target")).unwrap();
        std::os::unix::fs::symlink(&theirs, ours.join("target/ray-venv")).unwrap();

        let err = python_venv(&ours, "ray-venv", &["ray==2.60.0"]).unwrap_err();
        assert!(
            format!("{err:#}").contains("not remade through the link"),
            "{err:#}"
        );
        assert!(
            theirs.join("keep").exists(),
            "the other checkout's venv was touched"
        );

        std::fs::create_dir_all(theirs.join("bin")).unwrap();
        std::fs::write(theirs.join("bin/python"), "").unwrap();
        std::fs::write(
            theirs.join(".pyrometer-installed"),
            "ray==2.60.0 -e /main/x",
        )
        .unwrap();
        let used = python_venv(&ours, "ray-venv", &["ray==2.60.0"]).unwrap();
        assert_eq!(used, ours.join("target/ray-venv"));
        assert!(theirs.join("keep").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
