//! Native stacks for `pyrometer dump --native`: a thread's registers, read under a ptrace stop
//! that lasts as long as the read (seize, interrupt, read, detach: the thread is never stopped
//! for longer) or, without stopping it, those of a thread blocked in a system call (the
//! agent's remote dumps), then its user stack walked from user space with the same DWARF
//! unwind tables and rules the kernel unwinder uses, reading the stack through
//! `process_vm_readv`.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyrometer_unwind::{Regs, Rule, UnwindRow, lookup};

use crate::os::elfsyms::loads;
use crate::os::procs::{BinaryKey, Process};
use crate::os::workers::ProcessReads;

/// Frames walked at most, as the kernel unwinder.
pub const MAX_NATIVE_FRAMES: usize = 256;

/// How long a thread is given to stop for its registers to be read. A thread in a wait the
/// interrupt cannot end (a read from a file system that does not answer) stops only when
/// that wait ends, perhaps never: it is given up on and stays seized, so when the wait ends
/// it stops until this process exits and the kernel detaches it (`dump` exits at once).
pub const STOP_WAIT: Duration = Duration::from_millis(500);

/// How a dump reads a thread's registers for its native frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registers {
    /// Under a ptrace stop as long as the read ([`thread_registers`]): `dump --native` on the
    /// node.
    Stop,
    /// Without stopping the thread: those the kernel shows for a thread blocked in a system
    /// call ([`blocked_registers`]), else one perf sample of it running
    /// ([`super::native_sample::sample_running`]). The agent's remote dumps, whose
    /// system-call filter has no ptrace.
    Blocked,
}

/// The user stack and instruction pointers of thread `tid` of `pid` while it is blocked in a
/// system call, as the kernel shows them in `/proc/PID/task/TID/syscall` (read with ptrace
/// access, without stopping the thread). The frame pointer is not shown: a walk recovers it
/// where a frame saved it, and stops at a frame that needs it before that.
pub fn blocked_registers(proc_root: &Path, pid: u32, tid: u32) -> std::io::Result<Regs> {
    let path = proc_root.join(format!("{pid}/task/{tid}/syscall"));
    let mut text = String::new();
    // A kernel file of one short line: a bounded read all the same.
    std::fs::File::open(&path)?
        .take(256)
        .read_to_string(&mut text)?;
    parse_syscall(&text)
}

/// `/proc/PID/task/TID/syscall`: `NR ARG1 … ARG6 SP PC` in a system call, `-1 SP PC` blocked
/// outside one, `running` on a CPU.
fn parse_syscall(text: &str) -> std::io::Result<Regs> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    if fields.first() == Some(&"running") {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            "it was running on a CPU: without stopping it, only a thread blocked in a system \
             call shows its registers",
        ));
    }
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let regs = match fields[..] {
        [.., sp, pc] if fields.len() == 9 || fields.len() == 3 => hex(sp).zip(hex(pc)),
        _ => None,
    };
    regs.map(|(sp, pc)| Regs { pc, sp, bp: 0 })
        .ok_or_else(|| std::io::Error::other(format!("unreadable registers: {text:?}")))
}

/// A thread's user registers, read while it is stopped for the read alone. Fails (with the
/// OS error) when the thread cannot be traced: gone, already traced by a debugger, or no
/// permission; and when it does not stop within [`STOP_WAIT`].
pub fn thread_registers(tid: u32) -> std::io::Result<Regs> {
    let tid = tid as libc::pid_t;
    let last = std::io::Error::last_os_error;
    // SAFETY: ptrace and waitpid on a thread id with valid pointers; every path that seized
    // the thread detaches it again.
    unsafe {
        if libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) != 0 {
            return Err(last());
        }
        let mut signal = 0;
        let result = (|| {
            if libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) != 0 {
                return Err(last());
            }
            let status = wait_stopped(tid)?;
            if !libc::WIFSTOPPED(status) {
                return Err(std::io::Error::other("the thread exited"));
            }
            // A signal arriving just then stops it for delivery instead: it is handed back
            // at the detach, so the process still gets it.
            if status >> 16 != libc::PTRACE_EVENT_STOP {
                signal = libc::WSTOPSIG(status);
            }
            let mut regs: libc::user_regs_struct = std::mem::zeroed();
            if libc::ptrace(libc::PTRACE_GETREGS, tid, 0, &mut regs) != 0 {
                return Err(last());
            }
            Ok(Regs {
                pc: regs.rip,
                sp: regs.rsp,
                bp: regs.rbp,
            })
        })();
        libc::ptrace(libc::PTRACE_DETACH, tid, 0, signal as libc::c_long);
        result
    }
}

/// Waits up to [`STOP_WAIT`] for seized thread `tid` to report a stop; its wait status.
fn wait_stopped(tid: libc::pid_t) -> std::io::Result<i32> {
    let until = Instant::now() + STOP_WAIT;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on a thread this process traces, with a valid pointer.
        match unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) } {
            r if r == tid => return Ok(status),
            0 if Instant::now() < until => std::thread::sleep(Duration::from_millis(1)),
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "it did not stop within {} ms (in a wait that cannot be interrupted, \
                         such as a read from a file system that does not answer)",
                        STOP_WAIT.as_millis()
                    ),
                ));
            }
            _ => return Err(std::io::Error::last_os_error()),
        }
    }
}

/// An object's unwind rows and the segments that turn file offsets into its addresses.
struct Table {
    rows: Vec<UnwindRow>,
    /// (virtual address, file offset, file size) of each PT_LOAD.
    loads: Vec<(u64, u64, u64)>,
}

