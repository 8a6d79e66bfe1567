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

/// Values by the ids a push gave them: a vector indexed by id when the ids are dense, as
/// pprof writers number them (1, 2, 3, …), else a hash map. A lookup is then an index rather
/// than a hash and a probe, which is most of naming a push's locations.
pub enum ById<V> {
    Dense(Vec<Option<V>>),
    Hashed(IdMap<u64, V>),
}

impl<V: Copy> ById<V> {
    /// A table for `count` entries whose largest id is `max_id`: dense when that costs at
    /// most about twice the entries (so memory stays bounded by the count, which the push
    /// limits checked).
    pub fn for_ids(max_id: u64, count: usize) -> Self {
        let dense_up_to = count.saturating_mul(2).saturating_add(64) as u64;
        if max_id <= dense_up_to {
            ById::Dense(vec![None; max_id as usize + 1])
        } else {
            let mut map = IdMap::default();
            map.reserve(count);
            ById::Hashed(map)
        }
    }

    /// Sets `id`'s value; a repeated id keeps the last, as a map would.
    pub fn insert(&mut self, id: u64, v: V) {
        match self {
            ById::Dense(slots) => match slots.get_mut(id as usize) {
                Some(slot) => *slot = Some(v),
                // Not reached for ids within `for_ids`'s `max_id`; kept total anyway.
                None => {
                    let mut map: IdMap<u64, V> = slots
                        .iter()
                        .enumerate()
                        .filter_map(|(i, v)| v.map(|v| (i as u64, v)))
                        .collect();
                    map.insert(id, v);
                    *self = ById::Hashed(map);
                }
            },
            ById::Hashed(map) => {
                map.insert(id, v);
            }
        }
    }

    pub fn get(&self, id: u64) -> Option<V> {
        match self {
            ById::Dense(slots) => usize::try_from(id)
                .ok()
                .and_then(|i| slots.get(i))
                .copied()
                .flatten(),
            ById::Hashed(map) => map.get(&id).copied(),
        }
    }
}

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
    use super::{ById, content_hash};

    /// Dense and sparse ids answer alike: the last value of a repeated id, none for an id
    /// never given, whatever the table's form.
    #[test]
    fn by_id_answers_alike_dense_or_hashed() {
        for ids in [vec![1u64, 2, 3, 2], vec![7, 1 << 40, 7, 3]] {
            let max = ids.iter().copied().max().unwrap();
            let mut t = ById::for_ids(max, ids.len());
            assert_eq!(matches!(t, ById::Dense(_)), max < 100);
            for (i, &id) in ids.iter().enumerate() {
                t.insert(id, i);
            }
            for &id in &ids {
                let last = ids.iter().rposition(|&x| x == id).unwrap();
                assert_eq!(t.get(id), Some(last));
            }
            assert_eq!(t.get(0), None);
            assert_eq!(t.get(5), None);
            assert_eq!(t.get(u64::MAX), None);
        }
        let mut t = ById::for_ids(3, 3);
        t.insert(1000, 'x');
        t.insert(2, 'y');
        assert_eq!(
            (t.get(1000), t.get(2), t.get(3)),
            (Some('x'), Some('y'), None)
        );
    }

    #[test]
    fn content_hash_separates_parts() {
        let h = |p: &[&str]| content_hash(p.iter().copied());
        assert_eq!(h(&["main", "work"]), h(&["main", "work"]));
        assert_ne!(h(&["ab", "c"]), h(&["a", "bc"]));
        assert_ne!(h(&["a"]), h(&["a", ""]));
        assert_ne!(h(&["abcdefgh1"]), h(&["abcdefgh2"]));
    }
}
