//! Allocation accounting: sampled allocations weighted into unbiased totals by stack
//! (`alloc_objects`, `alloc_space`), and the sampled blocks still allocated (`inuse_objects`,
//! `inuse_space`), matched with the free records the kernel sends for them.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Capture, RawStack};

/// A sampled block not freed yet.
#[derive(Debug, Clone)]
pub struct LiveBlock {
    pub stack: Arc<RawStack>,
    pub size: u64,
    /// How many allocations (and `size`-byte blocks) it stands for.
    pub weight: f64,
    pub timestamp_ns: u64,
}

/// The allocation state of a capture. A daemon hands `live` to the next interval's capture,
/// so a block allocated in one push and freed in a later one is matched.
#[derive(Debug, Default)]
pub struct AllocState {
    /// Mean bytes between samples (1: every allocation).
    pub mean: u64,
    /// Processes whose preloaded sampler library uses another mean than `mean`.
    pub means: HashMap<u32, u64>,
    /// (pid, address) of sampled blocks still allocated.
    pub live: HashMap<(u32, u64), LiveBlock>,
    /// Sampled allocations and frees read.
    pub samples: u64,
    pub frees: u64,
    /// Resizes of sampled blocks read (their entries moved).
    pub moves: u64,
    /// Estimated allocations and bytes allocated.
    pub objects: f64,
    pub bytes: f64,
    /// Blocks count as in use when at least this old at `now_ns` (`--leaks --min-age`).
    pub min_age_ns: u64,
    /// When in-use is judged (the end of the recording or of the push interval); 0: now.
    pub now_ns: u64,
    /// Estimated allocations and bytes by stack id.
    sums: HashMap<u32, (f64, f64)>,
    /// Shared copies of stacks that have live blocks.
    stacks: HashMap<u32, Arc<RawStack>>,
}

/// Live blocks remembered at most (beyond, the oldest half is dropped and counted): the
/// kernel's table bounds what it reports, this bounds what a long-running agent keeps.
pub const MAX_LIVE_BLOCKS: usize = 1 << 22;

impl AllocState {
    pub fn new(mean: u64) -> Self {
        Self {
            mean: mean.max(1),
            ..Self::default()
        }
    }

    /// Drops the blocks (and means) of processes that are gone: their memory went with them.
    pub fn forget_exited(&mut self, proc_root: &std::path::Path) {
        let mut alive: HashMap<u32, bool> = HashMap::new();
        let mut is_alive = |pid: u32| {
            *alive
                .entry(pid)
                .or_insert_with(|| crate::os::pids::alive(proc_root, pid))
        };
        self.live.retain(|&(pid, _), _| is_alive(pid));
        self.means.retain(|&pid, _| is_alive(pid));
    }

    /// Estimated (objects, bytes) allocated in a stack.
    pub(super) fn sums(&self, id: u32) -> (f64, f64) {
        self.sums.get(&id).copied().unwrap_or((0.0, 0.0))
    }

    /// In-use (objects, bytes) by stack, of blocks at least `min_age_ns` old at `now_ns`.
    pub fn in_use(&self, now_ns: u64) -> Vec<(Arc<RawStack>, f64, f64)> {
        let mut by_stack: HashMap<*const RawStack, (Arc<RawStack>, f64, f64)> = HashMap::new();
        for b in self.live.values() {
            if now_ns.saturating_sub(b.timestamp_ns) < self.min_age_ns {
                continue;
            }
            let e = by_stack
                .entry(Arc::as_ptr(&b.stack))
                .or_insert_with(|| (b.stack.clone(), 0.0, 0.0));
            e.1 += b.weight;
            e.2 += b.weight * b.size as f64;
        }
        by_stack.into_values().collect()
    }
}

impl Capture {
    /// Counts one sampled allocation of `size` bytes at `addr` in stack `key`.
    #[cfg(test)]
    pub fn count_alloc(&mut self, key: RawStack, size: u64, addr: u64, timestamp_ns: u64) {
        self.count_sampled(key, size, Some(addr), timestamp_ns);
    }

