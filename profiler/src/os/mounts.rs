//! Which of a process's files live on a FUSE file system, from `/proc/PID/mountinfo` (which
//! the kernel writes). A FUSE file is answered by a process, which may never answer: a read
//! of it waits, and once the file system has taken the request, nothing but its answer or
//! the end of the connection ends the wait, not even SIGKILL. A thread of the profiler caught
//! so would hold its exit for good. A container can mount FUSE in its own user namespace,
//! so its files on FUSE are never opened: not its binaries and libraries, not its perf map.

use std::path::{Component, Path};

use super::proctext;

/// A process's mounts, as its mountinfo lists them (mount points relative to its root).
#[derive(Debug, Default)]
pub struct Mounts {
    mounts: Vec<Mount>,
}

#[derive(Debug)]
struct Mount {
    major: u32,
    minor: u32,
    point: String,
    fuse: bool,
}

impl Mounts {
    /// The mounts of process `pid` under `proc_root` (`self` for the profiler's own); none
    /// when they cannot be read.
    pub fn of_process(proc_root: &Path, pid: &str) -> Mounts {
        let mut mounts = Vec::new();
        let path = proc_root.join(pid).join("mountinfo");
        let _ = proctext::for_each_line(&path, proctext::MOUNT_LINES, |line| {
            mounts.extend(parse_line(line));
        });
        Mounts { mounts }
    }

    #[cfg(test)]
    fn parse(text: &str) -> Mounts {
        Mounts {
            mounts: text.lines().filter_map(parse_line).collect(),
        }
    }

    /// Whether the device `major:minor` (as `/proc/PID/maps` shows it) is a FUSE mount's.
    pub fn is_fuse_device(&self, major: u32, minor: u32) -> bool {
        self.mounts
            .iter()
            .any(|m| m.fuse && m.major == major && m.minor == minor)
    }

    /// Whether `path` (absolute, as the process sees it) lies on a FUSE mount: the mount with
    /// the longest mount point that is a prefix of it, component by component.
    pub fn is_fuse_path(&self, path: &Path) -> bool {
        self.mounts
            .iter()
            .filter(|m| path.starts_with(&m.point))
            .max_by_key(|m| Path::new(&m.point).components().count())
            .is_some_and(|m| m.fuse)
    }

    /// Whether opening `path` may wait on a FUSE file system: it lies on one, or walks
    /// through `..` (which mount it ends on is not known before it is resolved).
    pub fn may_block(&self, path: &Path) -> bool {
        path.components().any(|c| c == Component::ParentDir) || self.is_fuse_path(path)
    }
}

fn parse_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let mut fields = left.split(' ');
    let (_, _, dev, _, point) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let (major, minor) = dev.split_once(':')?;
    let fstype = right.split(' ').next()?;
    Some(Mount {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        point: unescape(point),
        fuse: fstype == "fuse" || fstype == "fuseblk" || fstype.starts_with("fuse."),
    })
}

/// Mount points escape space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|o| o.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(o) if b[i] == b'\\' => {
                let v = o.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                out.push(v as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:21 / /tmp rw shared:2 - tmpfs tmpfs rw
24 23 0:45 / /tmp/fuse\\040dir rw,nosuid - fuse.sshfs host:/ rw,user_id=0
25 22 0:46 / /data rw - fuse /dev/fuse rw
";

    #[test]
    fn fuse_devices_and_paths_are_known() {
        let m = Mounts::parse(INFO);
        assert!(m.is_fuse_device(0, 45));
        assert!(m.is_fuse_device(0, 46));
        assert!(!m.is_fuse_device(0, 21));
        assert!(!m.is_fuse_device(8, 1));
        assert!(m.is_fuse_path(Path::new("/tmp/fuse dir/perf-1.map")));
        assert!(m.is_fuse_path(Path::new("/data/lib.so")));
        assert!(!m.is_fuse_path(Path::new("/tmp/perf-1.map")));
        assert!(!m.is_fuse_path(Path::new("/database/lib.so")));
        assert!(!m.is_fuse_path(Path::new("/usr/lib/libc.so.6")));
        assert!(m.may_block(Path::new("/tmp/../data/x")));
        assert!(!m.may_block(Path::new("/tmp/perf-1.map")));
    }

    #[test]
    fn our_own_mounts_are_read() {
        let m = Mounts::of_process(Path::new("/proc"), "self");
        assert!(!m.mounts.is_empty());
        assert!(m.mounts.iter().any(|m| m.point == "/"));
    }
}
