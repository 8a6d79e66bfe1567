//! The CPython interpreters on the machine the Python tests run against: pyenv's shared builds
//! 3.8–3.13, Debian's static python3.11, Debian forky's 3.14 and 3.15 run by `chroot` in
//! `target/forky/root` (`cargo xtask forky-root`), and the free-threaded 3.13t and 3.14t built
//! into a cache outside the checkout (`cargo xtask free-threaded`, tests/free-threaded.txt). A
//! missing one makes a test skip through the skip ledger (`crate::skip`).

use std::path::{Path, PathBuf};

/// One interpreter to test.
#[derive(Debug, Clone)]
pub struct Interpreter {
    /// For messages: `3.11` for pyenv's, `Debian 3.11` for the system one.
    pub label: String,
    pub path: PathBuf,
    pub minor: u32,
}

/// pyenv's versions the tests use, (directory, minor).
pub const PYENV_VERSIONS: &[(&str, u32)] = &[
    ("3.8.18", 8),
    ("3.9.18", 9),
    ("3.10.13", 10),
    ("3.11.7", 11),
    ("3.12.1", 12),
    ("3.13.0", 13),
];

/// `~/.pyenv/versions/VERSION/bin/python3.X`.
pub fn pyenv(version: &str) -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let minor = version.rsplit_once('.').unwrap().0;
    Path::new(&home).join(format!(".pyenv/versions/{version}/bin/python{minor}"))
}

/// Every supported interpreter: pyenv 3.8–3.13, then Debian's python3.11.
pub fn supported() -> Vec<Interpreter> {
    let mut out: Vec<Interpreter> = PYENV_VERSIONS
        .iter()
        .map(|&(v, minor)| Interpreter {
            label: format!("3.{minor}"),
            path: pyenv(v),
            minor,
        })
        .collect();
    out.push(debian());
    out
}

/// Debian's `/usr/bin/python3.11` (static, stripped; symbols from python3.11-dbg).
pub fn debian() -> Interpreter {
    Interpreter {
        label: "Debian 3.11".into(),
        path: PathBuf::from("/usr/bin/python3.11"),
        minor: 11,
    }
}

/// The free-threaded builds' list: `VERSION SHA256` lines (xtask/src/cpython.rs builds them).
const FREE_THREADED: &str = include_str!("../free-threaded.txt");

/// The free-threaded build of 3.MINOR (`--disable-gil --enable-shared`), from the cache
/// `cargo xtask free-threaded` builds into: `/var/cache/pyrometer-cpython/SHA256/bin/python3.MINORt`
/// (`PYROMETER_CPYTHON_CACHE` overrides the directory). Labelled `3.MINORt`.
pub fn free_threaded(minor: u32) -> Interpreter {
    let want = format!("3.{minor}.");
    let (_, sha) = FREE_THREADED
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once(' '))
        .find(|(v, _)| v.starts_with(&want))
        .unwrap_or_else(|| panic!("tests/free-threaded.txt lists no 3.{minor}"));
    let cache = std::env::var_os("PYROMETER_CPYTHON_CACHE").map_or_else(
        || PathBuf::from("/var/cache/pyrometer-cpython"),
        PathBuf::from,
    );
    Interpreter {
        label: format!("3.{minor}t"),
        path: cache.join(sha.trim()).join(format!("bin/python3.{minor}t")),
        minor,
    }
}

/// Every free-threaded build the tests run: 3.13t and 3.14t.
pub fn free_threaded_all() -> Vec<Interpreter> {
    vec![free_threaded(13), free_threaded(14)]
}

/// The Debian forky root (`cargo xtask forky-root`; `PYROMETER_FORKY_ROOT` overrides).
pub fn forky_root() -> PathBuf {
    std::env::var_os("PYROMETER_FORKY_ROOT")
        .map_or_else(|| workspace().join("target/forky/root"), PathBuf::from)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_path_buf()
}

/// The launcher of a forky interpreter (see [`forky`]). Exit status 125: the namespace could
/// not be set up.
const LAUNCHER: &str = r#"#!/bin/sh
# Made by the tests (tests/src/python.rs): forky's @PYTHON@ in its own root, as in a container.
exec unshare --mount --propagation private /bin/sh -c '
r=$1; shift
mount -t proc proc "$r/proc" || exit 125
for d in /tmp @DIRS@; do
  mkdir -p "$r$d" && mount --bind "$d" "$r$d" || exit 125
