//! When the tracker reads a code object again after a failed read: soon after the first
//! failure, then less and less often.

use std::time::{Duration, Instant};

/// A code object that could not be read is read again after this long, doubling each time up
/// to `CODE_RETRY_MAX`: a read can fail for a moment (a frame seen while its code object was
/// being set up, a page the process had not touched yet), and caching the failure for good
/// once named every sample of a hot function `<unreadable frame>` for a whole recording. The
/// first wait is short because addresses are reused: a start-up module body's code object,
/// freed as its frame was read, gives its address (and its first line, 1) to the script's own
/// `<module>`, which a 50 ms wait left unnamed for 20-odd samples on a busy machine.
const CODE_RETRY: Duration = Duration::from_millis(5);
const CODE_RETRY_MAX: Duration = Duration::from_secs(5);

/// When a failed read is tried again (first and later failures).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Retry {
    at: Instant,
    wait: Duration,
}

impl Retry {
    pub(super) fn first(now: Instant) -> Self {
        Self {
            at: now,
            wait: CODE_RETRY,
        }
    }

    pub(super) fn again(self, now: Instant) -> Self {
        Self {
            at: now,
            wait: (self.wait * 2).min(CODE_RETRY_MAX),
        }
    }

    pub(super) fn due(self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) >= self.wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_code_reads_are_retried_later_and_less_often() {
        let t0 = Instant::now();
        let r = Retry::first(t0);
        assert!(!r.due(t0));
        assert!(!r.due(t0 + CODE_RETRY / 2));
        assert!(r.due(t0 + CODE_RETRY));
        // Each failure doubles the wait, up to the cap: a code object that stays unreadable
        // (the process is gone, the address was never one) costs a read every 5 s at most.
        let mut r = r;
        let mut waits = Vec::new();
        for _ in 0..10 {
            r = r.again(t0);
            waits.push(r.wait);
        }
        assert_eq!(waits[0], CODE_RETRY * 2);
        assert_eq!(waits[1], CODE_RETRY * 4);
        assert_eq!(*waits.last().unwrap(), CODE_RETRY_MAX);
        assert!(!r.due(t0 + CODE_RETRY_MAX / 2));
        assert!(r.due(t0 + CODE_RETRY_MAX));
    }
}
