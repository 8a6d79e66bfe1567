//! Process registry: what each profiled process had mapped, so addresses taken from its stacks
//! can be turned into (binary, file offset) pairs long after the sample was taken, even after
//! the process exited.
//!
//! Binaries are shared between processes by (device, inode) so a library mapped by a thousand
//! workers is opened, and its build-id read, once.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::os::mounts::Mounts;
use crate::os::proctext;
use crate::os::untrusted::{Kind, Root, UntrustedFile};

/// Default minimum time between two re-reads of one process's maps.
pub const DEFAULT_REFRESH_INTERVAL: Duration = Duration::from_millis(500);
/// How long after exec (or first sight) a process counts as young, and how often it may be
/// re-read then.
const YOUNG: Duration = Duration::from_secs(1);
const YOUNG_REFRESH_INTERVAL: Duration = Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("malformed line in {}: {line:?}", path.display())]
    Malformed { path: PathBuf, line: String },
    #[error("process {0} is opted out of profiling")]
    OptedOut(u32),
}

/// What backs an executable mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MappingKind {
    /// A file (an ELF object, normally).
    File,
    /// Anonymous memory (JIT code): `[anon]`, `[anon:name]`.
    Anon,
    /// The kernel's vDSO.
    Vdso,
    /// Another kernel-provided mapping such as `[vsyscall]`.
    Special,
}

/// Identity of a binary on disk, shared by every process that maps it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BinaryKey {
    Inode {
        major: u32,
        minor: u32,
        inode: u64,
    },
    /// Only for file systems reporting inode 0; the path is the one we opened.
    Path(PathBuf),
}

impl BinaryKey {
    /// The key of a file no process maps yet (a command about to start), as its mappings
    /// will carry it.
    pub fn of_file(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        Ok(Self::Inode {
            major: libc::major(meta.dev()),
            minor: libc::minor(meta.dev()),
            inode: meta.ino(),
        })
    }
}

/// A mapped file, resolved to a path this process (the profiler) can open.
#[derive(Debug)]
pub struct Binary {
    key: BinaryKey,
    path: PathBuf,
    dir: Option<PathBuf>,
    // Holding the file open keeps a container's (or a deleted) binary reachable through
    // /proc/self/fd after its process and mount namespace are gone.
    _held: Option<File>,
    build_id: OnceLock<Option<String>>,
    /// The root of the process it was first seen in, when that is not ours (a container or a
    /// chroot): held open, since its debug files are there and the process may be gone by the
    /// time they are needed.
    own_root: Option<OwnRoot>,
}

/// A process's root directory other than the profiler's.
#[derive(Debug)]
struct OwnRoot {
    /// `/proc/self/fd/N` of the held directory.
    path: PathBuf,
    /// Where the root lies in our namespace (`readlink /proc/PID/root`), which a chroot's
    /// mappings carry as a prefix; empty when unknown.
    prefix: String,
    _held: File,
}

impl Binary {
    /// The directories to look for separate debug files in: the process's own root's
    /// `usr/lib/debug` and `lib/debug` first (its files match its binaries), then `host`.
    pub fn debug_dirs(&self, host: &[PathBuf]) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self
            .own_root
            .iter()
            .flat_map(|r| [r.path.join("usr/lib/debug"), r.path.join("lib/debug")])
            .collect();
        dirs.extend_from_slice(host);
        dirs
    }

    /// `mapped` (the path as the maps show it, to us) as the process sees it in its own root:
    /// a chroot's mappings carry the root's path in front, and `.gnu_debuglink` targets are
    /// looked up under the debug dirs by the path inside.
    pub fn seen_path<'a>(&self, mapped: &'a str) -> &'a str {
        match &self.own_root {
            Some(r) => seen_in(r, mapped),
            None => mapped,
        }
    }

    pub fn key(&self) -> &BinaryKey {
        &self.key
    }

    /// A path that opens the file from the profiler's mount namespace.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory holding the binary, openable from here (for `.gnu_debuglink` siblings).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The build-id when it has been read (`Some(None)`: the binary has none).
    pub fn known_build_id(&self) -> Option<Option<&str>> {
        self.build_id.get().map(Option::as_deref)
    }

    /// Records a build-id read elsewhere ([`read_build_id`] of [`path`](Self::path), on a
    /// worker); the first one recorded stays.
    pub fn set_build_id(&self, id: Option<String>) -> Option<&str> {
        self.build_id.get_or_init(|| id).as_deref()
    }

    /// GNU build-id, lowercase hex; read on first use.
    pub fn build_id(&self) -> Option<&str> {
        self.build_id
            .get_or_init(|| read_build_id(&self.path))
            .as_deref()
    }
}

