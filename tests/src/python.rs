//! The CPython interpreters on the machine the Python tests run against: pyenv's shared builds
//! 3.8–3.13 and Debian's static python3.11. A missing one makes a test print `skipping: …`.

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

impl Interpreter {
    /// The pyenv interpreter of minor version `minor`.
    pub fn pyenv(minor: u32) -> Interpreter {
        supported()
            .into_iter()
            .find(|i| i.minor == minor && !i.label.starts_with("Debian"))
            .expect("a pyenv version the tests know")
    }

    /// False (after printing why) when the interpreter is not installed.
    pub fn present(&self) -> bool {
        if self.path.exists() {
            true
        } else {
            println!(
                "skipping {}: {} is missing",
                self.label,
                self.path.display()
            );
            false
        }
    }
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
