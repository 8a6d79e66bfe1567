//! `libpyrometer_alloc.so`: a preloadable allocation sampler. It interposes the C allocator
//! (`malloc`, `calloc`, `realloc`, `reallocarray`, `free`, `posix_memalign`, `aligned_alloc`,
//! `memalign`, `valloc`, `pvalloc`), forwards every call to the allocator that follows it
//! ([`real`]), and counts each thread's bytes down to an exponentially distributed gap
//! ([`countdown`]). Only the allocation that crosses the gap calls
//! [`probe::pyrometer_alloc_sampled`], where pyrometer's uprobe records its stack; its
//! address goes into a table ([`table`]) so that its free, and only the free of a sampled
//! block, calls [`probe::pyrometer_free_sampled`] (and its `realloc`
//! [`probe::pyrometer_realloc_sampled`]). With no profiler attached the probes are plain
//! calls, so the library costs the countdown only.
//!
//! The mean gap comes from `PYROMETER_ALLOC_SAMPLE_BYTES` (512 KiB by default; 1 samples
//! every allocation). Nothing on these paths allocates, takes a lock or touches Rust's
//! thread-locals, so they are safe before and after `main`, in a forked child, in signal
//! handlers and in exiting threads.

pub mod countdown;
pub mod hold;
pub mod probe;
pub mod python;
pub mod real;
pub mod table;

use core::ffi::c_void;
use core::sync::atomic::{AtomicU64, Ordering};

use probe::{
    RESIZED, TRACKED, pyrometer_alloc_sampled, pyrometer_free_sampled, pyrometer_realloc_sampled,
};

/// The environment variable `pyrometer record` sets (and users may): mean bytes per sample.
pub const MEAN_ENV: &str = "PYROMETER_ALLOC_SAMPLE_BYTES";

pub(crate) static SAMPLED: table::Table = table::Table::new();
/// Sampled blocks the table had no room for (reported to the kernel as untracked).
static UNTRACKED: AtomicU64 = AtomicU64::new(0);

/// Reads the mean from the environment and looks the wrapped allocator up, before `main`.
extern "C" fn init() {
    // SAFETY: getenv does not allocate; the value is read before any thread can setenv.
    let value = unsafe { libc::getenv(c"PYROMETER_ALLOC_SAMPLE_BYTES".as_ptr()) };
    if !value.is_null() {
        // SAFETY: getenv returns a NUL-terminated string.
        let bytes = unsafe { core::ffi::CStr::from_ptr(value) }.to_bytes();
        if let Some(mean) = parse_decimal(bytes) {
            countdown::set_mean(mean);
            countdown::reset_thread();
        }
    }
    let _ = real::get();
    // Before the interpreter's helper thread: nothing else runs while the program is held.
    hold::wait_if_asked();
    python::start();
}

#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

/// A decimal number (of bytes, or a descriptor); None when it is not one (the default mean
/// stays).
pub fn parse_decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    s.iter().try_fold(0u64, |n, &c| {
        c.is_ascii_digit().then(|| n * 10 + u64::from(c - b'0'))
    })
}

/// Counts a new block and, when the countdown crosses zero, reports it; returns the block.
/// Inlined into each exported function, whose last act it is: the report is a tail call
/// (see [`probe`]), so the probe returns into the program.
#[inline(always)]
pub(crate) fn account(ptr: *mut c_void, size: usize) -> *mut c_void {
    if ptr.is_null() || !countdown::sample(size) {
        return ptr;
    }
    report(ptr, size)
}

/// Reports a sampled block (made by the caller, whose last act this is): into the table of
/// sampled addresses, then to the kernel. Returns the block.
#[inline(always)]
pub(crate) fn report(ptr: *mut c_void, size: usize) -> *mut c_void {
    if ptr.is_null() {
        return ptr;
    }
    let flags = if SAMPLED.insert(ptr as usize) {
        TRACKED
    } else {
        UNTRACKED.fetch_add(1, Ordering::Relaxed);
        0
    };
    pyrometer_alloc_sampled(ptr, size, flags)
}

/// A block is going away: when it was sampled, the kernel hears of it first (once freed,
/// its address can be another thread's next sampled block).
#[inline(always)]
pub(crate) fn forget(ptr: *mut c_void) {
    if SAMPLED.remove(ptr as usize) {
        pyrometer_free_sampled(ptr);
    }
}

/// A resize of `old` to `size` bytes at `new` (null: it failed) is done; `was_sampled` says
/// whether `old` had been sampled (and was taken out of the table before the resize, as a
/// free does: once resized away its address can be another thread's next sampled block).
/// `counted`: the resize counts as an allocation of `size` bytes here (not in an allocator
/// call inside it). Returns `new`.
///
/// The two views a resize shows in: the allocation views count every resize as an
/// allocation of its new size, sampled by the countdown like any other (so a block grown in
/// steps counts each step); the in-use view follows a block from the allocation that made it:
/// a sampled block's entry moves to its new address with its stack, time and weight and the
/// new size, and the resize of an unsampled block is never in use, even when the countdown
/// samples it (its first block was not sampled, and counting it from a later step too would
/// count such blocks more than once on average).
#[inline(always)]
pub(crate) fn resized(
    old: *mut c_void,
    was_sampled: bool,
    new: *mut c_void,
    size: usize,
    counted: bool,
) -> *mut c_void {
    if was_sampled {
        moved(old, new, size);
    }
    if new.is_null() || !counted || !countdown::sample(size) {
        return new;
    }
    pyrometer_alloc_sampled(new, size, RESIZED)
}