/// One executable mapping of a process.
#[derive(Debug, Clone)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    /// Path as the process saw it (`[anon]`, `[vdso]` for those).
    pub path: String,
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
    pub kind: MappingKind,
    /// The file still had `(deleted)` after its name.
    pub deleted: bool,
    binary: Option<Arc<Binary>>,
}

impl Mapping {
    pub fn contains(&self, addr: u64) -> bool {
        self.start <= addr && addr < self.end
    }

    /// The file offset `addr` corresponds to (meaningful for file mappings and the vDSO).
    pub fn file_offset(&self, addr: u64) -> u64 {
        addr - self.start + self.offset
    }

    pub fn binary(&self) -> Option<&Arc<Binary>> {
        self.binary.as_ref()
    }

    /// The binary's build-id, read here if it was not yet (the symbolizer reads it on a
    /// worker instead).
    #[cfg(test)]
    pub fn build_id(&self) -> Option<&str> {
        self.binary.as_ref().and_then(|b| b.build_id())
    }

    /// Last path component, for names like `libfoo.so+0x1234`.
    pub fn basename(&self) -> &str {
        let p = self.path.strip_suffix(" (deleted)").unwrap_or(&self.path);
        p.rsplit('/').next().unwrap_or(p)
    }
}

/// One observed process.
#[derive(Debug)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
    pub exe: Option<PathBuf>,
    /// The pid inside the process's own pid namespace (it names its `/tmp/perf-PID.map`).
    pub ns_pid: u32,
    mappings: Vec<Mapping>,
    /// What `mappings` holds in memory.
    held: u64,
    exited: bool,
    last_read: Instant,
    /// When this image was first read (observe or exec).
    first_read: Instant,
}

impl Process {
    /// Executable mappings sorted by start address.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    /// Whether its dynamic loader is still at work: of the files it maps executable, only
    /// the program and its loader (`ld-*`), none of the libraries the loader brings in. A
    /// process read at its exec is in this state for a few milliseconds.
    pub fn loading(&self) -> bool {
        let program = self.exe.as_deref().and_then(Path::to_str);
        let mut loader = false;
        for m in self.mappings.iter().filter(|m| m.kind == MappingKind::File) {
            if Some(m.path.as_str()) == program {
                continue;
            }
            if !m.basename().starts_with("ld-") {
                return false;
            }
            loader = true;
        }
        loader
    }

    /// What the registry holds for it in memory: its mappings and their paths (a process
    /// decides how many it has, and unloaded ones are kept).
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    /// The file named `basename` the process maps, if any (the path as this process reaches
    /// it): where pyrometer's own in-process libraries are found.
    pub fn mapped_file(&self, basename: &str) -> Option<(BinaryKey, PathBuf)> {
        self.mappings
            .iter()
            .filter(|m| m.kind == MappingKind::File && m.basename() == basename)
            .find_map(|m| m.binary())
            .map(|b| (b.key().clone(), b.path().to_path_buf()))
    }

    /// The process was gone at the last refresh; its mappings are the last ones seen.
    #[cfg(test)]
    pub fn exited(&self) -> bool {
        self.exited
    }

    pub fn find(&self, addr: u64) -> Option<(&Mapping, u64)> {
        let i = self.mappings.partition_point(|m| m.start <= addr);
        let m = self.mappings.get(i.checked_sub(1)?)?;
        m.contains(addr).then(|| (m, m.file_offset(addr)))
    }
}

/// Every process seen during a capture. Nothing is removed unless asked
/// ([`ProcessRegistry::forget_exited`]), so samples can be symbolized after their process
/// exited.
#[derive(Debug)]
pub struct ProcessRegistry {
    proc_root: PathBuf,
    refresh_interval: Duration,
    processes: crate::FastMap<u32, Process>,
    binaries: crate::FastMap<BinaryKey, Arc<Binary>>,
    opt_out: Option<crate::os::optout::OptOut>,
}