done
exec chroot "$r" "$@"' sh @ROOT@ @PYTHON@ "$@"
"#;

/// Debian forky's `python3.MINOR`, started through a launcher script as a process in a
/// container would be: in a private mount namespace with its own /proc, `chroot`ed into the
/// forky root, where its debug files are. /tmp (the tests' scratch directories) and the
/// workspace (the fixtures) are bind-mounted at the same paths, so scripts and their paths are
/// the same inside and out.
pub fn forky(minor: u32) -> Interpreter {
    let root = forky_root();
    let python = format!("/usr/bin/python3.{minor}");
    let launcher = root
        .parent()
        .unwrap_or(&root)
        .join(format!("bin/python3.{minor}"));
    let label = format!("forky 3.{minor}");
    if root.join(python.trim_start_matches('/')).exists() {
        let script = LAUNCHER
            .replace("@PYTHON@", &python)
            .replace("@ROOT@", &root.display().to_string())
            .replace("@DIRS@", &bound_dirs());
        write_executable(&launcher, &script);
    }
    Interpreter {
        label,
        path: launcher,
        minor,
    }
}

/// The directories a forky process sees at their own paths besides /tmp: the workspace (the
/// fixtures) and, when it lies outside (CARGO_TARGET_DIR elsewhere), the directory of the
/// binaries under test, where the preloaded allocation library is.
fn bound_dirs() -> String {
    let ws = workspace();
    let mut dirs = vec![ws.clone()];
    if let Some(bin) = crate::pyrometer_bin().parent()
        && !bin.starts_with(&ws)
    {
        dirs.push(bin.to_path_buf());
    }
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Writes an executable file unless it already has `text` (tests in parallel processes make
/// the same one: write aside, then rename).
fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return;
    }
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Why the forky root is missing, for the skip ledger.
fn forky_missing() -> String {
    let failed = forky_root().parent().map(|d| d.join("failed"));
    match failed.and_then(|f| std::fs::read_to_string(f).ok()) {
        Some(reason) => format!("the Debian forky root could not be made: {}", reason.trim()),
        None => format!(
            "{} is missing (made by `cargo xtask forky-root`)",
            forky_root().display()
        ),
    }
}

impl Interpreter {
    /// Whether this is a forky interpreter run in its chroot.
    pub fn in_forky(&self) -> bool {
        self.label.starts_with("forky")
    }

    /// The pyenv interpreter of minor version `minor`.
    pub fn pyenv(minor: u32) -> Interpreter {
        supported()
            .into_iter()
            .find(|i| i.minor == minor && !i.label.starts_with("Debian"))
            .expect("a pyenv version the tests know")
    }

    /// False (after recording the skip) when the interpreter is not installed.
    pub fn present(&self) -> bool {
        let forky_python = forky_root().join(format!("usr/bin/python3.{}", self.minor));
        if self.in_forky() && !(self.path.exists() && forky_python.exists()) {
            crate::skip("forky-root", format!("{}: {}", self.label, forky_missing()));
            false
        } else if self.path.exists() {
            true
        } else if self.label.ends_with('t') {
            crate::skip(
                &self.capability(),
                format!(
                    "{}: {} is missing (built by `cargo xtask free-threaded`, ~6 min)",
                    self.label,
                    self.path.display()
                ),
            );
            false
        } else {
            crate::skip(
                &self.capability(),
                format!("{}: {} is missing", self.label, self.path.display()),
            );
            false
        }
    }

    /// The skip ledger's name for this interpreter: `python:3.12`, `python:debian-3.11`.
    pub fn capability(&self) -> String {
        capability(&self.label)
    }
}

/// The skip ledger's name for the interpreter labelled `label` (`3.12`, `Debian 3.11`, `forky
/// 3.14`): `python:3.12`, `python:debian-3.11`, `python:forky-3.14`.
pub fn capability(label: &str) -> String {
    format!("python:{}", label.to_lowercase().replace(' ', "-"))
}

/// 1-based number of the first line of `file` containing `needle`.
pub fn line_of(file: &Path, needle: &str) -> u32 {
    let text = std::fs::read_to_string(file).unwrap();
    text.lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no '{needle}' in {}", file.display())) as u32
        + 1
}

/// A tests/fixtures file.
pub fn source(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}