/// A sampled block was resized: its entry follows it. (Between the resize and this call
/// another thread may be handed the old address and sample it; the move then carries that
/// block's entry instead: a rare misattribution, never a lost or doubled block in the table.)
#[cold]
#[inline(never)]
fn moved(old: *mut c_void, new: *mut c_void, size: usize) {
    if new.is_null() {
        // The resize failed: the old block stays, and stays sampled.
        if !SAMPLED.insert(old as usize) {
            UNTRACKED.fetch_add(1, Ordering::Relaxed);
            pyrometer_free_sampled(old);
        }
        return;
    }
    if SAMPLED.contains(new as usize) {
        // An allocator call inside this one (pymalloc moving a block out to malloc) sampled
        // the new block on its own: that entry stands for it, the old one goes.
        pyrometer_free_sampled(old);
    } else if SAMPLED.insert(new as usize) {
        pyrometer_realloc_sampled(old, new, size);
    } else {
        UNTRACKED.fetch_add(1, Ordering::Relaxed);
        pyrometer_free_sampled(old);
    }
}

/// Sampled blocks not tracked for their free since the process started.
pub fn untracked() -> u64 {
    UNTRACKED.load(Ordering::Relaxed)
}

/// # Safety
/// The C `malloc` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    let Some(r) = real::ready() else {
        return malloc_unresolved(size);
    };
    // Counted before the call, so the unsampled path is a jump to the wrapped malloc with
    // nothing saved (the rare failed allocation still counts down).
    if countdown::skip(size) {
        // SAFETY: forwarded as called.
        return unsafe { (r.malloc)(size) };
    }
    sampled_malloc(r, size)
}

/// `malloc` before the wrapped allocator was looked up (its first calls, and `dlsym`'s own).
#[cold]
#[inline(never)]
fn malloc_unresolved(size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        return real::arena_alloc(size, 16);
    };
    // SAFETY: forwarded as called.
    let p = unsafe { (r.malloc)(size) };
    account(p, size)
}

/// A sampled malloc: out of line, and a tail call from `malloc`, so the report's probe still
/// returns into the program.
#[cold]
#[inline(never)]
fn sampled_malloc(r: &real::Real, size: usize) -> *mut c_void {
    if !countdown::sample_crossing(size) {
        // SAFETY: forwarded as called.
        return unsafe { (r.malloc)(size) };
    }
    // SAFETY: forwarded as called.
    let p = unsafe { (r.malloc)(size) };
    report(p, size)
}

/// # Safety
/// The C `calloc` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        // The arena is zeroed and never reused.
        return n
            .checked_mul(size)
            .map_or(core::ptr::null_mut(), |b| real::arena_alloc(b, 16));
    };
    if countdown::skip(n.wrapping_mul(size)) {
        // SAFETY: forwarded as called.
        return unsafe { (r.calloc)(n, size) };
    }
    sampled_calloc(r, n, size)
}

/// A sampled calloc, as [`sampled_malloc`].
#[cold]
#[inline(never)]
fn sampled_calloc(r: &real::Real, n: usize, size: usize) -> *mut c_void {
    if !countdown::sample_crossing(n.wrapping_mul(size)) {
        // SAFETY: forwarded as called.
        return unsafe { (r.calloc)(n, size) };
    }
    // SAFETY: forwarded as called.
    let p = unsafe { (r.calloc)(n, size) };
    report(p, n.wrapping_mul(size))
}

/// # Safety
/// The C `free` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if ptr.is_null() || real::in_arena(ptr) {
        return;
    }
    if let Some(r) = real::ready()
        && !SAMPLED.may_contain(ptr as usize)
    {
        // SAFETY: a block of the wrapped allocator.
        return unsafe { (r.free)(ptr) };
    }
    // SAFETY: as called.
    unsafe { free_slow(ptr) }
}

/// `free` of a block that may have been sampled, or before the wrapped allocator was looked
/// up: out of line, so the common free saves no registers.
///
/// # Safety
/// The C `free` contract.
#[cold]
#[inline(never)]
unsafe fn free_slow(ptr: *mut c_void) {
    forget(ptr);
    if let Some(r) = real::get() {
        // SAFETY: a block of the wrapped allocator.
        unsafe { (r.free)(ptr) }
    }
}

