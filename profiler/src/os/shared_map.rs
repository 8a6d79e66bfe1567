//! A shared mapping of a descriptor (a BPF array's pages, a perf event's ring), unmapped when
//! dropped, and the page size it is counted in.

use std::os::fd::{AsRawFd, BorrowedFd};

/// The system's page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// `len` bytes of `fd` from `offset` (a multiple of the page size), mapped shared.
pub struct SharedMap {
    base: *mut u8,
    len: usize,
}

impl SharedMap {
    /// Maps `len` bytes of `fd` at `offset`, read-write when `writable`, else read-only.
    pub fn new(
        fd: BorrowedFd<'_>,
        len: usize,
        offset: usize,
        writable: bool,
    ) -> std::io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        let offset = libc::off_t::try_from(offset).map_err(std::io::Error::other)?;
        // SAFETY: a new shared mapping of a descriptor the caller holds open; nothing else
        // refers to the address range until it is returned.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            base: base.cast(),
            len,
        })
    }

    /// The first byte mapped.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Bytes mapped.
    pub fn mapped_len(&self) -> usize {
        self.len
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the range this value mapped, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
