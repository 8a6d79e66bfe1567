//! The encoding of one stored chunk: a batch's (or a compacted bucket's) values of one sample
//! type, grouped by label set so a query skips the groups of label sets it does not want
//! without reading their entries:
//!
//! ```text
//! chunk  = group*
//! group  = labelset:varint  byte_length:varint  entry*
//! entry  = stack:varint  value:zigzag-varint
//! ```

#[derive(Debug, thiserror::Error)]
#[error("corrupt chunk: {0}")]
pub struct Corrupt(pub(super) &'static str);

fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get(data: &[u8], at: &mut usize) -> Result<u64, Corrupt> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *data.get(*at).ok_or(Corrupt("truncated varint"))?;
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(Corrupt("varint too long"))
}

/// Encodes `(label set, stack, value)` entries sorted by label set (and, for a compact
/// chunk, by stack): one group per run of equal label sets.
pub fn encode(sorted: &[(i64, i64, i64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(sorted.len() * 6);
    let mut entries = Vec::new();
    for group in sorted.chunk_by(|a, b| a.0 == b.0) {
        entries.clear();
        for &(_, stack, value) in group {
            put(&mut entries, stack as u64);
            put(&mut entries, ((value << 1) ^ (value >> 63)) as u64);
        }
        put(&mut out, group[0].0 as u64);
        put(&mut out, entries.len() as u64);
        out.extend_from_slice(&entries);
    }
    out
}

/// Calls `f(labelset, entries)` for each group; `entries` are read with [`each_entry`].
pub fn each_group<'a>(
    data: &'a [u8],
    mut f: impl FnMut(i64, &'a [u8]) -> Result<(), Corrupt>,
) -> Result<(), Corrupt> {
    let mut at = 0;
    while at < data.len() {
        let labelset = get(data, &mut at)? as i64;
        let len = usize::try_from(get(data, &mut at)?).map_err(|_| Corrupt("length"))?;
        let end = at.checked_add(len).filter(|&e| e <= data.len());
        let end = end.ok_or(Corrupt("group longer than the chunk"))?;
        f(labelset, &data[at..end])?;
        at = end;
    }
    Ok(())
}

pub fn each_entry(entries: &[u8], mut f: impl FnMut(i64, i64)) -> Result<(), Corrupt> {
    let mut at = 0;
    while at < entries.len() {
        let stack = get(entries, &mut at)? as i64;
        let z = get(entries, &mut at)?;
        f(stack, ((z >> 1) as i64) ^ -((z & 1) as i64));
    }
    Ok(())
}

pub use crate::idmap::{IdMap, IdSet};

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn round_trip_and_corruption() {
        let mut groups = BTreeMap::new();
        groups.insert(3, BTreeMap::from([(1, 5), (70_000, -2)]));
        groups.insert(1 << 40, BTreeMap::from([(2, i64::MAX)]));
        let flat: Vec<(i64, i64, i64)> = groups
            .iter()
            .flat_map(|(&l, stacks)| stacks.iter().map(move |(&s, &v)| (l, s, v)))
            .collect();
        let data = encode(&flat);
        let mut back: BTreeMap<i64, BTreeMap<i64, i64>> = BTreeMap::new();
        each_group(&data, |l, entries| {
            each_entry(entries, |s, v| {
                back.entry(l).or_default().insert(s, v);
            })
        })
        .unwrap();
        assert_eq!(back, groups);
        for cut in 0..data.len() {
            let _ = each_group(&data[..cut], |_, e| each_entry(e, |_, _| {}));
        }
        assert!(each_group(&[0x05, 0x7f], |_, _| Ok(())).is_err());
    }
}
