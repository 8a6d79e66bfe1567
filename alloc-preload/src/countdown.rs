//! The per-thread byte countdown: each thread counts allocated bytes down to a gap drawn from
//! an exponential distribution with the configured mean (a Poisson process over the bytes
//! allocated), and the allocation that crosses zero is sampled, as tcmalloc does. A block of
//! s bytes is then sampled with probability 1 - exp(-s/mean), which pyrometer inverts into
//! the sample's weight.
//!
//! The state lives in initial-exec TLS, reached through the thread pointer: Rust's
//! `thread_local!` in a shared object goes through `__tls_get_addr`, which may call `malloc`
//! to grow a thread's TLS vector after a `dlopen` — back into this library. Initial-exec TLS is
//! a fixed offset from the thread pointer, set up before the first allocation this library
//! can see, and never allocates.

use core::sync::atomic::{AtomicU64, Ordering};

/// `--alloc-sample-bytes`' default: tcmalloc's, jemalloc's and Go's rate.
pub const DEFAULT_MEAN: u64 = 512 * 1024;

/// Mean bytes between samples; 1 (or 0) samples every allocation.
static MEAN: AtomicU64 = AtomicU64::new(DEFAULT_MEAN);

pub fn set_mean(mean: u64) {
    MEAN.store(mean, Ordering::Relaxed);
}

/// Makes this thread draw its next gap afresh (with the mean now set): the library's
/// constructor sets the mean from the environment after the loader may already have
/// allocated on the main thread, whose first gap used the default.
pub fn reset_thread() {
    if let Some(s) = state() {
        // SAFETY: this thread's own state.
        unsafe {
            (*s).rng = 0;
            (*s).remaining = 0;
        }
    }
}

pub fn mean() -> u64 {
    MEAN.load(Ordering::Relaxed)
}

#[repr(C)]
pub struct ThreadState {
    /// Bytes to the next sample.
    remaining: i64,
    /// xorshift64* state; 0 until the thread's first gap is drawn.
    rng: u64,
}

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".p2align 4",
    ".globl pyrometer_alloc_tls",
    ".hidden pyrometer_alloc_tls",
    ".type pyrometer_alloc_tls,@object",
    ".size pyrometer_alloc_tls,16",
    "pyrometer_alloc_tls:",
    ".zero 16",
    ".popsection",
);

/// This thread's state. The dynamic loader sets the thread pointer up before it hands the
/// allocator to the program's libraries, so it is there on every call this library sees;
/// None only guards a null thread pointer.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn state() -> Option<*mut ThreadState> {
    let tp: usize;
    let off: isize;
    // SAFETY: fs:0 is the thread control block's pointer to itself; the GOT entry holds the
    // variable's offset from it (R_X86_64_TPOFF64).
    unsafe {
        core::arch::asm!(
            "mov {tp}, qword ptr fs:[0]",
            "mov {off}, qword ptr [rip + pyrometer_alloc_tls@GOTTPOFF]",
            tp = out(reg) tp,
            off = out(reg) off,
            options(nostack, readonly, preserves_flags, pure),
        );
    }
    if tp == 0 {
        return None;
    }
    Some(tp.wrapping_add_signed(off) as *mut ThreadState)
}

#[cfg(not(target_arch = "x86_64"))]
compile_error!("pyrometer-alloc's initial-exec TLS access is written for x86_64 only");

/// Whether an allocation of `size` bytes is sampled on this thread.
#[inline(always)]
pub fn sample(size: usize) -> bool {
    !skip(size) && sample_crossing(size)
}

/// The fast half of [`sample`]: counts `size` down and returns true when the countdown stays
/// above zero (not sampled). False means the caller must call [`sample_crossing`], which
/// decides; split so a caller's fast path holds no call (whose saved registers the compiler
/// would hoist into every call).
#[inline(always)]
pub fn skip(size: usize) -> bool {
    let Some(s) = state() else { return true };
    let size = size.min(i64::MAX as usize) as i64;
    // SAFETY: the state is this thread's own; a signal handler that allocates between the
    // load and the store costs one update of the countdown, nothing else.
    unsafe {
        let left = (*s).remaining - size;
        if left > 0 {
            (*s).remaining = left;
            return true;
        }
    }
    false
}

/// The slow half of [`sample`], after [`skip`] returned false for the same `size`.
#[inline(always)]
pub fn sample_crossing(size: usize) -> bool {
    let Some(s) = state() else { return false };
    let size = size.min(i64::MAX as usize) as i64;
    // SAFETY: as in `skip`.
    unsafe { crossed(s, size) }
}

/// The countdown reached zero, or the thread has not drawn its first gap yet.
#[cold]
#[inline(never)]
unsafe fn crossed(s: *mut ThreadState, size: i64) -> bool {
    let mean = mean();
    if mean <= 1 {
        return true;
    }
    // SAFETY: as in `sample`.
    unsafe {
        if (*s).rng == 0 {
            (*s).rng = seed(s as usize);
            (*s).remaining = gap(&mut (*s).rng, mean);
            let left = (*s).remaining - size;
            if left > 0 {
                (*s).remaining = left;
                return false;
            }
        }
        // One sample however many gaps the block covers: its weight accounts for that.
        (*s).remaining = gap(&mut (*s).rng, mean);
    }
    true
}

fn seed(salt: usize) -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0x2545_f491_4f6c_dd1d);
    // SAFETY: rdtsc has no preconditions on x86_64.
    let tsc = unsafe { core::arch::x86_64::_rdtsc() };
    let n = COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    let s = splitmix(tsc ^ n ^ salt as u64);
    if s == 0 { 1 } else { s }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Bytes to the next sample: mean * -ln(U), U uniform in (0, 1].
pub fn gap(rng: &mut u64, mean: u64) -> i64 {
    let mut x = *rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *rng = x;
    let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
    // 53 random bits, shifted into (0, 1].
    let u = ((r >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let g = -u.ln() * mean as f64;
    if g >= 1.0 {
        g.min(i64::MAX as f64) as i64
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_are_exponential_with_the_mean() {
        let mut rng = 12345u64;
        let n = 200_000;
        let mean = 512.0 * 1024.0;
        let gaps: Vec<f64> = (0..n).map(|_| gap(&mut rng, 512 * 1024) as f64).collect();
        let avg = gaps.iter().sum::<f64>() / n as f64;
        assert!((avg - mean).abs() < 0.01 * mean, "mean gap {avg}");
        // Exponential: P(gap > mean) = 1/e.
        let above = gaps.iter().filter(|&&g| g > mean).count() as f64 / n as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.01, "{above}");
    }

    #[test]
    fn sampling_probability_matches_the_weight() {
        // Blocks of 4 KiB on one thread at a 64 KiB mean: sampled with 1 - exp(-1/16).
        set_mean(64 * 1024);
        let n = 400_000;
        let hits = (0..n).filter(|_| sample(4096)).count() as f64;
        let p = 1.0 - (-4096.0f64 / 65536.0).exp();
        assert!(
            (hits / n as f64 - p).abs() < 0.1 * p,
            "sampled {hits} of {n}, expected {:.0}",
            p * n as f64
        );
        set_mean(1);
        reset_thread();
        assert!(sample(1) && sample(1), "mean 1 samples everything");
        set_mean(DEFAULT_MEAN);
        reset_thread();
    }
}
