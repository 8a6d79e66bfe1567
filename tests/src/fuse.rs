//! A FUSE file system that never answers a read, mounted by the test itself (as root, with
//! mount(2) on `/dev/fuse`: no fusermount or libfuse needed). Every name in its root directory
//! is the same regular file of 1 MiB; lookups, attributes, opens and the rest are answered,
//! `READ` requests are taken and never answered. A reader of one of its files waits for good
//! (past SIGKILL once the request is taken) until the file system goes away.
//!
//! [`StuckFs::serving`] answers reads with a real file's bytes (under that file's name only) until
//! [`StuckFs::stall`]: a program can run from it, its pages cached, and a reader that opens
//! the file after the stall (past the cache) waits for good. [`StuckFs::detach`] takes the
//! mount out of every mount table while what is open or mapped from it stays.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const OPEN: u32 = 14;
const READ: u32 = 15;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const OPENDIR: u32 = 27;
const READDIR: u32 = 28;
const RELEASEDIR: u32 = 29;
const ACCESS: u32 = 34;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;

/// The size every file shows (unless it serves a file).
pub const FILE_SIZE: u64 = 1 << 20;

/// `fuse_open_out.open_flags`: read past the page cache; keep the cache at open.
const FOPEN_DIRECT_IO: u32 = 1;
const FOPEN_KEEP_CACHE: u32 = 2;

/// A mounted stuck file system; unmounted (and every waiting reader released) when dropped.
pub struct StuckFs {
    at: PathBuf,
    stop: Arc<AtomicBool>,
    reads: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
}

impl StuckFs {
    /// Mounts it at `at` (an existing directory).
    pub fn mount(at: &Path) -> StuckFs {
        Self::mount_with(at, None)
    }

    /// Mounts it at `at` holding one file, `content` under its own name (its size, its
    /// bytes) until [`stall`](Self::stall); other names are not there.
    pub fn serving(at: &Path, content: &Path) -> StuckFs {
        let file = File::open(content).unwrap_or_else(|e| panic!("{}: {e}", content.display()));
        let name = content.file_name().unwrap().as_encoded_bytes().to_vec();
        Self::mount_with(at, Some((file, name)))
    }

