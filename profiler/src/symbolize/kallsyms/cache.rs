//! The kernel's symbols kept between runs: one file per boot, `kallsyms-BOOT_ID.bin` in a
//! directory only root can write, valid while the kernel release and the loaded modules (name,
//! size, address) are those it was written for. It holds the code symbols of the core kernel
//! and the modules, and the ranges they answer for: the core text (`_stext` to `_etext`) and
//! each module's memory.
//!
//! The file is read by root runs, so it is checked as any input would be: owned by this user
//! and writable by nobody else (the directory too), opened without following a link, every
//! length bounded by the file's, the addresses sorted and the names within their string.

use std::fs::{self, OpenOptions};
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;

use super::Table;

const MAGIC: &[u8; 8] = b"PYRKSYM1";
/// Larger than any kernel's symbols (120,000 functions make some 5 MB).
const MAX_FILE: u64 = 64 << 20;
const MAX_SYMBOLS: usize = 4 << 20;
const MAX_RANGES: usize = 1 << 16;

/// Where the file is and what it must have been written for.
#[derive(Debug, Clone)]
pub(crate) struct CacheSpec {
    dir: PathBuf,
    boot_id: String,
    /// The release, the boot and a digest of the modules: the file is used only when equal.
    key: String,
    /// Each loaded module's memory, [start, end).
    modules: Vec<(u64, u64)>,
}

/// The cache directory of a root run: `$PYROMETER_CACHE_DIR/kallsyms`, else
/// `/var/cache/pyrometer/kallsyms`. None for other users: their kallsyms shows no addresses.
pub(crate) fn default_dir() -> Option<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let root = std::env::var_os("PYROMETER_CACHE_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/var/cache/pyrometer"), PathBuf::from);
    Some(root.join("kallsyms"))
}

impl CacheSpec {
    /// The spec for this machine now: its boot id, kernel release and `/proc/modules`. None
    /// when the boot id cannot be read (no file name to give it).
    pub(crate) fn of_host(dir: PathBuf) -> Option<Self> {
        let read = |p: &str| fs::read_to_string(p).ok();
        let boot_id = read("/proc/sys/kernel/random/boot_id")?;
        let release = read("/proc/sys/kernel/osrelease").unwrap_or_default();
        // No /proc/modules: a kernel built without modules.
        let modules = read("/proc/modules").unwrap_or_default();
        Self::new(dir, boot_id.trim(), release.trim(), &modules)
    }

    /// From the facts themselves (tests give their own).
    pub(crate) fn new(dir: PathBuf, boot_id: &str, release: &str, modules: &str) -> Option<Self> {
        if boot_id.is_empty()
            || boot_id.len() > 64
            || !boot_id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        {
            return None;
        }
        // name size refcount deps state address: the refcount changes as modules are used,
        // name, size and address only when one is loaded again.
        let mut hasher = Fnv(0xcbf2_9ce4_8422_2325);
        let mut ranges = Vec::new();
        for line in modules.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(name), Some(size), Some(addr)) = (f.first(), f.get(1), f.get(5)) else {
                continue;
            };
            (name, size, addr).hash(&mut hasher);
            let size: u64 = size.parse().unwrap_or(0);
            let addr = u64::from_str_radix(addr.trim_start_matches("0x"), 16).unwrap_or(0);
            if addr != 0 && size != 0 {
                ranges.push((addr, addr.saturating_add(size)));
            }
        }
        Some(Self {
            dir,
            boot_id: boot_id.to_string(),
            key: format!("{release} {boot_id} {:016x}", hasher.finish()),
            modules: ranges,
        })
    }

    fn path(&self) -> PathBuf {
        self.dir.join(format!("kallsyms-{}.bin", self.boot_id))
    }

    /// The table and the ranges it answers for, when the file is there, safe to read, and
    /// written for this spec.
    pub(super) fn read(&self) -> Option<(Table, Vec<(u64, u64)>)> {
        check_private(&fs::symlink_metadata(&self.dir).ok()?, true)?;
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(self.path())
            .ok()?;
        let meta = file.metadata().ok()?;
        check_private(&meta, false)?;
        if meta.len() > MAX_FILE {
            return None;
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        Read::by_ref(&mut file)
            .take(MAX_FILE)
            .read_to_end(&mut bytes)
            .ok()?;
        decode(&bytes, &self.key)
    }

    /// Writes `table` (code symbols of the core kernel and the modules) for this spec,
    /// replacing the file of an earlier boot.
    pub(super) fn write(&self, table: &Table, core: (u64, u64)) -> std::io::Result<()> {
        // The cache root is shared (the allocation sampler's library in it must be reachable
        // by every user): 0755 as that code makes it; this directory root's alone.
        if let Some(parent) = self.dir.parent()
            && !parent.exists()
        {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)?;
            // Whatever the umask took.
            fs::set_permissions(parent, fs::Permissions::from_mode(0o755))?;
        }
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&self.dir)
            .or_else(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    Ok(())
                } else {
                    Err(e)
                }
            })?;
        if check_private(&fs::symlink_metadata(&self.dir)?, true).is_none() {
            return Err(std::io::Error::other("cache directory not private"));
        }
        let mut covered = vec![core];
        covered.extend(&self.modules);
        let bytes = encode(table, &covered, &self.key);
        let tmp = self
            .dir
            .join(format!(".kallsyms-{}.tmp", std::process::id()));
        let _ = fs::remove_file(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        drop(f);
        fs::rename(&tmp, self.path())?;
        // Earlier boots' files are never read again.
        let own = format!("kallsyms-{}.bin", self.boot_id);
        for e in fs::read_dir(&self.dir)?.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("kallsyms-") && name.ends_with(".bin") && name != own {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(())
    }
}

