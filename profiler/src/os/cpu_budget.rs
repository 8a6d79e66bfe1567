//! CPU time spent on behalf of each profiled process, bounded per interval (the agent's push
//! interval): reads of its files and what is built from them (on workers, timed there),
//! bringing its tables up to date, symbol lookups. A process found over the budget is
//! degraded: no more work is started for it, and its user stacks are one `[budget]` frame.
//! What it spent over the budget is carried into the next intervals and paid from their
//! budgets (at most [`MAX_DEBT_INTERVALS`] of them): it stays degraded until it is paid off.
//! Without the carry, a process whose one read costs more than the budget would have that
//! read every interval, the budget bounding nothing, and a read charged as the interval's
//! stacks are named would degrade none of them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The calling thread's CPU time so far.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// The most intervals a process's overspending keeps it degraded after the one it went over
/// in: one costly read (a huge binary) is not held against it for ever.
pub const MAX_DEBT_INTERVALS: u32 = 6;

#[derive(Debug, Default)]
struct Inner {
    limit: Duration,
    spent: HashMap<u32, Duration>,
    over: HashSet<u32>,
    /// Times a process went over, all intervals together.
    went_over: u64,
}

/// A budget shared by every part of the agent that works for a process (cloning shares it).
#[derive(Debug, Clone)]
pub struct CpuBudget(Arc<Mutex<Inner>>);

impl CpuBudget {
    /// At most `limit` of CPU time per process per interval.
    pub fn new(limit: Duration) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            limit,
            ..Inner::default()
        })))
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `spent` against `pid`'s budget; true when it is over it (now or before).
    pub fn charge(&self, pid: u32, spent: Duration) -> bool {
        let mut b = self.inner();
        let limit = b.limit;
        let total = b.spent.entry(pid).or_default();
        *total = total.saturating_add(spent);
        let over = *total > limit;
        if over && b.over.insert(pid) {
            b.went_over += 1;
        }
        over
    }

    /// Whether `pid` is over its budget: it went over in this interval, or is still paying
    /// off what it spent over in earlier ones.
    pub fn is_over(&self, pid: u32) -> bool {
        self.inner().over.contains(&pid)
    }

    /// Starts a new interval: each process's spending starts from what it spent over the
    /// budget (at most [`MAX_DEBT_INTERVALS`] budgets), which this interval's budget pays
    /// first; one still over after that stays degraded. Returns the processes that were over
    /// and no longer are, whose work was put off: theirs to bring up to date now.
    pub fn next_interval(&self) -> Vec<u32> {
        let mut b = self.inner();
        let limit = b.limit;
        let cap = limit.saturating_mul(MAX_DEBT_INTERVALS + 1);
        b.spent.retain(|_, spent| {
            *spent = (*spent).min(cap).saturating_sub(limit);
            !spent.is_zero()
        });
        let Inner { spent, over, .. } = &mut *b;
        let mut paid_off = Vec::new();
        over.retain(|pid| {
            let still = spent.get(pid).is_some_and(|s| *s > limit);
            if !still {
                paid_off.push(*pid);
            }
            still
        });
        paid_off.sort_unstable();
        paid_off
    }

    /// Times a process went over its budget, all intervals together.
    pub fn went_over(&self) -> u64 {
        self.inner().went_over
    }
}

