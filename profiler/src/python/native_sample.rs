//! The user registers and stack of a thread running on a CPU, from one perf sample of it: a
//! task-clock event on the thread alone samples its user registers (frame, stack and
//! instruction pointers) and a copy of the top of its user stack after a millisecond of its
//! CPU time, and is closed. Nothing stops the thread. The agent's remote `dump --native` uses
//! it for threads that were not blocked in a system call (whose registers the kernel shows
//! without a sample).

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use pyrometer_unwind::Regs;

use crate::os::perf::{PerfAttr, perf_event_open};
use crate::os::shared_map::{SharedMap, page_size};

/// How long a thread is given to run a millisecond of CPU time and be sampled.
pub const SAMPLE_WAIT: Duration = Duration::from_millis(100);
/// How long one dump waits for samples in all: a process with many threads runnable but not
/// running would otherwise hold it for 100 ms each.
pub const DUMP_SAMPLING: Duration = Duration::from_secs(1);

/// What is left of a dump's [`DUMP_SAMPLING`].
pub struct SamplingBudget {
    left: Duration,
}

impl Default for SamplingBudget {
    fn default() -> Self {
        Self {
            left: DUMP_SAMPLING,
        }
    }
}

impl SamplingBudget {
    /// [`sample_running`] within what is left, which its wait is taken from.
    pub fn sample(&mut self, tid: u32) -> std::io::Result<Sampled> {
        if self.left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "it was running, and the dump's {} ms of waiting for samples of running \
                     threads were spent",
                    DUMP_SAMPLING.as_millis()
                ),
            ));
        }
        let started = Instant::now();
        let sampled = sample_running(tid, SAMPLE_WAIT.min(self.left));
        self.left = self.left.saturating_sub(started.elapsed());
        sampled
    }
}
/// Bytes of the user stack copied with the sample (the kernel caps it at 64 KiB less the
/// record's header).
pub const STACK_BYTES: u32 = 32 * 1024;

/// A thread's user registers and the top of its stack as the sample copied it: `stack`
/// starts at `regs.sp`.
pub struct Sampled {
    pub regs: Regs,
    pub stack: Vec<u8>,
}

impl Sampled {
    /// Registers alone, every read from the process's memory.
    pub fn at(regs: Regs) -> Self {
        Self {
            regs,
            stack: Vec::new(),
        }
    }

    /// Eight bytes at `addr`: from the copy when it holds them (the stack as it was at the
    /// sample), else from `read` (the process's memory now).
    pub fn read_u64(&self, addr: u64, read: impl Fn(u64) -> Option<u64>) -> Option<u64> {
        let copied = addr
            .checked_sub(self.regs.sp)
            .and_then(|off| usize::try_from(off).ok())
            .and_then(|off| self.stack.get(off..off.checked_add(8)?));
        match copied {
            Some(b) => Some(u64::from_le_bytes(b.try_into().ok()?)),
            None => read(addr),
        }
    }
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
const PERF_SAMPLE_REGS_USER: u64 = 1 << 12;
const PERF_SAMPLE_STACK_USER: u64 = 1 << 13;
const PERF_RECORD_SAMPLE: u32 = 9;
/// `exclude_kernel` and `exclude_hv`: samples of user mode only, as the walk needs.
const EXCLUDE_KERNEL_HV: u64 = (1 << 5) | (1 << 6);
/// x86-64's perf register numbers: BP, SP, IP (sampled in this order).
const REGS_MASK: u64 = (1 << 6) | (1 << 7) | (1 << 8);
/// The mmap page's `data_head`, `data_offset` and `data_size`.
const DATA_HEAD: usize = 1024;
const DATA_OFFSET: usize = 1040;
const DATA_SIZE: usize = 1048;
/// Data pages of the ring (a power of two), room for one sample and its stack copy.
const DATA_PAGES: usize = 16;

/// The ring's mapping, unmapped when dropped.
struct Ring(SharedMap);

impl Ring {
    fn u64_at(&self, off: usize) -> u64 {
        // SAFETY: every offset read is inside the first page (the header) or inside the data
        // area, checked against `len` by the callers; the kernel writes the ring concurrently,
        // so reads are volatile.
        unsafe { std::ptr::read_volatile(self.0.base().add(off).cast::<u64>()) }
    }

