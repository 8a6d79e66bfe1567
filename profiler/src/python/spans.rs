//! Finding a process's OpenTelemetry span table: the memory the `pyrometer-otel` span
//! processor (python/pyrometer-otel) publishes each thread's active span in, for the kernel
//! to read at sample time (`ebpf/src/bpf/spans.h`).
//!
//! The package maps the table at a fixed address where it can, and the kernel program takes it
//! from there by itself (`span_probe` in spans.h); this finds the others. The package maps the
//! table from a memfd named [`MEMFD_NAME`], so the process's memory map
//! shows where it lies without any symbol lookup; its header says what it is, and is checked
//! before the kernel is told the address. A forked child shares its parent's table (slots are
//! per thread id, and thread ids are unique in a pid namespace), so it needs nothing of its
//! own. Slots are indexed by the id a thread has in its own pid namespace (gettid there),
//! which the kernel side reads from the task too, so processes in containers are covered.

use std::path::Path;

use super::memory::Memory;

/// The memfd name the package gives its table (`/memfd:NAME (deleted)` in the maps).
pub const MEMFD_NAME: &str = "pyrometer-otel-spans";
/// The header's first eight bytes.
pub const MAGIC: &[u8; 8] = b"PYROSPAN";
/// The layout version this agent reads.
pub const VERSION: u32 = 1;
/// Bytes of a slot (`struct span_slot`).
pub const SLOT_SIZE: u32 = 128;
/// Most slots a table may have.
const MAX_SLOTS: u32 = 1 << 20;

/// Where a process's slots lie, as the kernel's `py_procs` entry needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanTable {
    /// Run-time address of slot 0.
    pub slots: u64,
    /// Slot count less one.
    pub mask: u32,
}

/// The table mapped in `pid`, when there is one and its header checks out.
pub fn find(proc_root: &Path, pid: u32, mem: &dyn Memory) -> Option<SpanTable> {
    let maps = proc_root.join(pid.to_string()).join("maps");
    let mut start = None;
    crate::os::proctext::for_each_line(&maps, crate::os::proctext::MAPS_LINES, |line| {
        start = start.or_else(|| mapping_start(line));
    })
    .ok()?;
    let start = start?;
    let mut header = [0u8; 24];
    mem.read(start, &mut header).ok()?;
    parse_header(start, &header)
}

/// The start of the table's mapping in the text of `/proc/PID/maps`.
fn mapping_start(maps: &str) -> Option<u64> {
    let want = format!("/memfd:{MEMFD_NAME}");
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let range = fields.next()?;
        let path = fields.nth(4)?;
        if path != want {
            return None;
        }
        u64::from_str_radix(range.split('-').next()?, 16).ok()
    })
}

/// Header: magic, version (u32), slot count (u32), slot size (u32), header size (u32).
fn parse_header(start: u64, h: &[u8; 24]) -> Option<SpanTable> {
    let word = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
    let (version, count, slot_size, header_size) = (word(8), word(12), word(16), word(20));
    let sane = &h[..8] == MAGIC
        && version == VERSION
        && count.is_power_of_two()
        && count <= MAX_SLOTS
        && slot_size == SLOT_SIZE
        && header_size >= 24
        && header_size % 8 == 0;
    sane.then(|| SpanTable {
        slots: start + u64::from(header_size),
        mask: count - 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(version: u32, count: u32) -> [u8; 24] {
        let mut h = [0u8; 24];
        h[..8].copy_from_slice(MAGIC);
        for (i, v) in [version, count, SLOT_SIZE, 64].into_iter().enumerate() {
            h[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        h
    }

    #[test]
    fn the_table_is_found_by_its_memfd_name() {
        let maps = "55d0c0000000-55d0c0001000 r--p 00000000 08:01 12 /usr/bin/python3.11\n\
                    7f0000000000-7f0000080000 rw-s 00000000 00:01 77 /memfd:pyrometer-otel-spans (deleted)\n";
        assert_eq!(mapping_start(maps), Some(0x7f00_0000_0000));
        assert_eq!(
            mapping_start("7f00-7f01 rw-s 0 00:01 7 /memfd:other (deleted)\n"),
            None
        );
    }

    #[test]
    fn only_a_header_that_checks_out_is_taken() {
        assert_eq!(
            parse_header(0x1000, &header(VERSION, 8192)),
            Some(SpanTable {
                slots: 0x1040,
                mask: 8191
            })
        );
        assert_eq!(parse_header(0x1000, &header(VERSION + 1, 8192)), None);
        assert_eq!(parse_header(0x1000, &header(VERSION, 3000)), None);
        let mut bad = header(VERSION, 8192);
        bad[0] = b'X';
        assert_eq!(parse_header(0x1000, &bad), None);
    }
}
