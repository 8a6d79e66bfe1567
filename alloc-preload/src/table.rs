//! The addresses of sampled blocks still allocated: a fixed open-addressing table of atomics,
//! so a `free` can tell in a few nanoseconds, without a lock (fork and signal handlers can
//! interrupt any thread anywhere), whether its block was sampled and the kernel must hear of
//! it. Full chains drop the insertion; the caller counts the drop.

use core::sync::atomic::{AtomicUsize, Ordering};

/// Slots (a power of two): 512 KiB of address space, touched only where sampled blocks hash.
/// At the default rate a process holds one sampled block per 512 KiB in use, so the table
/// covers tens of GiB in use before chains fill.
pub const SLOTS: usize = 1 << 16;
/// Slots a lookup or insertion probes before giving up.
const MAX_PROBES: usize = 32;
const EMPTY: usize = 0;
/// A removed entry: lookups continue past it, insertions reuse it.
const TOMBSTONE: usize = 1;

pub struct Table {
    slots: [AtomicUsize; SLOTS],
    /// Entries present: frees skip the lookup while it is 0.
    live: AtomicUsize,
}

impl Table {
    pub const fn new() -> Self {
        Self {
            slots: [const { AtomicUsize::new(EMPTY) }; SLOTS],
            live: AtomicUsize::new(0),
        }
    }

    #[inline(always)]
    fn start(addr: usize) -> usize {
        // Blocks are 16-byte aligned: the low bits carry nothing.
        ((addr as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SLOTS.trailing_zeros()))
            as usize
    }

    /// Remembers `addr` (not 0 or 1); false when its chain is full.
    pub fn insert(&self, addr: usize) -> bool {
        if addr <= TOMBSTONE {
            return false;
        }
        let start = Self::start(addr);
        for i in 0..MAX_PROBES {
            let slot = &self.slots[(start + i) & (SLOTS - 1)];
            let cur = slot.load(Ordering::Relaxed);
            if (cur == EMPTY || cur == TOMBSTONE)
                && slot
                    .compare_exchange(cur, addr, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                self.live.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    /// Forgets `addr`; true when it was there.
    #[inline(always)]
    pub fn remove(&self, addr: usize) -> bool {
        if self.live.load(Ordering::Relaxed) == 0 || addr <= TOMBSTONE {
            return false;
        }
        self.remove_slow(addr)
    }

    #[inline(never)]
    fn remove_slow(&self, addr: usize) -> bool {
        let start = Self::start(addr);
        for i in 0..MAX_PROBES {
            let slot = &self.slots[(start + i) & (SLOTS - 1)];
            let cur = slot.load(Ordering::Acquire);
            if cur == EMPTY {
                return false;
            }
            if cur == addr {
                if slot
                    .compare_exchange(addr, TOMBSTONE, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    self.live.fetch_sub(1, Ordering::Relaxed);
                    return true;
                }
                return false;
            }
        }
        false
    }

    /// Entries present.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for Table {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_and_reuse() {
        let t = Box::new(Table::new());
        assert!(!t.remove(0x1000), "empty");
        assert!(t.insert(0x1000));
        assert!(t.insert(0x2000));
        assert_eq!(t.len(), 2);
        assert!(t.remove(0x1000));
        assert!(!t.remove(0x1000), "removed once");
        assert!(t.remove(0x2000));
        assert_eq!(t.len(), 0);
        assert!(!t.insert(0) && !t.insert(1), "reserved values");
    }

    #[test]
    fn a_full_chain_refuses_and_lookups_stay_bounded() {
        let t = Box::new(Table::new());
        // Addresses that all hash to one slot: multiples of 16 << (64 - 16) collide after
        // the multiply only by construction, so find colliding ones by search.
        let target = Table::start(0x10);
        let colliding: Vec<usize> = (1..)
            .map(|i| i * 16)
            .filter(|&a| Table::start(a) == target)
            .take(MAX_PROBES + 1)
            .collect();
        // Filling the chain from one start slot: each lands within MAX_PROBES slots.
        let mut inserted = 0;
        for &a in &colliding {
            if t.insert(a) {
                inserted += 1;
            }
        }
        assert_eq!(inserted, MAX_PROBES, "the chain holds MAX_PROBES entries");
        assert!(
            !t.remove(*colliding.last().unwrap()),
            "the refused one is absent"
        );
        for &a in &colliding[..MAX_PROBES] {
            assert!(t.remove(a));
        }
        // Tombstones are reused.
        assert!(t.insert(colliding[0]));
    }
}
