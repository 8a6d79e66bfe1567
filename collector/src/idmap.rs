//! A fast hasher for the collector's in-memory maps keyed by integers (row ids, content
//! hashes, addresses): summing a query's rows is most of its time, and SipHash would double
//! it.

use std::hash::{BuildHasherDefault, Hasher};

/// The multiply-rotate of rustc's FxHash, then a finalizer. Not keyed: where keys come from
/// agents (content hashes) a collision costs a comparison, never a wrong answer.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    /// Eight bytes at a time: slices of integers (a sample's location ids) hash as bytes.
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.write_u64(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        for &b in words.remainder() {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_i64(&mut self, v: i64) {
        self.write_u64(v as u64);
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }

    /// Mixed down (MurmurHash3's finalizer): a product alone carries the key's high bits
    /// only upward, and the table indexes by the low bits, so keys that differ in their high
    /// half (the label set) would all collide.
    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

pub type IdMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<IdHasher>>;
pub type IdSet<K> = std::collections::HashSet<K, BuildHasherDefault<IdHasher>>;

/// A hash of length-prefixed strings (so `["ab", "c"]` and `["a", "bc"]` differ), read eight
/// bytes at a time: the in-memory key stacks and label sets are found by, then compared.
/// Never stored, so it may change between versions.
pub fn content_hash<'a>(parts: impl Iterator<Item = &'a str>) -> u64 {
    let mut h = IdHasher::default();
    for p in parts {
        h.write_u64(p.len() as u64);
        let mut words = p.as_bytes().chunks_exact(8);
        for w in &mut words {
            h.write_u64(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            h.write_u64(u64::from_le_bytes(last));
        }
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::content_hash;

    #[test]
    fn content_hash_separates_parts() {
        let h = |p: &[&str]| content_hash(p.iter().copied());
        assert_eq!(h(&["main", "work"]), h(&["main", "work"]));
        assert_ne!(h(&["ab", "c"]), h(&["a", "bc"]));
        assert_ne!(h(&["a"]), h(&["a", ""]));
        assert_ne!(h(&["abcdefgh1"]), h(&["abcdefgh2"]));
    }
}