/// # Safety
/// The C `realloc` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        return arena_realloc(ptr, size, |n| real::arena_alloc(n, 16));
    };
    if real::in_arena(ptr) {
        // SAFETY: the wrapped malloc, as called.
        return arena_realloc(ptr, size, |n| unsafe { (r.malloc)(n) });
    }
    if ptr.is_null() {
        // SAFETY: forwarded as called (a malloc).
        let p = unsafe { (r.realloc)(ptr, size) };
        return account(p, size);
    }
    if size == 0 {
        // glibc frees the block (other allocators may return a minimal one, not counted).
        forget(ptr);
        // SAFETY: forwarded as called.
        return unsafe { (r.realloc)(ptr, size) };
    }
    let was_sampled = SAMPLED.remove(ptr as usize);
    // SAFETY: forwarded as called.
    let p = unsafe { (r.realloc)(ptr, size) };
    resized(ptr, was_sampled, p, size, true)
}

/// A resize of a bootstrap block: a new block from `alloc` with the old contents.
fn arena_realloc(
    ptr: *mut c_void,
    size: usize,
    alloc: impl FnOnce(usize) -> *mut c_void,
) -> *mut c_void {
    let p = alloc(size);
    if !p.is_null() && !ptr.is_null() {
        let old = real::arena_size(ptr);
        // SAFETY: both blocks hold at least min(old, size) bytes and do not overlap.
        unsafe { core::ptr::copy_nonoverlapping(ptr.cast::<u8>(), p.cast(), old.min(size)) };
    }
    p
}

/// # Safety
/// The C `reallocarray` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn reallocarray(ptr: *mut c_void, n: usize, size: usize) -> *mut c_void {
    match n.checked_mul(size) {
        // SAFETY: realloc's contract, which reallocarray's implies.
        Some(bytes) => unsafe { realloc(ptr, bytes) },
        None => {
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = libc::ENOMEM };
            core::ptr::null_mut()
        }
    }
}

/// # Safety
/// The C `posix_memalign` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> i32 {
    let Some(r) = real::get() else {
        if !align.is_power_of_two() || !align.is_multiple_of(size_of::<usize>()) {
            return libc::EINVAL;
        }
        let p = real::arena_alloc(size, align);
        if p.is_null() {
            return libc::ENOMEM;
        }
        // SAFETY: the caller's out pointer.
        unsafe { *out = p };
        return 0;
    };
    // SAFETY: forwarded as called.
    let rc = unsafe { (r.posix_memalign)(out, align, size) };
    if rc == 0 {
        // Not a tail call (the result is an int): the probe returns into this function, and
        // the stack is walked through its unwind table.
        // SAFETY: set by the successful call.
        account(unsafe { *out }, size);
    }
    rc
}

/// # Safety
/// The C `aligned_alloc` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        return real::arena_alloc(size, align.next_power_of_two());
    };
    // SAFETY: forwarded as called.
    let p = unsafe { (r.aligned_alloc)(align, size) };
    account(p, size)
}

/// # Safety
/// The C `memalign` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        return real::arena_alloc(size, align.next_power_of_two());
    };
    // SAFETY: forwarded as called.
    let p = unsafe { (r.memalign)(align, size) };
    account(p, size)
}

/// # Safety
/// The C `valloc` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        return real::arena_alloc(size, 4096);
    };
    // SAFETY: forwarded as called.
    let p = unsafe { (r.valloc)(size) };
    account(p, size)
}

/// # Safety
/// The C `pvalloc` contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let Some(r) = real::get() else {
        return real::arena_alloc(size.next_multiple_of(4096), 4096);
    };
    // SAFETY: forwarded as called.
    let p = unsafe { (r.pvalloc)(size) };
    account(p, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resized_sampled_block_moves_in_the_table() {
        // Addresses no allocator hands out in this test process.
        let (old, new, other) = (0x7e00_0000_0010usize, 0x7e00_0000_1000, 0x7e00_0000_2000);
        let p = |a: usize| a as *mut c_void;
        // As realloc does: the old block leaves the table before the resize.
        assert!(SAMPLED.insert(old) && SAMPLED.remove(old));
        let moved_to = resized(p(old), true, p(new), 64, false);
        assert_eq!(moved_to, p(new));
        assert!(SAMPLED.contains(new) && !SAMPLED.contains(old));
        // A failed resize keeps the old block sampled.
        assert!(SAMPLED.remove(new));
        assert!(resized(p(new), true, core::ptr::null_mut(), 64, false).is_null());
        assert!(SAMPLED.contains(new));
        // A new block sampled on its own inside the resize keeps its entry, once.
        assert!(SAMPLED.insert(other));
        assert!(SAMPLED.remove(new));
        resized(p(new), true, p(other), 64, false);
        assert!(!SAMPLED.contains(new));
        assert!(SAMPLED.remove(other) && !SAMPLED.contains(other));
        // An unsampled block's resize is never in the table.
        resized(p(old), false, p(new), 64, false);
        assert!(!SAMPLED.contains(new) && !SAMPLED.contains(old));
    }

    #[test]
    fn means_parse_as_decimal_numbers() {
        assert_eq!(parse_decimal(b"524288"), Some(524_288));
        assert_eq!(parse_decimal(b"1"), Some(1));
        assert_eq!(parse_decimal(b""), None);
        assert_eq!(parse_decimal(b"12k"), None);
        assert_eq!(parse_decimal(b"99999999999999999999"), None);
    }
}