/// How long building one object's unwind table may take (a file on a file system that does
/// not answer); past it the object is given up on, and the process's other objects too.
pub const TABLE_DEADLINE: Duration = Duration::from_secs(2);

/// Unwind tables of the objects walked through, built once each, on a worker within
/// [`TABLE_DEADLINE`].
pub struct NativeTables {
    tables: HashMap<BinaryKey, Option<Arc<Table>>>,
    reads: ProcessReads,
}

impl Default for NativeTables {
    fn default() -> Self {
        Self {
            tables: HashMap::new(),
            reads: ProcessReads::new(1, TABLE_DEADLINE, super::REST_OF_DUMP),
        }
    }
}

impl NativeTables {
    /// Whether a read of `pid`'s objects overran its deadline (its walks stop there).
    pub fn gave_up_on(&self, pid: u32) -> bool {
        self.reads.is_stalled(pid)
    }

    fn get(&mut self, process: &Process, addr: u64) -> Option<(Arc<Table>, u64)> {
        let (m, offset) = process.find(addr)?;
        let binary = m.binary()?;
        let reads = &mut self.reads;
        let table = self
            .tables
            .entry(binary.key().clone())
            .or_insert_with(|| {
                let path = binary.path().to_path_buf();
                reads.run(process.pid, move || build(&path)).flatten()
            })
            .clone()?;
        let vaddr = table
            .loads
            .iter()
            .find(|&&(_, off, size)| off <= offset && offset < off + size)
            .map(|&(vaddr, off, _)| offset - off + vaddr)?;
        Some((table, vaddr))
    }
}

/// The unwind table of the object at `path` and its PT_LOAD segments.
fn build(path: &std::path::Path) -> Option<Arc<Table>> {
    let bytes =
        crate::os::untrusted::UntrustedFile::open_resolved(path, crate::os::untrusted::Kind::Elf)
            .and_then(|f| f.copy_elf_sections(&[".eh_frame", ".debug_frame"]))
            .ok()?;
    let obj = object::File::parse(&*bytes).ok()?;
    let loads = loads(&obj);
    let table = pyrometer_unwind::build_table(&bytes).ok()?;
    Some(Arc::new(Table {
        rows: table.rows,
        loads,
    }))
}

/// The user stack of a thread of `process` stopped at `regs`, innermost first (the first
/// address the interrupted instruction, the others return addresses), and whether the walk
/// reached the outermost frame. `read` reads 8 bytes of the process's memory.
pub fn walk(
    process: &Process,
    regs: Regs,
    read: impl Fn(u64) -> Option<u64>,
    tables: &mut NativeTables,
) -> (Vec<u64>, bool) {
    pyrometer_unwind::walk(regs, MAX_NATIVE_FRAMES, read, |pc| {
        tables
            .get(process, pc)
            .and_then(|(table, vaddr)| lookup(&table.rows, u32::try_from(vaddr).ok()?).copied())
            .map_or(Rule::Stop, Rule::Row)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscall_lines() {
        let blocked = "230 0x1 0x0 0x7ffd5c0 0x0 0x0 0x0 0x7ffd5b8f0a8 0x7f3e1c2e4c7d\n";
        assert_eq!(
            parse_syscall(blocked).unwrap(),
            Regs {
                pc: 0x7f3e1c2e4c7d,
                sp: 0x7ffd5b8f0a8,
                bp: 0
            }
        );
        let outside = "-1 0x7ffd5b8f0a8 0x55d0c0de\n";
        assert_eq!(parse_syscall(outside).unwrap().pc, 0x55d0c0de);
        let running = parse_syscall("running\n").unwrap_err().to_string();
        assert!(running.contains("running on a CPU"), "{running}");
        for bad in [
            "",
            "1 2",
            "230 0x1 zz 0x3",
            "230 0x1 0x0 0x0 0x0 0x0 0x0 0xsp 0x1",
        ] {
            assert!(parse_syscall(bad).is_err(), "{bad:?}");
        }
    }

    /// A Python thread asleep in a system call: its registers without a stop, and a walk
    /// from them through libc into the interpreter.
    #[test]
    fn a_sleeping_threads_stack_without_stopping_it() {
        let Some(mut child) =
            crate::python::tests::pyenv_311("import time\nprint('up', flush=True)\ntime.sleep(30)")
        else {
            return;
        };
        let pid = child.id();
        let mut registry = crate::os::procs::ProcessRegistry::new();
        let mem = crate::python::memory::ProcessMemory::new(pid);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (addrs, regs) = loop {
            // Until it is asleep (exec and the loader run first).
            if let Ok(regs) = blocked_registers(Path::new("/proc"), pid, pid) {
                let process = registry.observe(pid).expect("sleep runs");
                let mut tables = NativeTables::default();
                let (addrs, _) = walk(
                    process,
                    regs,
                    |a| crate::python::memory::Memory::read_u64(&mem, a).ok(),
                    &mut tables,
                );
                if addrs.len() >= 8 {
                    break (addrs, regs);
                }
            }
            assert!(Instant::now() < deadline, "python never blocked");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut symbolizer = crate::symbolize::Symbolizer::new();
        let frames = symbolizer.user(&mut registry, pid, &addrs);
        let names: Vec<&str> = frames.iter().map(|f| f.function.as_str()).collect();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            names.iter().any(|n| n.contains("nanosleep")),
            "no nanosleep at pc {:#x}: {names:?}",
            regs.pc
        );
        assert!(
            names.iter().any(|n| n.contains("_PyEval_EvalFrameDefault")),
            "the walk did not reach the interpreter's loop: {names:?}"
        );
    }
}