    /// From now on reads are taken and never answered, and files opened are read past the
    /// page cache: what was cached before (a running program's pages) stays served from it.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::Release);
    }

    /// Takes the mount out of the mount table (a lazy unmount): `/proc/PID/mountinfo` no
    /// longer shows it, while files open and mapped from it stay answered by it.
    pub fn detach(&self) {
        let target = std::ffi::CString::new(self.at.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        assert_eq!(rc, 0, "umount: {}", std::io::Error::last_os_error());
    }

    fn mount_with(at: &Path, content: Option<(File, Vec<u8>)>) -> StuckFs {
        // SAFETY: a NUL-terminated path; the descriptor is owned by the File below.
        let fd = unsafe {
            libc::open(
                c"/dev/fuse".as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK,
            )
        };
        assert!(fd >= 0, "/dev/fuse: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nothing else owns.
        let dev = unsafe { File::from_raw_fd(fd) };
        let target = std::ffi::CString::new(at.to_str().unwrap()).unwrap();
        let opts = std::ffi::CString::new(format!(
            "fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        ))
        .unwrap();
        // SAFETY: NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                c"pyrometer-stuck".as_ptr(),
                target.as_ptr(),
                c"fuse".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount fuse: {}", std::io::Error::last_os_error());
        let stop = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicU64::new(0));
        // Without a file to serve, stalled from the start.
        let stalled = Arc::new(AtomicBool::new(content.is_none()));
        let server = {
            let state = State {
                stop: stop.clone(),
                reads: reads.clone(),
                stalled: stalled.clone(),
                content,
            };
            std::thread::spawn(move || serve(dev, &state))
        };
        StuckFs {
            at: at.to_path_buf(),
            stop,
            reads,
            stalled,
            server: Some(server),
        }
    }

    /// `READ` requests taken (and never answered) so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Acquire)
    }
}

impl Drop for StuckFs {
    fn drop(&mut self) {
        // Closing the device ends the connection: every request still waiting fails.
        self.stop.store(true, Ordering::Release);
        if let Some(s) = self.server.take() {
            let _ = s.join();
        }
        let target = std::ffi::CString::new(self.at.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

struct State {
    stop: Arc<AtomicBool>,
    reads: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
    /// The file served and its name; without one, every name is a file of `FILE_SIZE`.
    content: Option<(File, Vec<u8>)>,
}

impl State {
    fn size(&self) -> u64 {
        self.content
            .as_ref()
            .map_or(FILE_SIZE, |(f, _)| f.metadata().unwrap().len())
    }

    /// The bytes a READ asks for, until the stall.
    fn read(&self, offset: u64, len: u32) -> Option<Vec<u8>> {
        if self.stalled.load(Ordering::Acquire) {
            return None;
        }
        let (f, _) = self.content.as_ref()?;
        let mut b = vec![0u8; len as usize];
        let mut got = 0;
        while got < b.len() {
            match std::os::unix::fs::FileExt::read_at(f, &mut b[got..], offset + got as u64) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        b.truncate(got);
        Some(b)
    }

    /// Whether the root holds `name` (NUL-terminated, as LOOKUP carries it).
    fn has(&self, name: &[u8]) -> bool {
        let name = name.split(|&b| b == 0).next().unwrap_or_default();
        self.content.as_ref().is_none_or(|(_, own)| own == name)
    }

    fn open_flags(&self) -> u32 {
        if self.stalled.load(Ordering::Acquire) {
            FOPEN_DIRECT_IO | FOPEN_KEEP_CACHE
        } else if self.content.is_some() {
            FOPEN_KEEP_CACHE
        } else {
            0
        }
    }
}

fn serve(mut dev: File, state: &State) {
    let (stop, reads) = (&state.stop, &state.reads);
    let size = state.size();
    let mut buf = vec![0u8; 1 << 20];
    while !stop.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd: dev.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
            continue;
        }
        let n = match dev.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        };
        if n < 40 {
            continue;
        }
        let u32_at = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(buf[o..o + 8].try_into().unwrap());
        let (opcode, unique, node) = (u32_at(4), u64_at(8), u64_at(16));
        let body: Option<Result<Vec<u8>, i32>> = match opcode {
            INIT => Some(Ok(init_out(u32_at(48)))),
            LOOKUP if node == 1 && state.has(&buf[40..n]) => Some(Ok(entry_out(size))),
            LOOKUP => Some(Err(libc::ENOENT)),
            GETATTR => Some(Ok(attr_out(node, size))),
            OPEN => {
                // fuse_open_out: fh, open_flags, padding.
                let mut b = vec![0u8; 16];
                b[8..12].copy_from_slice(&state.open_flags().to_le_bytes());
                Some(Ok(b))
            }
            OPENDIR => Some(Ok(vec![0u8; 16])),
            READDIR => Some(Ok(Vec::new())),
            STATFS => Some(Ok(statfs_out())),
            RELEASE | RELEASEDIR | FLUSH | ACCESS => Some(Ok(Vec::new())),
            // fuse_read_in after the 40-byte header: fh, offset, size.
            READ => match state.read(u64_at(48), u32_at(56)) {
                Some(bytes) => Some(Ok(bytes)),
                None => {
                    reads.fetch_add(1, Ordering::AcqRel);
                    None
                }
            },
            FORGET | BATCH_FORGET | INTERRUPT => None,
            _ => Some(Err(libc::ENOSYS)),
        };
        let Some(body) = body else { continue };
        let (error, body) = match body {
            Ok(b) => (0i32, b),
            Err(e) => (-e, Vec::new()),
        };
        let mut out = Vec::with_capacity(16 + body.len());
        out.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
        out.extend_from_slice(&error.to_le_bytes());
        out.extend_from_slice(&unique.to_le_bytes());
        out.extend_from_slice(&body);
        let _ = std::io::Write::write(&mut dev, &out);
    }
}

fn init_out(max_readahead: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(&7u32.to_le_bytes()); // major
    b.extend_from_slice(&31u32.to_le_bytes()); // minor
    b.extend_from_slice(&max_readahead.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // flags
    b.extend_from_slice(&16u16.to_le_bytes()); // max_background
    b.extend_from_slice(&12u16.to_le_bytes()); // congestion_threshold
    b.extend_from_slice(&4096u32.to_le_bytes()); // max_write
    b.extend_from_slice(&1u32.to_le_bytes()); // time_gran
    b.resize(64, 0);
    b
}

/// `fuse_attr`: the root directory (node 1) or the one file (any other node).
fn attr(node: u64, file_size: u64) -> Vec<u8> {
    let (mode, size, nlink) = if node == 1 {
        (libc::S_IFDIR | 0o755, 0, 2)
    } else {
        (libc::S_IFREG | 0o755, file_size, 1)
    };
    let mut b = Vec::with_capacity(88);
    b.extend_from_slice(&node.to_le_bytes()); // ino
    b.extend_from_slice(&size.to_le_bytes());
    b.extend_from_slice(&size.div_ceil(512).to_le_bytes()); // blocks
    b.extend_from_slice(&[0u8; 24]); // atime, mtime, ctime
    b.extend_from_slice(&[0u8; 12]); // their nanoseconds
    b.extend_from_slice(&mode.to_le_bytes());
    b.extend_from_slice(&(nlink as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 8]); // uid, gid
    b.extend_from_slice(&0u32.to_le_bytes()); // rdev
    b.extend_from_slice(&4096u32.to_le_bytes()); // blksize
    b.extend_from_slice(&0u32.to_le_bytes()); // flags
    b
}

fn entry_out(size: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(128);
    b.extend_from_slice(&2u64.to_le_bytes()); // nodeid
    b.extend_from_slice(&0u64.to_le_bytes()); // generation
    b.extend_from_slice(&60u64.to_le_bytes()); // entry_valid
    b.extend_from_slice(&60u64.to_le_bytes()); // attr_valid
    b.extend_from_slice(&[0u8; 8]); // their nanoseconds
    b.extend_from_slice(&attr(2, size));
    b
}

fn attr_out(node: u64, size: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(104);
    b.extend_from_slice(&60u64.to_le_bytes()); // attr_valid
    b.extend_from_slice(&[0u8; 8]); // nanoseconds, dummy
    b.extend_from_slice(&attr(node, size));
    b
}

fn statfs_out() -> Vec<u8> {
    let mut b = Vec::with_capacity(80);
    for v in [256u64, 0, 0, 16, 0] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&4096u32.to_le_bytes()); // bsize
    b.extend_from_slice(&255u32.to_le_bytes()); // namelen
    b.extend_from_slice(&4096u32.to_le_bytes()); // frsize
    b.resize(80, 0);
    b
}

/// `python` (Debian's python3.11) run with `script` from a [`StuckFs`] mounted under
/// `dir/mnt` (`PYTHONHOME=/usr`, stdin piped), once it printed its first line (returned):
/// every page of the binary in the cache first, so it keeps running from there after the
/// file system stalls and is taken out of the mount table, both done before this returns.
pub fn stuck_python(
    dir: &Path,
    python: &Path,
    script: &str,
) -> (StuckFs, std::process::Child, String) {
    std::fs::create_dir_all(dir.join("mnt")).unwrap();
    let fs = StuckFs::serving(&dir.join("mnt"), python);
    let exe = dir.join("mnt").join(python.file_name().unwrap());
    assert_eq!(
        std::fs::read(&exe).unwrap().len() as u64,
        std::fs::metadata(python).unwrap().len()
    );
    let (child, line) = crate::spawn_until_line(
        std::process::Command::new(&exe)
            .args(["-c", script])
            .env("PYTHONHOME", "/usr")
            .stdin(std::process::Stdio::piped()),
    );
    fs.stall();
    fs.detach();
    (fs, child, line)
}

/// A stuck process, its file system and the agent beside them (once started), ended in that
/// order (on a failed assertion too): until the file system's connection ends, the agent's
/// stuck reads, and so its exit, wait for good.
pub struct StuckRun {
    pub fs: Option<StuckFs>,
    pub child: std::process::Child,
    pub agent: Option<crate::cluster::Agent>,
}

impl StuckRun {
    /// Ends the stuck process and the file system: the agent's stuck reads fail.
    pub fn release(&mut self) {
        self.child.kill().ok();
        self.fs.take();
        self.child.wait().ok();
    }

    /// The agent, once started.
    pub fn agent(&mut self) -> &mut crate::cluster::Agent {
        self.agent.as_mut().expect("the agent was started")
    }
}

impl Drop for StuckRun {
    fn drop(&mut self) {
        // The agent, a field, goes after this.
        self.release();
    }
}
