//! The libraries this `pyrometer` carries inside itself (built by `build.rs`): the
//! allocation sampler and the CUPTI library of `--gpu-kernels`; and where they are written so
//! that a process can load them: a cache directory keyed by the library's hash (`record`, the
//! agent), or a directory of the user's choosing (`pyrometer install-preload DIR`, for systemd
//! units, container images and Ray).
//!
//! A file in the cache is only ever replaced whole (written aside, then renamed over), never
//! rewritten in place: processes map it, and a library changed under a running process
//! crashes it. A copy found there is used only when it is a regular file owned by this user,
//! writable by nobody else, in directories writable by nobody else, and byte for byte the
//! carried library; anything else is written again.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::os::owned::check_owner_and_mode;

/// The allocation sampler's file name: a process that maps a file of this name loads it.
pub const LIBRARY: &str = "libpyrometer_alloc.so";

/// A library carried inside the binary.
#[derive(Debug)]
pub struct Carried {
    /// Its file name.
    pub name: &'static str,
    /// Its bytes; empty in a build that could not make it.
    bytes: &'static [u8],
    /// FNV-1a of the bytes in hex: the cache directory's name.
    hash: &'static str,
    /// Why a build carries none.
    missing: &'static str,
}

/// The allocation sampler (`libpyrometer_alloc.so`).
pub static ALLOC: Carried = Carried {
    name: LIBRARY,
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/libpyrometer_alloc.so")),
    hash: env!("PYROMETER_ALLOC_HASH"),
    missing: "the library is built for x86_64 Linux only",
};

/// The CUPTI library of `--gpu-kernels` (`libpyrometer_cupti.so`).
pub static CUPTI: Carried = Carried {
    name: "libpyrometer_cupti.so",
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/libpyrometer_cupti.so")),
    hash: env!("PYROMETER_CUPTI_HASH"),
    missing: "it was built without the CUDA headers: run `cargo xtask cuda-headers` and build pyrometer again",
};

#[cfg(test)]
const BYTES: &[u8] = ALLOC.bytes;
#[cfg(test)]
const HASH: &str = ALLOC.hash;
/// Overrides the cache directory.
pub const CACHE_ENV: &str = "PYROMETER_CACHE_DIR";
/// The cache directory of root.
pub const ROOT_CACHE: &str = "/var/cache/pyrometer";

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error("this pyrometer carries no {library} ({why})")]
    NotCarried {
        library: &'static str,
        why: &'static str,
    },
    #[error(
        "no cache directory for pyrometer's libraries: neither ${CACHE_ENV}, $XDG_CACHE_HOME nor $HOME is set"
    )]
    NoCacheDir,
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is {why}: pyrometer's libraries are not written there (processes would load what others can change); fix its owner and mode, or set ${CACHE_ENV} to another directory",
        path.display()
    )]
    Unsafe { path: PathBuf, why: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EmbeddedError + '_ {
    move |source| EmbeddedError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether this build carries the allocation sampler.
#[cfg(test)]
fn carried() -> bool {
    ALLOC.carried()
}

impl Carried {
    /// Whether this build carries the library.
    pub fn carried(&self) -> bool {
        !self.bytes.is_empty()
    }

    /// The carried library's bytes.
    pub fn bytes(&self) -> Result<&'static [u8], EmbeddedError> {
        if self.carried() {
            Ok(self.bytes)
        } else {
            Err(EmbeddedError::NotCarried {
                library: self.name,
                why: self.missing,
            })
        }
    }

    /// The carried library in the cache directory (`DIR/HASH/NAME`), written there first
    /// unless a verified copy is there already.
    pub fn cached(&self) -> Result<PathBuf, EmbeddedError> {
        self.cached_in(&cache_root()?)
    }

    /// [`Carried::cached`] under `root`.
    pub fn cached_in(&self, root: &Path) -> Result<PathBuf, EmbeddedError> {
        let bytes = self.bytes()?;
        let dir = root.join(self.hash);
        for d in [root, dir.as_path()] {
            ensure_private_dir(d)?;
        }
        let path = dir.join(self.name);
        if !is_verified_copy(&path, bytes)? {
            write_atomically(&path, bytes)?;
        }
        Ok(path)
    }

    /// Writes the carried library as `DIR/NAME` (DIR made 0755 when missing; the file 0644,
    /// replaced whole); returns its path.
    pub fn install(&self, dir: &Path) -> Result<PathBuf, EmbeddedError> {
        let bytes = self.bytes()?;
        if !dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(io(dir))?;
        }
        let path = dir.join(self.name);
        write_atomically(&path, bytes)?;
        Ok(path)
    }
}

/// The cache directory: `$PYROMETER_CACHE_DIR`, else `/var/cache/pyrometer` for root, else
/// `$XDG_CACHE_HOME/pyrometer` or `~/.cache/pyrometer`.
pub fn cache_root() -> Result<PathBuf, EmbeddedError> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    cache_root_from(root, env(CACHE_ENV), env("XDG_CACHE_HOME"), env("HOME"))
}

