//! `cargo xtask`: the project's tasks. Each installs what it needs first, so it works on a
//! fresh Debian machine run as root.
//!
//! - `deps`  install Debian packages the build and tests need (clang, libbpf-dev, golang-go, …)
//! - `demo`  build pyrometer, profile a bundled CPU-bound workload, write a flame graph
//! - `test`  fmt check, clippy `-D warnings`, the book (links, mdbook build), the man pages
//!   into `man/`, the whole suite with nextest
//! - `bench` overhead figures measured side by side (see bench.rs)
//! - `book`  check the book's links and build it into `target/book` (also part of `test`)
//! - `verifier` the BPF verifier table of the running kernel (see bpfcost.rs)
//! - `kernels [NAME...]` the kernel matrix under qemu, with a summary table (see kernels.rs)
//! - `forky-root` the Debian forky root with CPython 3.14/3.15 the tests chroot into (forky.rs)

mod agentbench;
mod allocbench;
mod bench;
mod book;
mod bpfcost;
mod forky;
mod kernels;
mod man;
mod otel;
mod otelbench;
mod pybench;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Debian packages, each with a file that shows it is installed.
const DEPS: &[(&str, &str)] = &[
    ("clang", "/usr/bin/clang"),
    ("llvm", "/usr/bin/llvm-objdump"),
    ("libbpf-dev", "/usr/include/bpf/bpf_helpers.h"),
    ("linux-libc-dev", "/usr/include/linux/bpf.h"),
    ("gcc", "/usr/bin/gcc"),
    ("binutils", "/usr/bin/objcopy"),
    ("util-linux", "/usr/bin/setpriv"),
    ("golang-go", "/usr/bin/go"),
    // promtool checks the agent's and collector's /metrics.
    ("prometheus", "/usr/bin/promtool"),
    // The speedscope export is checked in the real viewer (npm package), in headless Chromium.
    ("chromium", "/usr/bin/chromium"),
    ("nodejs", "/usr/bin/node"),
    ("npm", "/usr/bin/npm"),
    // The CPython offset table is checked against each build's DWARF through gdb.
    ("gdb", "/usr/bin/gdb"),
    // The separate debug file of Debian's python3.11 (the GIL probes' symbols); installing it
    // upgrades python3.11 to the matching build.
    ("python3.11-dbg", "/usr/share/doc/python3.11-dbg"),
    // Allocators other than glibc's, preloaded by the allocation tests.
    ("libjemalloc2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
    (
        "libtcmalloc-minimal4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    ),
    // For the e2e tests' OpenSSL-made TLS certificates and HTTPS queries.
    ("openssl", "/usr/bin/openssl"),
    ("curl", "/usr/bin/curl"),
    // `pyrometer top` is tested in a real terminal: tmux, read back with capture-pane.
    ("tmux", "/usr/bin/tmux"),
    // The generated man pages are rendered with groff in a test.
    ("groff-base", "/usr/bin/groff"),
    // The Kubernetes manifests are parsed with PyYAML; the agent image is built and run by a
    // private dockerd (the test skips, saying why, where no daemon can run).
    (
        "python3-yaml",
        "/usr/lib/python3/dist-packages/yaml/__init__.py",
    ),
    ("docker.io", "/usr/sbin/dockerd"),
    // The kernel matrix (tests/src/kernels): Debian kernels booted under qemu with a busybox
    // initramfs; depmod, xz and zstd prepare their modules.
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("seabios", "/usr/share/seabios/bios-256k.bin"),
    ("busybox-static", "/usr/share/doc/busybox-static"),
    ("kmod", "/usr/bin/kmod"),
    ("xz-utils", "/usr/bin/xz"),
    ("zstd", "/usr/bin/zstd"),
    // The collector's shared store: the tests start it by hand on loopback with a private
    // data directory (no system service runs it).
    ("clickhouse-server", "/usr/sbin/clickhouse-server"),
    // The Debian forky root with CPython 3.14 and 3.15 (forky.rs).
    ("debootstrap", "/usr/sbin/debootstrap"),
];

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    match args.first().map(String::as_str) {
        Some("deps") => deps(),
        Some("demo") => demo(&root),
        Some("test") => test(&args[1..]),
        Some("book") => book::check(&root),
        Some("bench") => {
            deps()?;
            bench::bench(&root)
        }
        Some("verifier") => {
            deps()?;
            bpfcost::verifier(&root)
        }
        Some("kernels") => kernels::kernels(&args[1..]),
        Some("forky-root") => {
            deps()?;
            let made = forky::ensure(&root).context("the Debian forky root was not made")?;
            println!("{}", made.display());
            Ok(())
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <deps|demo|test|bench|book|verifier|kernels [NAME...]|forky-root>"
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

/// Installs missing Debian packages (needs root, as the README says), then the npm packages.
fn deps() -> Result<()> {
    let missing: Vec<&str> = DEPS
        .iter()
        .filter(|(_, probe)| !Path::new(probe).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if !missing.is_empty() {
        eprintln!("installing Debian packages: {}", missing.join(" "));
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
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
fn build_dir() -> PathBuf {
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
    run(cargo().args([
        "build",
        "--release",
        "-p",
        "pyrometer",
        "--bin",
        "pyrometer",
    ]))?;
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

/// Builds the release binary and the bundled workload, records it, writes a flame graph.
fn demo(root: &Path) -> Result<()> {
    deps()?;
    let out = root.join("target/demo");
    let workload = build_release_and_workload(root, &out)?;
    let svg = out.join("flame.svg");
    run(Command::new(release_dir().join("pyrometer"))
        .args(["record", "-F", "199", "-o"])
        .arg(&svg)
        .arg("--")
        .arg(&workload)
        .arg("3"))?;
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
/// (a marker file records what was installed). Returns None, after saying why, when it cannot
/// be made: the tests that need it then print `skipping: …`.
pub fn python_venv(root: &Path, name: &str, packages: &[&str]) -> Option<PathBuf> {
    let venv = root.join("target").join(name);
    let marker = venv.join(".pyrometer-installed");
    let want = packages.join(" ");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == want) {
        return Some(venv);
    }
    let python = pyenv_python();
    if !python.exists() {
        eprintln!(
            "{} is missing: not making {} ({want})",
            python.display(),
            venv.display()
        );
        return None;
    }
    let made = run(Command::new(&python)
        .args(["-m", "venv", "--clear"])
        .arg(&venv))
    .and_then(|()| {
        run(Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(packages))
    });
    match made {
        Ok(()) => {
            std::fs::write(&marker, &want).ok()?;
            Some(venv)
        }
        Err(e) => {
            eprintln!("cannot make {} ({want}): {e:#}", venv.display());
            None
        }
    }
}

/// Ray for the real-cluster test (`tests/tests/ray.rs`), pinned.
pub const RAY_PACKAGES: &[&str] = &["ray==2.60.0"];

/// fmt, clippy and the whole suite. Extra arguments go to nextest (e.g. a test filter).
fn test(extra: &[String]) -> Result<()> {
    deps()?;
    otel::ray_venv(&workspace_root());
    otel::venv(&workspace_root());
    forky::ensure(&workspace_root());
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    book::check(&workspace_root())?;
    // The end-to-end tests run the real binary.
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
    ]))?;
    man::generate(&workspace_root())?;
    // The kernel in front of us: every program in every configuration within budget.
    run(Command::new(debug_dir().join("pyrometer")).arg("verifier"))?;
    let has_nextest = cargo()
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has_nextest {
        run(cargo()
            .args(["nextest", "run", "--workspace", "--no-fail-fast"])
            .args(extra))
    } else {
        eprintln!("cargo-nextest not found: running cargo test instead");
        run(cargo()
            .args(["test", "--workspace", "--no-fail-fast"])
            .args(extra))
    }
}
