//! A sample's labels: a map from label name to value, kept as a vector sorted by name. A
//! profile's label sets hold a handful of labels each, and there can be a hundred thousand
//! of them per tenant in memory: a sorted vector takes 48 bytes a label, where a `BTreeMap`
//! allocates a 544-byte node for even one. Iteration, equality, ordering, hashing and JSON
//! are those of the map it replaces (sorted by name), so stored label sets and the ids
//! derived from their JSON are unchanged.

use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Sets of at most this many labels are searched by a scan rather than a binary search.
const SCAN_LABELS: usize = 16;

#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LabelSet(Vec<(String, String)>);

impl LabelSet {
    pub fn new() -> Self {
        Self(Vec::new())
    }

    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name))
    }

    pub fn get(&self, name: &str) -> Option<&String> {
        self.position(name).map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_some()
    }

    /// The index of `name`. A set holds a handful of labels: a scan comparing lengths first
    /// (most names differ in length) costs less than a binary search's ordered string
    /// comparisons, and a query reads a label of every label set and stack it sums.
    fn position(&self, name: &str) -> Option<usize> {
        if self.0.len() <= SCAN_LABELS {
            self.0.iter().position(|(k, _)| k == name)
        } else {
            self.find(name).ok()
        }
    }

    /// Sets `name` to `value`; the value it had, if any.
    pub fn insert(&mut self, name: String, value: String) -> Option<String> {
        match self.find(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (name, value));
                None
            }
        }
    }

    pub fn remove(&mut self, name: &str) -> Option<String> {
        self.find(name).ok().map(|i| self.0.remove(i).1)
    }

    /// `(name, value)` pairs, sorted by name.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&String, &String)> + ExactSizeIterator {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Gives back the room insertions left over.
    pub fn shrink(&mut self) {
        self.0.shrink_to_fit();
    }

    /// Bytes the set occupies on the heap (its entries and strings), for memory budgets.
    pub fn heap_bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<(String, String)>()
            + self
                .0
                .iter()
                .map(|(k, v)| k.capacity() + v.capacity())
                .sum::<usize>()
    }
}

impl fmt::Debug for LabelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl std::ops::Index<&str> for LabelSet {
    type Output = String;

    /// The value of `name`; panics when the set has none (as a map's index does).
    fn index(&self, name: &str) -> &String {
        self.get(name)
            .unwrap_or_else(|| panic!("no label {name} in {self:?}"))
    }
}

impl FromIterator<(String, String)> for LabelSet {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        let mut set = LabelSet::new();
        for (k, v) in iter {
            set.insert(k, v);
        }
        set
    }
}

impl<const N: usize> From<[(String, String); N]> for LabelSet {
    fn from(pairs: [(String, String); N]) -> Self {
        pairs.into_iter().collect()
    }
}

impl<'a> IntoIterator for &'a LabelSet {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a String, &'a String),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl Serialize for LabelSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for LabelSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Pairs;
        impl<'de> Visitor<'de> for Pairs {
            type Value = LabelSet;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of label names to values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LabelSet, A::Error> {
                let mut set = LabelSet::new();
                while let Some((k, v)) = map.next_entry::<String, String>()? {
                    set.insert(k, v);
                }
                Ok(set)
            }
        }
        d.deserialize_map(Pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The same JSON, order and equality as the map it replaced.
    #[test]
    fn behaves_as_the_sorted_map() {
        let pairs = [
            ("node", "n1"),
            ("comm", "app"),
            ("pid", "7"),
            ("comm", "again"),
        ];
        let set: LabelSet = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            serde_json::to_string(&set).unwrap(),
            serde_json::to_string(&map).unwrap()
        );
        let back: LabelSet = serde_json::from_str(&serde_json::to_string(&map).unwrap()).unwrap();
        assert_eq!(back, set);
        assert_eq!(set.get("comm").map(String::as_str), Some("again"));
        assert!(set.get("nope").is_none());
        let keys: Vec<&String> = set.keys().collect();
        assert_eq!(keys, ["comm", "node", "pid"]);
        let mut smaller = set.clone();
        smaller.remove("pid");
        let smaller_map: BTreeMap<String, String> = smaller
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(
            smaller.cmp(&set),
            smaller_map.cmp(&map),
            "ordered as the map"
        );
        assert_eq!(set.len(), 3);
    }
}