thread_local! {
    /// Whether this thread is inside [`charged`] now.
    static CHARGING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` for `pid` on this thread, charging its CPU time to `budget` (when there is one).
/// Work charged inside other charged work on the same thread (a worker's read run on the
/// caller's thread while threads are held) is paid by the outer charge alone, not twice.
pub fn charged<T>(budget: Option<&CpuBudget>, pid: u32, work: impl FnOnce() -> T) -> T {
    let Some(budget) = budget else {
        return work();
    };
    if CHARGING.with(|c| c.replace(true)) {
        return work();
    }
    // Cleared however `work` ends.
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            CHARGING.with(|c| c.set(false));
        }
    }
    let _clear = Clear;
    let start = thread_cpu();
    let v = work();
    budget.charge(pid, thread_cpu().saturating_sub(start));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_over_its_budget_is_degraded_until_the_interval_ends() {
        let b = CpuBudget::new(Duration::from_millis(10));
        let shared = b.clone();
        assert!(!b.charge(1, Duration::from_millis(6)));
        assert!(!b.charge(2, Duration::from_millis(9)));
        assert!(shared.charge(1, Duration::from_millis(6)), "12 ms > 10 ms");
        assert!(b.is_over(1) && !b.is_over(2));
        assert!(b.charge(1, Duration::ZERO), "stays over");
        assert_eq!(b.went_over(), 1, "counted once per interval");
        assert_eq!(b.next_interval(), vec![1], "2 ms carried: paid at once");
        assert!(!b.is_over(1));
        assert!(
            !b.charge(1, Duration::from_millis(8)),
            "2 + 8 ms is the budget"
        );
        assert!(b.charge(1, Duration::from_millis(1)));
        assert_eq!(b.went_over(), 2);
        assert!(!b.is_over(2), "9 ms were not carried");
        assert!(!b.charge(2, Duration::from_millis(10)));
    }

    #[test]
    fn overspending_is_paid_off_by_later_intervals() {
        // One read of 50 ms against 20 ms an interval: the next interval is degraded whole,
        // and over many intervals such reads cost the budget on average.
        let b = CpuBudget::new(Duration::from_millis(20));
        let mut degraded = 0;
        let mut spent = Duration::ZERO;
        for _ in 0..100 {
            if b.is_over(1) {
                degraded += 1;
            } else {
                b.charge(1, Duration::from_millis(50));
                spent += Duration::from_millis(50);
            }
            b.next_interval();
        }
        assert!(degraded >= 55, "{degraded} of 100 intervals degraded");
        assert!(
            spent <= Duration::from_millis(20 * 100 + 50),
            "{spent:?} over 100 intervals of 20 ms"
        );
        // A read worth a thousand intervals degrades the process for MAX_DEBT_INTERVALS.
        let b = CpuBudget::new(Duration::from_millis(20));
        assert!(b.charge(2, Duration::from_secs(20)));
        let mut intervals = 0;
        while b.is_over(2) {
            assert_eq!(b.next_interval().is_empty(), b.is_over(2));
            intervals += 1;
        }
        assert_eq!(intervals, MAX_DEBT_INTERVALS);
        assert_eq!(b.went_over(), 1, "one episode");
    }

    #[test]
    fn work_is_charged_its_thread_cpu_time() {
        let b = CpuBudget::new(Duration::from_millis(5));
        let spin = || {
            let start = thread_cpu();
            let mut x = 0u64;
            while thread_cpu() - start < Duration::from_millis(20) {
                x = x.wrapping_add(1);
            }
            x
        };
        charged(Some(&b), 3, spin);
        assert!(b.is_over(3));
        // Sleeping costs no CPU.
        charged(Some(&b), 4, || {
            std::thread::sleep(Duration::from_millis(20))
        });
        assert!(!b.is_over(4));
    }

    #[test]
    fn nested_charges_on_one_thread_count_once() {
        let b = CpuBudget::new(Duration::from_secs(3600));
        let spin = |ms| {
            let start = thread_cpu();
            while thread_cpu() - start < Duration::from_millis(ms) {
                std::hint::spin_loop();
            }
        };
        charged(Some(&b), 5, || {
            spin(10);
            charged(Some(&b), 5, || spin(30));
        });
        let spent = b.inner().spent[&5];
        assert!(
            spent >= Duration::from_millis(40) && spent < Duration::from_millis(70),
            "{spent:?}: the inner 30 ms counted once"
        );
        // The flag is cleared: a later charge counts again.
        charged(Some(&b), 6, || spin(5));
        assert!(b.inner().spent[&6] >= Duration::from_millis(5));
    }
}
