//! How much table building the unwinder may do, node-wide. A new process whose binaries'
//! tables are cached is registered at once; only a binary seen for the first time costs
//! anything (a large program's `.eh_frame` is tens to hundreds of ms of CPU). Every build is
//! paid from a bucket of CPU time that refills at a fixed rate. A small binary (its estimated
//! cost, from the length of its executable mapping, under [`SMALL_NS`]) is built at once
//! whatever the bucket holds: there are few of them, each built once, and waiting would cost
//! its process's stacks more than the build costs the node. A large one is built only while
//! the bucket is not empty; meanwhile its process unwinds those mappings by frame pointers and
//! waits in a queue, oldest first. A build may overdraw the bucket (a table is built whole or
//! not at all); the debt is repaid before the next large one. So the CPU spent on large
//! tables is bounded by the rate however many new binaries a node runs (one library as large
//! as PyTorch's no longer holds the others up), and a node that runs the same programs again
//! and again pays for each binary once.

use std::collections::VecDeque;
use std::time::Instant;

/// The node-wide rate: 10 ms of CPU per second, 1 % of one core while new large binaries
/// keep coming, nothing once they are all cached.
pub const NODE_RATE_NS_PER_S: u64 = 10_000_000;
/// What the bucket holds when full: the first large binaries of a start-up (a compiler, an
/// interpreter and its libraries) are built without waiting.
pub const NODE_BURST_NS: u64 = 1_000_000_000;
/// A build estimated under this is made at once: about 7 MiB of executable text (Debian's
/// static python3.11 is 2.9 MiB, the C library 1.6 MiB, a 30 MB `cc1` 25 MiB).
pub const SMALL_NS: u64 = 50_000_000;
/// Estimated CPU per byte of executable text: the C library's table (1.6 MiB of text) took
/// ~10 ms to build here.
pub const NS_PER_TEXT_BYTE: u64 = 7;
/// Processes waiting for a table at most; beyond, the oldest gives up its place (it unwinds by
/// frame pointers until a later change of its maps brings it back).
const MAX_WAITING: usize = 4096;

pub struct Budget {
    /// None: unlimited (`record`, and the agent's chosen processes).
    rate_ns_per_s: Option<u64>,
    burst_ns: i64,
    tokens_ns: i64,
    last: Instant,
    /// Processes with a table left unbuilt for want of budget, oldest first.
    waiting: VecDeque<u32>,
}

impl Default for Budget {
    fn default() -> Self {
        Self::unlimited()
    }
}

impl Budget {
    pub fn unlimited() -> Self {
        Self {
            rate_ns_per_s: None,
            burst_ns: 0,
            tokens_ns: 0,
            last: Instant::now(),
            waiting: VecDeque::new(),
        }
    }

    /// A bucket of `burst_ns`, full at first, refilled at `rate_ns_per_s`.
    pub fn limited(rate_ns_per_s: u64, burst_ns: u64) -> Self {
        let burst = i64::try_from(burst_ns).unwrap_or(i64::MAX);
        Self {
            rate_ns_per_s: Some(rate_ns_per_s),
            burst_ns: burst,
            tokens_ns: burst,
            last: Instant::now(),
            waiting: VecDeque::new(),
        }
    }

    fn refill(&mut self, now: Instant) {
        let Some(rate) = self.rate_ns_per_s else {
            return;
        };
        let elapsed = now.saturating_duration_since(self.last);
        self.last = now;
        let earned = (elapsed.as_nanos().saturating_mul(u128::from(rate)) / 1_000_000_000)
            .min(i64::MAX as u128) as i64;
        self.tokens_ns = self.tokens_ns.saturating_add(earned).min(self.burst_ns);
    }

    /// Whether a table estimated to cost `estimate_ns` may be built now.
    pub fn allows(&mut self, estimate_ns: u64) -> bool {
        self.allows_at(estimate_ns, Instant::now())
    }

    fn allows_at(&mut self, estimate_ns: u64, now: Instant) -> bool {
        self.refill(now);
        self.rate_ns_per_s.is_none() || estimate_ns < SMALL_NS || self.tokens_ns > 0
    }

    /// Pays for a build that took `cpu_ns`.
    pub fn spend(&mut self, cpu_ns: u64) {
        if self.rate_ns_per_s.is_some() {
            let cost = i64::try_from(cpu_ns).unwrap_or(i64::MAX);
            self.tokens_ns = self.tokens_ns.saturating_sub(cost);
        }
    }

    /// `pid` needs a table the budget did not allow: it waits its turn (kept where it was if
    /// already waiting).
    pub fn wait(&mut self, pid: u32) {
        if self.waiting.contains(&pid) {
            return;
        }
        if self.waiting.len() >= MAX_WAITING {
            self.waiting.pop_front();
        }
        self.waiting.push_back(pid);
    }

    /// The oldest waiting process, taken from the queue, when the budget allows a large build
    /// now.
    pub fn next_due(&mut self) -> Option<u32> {
        if self.waiting.is_empty() || !self.allows(u64::MAX) {
            return None;
        }
        self.waiting.pop_front()
    }

    /// Processes waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Forgets a process that exited.
    pub fn forget(&mut self, pid: u32) {
        self.waiting.retain(|&p| p != pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn unlimited_always_allows() {
        let mut b = Budget::unlimited();
        b.spend(u64::MAX);
        assert!(b.allows(u64::MAX));
    }

    #[test]
    fn a_build_overdraws_and_the_debt_is_repaid_at_the_rate() {
        let mut b = Budget::limited(10_000_000, 50_000_000);
        let large = SMALL_NS;
        let t0 = b.last;
        assert!(b.allows_at(large, t0), "full at first");
        b.spend(80_000_000);
        assert!(!b.allows_at(large, t0), "30 ms in debt");
        assert!(b.allows_at(SMALL_NS - 1, t0), "a small build never waits");
        // 10 ms a second: the 30 ms debt takes 3 s.
        assert!(!b.allows_at(large, t0 + Duration::from_millis(2900)));
        assert!(b.allows_at(large, t0 + Duration::from_millis(3100)));
        // Never more than the burst, however long it waits.
        assert!(b.allows_at(large, t0 + Duration::from_secs(3600)));
        b.spend(50_000_000);
        assert!(!b.allows_at(large, t0 + Duration::from_secs(3600)));
    }

    #[test]
    fn waiting_processes_come_oldest_first_once_each() {
        let mut b = Budget::limited(1, 1);
        b.wait(7);
        b.wait(3);
        b.wait(7);
        assert_eq!(b.waiting(), 2);
        assert_eq!(b.next_due(), Some(7));
        b.spend(10);
        assert_eq!(b.next_due(), None, "no budget left");
        b.forget(3);
        assert_eq!(b.waiting(), 0);
    }
}
