//! `cargo xtask free-threaded`: the free-threaded CPython builds the tests run (3.13t, 3.14t),
//! listed with their SHA-256 in `tests/free-threaded.txt`. Neither pyenv's builds nor Debian's
//! packages are free-threaded, so each is built from Debian's upstream tarball
//! (`pool/main/p/python3.X/python3.X_VERSION.orig.tar.xz`, fetched from the mirror apt uses)
//! with `./configure --disable-gil --enable-shared`, once per machine: into a cache outside the
//! checkout keyed by the tarball's sum (`/var/cache/pyrometer-cpython/SHA256/`, or
//! `$PYROMETER_CPYTHON_CACHE/SHA256/`), so every clone and worktree of the machine shares it and
//! a clean clone does not build again. `make -j2`: about 6 minutes a build on two idle cores.
//! A lock per build keeps two test commands from building the same one at once.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// The list (one `VERSION SHA256` line per build).
const LIST: &str = include_str!("../../tests/free-threaded.txt");

/// How every build is configured. Part of the cache's completion mark: a build made another way
/// is made again.
const CONFIGURE: &[&str] = &["--disable-gil", "--enable-shared", "--without-ensurepip"];

/// Used when apt's sources name no Debian mirror.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// One build of the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Build {
    /// `3.14.7`.
    pub version: String,
    pub sha256: String,
}

impl Build {
    /// `3.14`.
    pub fn minor(&self) -> &str {
        self.version
            .rsplit_once('.')
            .map_or(self.version.as_str(), |(m, _)| m)
    }

    /// The tarball's path in Debian's pool.
    pub fn pool_path(&self) -> String {
        let minor = self.minor();
        format!(
            "pool/main/p/python{minor}/python{minor}_{}.orig.tar.xz",
            self.version
        )
    }

    /// Where the build is installed (its `--prefix`).
    pub fn prefix(&self) -> PathBuf {
        cache_dir().join(&self.sha256)
    }

    /// The interpreter: `PREFIX/bin/python3.14t`.
    pub fn python(&self) -> PathBuf {
        self.prefix().join(format!("bin/python{}t", self.minor()))
    }
}

/// The builds `tests/free-threaded.txt` lists.
pub fn builds() -> Result<Vec<Build>> {
    parse(LIST)
}

fn parse(text: &str) -> Result<Vec<Build>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(version), Some(sha256), None) = (words.next(), words.next(), words.next()) else {
            bail!("tests/free-threaded.txt:{}: want 'VERSION SHA256'", n + 1);
        };
        let numeric = version.split('.').count() == 3
            && version
                .split('.')
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        if !numeric || !version.starts_with("3.") {
            bail!(
                "tests/free-threaded.txt:{}: '{version}' is not a CPython 3.X.Y version",
                n + 1
            );
        }
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!(
                "tests/free-threaded.txt:{}: '{sha256}' is not a SHA-256",
                n + 1
            );
        }
        out.push(Build {
            version: version.to_string(),
            sha256: sha256.to_ascii_lowercase(),
        });
    }
    Ok(out)
}

/// `$PYROMETER_CPYTHON_CACHE`, else `/var/cache/pyrometer-cpython`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("PYROMETER_CPYTHON_CACHE").map_or_else(
        || PathBuf::from("/var/cache/pyrometer-cpython"),
        PathBuf::from,
    )
}

/// Every listed build, made where missing.
pub fn ensure_all() -> Result<Vec<PathBuf>> {
    builds()?.iter().map(ensure).collect()
}

