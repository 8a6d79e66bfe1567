//! The agent's seccomp filter: once attached, it makes only the system calls listed here, and
//! any other ends it (or, in log mode, is logged by the kernel and let through). The list is
//! what the agent's own work needs after start-up: sampling (perf events, BPF map updates,
//! uprobes on processes seen later), reading `/proc` and other processes' files and memory,
//! pushing over TCP or TLS (name resolution included), spooling, `/metrics`, and exiting.
//! It was taken from `strace -f` of the agent's end-to-end tests and must grow with the agent:
//! those tests run it in kill mode, so a call missing here fails them.

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// What a call outside the list does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The process is killed (SIGSYS), its core not dumped.
    Kill,
    /// The kernel logs the call (audit, `dmesg`) and lets it through.
    Log,
    /// No filter.
    Off,
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the seccomp filter: {0}")]
    Build(String),
    #[error("cannot install the seccomp filter: {0}")]
    Install(String),
}

/// The system calls the agent makes once attached (x86-64).
pub const AGENT_SYSCALLS: &[libc::c_long] = &[
    // Memory, threads, time, signals, exit.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_futex,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    libc::SYS_getrandom,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    // The kernel's own restart of a sleep interrupted by a stop or by a signal without a
    // handler (clock_nanosleep): without it such a signal kills the agent with SIGSYS.
    libc::SYS_restart_syscall,
    libc::SYS_sigaltstack,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_prctl,
    libc::SYS_uname,
    libc::SYS_prlimit64,
    libc::SYS_getrlimit,
    libc::SYS_tgkill,
    libc::SYS_kill,
    // Files: /proc, perf maps, binaries, the spool, debug files.
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_open,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_readv,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_statx,
    libc::SYS_fstatfs,
    libc::SYS_statfs,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_ftruncate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    // The debuginfod cache marks a file's last use in its time, for eviction by least use.
    libc::SYS_utimensat,
    libc::SYS_getcwd,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_memfd_create,
    // Other processes' memory (Python frames, thread names).
    libc::SYS_process_vm_readv,
    // Sampling: the ring buffer, BPF maps, perf events and uprobes for processes seen later.
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_ioctl,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    // The process-events connector (netlink), the collector, OTLP, /metrics, name resolution.
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_recvmmsg,
    libc::SYS_shutdown,
];

/// Installs the filter on every thread of the process (`SECCOMP_FILTER_FLAG_TSYNC`), with
/// `no_new_privs` set; threads started later inherit it.
pub fn install(mode: Mode) -> Result<(), SeccompError> {
    let mismatch = match mode {
        Mode::Off => return Ok(()),
        Mode::Kill => SeccompAction::KillProcess,
        Mode::Log => SeccompAction::Log,
    };
    let program = build(mismatch)?;
    seccompiler::apply_filter_all_threads(&program)
        .map_err(|e| SeccompError::Install(e.to_string()))
}

fn build(mismatch: SeccompAction) -> Result<BpfProgram, SeccompError> {
    let rules = AGENT_SYSCALLS.iter().map(|&nr| (nr, Vec::new())).collect();
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(|e| SeccompError::Build(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a child process (the filter cannot be taken off again): listed calls work, and one
    /// outside the list kills the process with SIGSYS.
    #[test]
    fn a_call_outside_the_list_kills_the_process() {
        // SAFETY: fork in a test; the child only makes system calls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = match install(Mode::Kill) {
                Ok(()) => {
                    // Listed: getpid. Not listed: chroot (an agent never changes its root).
                    // SAFETY: plain system calls.
                    unsafe {
                        libc::getpid();
                        libc::syscall(libc::SYS_chroot, c"/".as_ptr());
                    }
                    0
                }
                Err(_) => 3,
            };
            // SAFETY: leaving the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS,
            "status {status:#x}: the unlisted call did not kill the process"
        );
    }

    /// A sleep stopped and continued (as any signal without a handler interrupting it) is
    /// restarted by the kernel through restart_syscall: the filtered process lives on.
    #[test]
    fn a_sleep_interrupted_by_a_stop_goes_on() {
        // SAFETY: fork in a test; the child only makes system calls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = match install(Mode::Kill) {
                Ok(()) => {
                    let nap = libc::timespec {
                        tv_sec: 1,
                        tv_nsec: 0,
                    };
                    // SAFETY: a relative sleep with a valid timespec.
                    unsafe {
                        libc::clock_nanosleep(libc::CLOCK_MONOTONIC, 0, &nap, std::ptr::null_mut())
                    }
                }
                Err(_) => 3,
            };
            // SAFETY: leaving the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        // Until the child sleeps: its system call is clock_nanosleep's.
        let syscall = format!("/proc/{pid}/syscall");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !std::fs::read_to_string(&syscall)
            .is_ok_and(|s| s.starts_with(&format!("{} ", libc::SYS_clock_nanosleep)))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never slept"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut status = 0;
        // SAFETY: signals to and a wait for our own child.
        unsafe {
            libc::kill(pid, libc::SIGSTOP);
            assert_eq!(libc::waitpid(pid, &mut status, libc::WUNTRACED), pid);
            assert!(libc::WIFSTOPPED(status), "status {status:#x}");
            libc::kill(pid, libc::SIGCONT);
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status:#x}: the restarted sleep killed the process"
        );
    }

    #[test]
    fn the_filter_builds_in_both_modes() {
        assert!(build(SeccompAction::KillProcess).is_ok());
        assert!(build(SeccompAction::Log).is_ok());
    }
}
