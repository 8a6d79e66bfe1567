//! The functions pyrometer's kernel programs attach to (`ebpf/src/bpf/alloc.h`,
//! `alloc_preload`, `alloc_preload_free` and `alloc_preload_move`): called only for sampled
//! allocations and for the frees and resizes of sampled blocks, so an unsampled allocator
//! call never traps into the kernel.
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
/// `pyrometer_alloc_sampled`'s `flags`: the sample is a resize (`realloc`): it counts as an
/// allocation, never as in use (the block's in-use entry, if any, belongs to the allocation
/// that made it and moves with [`pyrometer_realloc_sampled`]).
pub const RESIZED: u64 = 2;

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

/// A sampled block at `old` was resized to `size` bytes at `new` (possibly `old` itself): its
/// in-use entry moves there, with the stack and weight of the allocation that made it.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn pyrometer_realloc_sampled(old: *mut c_void, new: *mut c_void, size: usize) {
    // The three arguments stay in rdi, rsi and rdx, where alloc_preload_move reads them.
    // SAFETY: a nop.
    unsafe {
        core::arch::asm!(
            "nop",
            in("rdi") old,
            in("rsi") new,
            in("rdx") size,
            options(nostack, preserves_flags)
        )
    };
}