impl Default for ProcessRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessRegistry {
    pub fn new() -> Self {
        Self::with_proc_root("/proc")
    }

    /// A registry reading another directory laid out like `/proc` (tests use fakes).
    pub fn with_proc_root(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
            refresh_interval: DEFAULT_REFRESH_INTERVAL,
            processes: Default::default(),
            binaries: Default::default(),
            opt_out: None,
        }
    }

    pub fn proc_root(&self) -> &Path {
        &self.proc_root
    }

    /// Minimum time between two maps re-reads of one pid by [`refresh`](Self::refresh).
    #[cfg(test)]
    pub fn set_refresh_interval(&mut self, interval: Duration) {
        self.refresh_interval = interval;
    }

    /// Processes whose cgroup matches `pattern` are never read ([`crate::os::optout`]).
    pub fn set_opt_out(&mut self, pattern: regex::Regex) {
        self.opt_out = Some(crate::os::optout::OptOut::new(pattern));
    }

    /// Whether `pid` is opted out of profiling: nothing of it may be read.
    pub fn opted_out(&mut self, pid: u32) -> bool {
        let root = &self.proc_root;
        self.opt_out.as_mut().is_some_and(|o| o.excluded(root, pid))
    }

    pub fn get(&self, pid: u32) -> Option<&Process> {
        self.processes.get(&pid)
    }

    /// Reads a process's maps, name and exe the first time it is seen; later calls return what
    /// was recorded.
    pub fn observe(&mut self, pid: u32) -> Result<&Process, ProcError> {
        if !self.processes.contains_key(&pid) {
            if self.opted_out(pid) {
                return Err(ProcError::OptedOut(pid));
            }
            let dir = self.proc_root.join(pid.to_string());
            let mappings = self.read_mappings(pid)?;
            let comm = proctext::read(&dir.join("comm"), proctext::TEXT_CAP)
                .map(|s| s.trim_end_matches('\n').to_string())
                .unwrap_or_default();
            let exe = fs::read_link(dir.join("exe")).ok();
            let ns_pid = proctext::read(&dir.join("status"), proctext::TEXT_CAP)
                .ok()
                .and_then(|s| parse_ns_pid(&s))
                .unwrap_or(pid);
            let process = Process {
                pid,
                comm,
                exe,
                ns_pid,
                held: held_bytes(&mappings),
                mappings,
                exited: false,
                last_read: Instant::now(),
                first_read: Instant::now(),
            };
            self.processes.insert(pid, process);
        }
        Ok(&self.processes[&pid])
    }

    /// Re-reads the maps of a process (after a `dlopen`, say), at most once per refresh
    /// interval. Returns whether the maps were read. Mappings that vanished are kept unless a
    /// new mapping overlaps them, because samples taken before a `dlclose` still point there.
    pub fn refresh(&mut self, pid: u32) -> Result<bool, ProcError> {
        let Some(process) = self.processes.get(&pid) else {
            self.observe(pid)?;
            return Ok(true);
        };
        // A young image is still mapping its libraries (the dynamic loader runs after exec),
        // so it may be re-read more often during its first second.
        let interval = if process.first_read.elapsed() < YOUNG {
            self.refresh_interval.min(YOUNG_REFRESH_INTERVAL)
        } else {
            self.refresh_interval
        };
        if process.exited || process.last_read.elapsed() < interval {
            return Ok(false);
        }
        let fresh = self.read_mappings(pid);
        let process = self.processes.get_mut(&pid).expect("checked above");
        process.last_read = Instant::now();
        let mut fresh = match fresh {
            Ok(fresh) => fresh,
            Err(ProcError::NoSuchProcess(_)) => {
                process.exited = true;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let old = std::mem::take(&mut process.mappings);
        let kept: Vec<Mapping> = old
            .into_iter()
            .filter(|o| !fresh.iter().any(|n| n.start < o.end && o.start < n.end))
            .collect();
        fresh.extend(kept);
        fresh.sort_by_key(|m| m.start);
        process.held = held_bytes(&fresh);
        process.mappings = fresh;
        Ok(true)
    }

    /// The process exec'd a new image: forget the old maps and name, read the new ones.
    /// Samples of the old image not yet symbolized are then symbolized against the new maps;
    /// exec follows fork closely, so there are at most a few of them.
    pub fn exec(&mut self, pid: u32) -> Result<&Process, ProcError> {
        self.processes.remove(&pid);
        if let Some(o) = &mut self.opt_out {
            o.forget(pid);
        }
        self.observe(pid)?;
        // At exec only the executable and the dynamic loader are mapped; the libraries come
        // moments later, so the first miss after an exec may re-read at once.
        let interval = self.refresh_interval;
        let process = self.processes.get_mut(&pid).expect("just observed");
        if let Some(earlier) = process.last_read.checked_sub(interval) {
            process.last_read = earlier;
        }
        Ok(&self.processes[&pid])
    }

    pub fn find(&self, pid: u32, addr: u64) -> Option<(&Mapping, u64)> {
        self.processes.get(&pid)?.find(addr)
    }

    /// The file identity of the program `pid` runs, from the first line of its maps (the
    /// program is mapped below its libraries and the loader): a look-up before the whole map
    /// is read, which never opens the file (it may be on a mount that does not answer).
    pub fn exe_key(&self, pid: u32) -> Option<BinaryKey> {
        let path = self.proc_root.join(pid.to_string()).join("maps");
        let mut key = None;
        proctext::for_each_line(&path, 1, |line| {
            key = parse_maps_line(line)
                .map(|raw| raw.mapping)
                .filter(|m| m.kind == MappingKind::File && m.inode != 0)
                .map(|m| BinaryKey::Inode {
                    major: m.major,
                    minor: m.minor,
                    inode: m.inode,
                });
        })
        .ok()?;
        key
    }

    /// Whether some process the registry holds maps the binary `key`.
    pub fn maps_binary(&self, key: &BinaryKey) -> bool {
        self.binaries.contains_key(key)
    }

    /// Forgets a process, so that the next [`observe`](Self::observe) reads it afresh.
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// Forgets the processes that are gone and the binaries no process maps any more. A
    /// long-running agent calls it once the samples of an interval are symbolized: the
    /// registry would otherwise keep every process a node ever ran (and an open descriptor
    /// for each binary seen inside a container).
    pub fn forget_exited(&mut self) -> usize {
        let root = self.proc_root.clone();
        let before = self.processes.len();
        self.processes
            .retain(|&pid, _| crate::os::pids::alive(&root, pid));
        // Only the registry's own reference left: no process of it maps the binary.
        self.binaries.retain(|_, b| Arc::strong_count(b) > 1);
        before - self.processes.len()
    }

    fn read_mappings(&mut self, pid: u32) -> Result<Vec<Mapping>, ProcError> {
        let path = self.proc_root.join(pid.to_string()).join("maps");
        // Streamed, executable lines kept: a process decides how many mappings it has.
        let mut raws = Vec::new();
        let mut malformed = None;
        let read = proctext::for_each_line(&path, proctext::MAPS_LINES, |line| {
            if line.is_empty() || malformed.is_some() {
                return;
            }
            match parse_maps_line(line) {
                Some(raw) if raw.executable => raws.push(raw.mapping),
                Some(_) => {}
                None => malformed = Some(line.to_string()),
            }
        });
        read.map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => ProcError::NoSuchProcess(pid),
            // ESRCH: the process exited between open and read.
            _ if source.raw_os_error() == Some(libc::ESRCH) => ProcError::NoSuchProcess(pid),
            _ => ProcError::Io {
                path: path.clone(),
                source,
            },
        })?;
        if let Some(line) = malformed {
            return Err(ProcError::Malformed { path, line });
        }
        // Read once per reading of the maps, and only when a file is mapped.
        let mut mounts = None;
        let mut mappings = Vec::with_capacity(raws.len());
        for mut m in raws {
            if m.kind == MappingKind::File {
                let mounts = mounts
                    .get_or_insert_with(|| Mounts::of_process(&self.proc_root, &pid.to_string()));
                m.binary = Some(self.binary_for(pid, &m, mounts));
            }
            mappings.push(m);
        }
        mappings.sort_by_key(|m| m.start);
        Ok(mappings)
    }

    fn binary_for(&mut self, pid: u32, m: &Mapping, mounts: &Mounts) -> Arc<Binary> {
        let plain = Path::new(m.path.strip_suffix(" (deleted)").unwrap_or(&m.path));
        let key = if m.inode != 0 {
            BinaryKey::Inode {
                major: m.major,
                minor: m.minor,
                inode: m.inode,
            }
        } else {
            BinaryKey::Path(plain.to_path_buf())
        };
        if let Some(b) = self.binaries.get(&key) {
            return Arc::clone(b);
        }
        let pid_dir = self.proc_root.join(pid.to_string());
        let own_root = own_root(&pid_dir.join("root"));
        // A FUSE file is answered by a process, which may never answer: not opened at all.
        let opened = if mounts.is_fuse_device(m.major, m.minor) {
            None
        } else {
            open_mapped(&pid_dir, m, plain, own_root.as_ref())
        };
        let binary = match opened {
            // A process sharing the profiler's root names the file by the path the profiler
            // would open; the path stays the name, as the plain path always did.
            Some(Opened::Host(_)) if own_root.is_none() => plain_binary(plain),
            Some(Opened::Host(f)) => {
                held_binary(f.into_file(), plain.parent().map(Path::to_path_buf))
            }
            Some(Opened::Inside(f, seen)) => {
                let dir = own_root
                    .as_ref()
                    .zip(seen.parent())
                    .map(|(r, d)| r.path.join(d.strip_prefix("/").unwrap_or(d)));
                held_binary(f.into_file(), dir)
            }
            Some(Opened::Mapped(f)) => held_binary(f.into_file(), None),
            // Nothing that opens is the file mapped: nothing of it is read.
            None => unreadable_binary(plain),
        };
        let binary = Arc::new(Binary {
            key: key.clone(),
            own_root,
            ..binary
        });
        self.binaries.insert(key, Arc::clone(&binary));
        binary
    }
}

