//! The allocator's share of the collector's memory. glibc gives each thread that allocates
//! an arena of its own (up to eight per core) and keeps what a large push freed for reuse,
//! so after a burst of large pushes on many blocking threads the process holds far more than
//! it uses. The collector bounds the arenas and, after a large push, returns what is free to
//! the system, so its RSS follows what it holds.

/// Pushes at least this large are followed by [`release`].
pub const RELEASE_AFTER: usize = 1 << 20;

/// Bounds glibc's arenas (call before threads start).
pub fn limit_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt changes allocator tuning only; called before other threads allocate.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 4);
    }
}

/// Returns free memory at the top of the heap and in whole free pages to the system.
pub fn release() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}
