//! Ids derived from content (XXH64, a fixed and documented algorithm, so every collector
//! version computes the same id for the same label set or stack). Type ids are never 0: 0
//! marks a batch's marker row.

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use twox_hash::XxHash64;

use crate::store::LabelSet;

fn hash(parts: &[&[u8]], domain: u64) -> u64 {
    let mut h = XxHash64::with_seed(domain);
    for p in parts {
        // Length-prefixed, so ["ab", "c"] and ["a", "bc"] differ.
        h.write(&(p.len() as u64).to_le_bytes());
        h.write(p);
    }
    h.finish()
}

pub fn sample_type(name: &str, unit: &str) -> u64 {
    hash(&[name.as_bytes(), unit.as_bytes()], 1).max(1)
}

/// The label set as stored: JSON of the sorted map.
pub fn labelset_json(labels: &LabelSet) -> String {
    serde_json::to_string(labels).expect("string maps serialize")
}

pub fn labelset(labels: &LabelSet) -> u64 {
    hash(&[labelset_json(labels).as_bytes()], 2)
}

pub fn stack<S: AsRef<str>>(frames: &[S]) -> u64 {
    let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref().as_bytes()).collect();
    hash(&parts, 3)
}

pub fn agent(agent_id: &str) -> u64 {
    hash(&[agent_id.as_bytes()], 4)
}

/// An id for one insert attempt, unique across collectors and restarts: the batch's identity
/// mixed with this process, the clock and a counter.
pub fn attempt(agent_id: &str, sequence: u64) -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    hash(
        &[
            agent_id.as_bytes(),
            &sequence.to_le_bytes(),
            &u64::from(std::process::id()).to_le_bytes(),
            &nanos.to_le_bytes(),
            &COUNTER.fetch_add(1, Relaxed).to_le_bytes(),
            &std::ptr::addr_of!(COUNTER).addr().to_le_bytes(),
        ],
        5,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_and_distinct() {
        // Fixed values: a change here would split every existing store's interned ids.
        assert_eq!(stack(&["main", "work"]), 10_244_108_195_424_332_422);
        assert_eq!(
            labelset(&[("node".to_string(), "n1".to_string())].into()),
            16_445_260_116_991_757_796
        );
        assert_eq!(stack(&["main", "work"]), stack(&["main", "work"]));
        assert_ne!(stack(&["ab", "c"]), stack(&["a", "bc"]));
        assert_ne!(sample_type("cpu", "nanoseconds"), 0);
        assert_ne!(attempt("a", 1), attempt("a", 1));
    }
}