/// Where the file a mapping names was opened.
enum Opened {
    /// Inside the process's own root, by the path it sees (which is also returned).
    Inside(UntrustedFile, PathBuf),
    /// By the path as the profiler sees it.
    Host(UntrustedFile),
    /// Through the kernel's link to the mapping.
    Mapped(UntrustedFile),
}

/// Opens the file `m` maps through the untrusted-file layer, trying the process's root, the
/// profiler's view of the path, and the kernel's link to the mapping, in that order; each
/// must be the device and inode mapped, so a file replaced after exec (or a link planted
/// where the library was) is not believed.
fn open_mapped(
    pid_dir: &Path,
    m: &Mapping,
    plain: &Path,
    root: Option<&OwnRoot>,
) -> Option<Opened> {
    let check = |f: UntrustedFile| {
        (m.inode == 0 || f.expect_mapped(m.major, m.minor, m.inode).is_ok()).then_some(f)
    };
    // A deleted file's name, if anything, is its replacement's (a package upgrade).
    if m.deleted {
        return open_link(pid_dir, m).and_then(check).map(Opened::Mapped);
    }
    if let Some(r) = root {
        let seen = Path::new(seen_in(r, plain.to_str().unwrap_or_default()));
        let inside = Root::open(&r.path)
            .ok()
            .and_then(|root| UntrustedFile::open_in_root(&root, seen, Kind::Elf).ok())
            .and_then(check);
        if let Some(f) = inside {
            return Some(Opened::Inside(f, seen.to_path_buf()));
        }
    }
    if let Some(f) = UntrustedFile::open(plain, Kind::Elf).ok().and_then(check) {
        return Some(Opened::Host(f));
    }
    open_link(pid_dir, m).and_then(check).map(Opened::Mapped)
}

