//! `/tmp/perf-PID.map` files: JIT compilers (V8, the JVM with perf-map-agent, CPython 3.12's
//! perf trampolines, LuaJIT…) write one `START SIZE name` line per compiled function.

use std::path::PathBuf;
use std::time::Instant;

use crate::os::untrusted::{Kind, Root, UntrustedFile};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerfMapEntry {
    pub start: u64,
    pub size: u64,
    pub name: String,
}

fn hex(s: &str) -> Option<u64> {
    let s = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    u64::from_str_radix(s, 16).ok()
}

/// Parses a perf map; malformed lines are skipped (the file is often read while the JIT is
/// still appending to it, so the last line may be cut). Entries come back sorted by start;
/// where a JIT reused an address the later line wins.
pub fn parse_perf_map(text: &str) -> Vec<PerfMapEntry> {
    let mut entries: Vec<PerfMapEntry> = text
        .lines()
        .filter_map(|line| {
            let mut parts = line.trim_start().splitn(3, char::is_whitespace);
            let start = hex(parts.next()?)?;
            let size = hex(parts.next()?)?;
            let name = parts.next()?.trim();
            (!name.is_empty() && size > 0).then(|| PerfMapEntry {
                start,
                size,
                name: name.to_string(),
            })
        })
        .collect();
    // Stable sort keeps file order among equal starts, so keeping the last keeps the newest.
    entries.sort_by_key(|e| e.start);
    let mut out: Vec<PerfMapEntry> = Vec::with_capacity(entries.len());
    for e in entries {
        match out.last_mut() {
            Some(last) if last.start == e.start => *last = e,
            _ => out.push(e),
        }
    }
    out
}

/// What reading a process's perf map gave.
#[derive(Debug)]
pub(crate) enum Read {
    Entries(Vec<PerfMapEntry>),
    Absent,
    /// A FIFO, a link, a device or a file over the cap.
    Refused,
}

/// Reads and parses the first of `candidates` (a root, and the map's path inside it) that
/// exists, through the untrusted-file layer.
pub(crate) fn read(candidates: &[(Root, PathBuf)]) -> Read {
    for (root, path) in candidates {
        match UntrustedFile::open_in_root(root, path, Kind::PerfMap).and_then(|f| f.read_text()) {
            Ok(text) => return Read::Entries(parse_perf_map(&text)),
            Err(e) if e.is_not_found() => {}
            Err(_) => return Read::Refused,
        }
    }
    Read::Absent
}

/// One process's perf map as last read.
#[derive(Debug, Default)]
pub(crate) struct PerfMap {
    pub entries: Vec<PerfMapEntry>,
    pub last_read: Option<Instant>,
}

impl PerfMap {
    /// What its entries hold in memory.
    pub fn held_bytes(&self) -> u64 {
        let names: usize = self.entries.iter().map(|e| e.name.capacity()).sum();
        (self.entries.capacity() * std::mem::size_of::<PerfMapEntry>() + names) as u64
    }

    pub fn lookup(&self, addr: u64) -> Option<&PerfMapEntry> {
        let i = self.entries.partition_point(|e| e.start <= addr);
        let e = self.entries.get(i.checked_sub(1)?)?;
        (addr - e.start < e.size).then_some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hex_with_and_without_prefix_and_names_with_spaces() {
        let text = "\
7f0000001000 40 LazyCompile:~foo /app/x.js:1
0x7f0000002000 0x20 py::bar:/app/y.py
garbage line
7f0000003000 zz bad size
7f0000004000 10
7f0000001000 8 newer
";
        let e = parse_perf_map(text);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].start, 0x7f0000001000);
        assert_eq!((e[0].size, e[0].name.as_str()), (8, "newer"));
        assert_eq!(
            e[1],
            PerfMapEntry {
                start: 0x7f0000002000,
                size: 0x20,
                name: "py::bar:/app/y.py".into()
            }
        );
        let map = PerfMap {
            entries: e,
            ..Default::default()
        };
        assert_eq!(
            map.lookup(0x7f0000002010).unwrap().name,
            "py::bar:/app/y.py"
        );
        assert!(map.lookup(0x7f0000002020).is_none(), "end is exclusive");
        assert!(map.lookup(0x7f0000001008).is_none());
        assert!(map.lookup(0x10).is_none());
    }
}