fn cache_root_from(
    root: bool,
    explicit: Option<std::ffi::OsString>,
    xdg: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Result<PathBuf, EmbeddedError> {
    if let Some(dir) = explicit {
        return Ok(PathBuf::from(dir));
    }
    if root {
        return Ok(PathBuf::from(ROOT_CACHE));
    }
    xdg.map(|x| PathBuf::from(x).join("pyrometer"))
        .or_else(|| home.map(|h| PathBuf::from(h).join(".cache/pyrometer")))
        .ok_or(EmbeddedError::NoCacheDir)
}

/// The allocation sampler in the cache directory ([`Carried::cached`]).
pub fn cached_library() -> Result<PathBuf, EmbeddedError> {
    ALLOC.cached()
}

/// [`cached_library`] under `root`.
#[cfg(test)]
fn cached_in(root: &Path) -> Result<PathBuf, EmbeddedError> {
    ALLOC.cached_in(root)
}

/// Writes the allocation sampler into `dir` ([`Carried::install`]).
#[cfg(test)]
fn install(dir: &Path) -> Result<PathBuf, EmbeddedError> {
    ALLOC.install(dir)
}

/// Makes `dir` (0755, whatever the umask) unless it exists; either way it must be a
/// directory owned by this user that nobody else can write to.
fn ensure_private_dir(dir: &Path) -> Result<(), EmbeddedError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(io(dir))?;
    let meta = fs::symlink_metadata(dir).map_err(io(dir))?;
    let unsafe_because = |why: String| EmbeddedError::Unsafe {
        path: dir.to_path_buf(),
        why,
    };
    if !meta.is_dir() {
        return Err(unsafe_because("not a directory".into()));
    }
    check_owner_and_mode(&meta).map_err(unsafe_because)?;
    // The umask may have taken bits a process running as another user needs to reach it.
    if meta.mode() & 0o755 != 0o755 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(io(dir))?;
    }
    Ok(())
}

/// Whether `path` is a copy of `bytes` that can be handed to processes as it is.
fn is_verified_copy(path: &Path, bytes: &[u8]) -> Result<bool, EmbeddedError> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        // Missing, a link or something else that cannot be opened: written anew.
        Err(_) => return Ok(false),
    };
    let meta = file.metadata().map_err(io(path))?;
    if !meta.is_file()
        || meta.len() != bytes.len() as u64
        || check_owner_and_mode(&meta).is_err()
        || meta.mode() & 0o444 != 0o444
    {
        return Ok(false);
    }
    same_content(file, bytes).map_err(io(path))
}

fn same_content(mut file: File, bytes: &[u8]) -> std::io::Result<bool> {
    let mut buf = vec![0u8; 1 << 16];
    let mut at = 0;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(at == bytes.len());
        }
        if bytes.get(at..at + n) != Some(&buf[..n]) {
            return Ok(false);
        }
        at += n;
    }
}

/// Writes `bytes` to a new file beside `path` (0644) and renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), EmbeddedError> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("pyrometer-embedded-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn the_cache_directory_depends_on_the_user() {
        let some = |s: &str| Some(std::ffi::OsString::from(s));
        let root = |r, e, x, h| cache_root_from(r, e, x, h).unwrap();
        assert_eq!(
            root(true, None, some("/x"), some("/h")),
            Path::new(ROOT_CACHE)
        );
        assert_eq!(
            root(false, None, some("/x"), some("/h")),
            Path::new("/x/pyrometer")
        );
        assert_eq!(
            root(false, None, None, some("/h")),
            Path::new("/h/.cache/pyrometer")
        );
        assert_eq!(root(true, some("/c"), None, None), Path::new("/c"));
        assert!(cache_root_from(false, None, None, None).is_err());
    }

    #[test]
    fn a_cached_copy_is_written_once_and_replaced_when_it_differs() {
        if !carried() {
            return;
        }
        let root = scratch("cache");
        let path = cached_in(&root).unwrap();
        assert_eq!(path, root.join(HASH).join(LIBRARY));
        assert_eq!(fs::read(&path).unwrap(), BYTES);
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o644);
        assert_eq!(
            fs::metadata(root.join(HASH)).unwrap().mode() & 0o7777,
            0o755
        );
        // Reused as it is: the same file.
        assert_eq!(cached_in(&root).unwrap(), path);
        assert_eq!(fs::metadata(&path).unwrap().ino(), meta.ino());
        // A changed copy is replaced (a new file, not the old one rewritten in place).
        let mut changed = BYTES.to_vec();
        changed[100] ^= 0xff;
        fs::write(&path, &changed).unwrap();
        cached_in(&root).unwrap();
        assert_eq!(fs::read(&path).unwrap(), BYTES);
        assert_ne!(fs::metadata(&path).unwrap().ino(), meta.ino());
        // A copy others can write to is not trusted.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        cached_in(&root).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o7777, 0o644);
        // Nor a directory others can write to.
        fs::set_permissions(root.join(HASH), fs::Permissions::from_mode(0o777)).unwrap();
        let err = cached_in(&root).unwrap_err().to_string();
        assert!(err.contains("writable by group or others"), "{err}");
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_build_without_a_library_says_in_one_line_what_is_missing() {
        // As a build without the CUDA headers carries the CUPTI library: empty.
        let none = Carried {
            bytes: &[],
            ..CUPTI
        };
        assert!(!none.carried());
        let root = scratch("none");
        for err in [
            none.cached_in(&root).unwrap_err(),
            none.install(&root).unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(!msg.contains('\n'), "{msg}");
            assert!(msg.contains("carries no libpyrometer_cupti.so"), "{msg}");
            assert!(msg.contains("cargo xtask cuda-headers"), "{msg}");
        }
        // Nothing was written.
        assert!(!root.exists());
    }

    #[test]
    fn install_writes_the_library_into_a_new_directory() {
        if !carried() {
            return;
        }
        let dir = scratch("install").join("lib/pyrometer");
        let path = install(&dir).unwrap();
        assert_eq!(path, dir.join(LIBRARY));
        assert_eq!(fs::read(&path).unwrap(), BYTES);
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o755);
        // Again over the first: replaced, not rewritten in place.
        let ino = fs::metadata(&path).unwrap().ino();
        install(&dir).unwrap();
        assert_ne!(fs::metadata(&path).unwrap().ino(), ino);
        let _ = fs::remove_dir_all(dir.parent().unwrap().parent().unwrap());
    }
}
