//! Reading another process's memory with `process_vm_readv`: the target keeps running (no
//! ptrace stop), so every read may race it and callers validate what they read.

use std::io;

use super::PythonError;

/// Something that reads a process's memory; a trait so tests can feed the walker fake images.
pub trait Memory {
    /// Fills `buf` from `addr`, entirely or not at all.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError>;

    fn read_u64(&self, addr: u64) -> Result<u64, PythonError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn read_u32(&self, addr: u64) -> Result<u32, PythonError> {
        let mut b = [0u8; 4];
        self.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn read_u8(&self, addr: u64) -> Result<u8, PythonError> {
        let mut b = [0u8; 1];
        self.read(addr, &mut b)?;
        Ok(b[0])
    }
}

/// The memory of a live process.
pub struct ProcessMemory {
    pid: u32,
}

impl ProcessMemory {
    pub fn new(pid: u32) -> Self {
        Self { pid }
    }
}

impl Memory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError> {
        if buf.is_empty() {
            return Ok(());
        }
        if addr == 0 {
            return Err(PythonError::BadAddress(addr));
        }
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: `local` covers exactly `buf`, which outlives the call; the remote iovec is
        // only interpreted by the kernel in the target's address space.
        let n =
            unsafe { libc::process_vm_readv(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::EPERM) => PythonError::Permission(self.pid),
                Some(libc::ESRCH) => PythonError::NoSuchProcess(self.pid),
                Some(libc::EFAULT) => PythonError::BadAddress(addr),
                _ => PythonError::Read { addr, source: err },
            });
        }
        if n as usize != buf.len() {
            return Err(PythonError::BadAddress(addr));
        }
        Ok(())
    }
}
