//! Line numbers from a code object's line table, for the three encodings CPython 3.8–3.13 use.
//! The decoders mirror `PyCode_Addr2Line` of each version (Objects/codeobject.c), so a line is
//! the one Python itself would report for that instruction. All of them stop at the end of the
//! input: a torn or truncated table gives `None` or a wrong-but-bounded line, never a panic.

use super::offsets::LineTableKind;

/// The line of the instruction at byte offset `addr` (into the bytecode), or `None` when the
/// table says the instruction has no line (or `addr` is past the table).
pub fn line_for(kind: LineTableKind, table: &[u8], first_line: u32, addr: u32) -> Option<u32> {
    let line = match kind {
        LineTableKind::Lnotab => lnotab(table, first_line as i64, addr as i64),
        LineTableKind::Linetable310 => linetable310(table, first_line as i64, addr as i64),
        LineTableKind::Locations311 => locations311(table, first_line as i64, addr as i64),
    }?;
    u32::try_from(line).ok()
}

/// 3.8–3.9 `co_lnotab`: pairs of (address increment, signed line increment).
fn lnotab(table: &[u8], first_line: i64, addrq: i64) -> Option<i64> {
    let mut line = first_line;
    let mut addr = 0i64;
    for pair in table.chunks_exact(2) {
        addr += i64::from(pair[0]);
        if addr > addrq {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    Some(line)
}

/// 3.10 `co_linetable`: pairs of (range length in bytes, signed line delta); a delta of -128
/// means the range has no line and leaves the running line unchanged.
fn linetable310(table: &[u8], first_line: i64, addrq: i64) -> Option<i64> {
    let mut line = first_line;
    let mut end = 0i64;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += i64::from(pair[0]);
        let delta = pair[1] as i8;
        let range_line = if delta == -128 {
            None
        } else {
            line += i64::from(delta);
            Some(line)
        };
        if start <= addrq && addrq < end {
            return range_line;
        }
    }
    None
}

/// 3.11+ location table: entries start with a byte with the high bit set, holding a 4-bit code
/// and the entry's length in code units minus one; the code says how the line changes.
fn locations311(table: &[u8], first_line: i64, addrq: i64) -> Option<i64> {
    let mut line = first_line;
    let mut end = 0i64;
    let mut i = 0usize;
    while i < table.len() {
        let head = table[i];
        if head & 0x80 == 0 {
            // Not at an entry start: the table is torn.
            return None;
        }
        let code = (head >> 3) & 15;
        let start = end;
        end += (i64::from(head & 7) + 1) * 2;
        let delta = match code {
            13 | 14 => signed_varint(&table[i + 1..]),
            10..=12 => i64::from(code) - 10,
            _ => 0,
        };
        line += delta;
        if start <= addrq && addrq < end {
            return if code == 15 { None } else { Some(line) };
        }
        i += 1;
        while i < table.len() && table[i] & 0x80 == 0 {
            i += 1;
        }
    }
    None
}

fn varint(bytes: &[u8]) -> u64 {
    let mut value = 0u64;
    let mut shift = 0u32;
    for &b in bytes {
        if shift > 56 {
            break;
        }
        value |= u64::from(b & 63) << shift;
        shift += 6;
        if b & 64 == 0 {
            break;
        }
    }
    value
}

fn signed_varint(bytes: &[u8]) -> i64 {
    let v = varint(bytes);
    if v & 1 == 1 {
        -((v >> 1) as i64)
    } else {
        (v >> 1) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lnotab_pairs() {
        // def f():\n  a = 1\n  b = 2   (firstlineno 1): two statements 4 bytes each.
        let table = [0, 1, 4, 1];
        assert_eq!(line_for(LineTableKind::Lnotab, &table, 1, 0), Some(2));
        assert_eq!(line_for(LineTableKind::Lnotab, &table, 1, 2), Some(2));
        assert_eq!(line_for(LineTableKind::Lnotab, &table, 1, 4), Some(3));
        assert_eq!(line_for(LineTableKind::Lnotab, &table, 1, 400), Some(3));
        // A signed decrement (a loop's back edge).
        assert_eq!(
            line_for(LineTableKind::Lnotab, &[6, 3, 2, 0xff], 10, 8),
            Some(12)
        );
    }

    #[test]
    fn linetable_310_ranges() {
        let table = [2, 0, 4, 1, 2, 0x80, 2, 1];
        assert_eq!(line_for(LineTableKind::Linetable310, &table, 5, 0), Some(5));
        assert_eq!(line_for(LineTableKind::Linetable310, &table, 5, 3), Some(6));
        assert_eq!(line_for(LineTableKind::Linetable310, &table, 5, 6), None);
        assert_eq!(line_for(LineTableKind::Linetable310, &table, 5, 8), Some(7));
        assert_eq!(line_for(LineTableKind::Linetable310, &table, 5, 10), None);
    }

    #[test]
    fn locations_311_entries() {
        // RESUME on the def line (no columns, delta 0), one-line form +1 spanning 3 units,
        // a long form -2 with columns, a no-location entry.
        let table = [
            0x80 | (13 << 3),
            0,
            0x80 | (11 << 3) | 2,
            4,
            9,
            0x80 | (14 << 3),
            5,
            0,
            1,
            3,
            0x80 | (15 << 3),
        ];
        let at = |addr| line_for(LineTableKind::Locations311, &table, 20, addr);
        assert_eq!(at(0), Some(20));
        assert_eq!(at(2), Some(21));
        assert_eq!(at(6), Some(21));
        assert_eq!(at(8), Some(19));
        assert_eq!(at(10), None);
        assert_eq!(at(12), None);
    }

    /// The most a table of `len` bytes can move the line away from the first line: an i8
    /// delta per two bytes in the 3.8–3.10 formats; in 3.11's, an entry per byte at most,
    /// each moving it by 2 or by the signed varint in the bytes after it (under 2^(6k-1) in
    /// k of them, ten at most).
    fn max_shift(kind: LineTableKind, len: usize) -> i128 {
        match kind {
            LineTableKind::Lnotab | LineTableKind::Linetable310 => 128 * (len as i128 / 2),
            LineTableKind::Locations311 => (0..len)
                .map(|i| match (len - i - 1).min(10) as u32 {
                    0 => 2,
                    k => (1i128 << (6 * k - 1)).max(2),
                })
                .sum(),
        }
    }

    #[test]
    fn torn_tables_are_bounded() {
        // Torn tables: fixed odd cases, every prefix of the well-formed tables above, and
        // pseudo-random bytes (a fixed xorshift sequence, so a failure repeats).
        let mut tables: Vec<Vec<u8>> = vec![
            vec![],
            vec![0xff],
            vec![0x7f, 0x7f, 0x7f],
            vec![0xf0, 0xff, 0xff, 0xff],
        ];
        let good: [&[u8]; 3] = [
            &[0, 1, 4, 1],
            &[2, 0, 4, 1, 2, 0x80, 2, 1],
            &[0xe8, 0, 0xda, 4, 9, 0xf0, 5, 0, 1, 3, 0xf8],
        ];
        for t in good {
            tables.extend((0..t.len()).map(|n| t[..n].to_vec()));
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 24) as usize;
            tables.push(
                (0..len)
                    .map(|i| (x >> (i % 8 * 8)) as u8 ^ i as u8)
                    .collect(),
            );
        }
        let mut lines = 0;
        for kind in [
            LineTableKind::Lnotab,
            LineTableKind::Linetable310,
            LineTableKind::Locations311,
        ] {
            for table in &tables {
                let bound = max_shift(kind, table.len());
                for (first, addr) in [(1u32, 0u32), (1, 7), (1000, 1000), (u32::MAX, 0)] {
                    let Some(line) = line_for(kind, table, first, addr) else {
                        continue;
                    };
                    lines += 1;
                    let shift = (i128::from(line) - i128::from(first)).abs();
                    assert!(
                        shift <= bound,
                        "{kind:?} {table:02x?} at {addr}: line {line} from {first} (bound {bound})"
                    );
                }
            }
        }
        // Most lookups still give a line: the bound was checked, not skipped.
        assert!(lines > 1000, "{lines} lines");
        // An empty table leaves the first line (3.8's) or says no line (the later formats).
        assert_eq!(line_for(LineTableKind::Lnotab, &[], 7, 3), Some(7));
        assert_eq!(line_for(LineTableKind::Linetable310, &[], 7, 3), None);
        assert_eq!(line_for(LineTableKind::Locations311, &[], 7, 3), None);
        // A 3.11 table that starts inside an entry is torn: no line at all.
        assert_eq!(
            line_for(LineTableKind::Locations311, &[0x7f, 0x7f], 7, 0),
            None
        );
    }
}
