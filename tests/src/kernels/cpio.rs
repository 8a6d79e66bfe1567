//! A cpio archive in the "newc" format the kernel unpacks as its initramfs (see the kernel's
//! Documentation/driver-api/early-userspace/buffer-format.rst). Written here rather than with
//! `cpio`, which is not on a fresh machine: the format is a text header per entry.

/// An archive being built in memory (a busybox, a few modules: a few MB).
#[derive(Default)]
pub struct Archive {
    bytes: Vec<u8>,
    inode: u32,
}

const DIR: u32 = 0o040_000;
const FILE: u32 = 0o100_000;
const CHAR: u32 = 0o020_000;

impl Archive {
    pub fn dir(&mut self, name: &str) {
        self.entry(name, DIR | 0o755, &[], (0, 0));
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, FILE | mode, data, (0, 0));
    }

    /// A character device node, e.g. /dev/console (5, 1), so init has its stdio before it
    /// mounts devtmpfs.
    pub fn char_device(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, CHAR | 0o600, &[], (major, minor));
    }

    /// The archive with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[], (0, 0));
        self.bytes
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)) {
        self.inode += 1;
        let nlink = if mode & DIR != 0 { 2 } else { 1 };
        let fields = [
            self.inode,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // checksum (unused by "070701")
        ];
        self.bytes.extend_from_slice(b"070701");
        for f in fields {
            self.bytes.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_end_with_the_trailer() {
        let mut a = Archive::default();
        a.dir("bin");
        a.file("init", 0o755, b"#!/bin/sh\n");
        let bytes = a.finish();
        assert_eq!(&bytes[..6], b"070701");
        assert_eq!(bytes.len() % 4, 0);
        // "bin" header: 110 bytes + "bin\0" (114) padded to 116.
        assert_eq!(&bytes[116..122], b"070701");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("init\0"));
        assert!(text.contains("TRAILER!!!\0"));
    }
}
