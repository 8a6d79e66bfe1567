//! Files read on behalf of a profiled process: perf maps, its binaries and libraries, debug
//! files, `/proc` text. The process controls them, so each is opened one way:
//!
//! - resolved inside the process's root (`openat2` with `RESOLVE_IN_ROOT`), so neither an
//!   absolute symbolic link nor a `..` chain reaches a file of the host, and with
//!   `RESOLVE_NO_MAGICLINKS`, so no `/proc/*/fd` link hands over another file;
//! - `O_NOFOLLOW` (a link as the last component is refused) and `O_NONBLOCK` (a FIFO opens
//!   at once instead of waiting for a writer);
//! - regular files only (`fstat` after the open, so what was checked is what is read);
//! - a size cap per [`Kind`], checked against `fstat` and again while reading;
//! - where a mapping names the file, its device and inode must match
//!   ([`UntrustedFile::expect_mapped`]): a file replaced after exec is not believed.
//!
//! Contents are read with `pread` into memory the profiler owns (the heap, or an anonymous
//! mapping for ELF objects) and never through a mapping of the file itself: a file truncated
//! while it is parsed costs a parse error, not a SIGBUS in the agent. ELF objects are copied
//! sparsely ([`UntrustedFile::copy_elf_sections`]): only the headers and the sections asked
//! for are read, the rest of the anonymous mapping stays untouched and costs no memory.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What a file is read as; each kind has its own size cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A JIT's `/tmp/perf-PID.map`: 16 MiB (about 300 000 functions).
    PerfMap,
    /// An ELF object parsed from a sparse copy (binaries, libraries, debug files): 2 GiB.
    /// Only the sections asked for are read, so the cap bounds address space, not memory.
    Elf,
    /// An ELF object copied whole (an interpreter's binary, whose read-only data is searched
    /// for its version): 256 MiB.
    ElfWhole,
    /// `/proc/PID/*` text (cmdline, environ, status): 256 KiB, read up to the cap and cut
    /// there (procfs reports no size).
    ProcText,
}