    /// Counts one sampled allocation; `addr` None: not tracked for its free (a table was
    /// full), so it counts as allocated and never as in use.
    pub fn count_sampled(
        &mut self,
        key: RawStack,
        size: u64,
        addr: Option<u64>,
        timestamp_ns: u64,
    ) {
        if self.alloc.is_none() {
            return;
        }
        let pid = key.pid;
        // The stack is copied only the first time it is seen, not for every sample.
        let id = match self.stacks.get(&key) {
            Some(c) => c.id,
            None => self.entry(key.clone()).id,
        };
        let Some(a) = self.alloc.as_mut() else { return };
        let mean = a.means.get(&pid).copied().unwrap_or(a.mean);
        let w = crate::alloc::weight(size, mean);
        let sums = a.sums.entry(id).or_insert((0.0, 0.0));
        sums.0 += w;
        sums.1 += w * size as f64;
        a.objects += w;
        a.bytes += w * size as f64;
        a.samples += 1;
        let Some(addr) = addr else { return };
        let stack = a.stacks.entry(id).or_insert_with(|| Arc::new(key)).clone();
        if a.live.len() >= MAX_LIVE_BLOCKS {
            let mut ages: Vec<u64> = a.live.values().map(|b| b.timestamp_ns).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            a.live.retain(|_, b| b.timestamp_ns > cut);
            self.alloc_live_dropped += 1;
        }
        a.live.insert(
            (pid, addr),
            LiveBlock {
                stack,
                size,
                weight: w,
                timestamp_ns,
            },
        );
    }

    /// A sampled block was freed.
    pub fn count_free(&mut self, pid: u32, addr: u64) {
        if let Some(a) = self.alloc.as_mut() {
            a.frees += 1;
            a.live.remove(&(pid, addr));
        }
    }

    /// A sampled block was resized: it stays in use under the stack, time and weight of
    /// the allocation that made it, at its new address and size (the resize itself, when
    /// the countdown sampled it, came as an untracked allocation).
    pub fn count_move(&mut self, pid: u32, from: u64, to: u64, size: u64) {
        if let Some(a) = self.alloc.as_mut() {
            a.moves += 1;
            if let Some(mut block) = a.live.remove(&(pid, from)) {
                block.size = size;
                a.live.insert((pid, to), block);
            }
        }
    }

    /// A process exec'd a new image: its old blocks are gone with the old image (and its
    /// sampler library's mean, read from the environment, may change).
    pub fn forget_allocations(&mut self, pid: u32) {
        if let Some(a) = self.alloc.as_mut() {
            a.live.retain(|&(p, _), _| p != pid);
            a.means.remove(&pid);
        }
    }

    /// A report from `pid`'s preloaded sampler library: the weights use the mean its
    /// environment gave it (read once).
    pub(super) fn note_preload_mean(&mut self, pid: u32, proc_root: &std::path::Path) {
        if let Some(a) = self.alloc.as_mut()
            && !a.means.contains_key(&pid)
        {
            let mean = crate::alloc::preload::mean_of(proc_root, pid).unwrap_or(a.mean);
            a.means.insert(pid, mean.max(1));
        }
    }

