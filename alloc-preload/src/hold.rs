//! The start-up handshake with `pyrometer record --alloc -- CMD`: record passes one end of a
//! socket pair in `PYROMETER_ALLOC_HOLD` (its descriptor number) to the command it starts.
//! This library's constructor runs once the dynamic loader has mapped every library and
//! before `main`: it says so on the socket and waits (at most [`WAIT_MS`]) for record to read
//! the process's mappings and load their unwind tables (and register an interpreter). So even
//! a command that lives a few milliseconds has its stacks unwound from its first allocation,
//! instead of only once record has noticed the libraries the loader mapped after `exec`.
//!
//! The variable is removed at once, so only the first program of the command holds (not its
//! children), and the socket is closed after. Anything but a socket under that number is left
//! alone. If record never answers, the program goes on after the wait.

use core::ffi::{CStr, c_int};

/// The environment variable record sets: the socket's descriptor number.
pub const HOLD_ENV: &CStr = c"PYROMETER_ALLOC_HOLD";

/// The longest the program waits for record's answer.
pub const WAIT_MS: c_int = 2000;

/// Holds the program until record is ready, when it was asked to. Allocation-free.
pub fn wait_if_asked() {
    // SAFETY: getenv/unsetenv in the constructor, before the program can start threads;
    // neither allocates.
    let value = unsafe { libc::getenv(HOLD_ENV.as_ptr()) };
    if value.is_null() {
        return;
    }
    // SAFETY: getenv returns a NUL-terminated string.
    let fd = crate::parse_decimal(unsafe { CStr::from_ptr(value) }.to_bytes());
    // SAFETY: as above.
    unsafe { libc::unsetenv(HOLD_ENV.as_ptr()) };
    let Some(fd) = fd.and_then(|fd| c_int::try_from(fd).ok()) else {
        return;
    };
    // SAFETY: fstat of a descriptor number into a local struct.
    let is_socket = unsafe {
        let mut st: libc::stat = core::mem::zeroed();
        libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK
    };
    if !is_socket {
        return;
    }
    // SAFETY: one byte to and from the socket record handed over, which is then closed.
    unsafe {
        if libc::write(fd, b"r".as_ptr().cast(), 1) == 1 {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            if libc::poll(&mut p, 1, WAIT_MS) == 1 {
                let mut answer = 0u8;
                let _ = libc::read(fd, (&mut answer as *mut u8).cast(), 1);
            }
        }
        libc::close(fd);
    }
}