/// FNV-1a: the digest must be the same in every run of every build (std's hasher is not
/// promised to be).
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Owned by this user and writable by nobody else (and, for `dir`, a directory; else a file).
fn check_private(meta: &fs::Metadata, dir: bool) -> Option<()> {
    let kind = if dir { meta.is_dir() } else { meta.is_file() };
    (kind && crate::os::owned::check_owner_and_mode(meta).is_ok()).then_some(())
}

fn encode(table: &Table, covered: &[(u64, u64)], key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + table.len() * 12 + table.names.len());
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&len(key.len()));
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&len(covered.len()));
    for &(s, e) in covered {
        out.extend_from_slice(&s.to_le_bytes());
        out.extend_from_slice(&e.to_le_bytes());
    }
    out.extend_from_slice(&len(table.len()));
    for a in &table.addrs {
        out.extend_from_slice(&a.to_le_bytes());
    }
    for e in &table.ends {
        out.extend_from_slice(&e.to_le_bytes());
    }
    out.extend_from_slice(&len(table.names.len()));
    out.extend_from_slice(table.names.as_bytes());
    out
}

/// Reads `bytes` front to back, every length checked against what is left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn len(&mut self, max: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n <= max).then_some(n)
    }
}

fn decode(bytes: &[u8], key: &str) -> Option<(Table, Vec<(u64, u64)>)> {
    let mut r = Reader(bytes);
    if r.take(MAGIC.len())? != MAGIC {
        return None;
    }
    let key_len = r.len(4096)?;
    if r.take(key_len)? != key.as_bytes() {
        return None;
    }
    let ranges = r.len(MAX_RANGES)?;
    let mut covered = Vec::with_capacity(ranges);
    for _ in 0..ranges {
        let (s, e) = (r.u64()?, r.u64()?);
        if s >= e {
            return None;
        }
        covered.push((s, e));
    }
    let n = r.len(MAX_SYMBOLS)?;
    let addrs: Vec<u64> = r
        .take(n.checked_mul(8)?)?
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let ends: Vec<u32> = r
        .take(n.checked_mul(4)?)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let names_len = r.len(MAX_FILE as usize)?;
    let names = String::from_utf8(r.take(names_len)?.to_vec()).ok()?;
    let sorted = addrs.windows(2).all(|w| w[0] < w[1]);
    let bounded = ends.windows(2).all(|w| w[0] <= w[1])
        && ends.last().is_none_or(|&e| e as usize == names.len())
        && ends.iter().all(|&e| names.is_char_boundary(e as usize));
    if !r.0.is_empty() || !sorted || !bounded {
        return None;
    }
    Some((Table { addrs, ends, names }, covered))
}

#[cfg(test)]
mod tests;
