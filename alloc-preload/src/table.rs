//! The addresses of sampled blocks still allocated: a fixed open-addressing table of atomics,
//! so a `free` can tell in a few nanoseconds, without a lock (fork and signal handlers can
//! interrupt any thread anywhere), whether its block was sampled and the kernel must hear of
//! it. Full chains drop the insertion; the caller counts the drop.
//!
//! Nearly every free is of an unsampled block, and a program with memory in use nearly always
//! has some sampled blocks live, so the table's slot for the address — a random line of
//! 512 KiB, evicted from the caches by the program's own data — would be read on every free.
//! A 4 KiB counting filter in front of it (entries per hash bucket, a byte each) answers
//! "certainly not sampled" from one line that stays cached: with n sampled blocks live, a free
//! reads the table about n/4096 of the time.

use core::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// Slots (a power of two): 512 KiB of address space, touched only where sampled blocks hash.
/// At the default rate a process holds one sampled block per 512 KiB in use, so the table
/// covers tens of GiB in use before chains fill.
pub const SLOTS: usize = 1 << 16;
/// Slots a lookup or insertion probes before giving up.
const MAX_PROBES: usize = 32;
const EMPTY: usize = 0;
/// A removed entry: lookups continue past it, insertions reuse it.
const TOMBSTONE: usize = 1;
/// Filter buckets (a power of two), one byte each.
const BUCKETS: usize = 1 << 12;
/// A bucket this full stays so (never decremented): its addresses always read the table.
const STUCK: u8 = u8::MAX;

pub struct Table {
    slots: [AtomicUsize; SLOTS],
    /// Entries present.
    live: AtomicUsize,
    /// Entries whose address falls in each bucket (saturating at [`STUCK`]): 0 means none.
    /// A bucket is raised before its entry goes in and lowered after it left, so it never
    /// reads 0 while one of its addresses is in the table.
    filter: [AtomicU8; BUCKETS],
}

impl Table {
    pub const fn new() -> Self {
        Self {
            slots: [const { AtomicUsize::new(EMPTY) }; SLOTS],
            live: AtomicUsize::new(0),
            filter: [const { AtomicU8::new(0) }; BUCKETS],
        }
    }

    #[inline(always)]
    fn bucket(&self, addr: usize) -> &AtomicU8 {
        // The hash's low bits (the table uses the high ones), after dropping the alignment.
        let h = (addr as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20;
        &self.filter[h as usize & (BUCKETS - 1)]
    }

    fn raise(&self, addr: usize) {
        let b = self.bucket(addr);
        let _ = b.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
            (n < STUCK).then(|| n + 1)
        });
    }

    fn lower(&self, addr: usize) {
        let b = self.bucket(addr);
        let _ = b.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
            (n > 0 && n < STUCK).then(|| n - 1)
        });
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
        self.raise(addr);
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
        self.lower(addr);
        false
    }

    /// False when `addr` is certainly not in the table (its filter bucket is empty): one byte
    /// of a line that stays cached.
    #[inline(always)]
    pub fn may_contain(&self, addr: usize) -> bool {
        self.bucket(addr).load(Ordering::Relaxed) != 0 && addr > TOMBSTONE
    }

    /// Forgets `addr`; true when it was there.
    #[inline(always)]
    pub fn remove(&self, addr: usize) -> bool {
        // A block being freed was handed to this thread after its insertion finished (the
        // program's own synchronisation), so a relaxed load sees its bucket raised.
        if !self.may_contain(addr) {
            return false;
        }
        self.remove_slow(addr)
    }

    /// Whether `addr` is in the table.
    pub fn contains(&self, addr: usize) -> bool {
        if !self.may_contain(addr) {
            return false;
        }
        let start = Self::start(addr);
        for i in 0..MAX_PROBES {
            match self.slots[(start + i) & (SLOTS - 1)].load(Ordering::Acquire) {
                EMPTY => return false,
                cur if cur == addr => return true,
                _ => {}
            }
        }
        false
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
                    self.lower(addr);
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

    #[test]
    fn the_filter_follows_the_entries() {
        let t = Box::new(Table::new());
        assert!(t.insert(0x1000) && t.contains(0x1000));
        assert_eq!(t.bucket(0x1000).load(Ordering::Relaxed), 1);
        assert!(!t.contains(0x2000) && !t.remove(0x2000));
        assert!(t.remove(0x1000) && !t.contains(0x1000));
        assert!(
            t.filter.iter().all(|b| b.load(Ordering::Relaxed) == 0),
            "an emptied table leaves every bucket at 0: frees skip it"
        );
        // Addresses sharing one bucket: it counts them, and saturates rather than wraps.
        let target = t.bucket(0x10) as *const AtomicU8;
        let same: Vec<usize> = (1..)
            .map(|i| i * 16)
            .filter(|&a| core::ptr::eq(t.bucket(a), target))
            .take(300)
            .collect();
        for &a in &same[..2] {
            assert!(t.insert(a));
        }
        assert!(t.remove(same[0]));
        assert!(t.contains(same[1]), "its bucket still counts it");
        assert!(t.remove(same[1]));
        let mut inserted = Vec::new();
        for &a in &same {
            if t.insert(a) {
                inserted.push(a);
            }
        }
        assert!(inserted.len() > usize::from(STUCK), "{}", inserted.len());
        assert_eq!(t.bucket(same[0]).load(Ordering::Relaxed), STUCK);
        for &a in &inserted {
            assert!(t.remove(a), "a stuck bucket still finds its entries");
        }
    }
}