    fn bytes(&self, off: usize, n: usize) -> Option<&[u8]> {
        if off.checked_add(n)? > self.0.mapped_len() {
            return None;
        }
        // SAFETY: in bounds (checked above); the sample's bytes are complete once data_head
        // has passed them.
        Some(unsafe { std::slice::from_raw_parts(self.0.base().add(off), n) })
    }
}

/// Samples thread `tid` once while it runs in user mode, within `wait`: its registers and
/// stack top.
pub fn sample_running(tid: u32, wait: Duration) -> std::io::Result<Sampled> {
    let attr = PerfAttr {
        config: PERF_COUNT_SW_TASK_CLOCK,
        sample_period: 1_000_000,
        sample_type: PERF_SAMPLE_REGS_USER | PERF_SAMPLE_STACK_USER,
        flags: EXCLUDE_KERNEL_HV,
        sample_regs_user: REGS_MASK,
        sample_stack_user: STACK_BYTES,
        ..PerfAttr::new(PERF_TYPE_SOFTWARE)
    };
    let fd = perf_event_open(&attr, tid as libc::pid_t);
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let page = page_size();
    // Read-only, of the size perf expects: its header page and the data pages.
    let ring = Ring(SharedMap::new(
        fd.as_fd(),
        page * (1 + DATA_PAGES),
        0,
        false,
    )?);
    let until = Instant::now() + wait;
    loop {
        if let Some(sampled) = first_sample(&ring, page) {
            return Ok(sampled);
        }
        if Instant::now() >= until {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "it was neither blocked in a system call nor sampled running within {} ms",
                    wait.as_millis()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The first sample in the ring with user registers, once the kernel has written it.
fn first_sample(ring: &Ring, page: usize) -> Option<Sampled> {
    let head = usize::try_from(ring.u64_at(DATA_HEAD)).ok()?;
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    let offset = match usize::try_from(ring.u64_at(DATA_OFFSET)).ok()? {
        0 => page,
        o => o,
    };
    let size = match usize::try_from(ring.u64_at(DATA_SIZE)).ok()? {
        0 => ring.0.mapped_len() - page,
        s => s,
    };
    let mut at = 0;
    // Records before the first wrap only: one sample is all that is wanted.
    while at + 8 <= head.min(size) {
        let header = ring.bytes(offset + at, 8)?;
        let kind = u32::from_le_bytes(header[0..4].try_into().ok()?);
        let len = usize::from(u16::from_le_bytes(header[6..8].try_into().ok()?));
        if len < 8 || at + len > head.min(size) {
            return None;
        }
        if kind == PERF_RECORD_SAMPLE
            && let Some(s) = parse_sample(ring.bytes(offset + at + 8, len - 8)?)
        {
            return Some(s);
        }
        at += len;
    }
    None
}

/// A sample's body: `abi, regs[3]` (BP, SP, IP), then `size, data[size], dyn_size`.
fn parse_sample(body: &[u8]) -> Option<Sampled> {
    let word = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(
            body.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    if word(0)? == 0 {
        // No user registers: the thread was in the kernel on the kernel's own behalf.
        return None;
    }
    let (bp, sp, pc) = (word(1)?, word(2)?, word(3)?);
    let size = usize::try_from(word(4)?).ok()?;
    let data = body.get(40..40usize.checked_add(size)?)?;
    let dynamic = usize::try_from(word(5 + size.div_ceil(8)).unwrap_or(0)).ok()?;
    let kept = if size == 0 { 0 } else { dynamic.min(size) };
    Some(Sampled {
        regs: Regs { pc, sp, bp },
        stack: data[..kept].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_come_from_the_copy_where_it_has_them() {
        let mut stack = 0x1111u64.to_le_bytes().to_vec();
        stack.extend(0x2222u64.to_le_bytes());
        let s = Sampled {
            regs: Regs {
                pc: 1,
                sp: 0x1000,
                bp: 0,
            },
            stack,
        };
        let live = |a: u64| Some(a + 1);
        assert_eq!(s.read_u64(0x1000, live), Some(0x1111));
        assert_eq!(s.read_u64(0x1008, live), Some(0x2222));
        // Past the copy, or straddling its end: the process's memory.
        assert_eq!(s.read_u64(0x1010, live), Some(0x1011));
        assert_eq!(s.read_u64(0x100c, live), Some(0x100d));
        // Below the stack pointer: never from the copy.
        assert_eq!(s.read_u64(0xff8, live), Some(0xff9));
    }

    /// A dump's waits for samples add up to its budget at most: a thread that never runs
    /// (asleep) costs a wait each time until the budget is spent, then none.
    #[test]
    fn a_dumps_waits_for_samples_are_bounded() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        let mut budget = SamplingBudget {
            left: Duration::from_millis(150),
        };
        let mut refusals = Vec::new();
        for _ in 0..4 {
            match budget.sample(tid) {
                Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
                    skip_ledger::skip("root", format!("perf_event_open of a thread: {e}"));
                    let _ = stop_tx.send(());
                    sleeper.join().unwrap();
                    return;
                }
                Err(e) => refusals.push(e.to_string()),
                Ok(_) => panic!("a sleeping thread was sampled running"),
            }
        }
        let _ = stop_tx.send(());
        sleeper.join().unwrap();
        assert!(
            refusals[0].contains("within 100 ms") && refusals[3].contains("were spent"),
            "{refusals:?}"
        );
        // A wait of 100 ms, then of the 50 left; once spent, no wait at all.
        assert!(budget.left.is_zero(), "{:?} left", budget.left);
    }

    /// A thread spinning in user mode: sampled within the wait, its instruction pointer in
    /// this test's own code and its stack copy starting at its stack pointer.
    #[test]
    fn a_spinning_thread_is_sampled() {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let spinner = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let mut x = 0u64;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            x
        });
        let tid = rx.recv().unwrap();
        let sampled = sample_running(tid, SAMPLE_WAIT);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spinner.join().unwrap();
        let s = match sampled {
            Ok(s) => s,
            // Without CAP_PERFMON and a strict perf_event_paranoid: nothing to check here.
            // SAFETY: geteuid has no preconditions.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) && unsafe { libc::geteuid() } != 0 => {
                skip_ledger::skip("root", format!("perf_event_open of a thread: {e}"));
                return;
            }
            Err(e) => panic!("no sample of a spinning thread: {e}"),
        };
        assert!(s.regs.pc != 0 && s.regs.sp != 0, "{:?}", s.regs);
        assert!(s.stack.len() >= 64, "{} bytes of stack", s.stack.len());
    }
}
