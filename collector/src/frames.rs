//! Frame names and stacks shared by every push: the same code runs on every node and in
//! every push, so most names and stacks a push decodes to were decoded before. A name is one
//! `Arc<str>` however many stacks hold it, and a stack seen before is the very allocation the
//! stores already hold (the SQLite store finds it by address, without hashing its names).
//! Process-wide and bounded: each table starts over when full.

use std::collections::HashSet;
use std::hash::Hasher;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::idmap::{IdHasher, IdMap};
use crate::store::{Frame, Stack};

/// Bytes of names held before the name table starts over.
const NAME_BYTES: usize = 64 << 20;
/// Stacks held before the stack table starts over.
const STACKS: usize = 1 << 16;

#[derive(Default)]
struct Shared {
    /// Keyed by text that agents choose, so with a seeded hasher (foldhash: a fifth of
    /// SipHash's time on frame names, and no collisions an agent can aim for).
    names: HashSet<Frame, foldhash::fast::RandomState>,
    name_bytes: usize,
    /// Stacks by [`frames_hash`]; a hash names several only when they collide.
    stacks: IdMap<u64, Vec<Stack>>,
}

static SHARED: OnceLock<Mutex<Shared>> = OnceLock::new();

fn shared() -> MutexGuard<'static, Shared> {
    // Holds only immutable Arcs, so a poisoned lock is still consistent.
    SHARED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Bytes a name costs when it is new: its text and the `Arc`'s counts.
pub fn name_cost(name: &str) -> usize {
    name.len() + 16
}

/// Bytes a new stack of `frames` frames costs: a pointer a frame and the headers.
pub fn stack_cost(frames: usize) -> usize {
    frames * std::mem::size_of::<Frame>() + 64
}

/// The shared name `name`, and whether it had to be made.
pub fn name(name: &str) -> (Frame, bool) {
    let mut s = shared();
    if let Some(f) = s.names.get(name) {
        return (f.clone(), false);
    }
    if s.name_bytes >= NAME_BYTES {
        s.names.clear();
        s.name_bytes = 0;
    }
    let f = Frame::from(name);
    s.name_bytes += name_cost(name);
    s.names.insert(f.clone());
    (f, true)
}

/// The shared stack of these frames (root first), and whether it had to be made; `fits`
/// is asked, with what a new one costs, before it is made (`None` when it may not be).
pub fn stack(frames: &[&Frame], fits: impl FnOnce(usize) -> bool) -> Option<(Stack, bool)> {
    let hash = frames_hash(frames);
    let mut s = shared();
    if let Some(found) = s.stacks.get(&hash).and_then(|same| {
        same.iter().find(|st| {
            st.len() == frames.len()
                && st
                    .iter()
                    .zip(frames)
                    .all(|(a, b)| Arc::ptr_eq(a, b) || a == *b)
        })
    }) {
        return Some((found.clone(), false));
    }
    if !fits(stack_cost(frames.len())) {
        return None;
    }
    if s.stacks.len() >= STACKS {
        s.stacks.clear();
    }
    let stack: Stack = Arc::new(frames.iter().map(|&f| f.clone()).collect());
    s.stacks.entry(hash).or_default().push(stack.clone());
    Some((stack, true))
}

/// A stack's hash from its frames' addresses, not their text: names come from [`name`], so
/// equal names are one allocation while the name table lasts (eight bytes a frame to hash
/// instead of its whole name). A frame named again after the table started over is another
/// allocation: its stacks are then made anew, which costs memory, never a wrong stack, as
/// equal stacks are still compared by text. Addresses are not an agent's to choose.
fn frames_hash(frames: &[&Frame]) -> u64 {
    let mut h = IdHasher::default();
    h.write_u64(frames.len() as u64);
    for f in frames {
        h.write_u64(Arc::as_ptr(f).cast::<u8>() as usize as u64);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same stack decoded from two pushes is one shared allocation; a different one is
    /// not; names are shared too.
    #[test]
    fn names_and_stacks_are_shared_across_pushes() {
        let names: Vec<Frame> = ["main", "frames-test-shared", "leaf"]
            .iter()
            .map(|n| name(n).0)
            .collect();
        let again = name("frames-test-shared");
        assert!(Arc::ptr_eq(&names[1], &again.0) && !again.1);
        let refs: Vec<&Frame> = names.iter().collect();
        let (a, new) = stack(&refs, |_| true).unwrap();
        assert!(new);
        let (b, new) = stack(&refs, |_| false).unwrap();
        assert!(Arc::ptr_eq(&a, &b) && !new, "a known stack costs nothing");
        let (c, _) = stack(&refs[..2], |_| true).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert!(Arc::ptr_eq(&a[1], &c[1]), "one allocation per name");
        let other = name("frames-test-other").0;
        assert!(
            stack(&[&other], |_| false).is_none(),
            "refused when it does not fit"
        );
    }
}
