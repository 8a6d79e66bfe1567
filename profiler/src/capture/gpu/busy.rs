//! How long a device was busy: the union of its work's intervals (streams overlap, so the
//! summed time of its kernels can exceed the wall time), beside the sum. Intervals arrive out
//! of order (streams, buffers completing in any order); they are gathered, then sorted and
//! merged when [`Busy::compact`] is called or too many wait. Memory is bounded: the merged
//! intervals beyond [`CAP`] are folded into a total below a watermark, and work that arrives
//! later for time below the watermark counts only past it.

/// Intervals kept, waiting and merged, each.
pub const CAP: usize = 1 << 16;

#[derive(Debug, Clone, Default)]
pub struct Busy {
    waiting: Vec<(u64, u64)>,
    merged: Vec<(u64, u64)>,
    /// Busy ns folded away, all at or below `watermark`.
    folded: u64,
    watermark: u64,
    /// Summed ns of every interval added, overlaps and all.
    pub summed: u64,
    pub intervals: u64,
}

impl Busy {
    pub fn add(&mut self, start: u64, end: u64) {
        if end <= start {
            return;
        }
        self.summed += end - start;
        self.intervals += 1;
        let start = start.max(self.watermark);
        if end <= start {
            return;
        }
        self.waiting.push((start, end));
        if self.waiting.len() >= CAP {
            self.compact();
        }
    }

    /// Merges what waits into the sorted, disjoint intervals.
    pub fn compact(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        let mut all = std::mem::take(&mut self.merged);
        all.append(&mut self.waiting);
        all.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(all.len());
        for (s, e) in all {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        if out.len() > CAP {
            let fold = out.len() - CAP / 2;
            self.folded += out[..fold].iter().map(|(s, e)| e - s).sum::<u64>();
            self.watermark = out[fold - 1].1;
            out.drain(..fold);
        }
        self.merged = out;
    }

    /// Nanoseconds at least one interval covered.
    pub fn busy(&mut self) -> u64 {
        self.compact();
        self.folded + self.merged.iter().map(|(s, e)| e - s).sum::<u64>()
    }

    /// The busy time within [from, to).
    #[cfg(test)]
    pub fn busy_within(&mut self, from: u64, to: u64) -> u64 {
        self.compact();
        self.merged
            .iter()
            .map(|&(s, e)| e.min(to).saturating_sub(s.max(from)))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps_count_once_and_gaps_not_at_all() {
        let mut b = Busy::default();
        // Two streams: [0,100) and [50,150) overlap; [200,250) after a gap.
        b.add(50, 150);
        b.add(200, 250);
        b.add(0, 100);
        assert_eq!(b.busy(), 200);
        assert_eq!(b.summed, 250);
        assert_eq!(b.busy_within(90, 210), 70);
        // Touching intervals join.
        b.add(250, 260);
        assert_eq!(b.busy(), 210);
        // Empty and reversed ones are ignored.
        b.add(5, 5);
        b.add(9, 3);
        assert_eq!(b.busy(), 210);
        assert_eq!(b.intervals, 4);
    }

    #[test]
    fn many_disjoint_intervals_stay_bounded_and_exact() {
        let mut b = Busy::default();
        let n = 330_000u64; // five times CAP, and more
        // Shuffled within windows of 1000, as buffers complete out of order.
        for w in 0..n / 1000 {
            for i in (0..1000).rev() {
                let k = w * 1000 + i;
                b.add(k * 10, k * 10 + 4);
            }
        }
        assert_eq!(b.busy(), n * 4);
        assert!(b.merged.len() <= CAP);
        assert!(b.waiting.capacity() <= 2 * CAP);
    }

    #[test]
    fn random_intervals_match_a_brute_force_union() {
        let mut x = 12345u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut b = Busy::default();
        let mut covered = vec![false; 10_000];
        for _ in 0..2000 {
            let s = next() % 9_900;
            let e = s + 1 + next() % 100;
            b.add(s, e);
            for c in &mut covered[s as usize..e as usize] {
                *c = true;
            }
        }
        assert_eq!(b.busy(), covered.iter().filter(|&&c| c).count() as u64);
    }
}
