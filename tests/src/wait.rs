//! Waiting for events, never for a fixed time: a test polls the signal it needs (an agent's
//! first push, a collector's readiness, a spool drained, a metric reaching a value, CPU time a
//! workload has used) until a deadline, and fails naming what it waited for. The deadlines are
//! generous (the tests run on a machine busy with other builds); a test that meets its signal
//! early goes on at once.

use std::fmt::Debug;
use std::time::{Duration, Instant};

/// How often a condition is checked.
const POLL: Duration = Duration::from_millis(50);

/// Polls `probe` until it gives `Ok(value)`; panics after `timeout`, naming `what` and the
/// last `Err` it gave (the state seen, for the failure message).
pub fn wait_for<T, S: Debug>(
    timeout: Duration,
    what: &str,
    mut probe: impl FnMut() -> Result<T, S>,
) -> T {
    let start = Instant::now();
    loop {
        match probe() {
            Ok(value) => return value,
            Err(state) => assert!(
                start.elapsed() < timeout,
                "waited {:.1}s for {what}; last seen: {state:?}",
                start.elapsed().as_secs_f64()
            ),
        }
        std::thread::sleep(POLL);
    }
}

/// Polls `condition` until it holds; panics after `timeout`, naming `what`.
pub fn wait_until(timeout: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    wait_for(timeout, what, || {
        if condition() { Ok(()) } else { Err("not yet") }
    });
}

/// CPU time (user and system) process `pid` has used, from `/proc/PID/stat`; None once it
/// is gone.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&h| h > 0)?;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// Waits until process `pid` has used `amount` more CPU time than it had when called: the
/// moment a sampler running meanwhile has had that much of it to sample, however busy the
/// machine is (a fixed wall-clock wait gives it anything from all of it to nothing).
pub fn cpu_used(pid: u32, amount: Duration, timeout: Duration) {
    let start = cpu_time(pid).unwrap_or_else(|| panic!("process {pid} is gone"));
    wait_for(
        timeout,
        &format!("process {pid} to use {:.2}s of CPU", amount.as_secs_f64()),
        || {
            let now = cpu_time(pid).ok_or("the process exited")?;
            if now - start >= amount {
                Ok(())
            } else {
                Err("not yet")
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's CPU time by the kernel's clock for it.
    fn process_clock() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0);
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    /// What `/proc/PID/stat` says this process used agrees with its CPU clock (to the
    /// clock ticks stat counts in), however long the busy machine takes to give it 0.2 s.
    #[test]
    fn cpu_time_is_what_the_process_used() {
        let me = std::process::id();
        let (stat_before, clock_before) = (cpu_time(me).unwrap(), process_clock());
        let start = Instant::now();
        let mut x = 0u64;
        while process_clock() - clock_before < Duration::from_millis(200) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no CPU time given"
            );
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
        let (used_stat, used_clock) = (
            cpu_time(me).unwrap() - stat_before,
            process_clock() - clock_before,
        );
        let gap = used_stat.abs_diff(used_clock);
        assert!(
            gap <= Duration::from_millis(40),
            "stat says {used_stat:?}, the clock {used_clock:?}"
        );
        assert_eq!(cpu_time(u32::MAX), None);
    }

    #[test]
    #[should_panic(expected = "waited")]
    fn a_wait_that_never_ends_names_what_it_waited_for() {
        wait_until(Duration::from_millis(100), "nothing", || false);
    }
}