fn open_link(pid_dir: &Path, m: &Mapping) -> Option<UntrustedFile> {
    let link = pid_dir
        .join("map_files")
        .join(format!("{:x}-{:x}", m.start, m.end));
    UntrustedFile::open_map_file(&link, Kind::Elf).ok()
}

/// The process's root when it is not ours, held open.
fn own_root(root: &Path) -> Option<OwnRoot> {
    let dir = File::open(root).ok()?;
    if same_file(&dir, Path::new("/")) {
        return None;
    }
    let prefix = fs::read_link(root)
        .ok()
        .map(|p| p.to_string_lossy().trim_end_matches('/').to_string())
        .unwrap_or_default();
    Some(OwnRoot {
        path: PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())),
        prefix,
        _held: dir,
    })
}

/// `mapped` with the root's place in our namespace taken off its front, when it has it.
fn seen_in<'a>(root: &OwnRoot, mapped: &'a str) -> &'a str {
    Some(root)
        .filter(|r| r.prefix.len() > 1)
        .and_then(|r| mapped.strip_prefix(r.prefix.as_str()))
        .filter(|rest| rest.starts_with('/'))
        .unwrap_or(mapped)
}

fn same_file(f: &File, path: &Path) -> bool {
    match (f.metadata(), fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

fn plain_binary(path: &Path) -> Binary {
    Binary {
        key: BinaryKey::Path(path.to_path_buf()),
        path: path.to_path_buf(),
        dir: path.parent().map(Path::to_path_buf),
        _held: None,
        build_id: OnceLock::new(),
        own_root: None,
    }
}

fn held_binary(f: File, dir: Option<PathBuf>) -> Binary {
    Binary {
        key: BinaryKey::Path(PathBuf::new()),
        path: PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())),
        dir,
        _held: Some(f),
        build_id: OnceLock::new(),
        own_root: None,
    }
}

