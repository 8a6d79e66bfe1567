//! `/proc/PID/*` text, read one bounded way. The kernel writes these files, but a process
//! decides how long they are: its command line and environment, its name, how many mappings
//! and mounts it has (a process with a million mappings has a maps file of ~100 MB). Short
//! files are read up to a byte cap and cut there; line files (`maps`, `mountinfo`) are
//! streamed one line at a time, up to a cap on lines, so memory never follows their size.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

/// What a short `/proc` file (`comm`, `status`, `stat`, `cmdline`, `environ`, `cgroup`) is
/// read up to: 256 KiB. `status` is ~1.5 KB; a command line or environment past this is cut.
pub const TEXT_CAP: u64 = 256 << 10;

/// Lines of `/proc/PID/maps` read at most: the kernel's default `vm.max_map_count`
/// (65 530) and some. Mappings past it are left out (their frames stay unnamed).
pub const MAPS_LINES: usize = 65_536;

/// Lines of `/proc/PID/mountinfo` read at most.
pub const MOUNT_LINES: usize = 16_384;

/// The longest line kept: a maps line is at most a path (`PATH_MAX`, 4096) and ~100 bytes of
/// fields; a longer one (which the kernel does not write) ends the read.
const LINE_CAP: u64 = 8 << 10;

/// Reads a short `/proc` file, cut at `cap` bytes, invalid UTF-8 replaced.
pub fn read(path: &Path, cap: u64) -> io::Result<String> {
    Ok(String::from_utf8_lossy(&read_bytes(path, cap)?).into_owned())
}

/// [`read`] as bytes (`cmdline` and `environ` are NUL-separated).
pub fn read_bytes(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    File::open(path)?.take(cap).read_to_end(&mut out)?;
    Ok(out)
}

/// Calls `each` with every line of `path` (without its newline), at most `max_lines` of
/// them; true when the whole file was read, false when it was cut at the cap.
pub fn for_each_line(
    path: &Path,
    max_lines: usize,
    mut each: impl FnMut(&str),
) -> io::Result<bool> {
    let mut reader = BufReader::with_capacity(64 << 10, File::open(path)?);
    let mut line = Vec::with_capacity(256);
    for _ in 0..max_lines {
        line.clear();
        let n = (&mut reader).take(LINE_CAP).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(true);
        }
        if line.last() != Some(&b'\n') && n as u64 == LINE_CAP {
            return Ok(false);
        }
        let text = String::from_utf8_lossy(&line);
        each(text.trim_end_matches('\n'));
    }
    Ok(reader.fill_buf()?.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolize::testutil::TempDir;

    #[test]
    fn short_files_are_cut_at_the_cap() {
        let tmp = TempDir::new("proctext");
        let p = tmp.path().join("environ");
        std::fs::write(&p, vec![b'x'; 1000]).unwrap();
        assert_eq!(read_bytes(&p, 100).unwrap().len(), 100);
        assert_eq!(read(&p, 5000).unwrap().len(), 1000);
        assert!(
            read(Path::new("/proc/self/status"), TEXT_CAP)
                .unwrap()
                .contains("Pid:")
        );
    }

    #[test]
    fn lines_are_streamed_up_to_the_cap() {
        let tmp = TempDir::new("proctext-lines");
        let p = tmp.path().join("maps");
        let text: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&p, text).unwrap();
        let mut seen = Vec::new();
        assert!(for_each_line(&p, 5000, |l| seen.push(l.to_string())).unwrap());
        assert_eq!(seen.len(), 1000);
        assert_eq!(seen[999], "line 999");
        seen.clear();
        assert!(!for_each_line(&p, 10, |l| seen.push(l.to_string())).unwrap());
        assert_eq!(seen.len(), 10);
        // Exactly at the cap: the whole file.
        assert!(for_each_line(&p, 1000, |_| {}).unwrap());
        // A line longer than any the kernel writes ends the read.
        std::fs::write(&p, vec![b'a'; 20 << 10]).unwrap();
        let mut n = 0;
        assert!(!for_each_line(&p, 10, |_| n += 1).unwrap());
        assert_eq!(n, 0);
        // Our own maps, as the registry reads them.
        let mut maps = 0;
        assert!(for_each_line(Path::new("/proc/self/maps"), MAPS_LINES, |_| maps += 1).unwrap());
        assert!(maps > 5);
    }
}