/// The build's interpreter, built first unless the cache holds it.
pub fn ensure(build: &Build) -> Result<PathBuf> {
    let cache = cache_dir();
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("cannot make {} (run as root)", cache.display()))?;
    let lock_path = cache.join(format!("{}.lock", build.sha256));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&lock_path)
        .with_context(|| format!("cannot open {}", lock_path.display()))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` is dropped.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        eprintln!(
            "CPython {}: another command is building it; waiting for its lock",
            build.version
        );
        // SAFETY: as above, blocking this time.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            bail!("cannot lock {}", lock_path.display());
        }
    }
    let mark = build.prefix().join(MARK);
    if complete(&mark) && build.python().exists() {
        return Ok(build.python());
    }
    let started = Instant::now();
    make(build).with_context(|| {
        format!(
            "cannot build free-threaded CPython {} into {}",
            build.version,
            build.prefix().display()
        )
    })?;
    let took = started.elapsed().as_secs();
    std::fs::write(&mark, format!("{}\n{took} s\n", CONFIGURE.join(" ")))?;
    eprintln!(
        "built free-threaded CPython {} in {took} s: {}",
        build.version,
        build.python().display()
    );
    Ok(build.python())
}

/// The completion mark in a build's prefix: the configure options, then how long it took.
const MARK: &str = "pyrometer-built";

fn complete(mark: &Path) -> bool {
    std::fs::read_to_string(mark)
        .is_ok_and(|m| m.lines().next() == Some(CONFIGURE.join(" ").as_str()))
}

fn make(build: &Build) -> Result<()> {
    let cache = cache_dir();
    let tarball = cache.join(format!("{}.tar.xz", build.sha256));
    if !tarball.exists() || sha256(&tarball)? != build.sha256 {
        fetch(build, &tarball)?;
    }
    let work = cache.join(format!("{}.build", build.sha256));
    let prefix = build.prefix();
    for dir in [&work, &prefix] {
        if dir.exists() {
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
        }
    }
    std::fs::create_dir_all(&work)?;
    crate::run(
        Command::new("tar")
            .arg("-xf")
            .arg(&tarball)
            .arg("-C")
            .arg(&work)
            .arg("--strip-components=1"),
    )?;
    // The library is found through the run path, wherever the interpreter is started from.
    let ldflags = format!("LDFLAGS=-Wl,-rpath,{}/lib", prefix.display());
    quiet(
        Command::new("./configure")
            .arg(format!("--prefix={}", prefix.display()))
            .args(CONFIGURE)
            .arg(ldflags)
            .current_dir(&work),
        &work.join("configure.log"),
    )?;
    quiet(
        Command::new("make").arg("-j2").current_dir(&work),
        &work.join("make.log"),
    )?;
    // Installed aside, then moved into place: an interrupted install leaves no prefix behind
    // that looks complete.
    let stage = work.join("stage");
    quiet(
        Command::new("make")
            .arg("install")
            .arg(format!("DESTDIR={}", stage.display()))
            .current_dir(&work),
        &work.join("install.log"),
    )?;
    let staged = stage.join(prefix.strip_prefix("/").unwrap_or(&prefix));
    std::fs::rename(&staged, &prefix)
        .with_context(|| format!("cannot move {} into place", staged.display()))?;
    check(build)?;
    std::fs::remove_dir_all(&work)?;
    Ok(())
}

/// The interpreter runs, free-threaded, with the modules the tests use.
fn check(build: &Build) -> Result<()> {
    let out = Command::new(build.python())
        .args([
            "-c",
            "import sys, zlib, asyncio, threading; print(sys.version.split()[0], sys._is_gil_enabled())",
        ])
        .output()
        .with_context(|| format!("cannot run {}", build.python().display()))?;
    let said = String::from_utf8_lossy(&out.stdout);
    let want = format!("{} False", build.version);
    if !out.status.success() || said.trim() != want {
        bail!(
            "{} printed '{}' (want '{want}'): {}",
            build.python().display(),
            said.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `cmd` with its output in `log`; a failure quotes the log's end.
fn quiet(cmd: &mut Command, log: &Path) -> Result<()> {
    eprintln!("+ {} (output in {})", crate::display(cmd), log.display());
    let file = std::fs::File::create(log)?;
    let status = cmd
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("cannot run {}", crate::display(cmd)))?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{} failed ({status}); the end of {}:\n{}",
            crate::display(cmd),
            log.display(),
            tail.join("\n")
        );
    }
    Ok(())
}

/// Downloads the tarball into `to` and checks its sum.
fn fetch(build: &Build, to: &Path) -> Result<()> {
    let url = format!("{}/{}", mirror(), build.pool_path());
    let part = to.with_extension("part");
    crate::run(
        Command::new("curl")
            .args(["-fsSL", "--retry", "3", "--max-time", "900", "-o"])
            .arg(&part)
            .arg(&url),
    )
    .with_context(|| format!("cannot download {url}"))?;
    let got = sha256(&part)?;
    if got != build.sha256 {
        let _ = std::fs::remove_file(&part);
        bail!(
            "{url} has SHA-256 {got}, tests/free-threaded.txt says {}: not used",
            build.sha256
        );
    }
    std::fs::rename(&part, to)?;
    Ok(())
}

fn sha256(path: &Path) -> Result<String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("cannot run sha256sum")?;
    if !out.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .with_context(|| format!("sha256sum printed nothing for {}", path.display()))
}

/// The Debian mirror apt uses: the first `URIs:` (deb822 `.sources`) or `deb` line (`.list`)
/// of apt's sources whose path ends in `/debian`, else deb.debian.org.
pub fn mirror() -> String {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "list" || e == "sources"))
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .find_map(|text| mirror_in(&text))
        .unwrap_or_else(|| DEFAULT_MIRROR.to_string())
}

fn mirror_in(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            let uris: Vec<&str> = if let Some(rest) = l.strip_prefix("URIs:") {
                rest.split_whitespace().collect()
            } else if let Some(rest) = l.strip_prefix("deb ") {
                // `deb [options] URI suite components`
                rest.split_whitespace()
                    .filter(|w| w.contains("://"))
                    .take(1)
                    .collect()
            } else {
                Vec::new()
            };
            uris
        })
        .map(|u| u.trim_end_matches('/'))
        .find(|u| u.ends_with("/debian") && u.contains("://"))
        .map(str::to_string)
}

/// `cargo xtask free-threaded`: builds what is missing and prints each interpreter.
pub fn command() -> Result<()> {
    for python in ensure_all()? {
        let mut out = std::io::stdout();
        writeln!(out, "{}", python.display())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_parses_and_names_pool_paths() {
        let builds = builds().unwrap();
        assert!(builds.len() >= 2);
        let b = Build {
            version: "3.14.7".into(),
            sha256: "ab".repeat(32),
        };
        assert_eq!(
            b.pool_path(),
            "pool/main/p/python3.14/python3.14_3.14.7.orig.tar.xz"
        );
        assert!(
            b.python()
                .ends_with(format!("{}/bin/python3.14t", "ab".repeat(32)))
        );
        for bad in [
            "3.14 abc".to_string(),
            "3.14.7".to_string(),
            format!("x.y.z {}", "a".repeat(64)),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_mirror_is_read_from_either_format() {
        let deb822 = "Types: deb\n# URIs: http://old/debian\nURIs: http://mirror.example/debian/\nSuites: bookworm\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n";
        assert_eq!(
            mirror_in(deb822).as_deref(),
            Some("http://mirror.example/debian")
        );
        let list = "deb [arch=amd64] http://ftp.example/debian bookworm main\n";
        assert_eq!(
            mirror_in(list).as_deref(),
            Some("http://ftp.example/debian")
        );
        assert_eq!(
            mirror_in("deb https://packages.cloud.google.com/apt cloud-sdk main"),
            None
        );
    }
}