/// A mapped file that could not be opened as the file mapped: its path is empty, so every
/// reader's open fails and its frames keep their module and offset.
fn unreadable_binary(path: &Path) -> Binary {
    Binary {
        key: BinaryKey::Path(path.to_path_buf()),
        path: PathBuf::new(),
        dir: None,
        _held: None,
        build_id: OnceLock::new(),
        own_root: None,
    }
}

fn held_bytes(mappings: &[Mapping]) -> u64 {
    let paths: usize = mappings.iter().map(|m| m.path.capacity()).sum();
    (std::mem::size_of_val(mappings) + paths) as u64
}

struct RawMapping {
    mapping: Mapping,
    executable: bool,
}

fn parse_maps_line(line: &str) -> Option<RawMapping> {
    let mut rest = line;
    let mut field = || {
        let s = rest.trim_start();
        let end = s.find(char::is_whitespace).unwrap_or(s.len());
        let (f, r) = s.split_at(end);
        rest = r;
        f
    };
    let (range, perms, offset, dev, inode) = (field(), field(), field(), field(), field());
    let path = rest.trim();
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let inode: u64 = inode.parse().ok()?;
    let kind = match path {
        "[vdso]" => MappingKind::Vdso,
        "" => MappingKind::Anon,
        p if p.starts_with("[anon") => MappingKind::Anon,
        p if p.starts_with('[') => MappingKind::Special,
        p if p.starts_with('/') => MappingKind::File,
        // `anon_inode:…` and the like: nothing on disk to read.
        _ => MappingKind::Anon,
    };
    Some(RawMapping {
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        mapping: Mapping {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            offset: u64::from_str_radix(offset, 16).ok()?,
            path: if path.is_empty() { "[anon]" } else { path }.to_string(),
            major: u32::from_str_radix(major, 16).ok()?,
            minor: u32::from_str_radix(minor, 16).ok()?,
            inode,
            kind,
            deleted: path.ends_with(" (deleted)"),
            binary: None,
        },
    })
}

/// A task's ids in the pid namespaces it is in, from its status's `NSpid:` line: first the
/// one this /proc shows, last the one in its own namespace.
pub(crate) fn ns_pids(status: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(
        status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))?
            .split_whitespace(),
    )
}

/// A task's id in its own pid namespace (the last of [`ns_pids`]).
pub(crate) fn parse_ns_pid(status: &str) -> Option<u32> {
    ns_pids(status)?.last()?.parse().ok()
}

/// Reads an ELF file's GNU build-id (lowercase hex) without loading the whole file.
pub fn read_build_id(path: &Path) -> Option<String> {
    build_id_of(&UntrustedFile::open_resolved(path, Kind::Elf).ok()?)
}

/// [`read_build_id`] of a file already opened.
pub fn build_id_of(file: &UntrustedFile) -> Option<String> {
    let cache = object::read::ReadCache::new(file.reader());
    let obj = object::File::parse(&cache).ok()?;
    use object::Object as _;
    let id = obj.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests;
