//! The functions pyrometer's kernel programs attach to (`ebpf/src/bpf/alloc.h`,
//! `alloc_preload` and `alloc_preload_free`): called only for sampled allocations and for
//! the frees of sampled blocks, so an unsampled allocator call never traps into the kernel.
//!
//! The allocator functions tail-call `pyrometer_alloc_sampled`, which returns the block, so
//! it returns straight into the program: the return probe on it sees the program's own
//! registers right after its allocator call, as a return probe on `malloc` would, and walks
//! the program's stack without knowing this library's frames. It leaves its size and flags
//! arguments in their registers (rsi, rdx), where that probe reads them.

use core::ffi::c_void;

/// `pyrometer_alloc_sampled`'s `flags`: the block is in the table of sampled addresses, so
/// its free will reach `pyrometer_free_sampled` (without it the table was full: the
/// allocation counts, but pyrometer must not keep it as in use).
pub const TRACKED: u64 = 1;

/// A sampled allocation of `size` bytes at `ptr`, just made; returns `ptr`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn pyrometer_alloc_sampled(
    ptr: *mut c_void,
    size: usize,
    flags: u64,
) -> *mut c_void {
    let out: *mut c_void;
    // The arguments stay where the C calling convention put them; the asm is an opaque
    // side effect, so the call is never dropped and never merged with another function.
    // SAFETY: one register move.
    unsafe {
        core::arch::asm!(
            "mov rax, rdi",
            in("rdi") ptr,
            in("rsi") size,
            in("rdx") flags,
            lateout("rax") out,
            options(nostack, preserves_flags)
        )
    };
    out
}

/// A sampled block at `ptr` is about to be freed (or resized away).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn pyrometer_free_sampled(ptr: *mut c_void) {
    // SAFETY: two nops.
    unsafe {
        core::arch::asm!("nop", "nop /* {0} */", in(reg) ptr, options(nostack, preserves_flags))
    };
}