impl Kind {
    /// The size cap of this kind, in bytes.
    pub const fn cap(self) -> u64 {
        match self {
            Kind::PerfMap => 16 << 20,
            Kind::Elf => 2 << 30,
            Kind::ElfWhole => 256 << 20,
            Kind::ProcText => 256 << 10,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::PerfMap => "perf map",
            Kind::Elf | Kind::ElfWhole => "ELF object",
            Kind::ProcText => "process file",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UntrustedError {
    #[error("cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is a symbolic link or leads through a magic link; not followed", path.display())]
    Link { path: PathBuf },
    #[error("{} is a {what}, not a regular file; not read", path.display())]
    NotRegular { path: PathBuf, what: &'static str },
    #[error("{} is {size} bytes, over the {cap}-byte cap for a {kind}", path.display())]
    TooBig {
        path: PathBuf,
        size: u64,
        cap: u64,
        kind: &'static str,
    },
    #[error("{} is not the file the process mapped or that was checked (replaced since)", path.display())]
    Replaced { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} changed size while it was read", path.display())]
    Truncated { path: PathBuf },
    #[error("{} is not a well-formed ELF object: {reason}", path.display())]
    Malformed { path: PathBuf, reason: String },
}

impl UntrustedError {
    /// The file simply is not there (the common, harmless case: no perf map).
    pub fn is_not_found(&self) -> bool {
        matches!(self, UntrustedError::Open { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// A process's root directory, opened to resolve paths in (`/proc/PID/root`, or `/`).
#[derive(Debug)]
pub struct Root {
    dir: File,
}

impl Root {
    /// The root of process `pid` as `proc_root` shows it. Opening `/proc/PID/root` follows
    /// the kernel's link to that process's root, which is the point; nothing inside it is
    /// resolved that way.
    pub fn of_process(proc_root: &Path, pid: u32) -> io::Result<Root> {
        Self::open(&proc_root.join(pid.to_string()).join("root"))
    }

    /// A directory to resolve paths in, taken as a root.
    pub fn open(dir: &Path) -> io::Result<Root> {
        let c = cstring(dir)?;
        // SAFETY: a NUL-terminated path; the descriptor is owned by the File below.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let dir = unsafe { File::from_raw_fd(fd) };
        Ok(Root { dir })
    }
}

/// A regular file of a profiled process, opened and checked; read it with the methods below.
#[derive(Debug)]
pub struct UntrustedFile {
    file: File,
    path: PathBuf,
    size: u64,
    dev: u64,
    ino: u64,
    kind: Kind,
}

/// The flags every open here uses.
const OPEN_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;

impl UntrustedFile {
    /// Opens `path` inside `root` (an absolute `path` is taken from the root).
    pub fn open_in_root(root: &Root, path: &Path, kind: Kind) -> Result<Self, UntrustedError> {
        let inner = path.strip_prefix("/").unwrap_or(path);
        let inner = if inner.as_os_str().is_empty() {
            Path::new(".")
        } else {
            inner
        };
        // A perf map has one place, `/tmp`: no link on the way to it is followed, so none
        // leads the reader onto a mount that was not checked (os::mounts).
        let links = if kind == Kind::PerfMap {
            libc::RESOLVE_NO_SYMLINKS
        } else {
            0
        };
        let fd = openat2(
            root.dir.as_raw_fd(),
            inner,
            libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS | links,
        )
        .map_err(|e| open_error(path, e))?;
        Self::checked(fd, path.to_path_buf(), kind)
    }

    /// Opens a path of the profiler's own namespace (`/proc/PID/cmdline`, a host debug file)
    /// with the same checks, magic links refused.
    pub fn open(path: &Path, kind: Kind) -> Result<Self, UntrustedError> {
        let fd = openat2(libc::AT_FDCWD, path, libc::RESOLVE_NO_MAGICLINKS)
            .map_err(|e| open_error(path, e))?;
        Self::checked(fd, path.to_path_buf(), kind)
    }

    /// Opens a path the profiler resolved itself (a binary's path: the `/proc/self/fd/N` of
    /// a descriptor it holds, or a host path checked when it was chosen), with the checks.
    /// A path below such a descriptor (`/proc/self/fd/N/usr/lib/debug/…`, N a process's
    /// root the profiler holds) is resolved inside that directory, as in
    /// [`open_in_root`](Self::open_in_root).
    pub fn open_resolved(path: &Path, kind: Kind) -> Result<Self, UntrustedError> {
        if !path.starts_with("/proc/self/fd") {
            return Self::open(path, kind);
        }
        let mut parts = path.components();
        let held: PathBuf = parts.by_ref().take(5).collect();
        let rest = parts.as_path();
        if !rest.as_os_str().is_empty() {
            let root = Root::open(&held).map_err(|e| open_error(path, e))?;
            let mut f = Self::open_in_root(&root, rest, kind)?;
            f.path = path.to_path_buf();
            return Ok(f);
        }
        let c = cstring(path).map_err(|e| open_error(path, e))?;
        // SAFETY: a NUL-terminated path; the descriptor is owned by `checked`. The magic link
        // is one of our own descriptors.
        let fd = unsafe { libc::open(c.as_ptr(), OPEN_FLAGS & !libc::O_NOFOLLOW) };
        if fd < 0 {
            return Err(open_error(path, io::Error::last_os_error()));
        }
        Self::checked(fd, path.to_path_buf(), kind)
    }

    /// [`open_resolved`](Self::open_resolved), held to a check made earlier: an error when the
    /// file now at `path` is not the one with device and inode `id` (one renamed over it
    /// since).
    pub fn open_identified(
        path: &Path,
        kind: Kind,
        id: (u64, u64),
    ) -> Result<Self, UntrustedError> {
        let file = Self::open_resolved(path, kind)?;
        file.expect_identity(id.0, id.1)?;
        Ok(file)
    }

    /// A `Read + Seek` over the file built on `pread`, for parsers that read what they need
    /// (`object::read::ReadCache`): no mapping, and no file offset shared with anyone.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            file: &self.file,
            pos: 0,
        }
    }

    fn checked(fd: libc::c_int, path: PathBuf, kind: Kind) -> Result<Self, UntrustedError> {
        // SAFETY: a fresh descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let meta = file.metadata().map_err(|source| UntrustedError::Read {
            path: path.clone(),
            source,
        })?;
        let ft = meta.file_type();
        if !ft.is_file() {
            let what = if ft.is_fifo() {
                "FIFO"
            } else if ft.is_char_device() {
                "character device"
            } else if ft.is_block_device() {
                "block device"
            } else if ft.is_socket() {
                "socket"
            } else if ft.is_dir() {
                "directory"
            } else {
                "special file"
            };
            return Err(UntrustedError::NotRegular { path, what });
        }
        if meta.len() > kind.cap() && kind != Kind::ProcText {
            return Err(UntrustedError::TooBig {
                path,
                size: meta.len(),
                cap: kind.cap(),
                kind: kind.name(),
            });
        }
        Ok(Self {
            file,
            path,
            size: meta.len(),
            dev: meta.dev(),
            ino: meta.ino(),
            kind,
        })
    }

    /// Refuses the file unless it is the one a mapping names (`major:minor inode` as
    /// `/proc/PID/maps` shows them).
    /// overlayfs and btrfs report through `stat` another device than the mapping carries
    /// (the overlay's, a subvolume's) for the same file; there the inode alone is compared,
    /// which still tells the mapped file from a replacement: a mapped inode is alive, so no
    /// other file of its file system has its number.
    pub fn expect_mapped(&self, major: u32, minor: u32, inode: u64) -> Result<(), UntrustedError> {
        let dev = libc::makedev(major, minor);
        if self.dev != dev && self.ino == inode && self.device_differs_by_design() {
            return Ok(());
        }
        self.expect_identity(dev, inode)
    }

    fn device_differs_by_design(&self) -> bool {
        const OVERLAYFS_SUPER_MAGIC: i64 = 0x794c_7630;
        const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
        // SAFETY: statfs is plain data, for which all zeros is a valid value.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: an open descriptor and a statfs to fill.
        if unsafe { libc::fstatfs(self.file.as_raw_fd(), &mut st) } != 0 {
            return false;
        }
        matches!(st.f_type as i64, OVERLAYFS_SUPER_MAGIC | BTRFS_SUPER_MAGIC)
    }

    /// Opens a mapped file through the kernel's own link to it
    /// (`/proc/PID/map_files/START-END`, which needs CAP_SYS_ADMIN or
    /// CAP_CHECKPOINT_RESTORE): the file the process mapped whatever its name is now.
    pub fn open_map_file(link: &Path, kind: Kind) -> Result<Self, UntrustedError> {
        let c = cstring(link).map_err(|e| open_error(link, e))?;
        // SAFETY: a NUL-terminated path; the descriptor is owned by `checked`. The magic link
        // is the kernel's answer for this mapping, so it is followed on purpose.
        let fd = unsafe { libc::open(c.as_ptr(), OPEN_FLAGS & !libc::O_NOFOLLOW) };
        if fd < 0 {
            return Err(open_error(link, io::Error::last_os_error()));
        }
        Self::checked(fd, link.to_path_buf(), kind)
    }

    fn expect_identity(&self, dev: u64, ino: u64) -> Result<(), UntrustedError> {
        if self.dev == dev && self.ino == ino {
            Ok(())
        } else {
            Err(UntrustedError::Replaced {
                path: self.path.clone(),
            })
        }
    }

    /// The size `fstat` gave at open.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The file's device and inode, as `fstat` gave them at open.
    pub fn identity(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// The opened file, to keep (its `/proc/self/fd/N` opens the same file later).
    pub fn into_file(self) -> File {
        self.file
    }

    /// The whole file, up to the kind's cap: larger is an error, except for `/proc` text,
    /// which is cut at the cap.
    pub fn read_bytes(&self) -> Result<Vec<u8>, UntrustedError> {
        let cap = self.kind.cap();
        let mut out = Vec::with_capacity(self.size.min(cap) as usize);
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            let want = chunk.len().min((cap + 1 - out.len() as u64) as usize);
            if want == 0 {
                break;
            }
            let n = match self.file.read_at(&mut chunk[..want], out.len() as u64) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(UntrustedError::Read {
                        path: self.path.clone(),
                        source,
                    });
                }
            };
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
        }
        if out.len() as u64 > cap {
            if self.kind == Kind::ProcText {
                out.truncate(cap as usize);
            } else {
                return Err(UntrustedError::TooBig {
                    path: self.path.clone(),
                    size: out.len() as u64,
                    cap,
                    kind: self.kind.name(),
                });
            }
        }
        Ok(out)
    }

    /// [`read_bytes`](Self::read_bytes) as text, invalid UTF-8 replaced.
    pub fn read_text(&self) -> Result<String, UntrustedError> {
        Ok(String::from_utf8_lossy(&self.read_bytes()?).into_owned())
    }

    /// The whole file copied into an anonymous mapping of the profiler's.
    pub fn copy(&self) -> Result<Copy, UntrustedError> {
        let mut map = self.anon()?;
        self.fill(&mut map, 0, self.size)?;
        self.seal(map)
    }

    /// An ELF object copied sparsely: the file header, program and section headers, the
    /// section names, and the sections named in `sections` (`.eh_frame`, `.symtab`…); every
    /// other byte reads as zero and costs no memory. Parse the result as the file itself.
    pub fn copy_elf_sections(&self, sections: &[&str]) -> Result<Copy, UntrustedError> {
        let mut map = self.anon()?;
        self.fill_elf(&mut map, |name| {
            sections.iter().any(|w| w.as_bytes() == name)
        })?;
        self.seal(map)
    }

    /// An ELF object copied sparsely, as [`copy_elf_sections`](Self::copy_elf_sections)
    /// does, into a memory file of the profiler's (`memfd_create`) rather than an anonymous
    /// mapping: for a reader that opens a path (blazesym, through `/proc/self/fd/N`). The
    /// sections whose name `keep` accepts are read; nobody else holds the memory file, so
    /// no one can truncate it under the reader.
    pub fn copy_elf_to_memfd(&self, keep: impl Fn(&[u8]) -> bool) -> Result<File, UntrustedError> {
        let read_err = |source| UntrustedError::Read {
            path: self.path.clone(),
            source,
        };
        if self.size == 0 {
            return Err(UntrustedError::Malformed {
                path: self.path.clone(),
                reason: "empty file".into(),
            });
        }
        // SAFETY: a NUL-terminated name; the descriptor is owned by the File below.
        let fd = unsafe { libc::memfd_create(c"pyrometer-elf".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(read_err(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(self.size).map_err(read_err)?;
        // SAFETY: a memory file only this function has; the mapping ends with it.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&memfd) }.map_err(read_err)?;
        self.fill_elf(&mut map, keep)?;
        drop(map);
        Ok(memfd)
    }

    /// Fills `map` (as long as the file) with the headers and the sections `keep` names.
    fn fill_elf(&self, map: &mut [u8], keep: impl Fn(&[u8]) -> bool) -> Result<(), UntrustedError> {
        use object::elf::FileHeader64;
        use object::read::elf::{FileHeader, SectionHeader};
        let malformed = |reason: String| UntrustedError::Malformed {
            path: self.path.clone(),
            reason,
        };
        self.fill(map, 0, 64.min(self.size))?;
        let (ph, sh) = {
            let header = FileHeader64::<object::Endianness>::parse(&*map)
                .map_err(|e| malformed(e.to_string()))?;
            let endian = header.endian().map_err(|e| malformed(e.to_string()))?;
            let ph = (
                header.e_phoff.get(endian),
                u64::from(header.e_phnum.get(endian)) * u64::from(header.e_phentsize.get(endian)),
            );
            // Section 0 carries the count when it overflows e_shnum; read at least it.
            let count = u64::from(header.e_shnum.get(endian)).max(1);
            let sh = (
                header.e_shoff.get(endian),
                count * u64::from(header.e_shentsize.get(endian)),
            );
            (ph, sh)
        };
        self.fill(map, ph.0, ph.1)?;
        self.fill(map, sh.0, sh.1)?;
        // With the section headers in place, the full count (and the names' table) is known.
        let sh_all = {
            let header = FileHeader64::<object::Endianness>::parse(&*map)
                .map_err(|e| malformed(e.to_string()))?;
            let endian = header.endian().map_err(|e| malformed(e.to_string()))?;
            let n = header
                .shnum(endian, &*map)
                .map_err(|e| malformed(e.to_string()))?;
            n as u64 * u64::from(header.e_shentsize.get(endian))
        };
        self.fill(map, sh.0, sh_all)?;
        let names_range = {
            let header = FileHeader64::<object::Endianness>::parse(&*map)
                .map_err(|e| malformed(e.to_string()))?;
            let endian = header.endian().map_err(|e| malformed(e.to_string()))?;
            let headers = header
                .section_headers(endian, &*map)
                .map_err(|e| malformed(e.to_string()))?;
            let index = header
                .shstrndx(endian, &*map)
                .map_err(|e| malformed(e.to_string()))?;
            headers
                .get(index as usize)
                .and_then(|s| s.file_range(endian))
                .unwrap_or((0, 0))
        };
        self.fill(map, names_range.0, names_range.1)?;
        let wanted: Vec<(u64, u64)> = {
            let header = FileHeader64::<object::Endianness>::parse(&*map)
                .map_err(|e| malformed(e.to_string()))?;
            let endian = header.endian().map_err(|e| malformed(e.to_string()))?;
            let table = header
                .sections(endian, &*map)
                .map_err(|e| malformed(e.to_string()))?;
            table
                .iter()
                .filter(|s| table.section_name(endian, s).is_ok_and(&keep))
                .filter_map(|s| s.file_range(endian))
                .collect()
        };
        for (offset, len) in wanted {
            self.fill(map, offset, len)?;
        }
        Ok(())
    }

    fn anon(&self) -> Result<memmap2::MmapMut, UntrustedError> {
        if self.size == 0 {
            return Err(UntrustedError::Malformed {
                path: self.path.clone(),
                reason: "empty file".into(),
            });
        }
        memmap2::MmapMut::map_anon(self.size as usize).map_err(|source| UntrustedError::Read {
            path: self.path.clone(),
            source,
        })
    }

    fn seal(&self, map: memmap2::MmapMut) -> Result<Copy, UntrustedError> {
        map.make_read_only()
            .map(|map| Copy { map })
            .map_err(|source| UntrustedError::Read {
                path: self.path.clone(),
                source,
            })
    }

    /// Reads `len` bytes at `offset` into the same place of `map`; the file must still hold
    /// them (it may have been truncated since the open).
    fn fill(&self, map: &mut [u8], offset: u64, len: u64) -> Result<(), UntrustedError> {
        let end = offset.checked_add(len).filter(|&e| e <= map.len() as u64);
        let Some(end) = end else {
            return Err(UntrustedError::Malformed {
                path: self.path.clone(),
                reason: format!("range {offset:#x}+{len:#x} beyond the file's end"),
            });
        };
        let mut at = offset;
        while at < end {
            match self.file.read_at(&mut map[at as usize..end as usize], at) {
                Ok(0) => {
                    return Err(UntrustedError::Truncated {
                        path: self.path.clone(),
                    });
                }
                Ok(n) => at += n as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(UntrustedError::Read {
                        path: self.path.clone(),
                        source,
                    });
                }
            }
        }
        Ok(())
    }
}

/// A file's bytes in an anonymous mapping the profiler owns: truncating the file does not
/// reach it.
#[derive(Debug)]
pub struct Copy {
    map: memmap2::Mmap,
}

impl std::ops::Deref for Copy {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

/// See [`UntrustedFile::reader`].
#[derive(Debug)]
pub struct Reader<'a> {
    file: &'a File,
    pos: u64,
}

impl io::Read for Reader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl io::Seek for Reader<'_> {
    fn seek(&mut self, to: io::SeekFrom) -> io::Result<u64> {
        let base = match to {
            io::SeekFrom::Start(n) => {
                self.pos = n;
                return Ok(n);
            }
            io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            io::SeekFrom::End(d) => self.file.metadata()?.len().checked_add_signed(d),
        };
        self.pos = base.ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        Ok(self.pos)
    }
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in path"))
}

fn openat2(dirfd: libc::c_int, path: &Path, resolve: u64) -> io::Result<libc::c_int> {
    let c = cstring(path)?;
    // SAFETY: open_how is plain data; zeroed is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = OPEN_FLAGS as u64;
    how.resolve = resolve;
    // A process renaming files in its root without pause must not hold the reader here.
    for _ in 0..8 {
        // SAFETY: a NUL-terminated path and an open_how of the size passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dirfd,
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            return Ok(fd as libc::c_int);
        }
        let e = io::Error::last_os_error();
        // EAGAIN: a rename raced the in-root resolution; the kernel asks for a retry.
        if e.raw_os_error() != Some(libc::EAGAIN) && e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Err(io::Error::from_raw_os_error(libc::EAGAIN))
}

fn open_error(path: &Path, source: io::Error) -> UntrustedError {
    match source.raw_os_error() {
        Some(libc::ELOOP) | Some(libc::EXDEV) => UntrustedError::Link {
            path: path.to_path_buf(),
        },
        _ => UntrustedError::Open {
            path: path.to_path_buf(),
            source,
        },
    }
}

#[cfg(test)]
mod tests;
