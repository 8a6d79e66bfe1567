//! The on-disk cache of debug files fetched by build id, shared by `record` and the agent:
//! one flat directory of `<build-id>.debug` files (and `<build-id>.missing` / `.failed`
//! markers whose age says how long an answer is remembered). Flat, so that whoever owns the
//! directory (the agent's unprivileged user) can delete what root wrote in it. Files land
//! under a temporary name and are renamed into place only once read as ELF with the build id
//! asked for; the least recently used go first when the cache is over its size.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// The cache's size limit unless configured otherwise: 1 GiB.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 1 << 30;
/// How long a server's "not found" is remembered.
pub const MISSING_TTL: Duration = Duration::from_secs(3600);
/// How long a failed fetch (timeout, refused connection, bad file) is remembered.
pub const FAILED_TTL: Duration = Duration::from_secs(300);

/// Where the cache lives unless configured otherwise: `/var/cache/pyrometer/debuginfod` as
/// root, else `$XDG_CACHE_HOME/pyrometer/debuginfod` (`~/.cache/…`).
pub fn default_dir() -> PathBuf {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/cache/pyrometer/debuginfod");
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("pyrometer/debuginfod")
}

/// Whether `id` is a build id as we write them (lowercase hex, 2 to 128 digits): it becomes a
/// file name and part of a URL.
pub fn valid_build_id(id: &str) -> bool {
    (2..=128).contains(&id.len())
        && id.len().is_multiple_of(2)
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// One cache directory and its size limit.
#[derive(Debug)]
pub struct DebugCache {
    dir: PathBuf,
    max_bytes: u64,
}

/// What the cache knows of one build id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cached {
    /// The debug file, checked.
    File(PathBuf),
    /// A recent answer that there is none (or a recent failure): not asked again yet.
    Absent,
    /// Nothing: ask the servers.
    Unknown,
}

impl DebugCache {
    /// The cache in `dir`, kept within `max_bytes` (the file just stored excepted).
    pub fn new(dir: PathBuf, max_bytes: u64) -> Self {
        Self { dir, max_bytes }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes the directory (and its parents), owned by `owner` when given: the agent makes it
    /// before it becomes its unprivileged user, which then writes and evicts in it.
    pub fn prepare(&self, owner: Option<(u32, u32)>) -> io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&self.dir, Some(uid), Some(gid))?;
        }
        Ok(())
    }

    fn path(&self, id: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{id}.{ext}"))
    }

    /// The debug file of `id` when the cache holds it as ELF with that build id (its time is
    /// touched, for eviction by least recent use), or a recent negative answer.
    pub fn lookup(&self, id: &str) -> Cached {
        if !valid_build_id(id) {
            return Cached::Absent;
        }
        let file = self.path(id, "debug");
        if std::fs::symlink_metadata(&file).is_ok_and(|m| m.is_file()) {
            if crate::os::procs::read_build_id(&file).as_deref() == Some(id) {
                if let Ok(f) = File::options().append(true).open(&file) {
                    let _ = f.set_modified(SystemTime::now());
                }
                return Cached::File(file);
            }
            // Not what it should be (truncated, replaced): dropped, fetched again.
            let _ = std::fs::remove_file(&file);
        }
        let recent = |ext, ttl: Duration| {
            std::fs::symlink_metadata(self.path(id, ext))
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < ttl))
        };
        if recent("missing", MISSING_TTL) || recent("failed", FAILED_TTL) {
            return Cached::Absent;
        }
        Cached::Unknown
    }

    /// A new temporary file in the cache directory (so the rename into place is atomic).
    pub fn temp(&self, id: &str) -> io::Result<(PathBuf, File)> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        std::fs::create_dir_all(&self.dir)?;
        let path = self
            .dir
            .join(format!(".tmp-{id}-{}-{n}", std::process::id()));
        let file = File::options().write(true).create_new(true).open(&path)?;
        Ok((path, file))
    }

    /// Moves a downloaded file into place once it reads as ELF with build id `id`, then
    /// evicts the least recently used files past the size limit. The temporary file is gone
    /// either way.
    pub fn commit(&self, id: &str, temp: &Path) -> Result<PathBuf, String> {
        let got = crate::os::procs::read_build_id(temp);
        if got.as_deref() != Some(id) {
            let _ = std::fs::remove_file(temp);
            return Err(match got {
                Some(other) => format!("the server sent the debug file of build id {other}"),
                None => "the server's answer is not an ELF file with a build id".to_string(),
            });
        }
        let file = self.path(id, "debug");
        if let Err(e) = std::fs::rename(temp, &file) {
            let _ = std::fs::remove_file(temp);
            return Err(format!("cannot move it into {}: {e}", self.dir.display()));
        }
        for ext in ["missing", "failed"] {
            let _ = std::fs::remove_file(self.path(id, ext));
        }
        self.evict(&file);
        Ok(file)
    }

    /// Remembers that no server has `id` (`missing`) or that asking failed.
    pub fn mark(&self, id: &str, missing: bool) {
        let ext = if missing { "missing" } else { "failed" };
        let _ = File::create(self.path(id, ext));
    }

    /// Deletes the least recently used debug files until the cache is within its limit,
    /// never `keep` (the file just stored), and temporary files left by a process that died
    /// mid-download (older than a day).
    fn evict(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            let path = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            let mtime = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if name.starts_with(".tmp-") {
                if mtime
                    .elapsed()
                    .is_ok_and(|a| a > Duration::from_secs(86_400))
                {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            if m.is_file() && name.ends_with(".debug") {
                files.push((mtime, m.len(), path));
            }
        }
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        files.sort();
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            if path != keep && std::fs::remove_file(&path).is_ok() {
                total -= len;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_ids_are_plain_lowercase_hex() {
        assert!(valid_build_id("0a1b2c"));
        assert!(!valid_build_id("0A1B"));
        assert!(!valid_build_id("../etc"));
        assert!(!valid_build_id("abc"));
        assert!(!valid_build_id(""));
    }

    #[test]
    fn a_file_without_the_build_id_is_refused_and_gone() {
        let dir = std::env::temp_dir().join(format!("pyrometer-dcache-{}", std::process::id()));
        let cache = DebugCache::new(dir.clone(), 1 << 20);
        cache.prepare(None).unwrap();
        let (temp, mut f) = cache.temp("abcd").unwrap();
        std::io::Write::write_all(&mut f, b"not an ELF file").unwrap();
        assert!(cache.commit("abcd", &temp).is_err());
        assert!(!temp.exists());
        assert_eq!(cache.lookup("abcd"), Cached::Unknown);
        cache.mark("abcd", true);
        assert_eq!(cache.lookup("abcd"), Cached::Absent);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_least_recently_used_go_first() {
        let dir = std::env::temp_dir().join(format!("pyrometer-devict-{}", std::process::id()));
        let cache = DebugCache::new(dir.clone(), 250);
        cache.prepare(None).unwrap();
        let old = SystemTime::now() - Duration::from_secs(100);
        for (i, id) in ["aa", "bb", "cc"].iter().enumerate() {
            let p = dir.join(format!("{id}.debug"));
            std::fs::write(&p, [0u8; 100]).unwrap();
            let f = File::options().append(true).open(&p).unwrap();
            f.set_modified(old + Duration::from_secs(i as u64)).unwrap();
        }
        cache.evict(&dir.join("aa.debug"));
        // 300 bytes over a 250-byte limit: the oldest but the one kept goes.
        assert!(dir.join("aa.debug").exists());
        assert!(!dir.join("bb.debug").exists());
        assert!(dir.join("cc.debug").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
