//! `perf_event_open(2)`: its attributes, which libc does not define, and the call.

/// `struct perf_event_attr` up to `sample_stack_user` (PERF_ATTR_SIZE_VER3, 96 bytes; Linux
/// 3.7 and later know every field).
#[repr(C)]
#[derive(Default)]
#[allow(dead_code)] // The kernel reads the fields, Rust never does.
pub struct PerfAttr {
    pub kind: u32,
    pub size: u32,
    pub config: u64,
    pub sample_period: u64,
    pub sample_type: u64,
    pub read_format: u64,
    pub flags: u64,
    pub wakeup_events: u32,
    pub bp_type: u32,
    pub config1: u64,
    pub config2: u64,
    pub branch_sample_type: u64,
    pub sample_regs_user: u64,
    pub sample_stack_user: u32,
    pub clockid: i32,
}

impl PerfAttr {
    /// Attributes of `kind` with the struct's size set.
    pub fn new(kind: u32) -> Self {
        Self {
            kind,
            size: std::mem::size_of::<Self>() as u32,
            ..Self::default()
        }
    }
}

const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

/// Opens an event of `attr` for process or thread `pid` on any CPU, close-on-exec, in no
/// group: the descriptor, or -1 with errno set. Allocates nothing (a forked child calls it).
pub fn perf_event_open(attr: &PerfAttr, pid: libc::pid_t) -> libc::c_long {
    // SAFETY: perf_event_open with a valid attr (whose pointers, if any, the caller keeps
    // alive across the call).
    unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr as *const PerfAttr,
            pid,
            -1,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_is_the_third_versions_size() {
        assert_eq!(std::mem::size_of::<PerfAttr>(), 96);
    }
}