    /// Adds the in-use blocks to the stacks they were allocated in (stacks of blocks from
    /// an earlier interval are added to this capture), returning in-use (objects, bytes) by
    /// stack id.
    pub(super) fn in_use_by_id(&mut self) -> HashMap<u32, (f64, f64)> {
        let Some(a) = self.alloc.as_ref() else {
            return HashMap::new();
        };
        let now = if a.now_ns == 0 {
            crate::os::clock::monotonic_now_ns()
        } else {
            a.now_ns
        };
        let blocks = a.in_use(now);
        let mut out = HashMap::new();
        for (stack, objects, bytes) in blocks {
            let id = self.entry((*stack).clone()).id;
            let e = out.entry(id).or_insert((0.0, 0.0));
            e.0 += objects;
            e.1 += bytes;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Profile;
    use crate::os::procs::ProcessRegistry;
    use crate::symbolize::Symbolizer;

    fn stack(tid: u32) -> RawStack {
        RawStack {
            pid: 4_000_000,
            tid,
            thread: format!("t{tid}"),
            thread_named: true,
            user: Vec::new(),
            kernel: vec![0xffff_ffff_8100_0000 + u64::from(tid)],
            ray: None,
            span: None,
            python: Vec::new(),
            complete: false,
            gc_generation: None,
        }
    }

    fn value(p: &Profile, name: &str) -> i64 {
        p.total(p.type_index(name).unwrap())
    }

    #[test]
    fn rate_one_is_exact_and_frees_leave_in_use() {
        let mut c = Capture {
            alloc: Some(AllocState::new(1)),
            ..Capture::default()
        };
        c.count_alloc(stack(1), 100, 0x1000, 10);
        c.count_alloc(stack(1), 50, 0x2000, 20);
        c.count_alloc(stack(2), 7, 0x3000, 30);
        c.count_free(4_000_000, 0x1000);
        // A free of an address never sampled changes nothing.
        c.count_free(4_000_000, 0x9999);
        let p = c.into_profile(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        assert_eq!(value(&p, "alloc_objects"), 3);
        assert_eq!(value(&p, "alloc_space"), 157);
        assert_eq!(value(&p, "inuse_objects"), 2);
        assert_eq!(value(&p, "inuse_space"), 57);
        assert_eq!(value(&p, "samples"), 0, "allocations are not CPU samples");
    }

    #[test]
    fn a_resized_block_stays_in_use_under_its_allocation() {
        let mut c = Capture {
            alloc: Some(AllocState::new(4096)),
            ..Capture::default()
        };
        c.count_alloc(stack(1), 1024, 0x1000, 10);
        c.count_alloc(stack(2), 1024, 0x2000, 20);
        // 0x1000 grows to 8 KiB at 0x5000; 0x2000 grows in place, then is freed.
        c.count_move(4_000_000, 0x1000, 0x5000, 8192);
        c.count_move(4_000_000, 0x2000, 0x2000, 4096);
        c.count_free(4_000_000, 0x2000);
        // A move of a block never seen (sampled before the recording) changes nothing.
        c.count_move(4_000_000, 0x9000, 0xa000, 64);
        let a = c.alloc.as_ref().unwrap();
        assert_eq!(a.moves, 3);
        let live: Vec<_> = a.live.iter().collect();
        assert_eq!(live.len(), 1);
        let (&(_, addr), block) = live[0];
        assert_eq!((addr, block.size, block.timestamp_ns), (0x5000, 8192, 10));
        assert_eq!(block.stack.tid, 1, "the allocating stack");
        let w = crate::alloc::weight(1024, 4096);
        assert!(
            (block.weight - w).abs() < 1e-9,
            "the weight of the 1 KiB allocation that was sampled"
        );
        let used = a.in_use(100);
        assert!(
            (used[0].2 - w * 8192.0).abs() < 1e-6,
            "in use at the new size"
        );
        // Allocated: the two 1 KiB blocks only (the moves are no allocations).
        assert!((a.bytes - 2.0 * w * 1024.0).abs() < 1e-6);
    }

    #[test]
    fn min_age_keeps_only_old_blocks() {
        let mut a = AllocState::new(1);
        a.min_age_ns = 100;
        let s = Arc::new(stack(1));
        for (addr, ts) in [(1u64, 0u64), (2, 50), (3, 150)] {
            a.live.insert(
                (1, addr),
                LiveBlock {
                    stack: s.clone(),
                    size: 10,
                    weight: 1.0,
                    timestamp_ns: ts,
                },
            );
        }
        let used = a.in_use(200);
        assert_eq!(used.len(), 1);
        assert_eq!((used[0].1, used[0].2), (2.0, 20.0), "blocks from 0 and 50");
    }

    #[test]
    fn sampled_weights_estimate_totals() {
        let mut c = Capture {
            alloc: Some(AllocState::new(512 * 1024)),
            ..Capture::default()
        };
        // One sampled 1 KiB block stands for ~512.5 blocks and ~512.5 KiB.
        c.count_alloc(stack(1), 1024, 0x1000, 1);
        let a = c.alloc.as_ref().unwrap();
        assert!((a.objects - 512.5).abs() < 0.1, "{}", a.objects);
        assert!((a.bytes - 512.5 * 1024.0).abs() < 100.0, "{}", a.bytes);
    }

    #[test]
    fn blocks_of_exited_processes_are_forgotten() {
        let mut a = AllocState::new(1);
        let s = Arc::new(stack(1));
        let block = |ts| LiveBlock {
            stack: s.clone(),
            size: 10,
            weight: 1.0,
            timestamp_ns: ts,
        };
        let me = std::process::id();
        // No process has pid 4_000_000 (above the kernel's pid limit).
        a.live.insert((me, 1), block(1));
        a.live.insert((4_000_000, 2), block(2));
        a.means.insert(4_000_000, 64);
        a.forget_exited(std::path::Path::new("/proc"));
        assert_eq!(a.live.keys().copied().collect::<Vec<_>>(), vec![(me, 1)]);
        assert!(a.means.is_empty());
    }

    #[test]
    fn a_process_mean_and_untracked_blocks() {
        let mut state = AllocState::new(512 * 1024);
        state.means.insert(4_000_000, 1);
        let mut c = Capture {
            alloc: Some(state),
            ..Capture::default()
        };
        // Every allocation of that process is sampled: weight 1, not 512.
        c.count_alloc(stack(1), 1024, 0x1000, 1);
        c.count_sampled(stack(1), 1024, None, 2);
        let a = c.alloc.as_ref().unwrap();
        assert_eq!((a.objects, a.bytes), (2.0, 2048.0));
        assert_eq!(a.live.len(), 1, "the untracked block is not in use");
    }
}
