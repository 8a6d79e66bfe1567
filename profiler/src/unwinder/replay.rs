//! Walking a sample's copy of its user stack (`SAMPLE_STACK_COPY`) in user space, with the
//! rows and mapping table the kernel walks with: the process's entry in `unwind_procs` and
//! the row array, both as they are now that the tables the sample lacked are in. Each step
//! follows the kernel's (`ebpf/src/bpf/unwind.h`): a row where the mapping has a table, frame
//! pointers where it has none or the address is in no mapping, a stop where a table has no
//! row for it (the walk itself is `pyrometer_unwind::walk`, which `dump --native` uses too).

use pyrometer_ebpf::{ExecMapping, MAX_MAPPINGS, MAX_USER_FRAMES, ProcessUnwind};
use pyrometer_unwind::{Regs, Rule, UnwindRow, walk};

use super::Unwinder;
use super::arrays::Window;

/// A stack walked again from its copy, innermost first, and whether it reached the outermost
/// frame.
pub struct Replayed {
    pub frames: Vec<u64>,
    pub complete: bool,
}

impl Unwinder {
    /// The process's entry in `unwind_procs` as the kernel walks with it now (None: it has
    /// none, e.g. it exited and was forgotten). A copy: read once for a process's held samples.
    pub fn entry(&self, pid: u32) -> Option<ProcessUnwind> {
        self.procs.get(&pid, 0).ok()
    }

    /// How many times a process's entry was written: held samples wait for a change.
    pub fn generation(&self) -> u64 {
        self.clock
    }

    /// Walks the stack of a sample of the process whose entry is `entry`, taken at `regs`,
    /// reading the stack with `read` (the sample's copy).
    pub fn replay(
        &self,
        entry: &ProcessUnwind,
        regs: Regs,
        read: impl Fn(u64) -> Option<u64>,
    ) -> Replayed {
        let maps = mappings(entry);
        // The rows of each mapping met, mapped once for the walk: a stack goes back and forth
        // between a program and its libraries.
        let mut windows: Vec<(u64, Window)> = Vec::new();
        let (frames, complete) = walk(regs, MAX_USER_FRAMES, read, |pc| {
            let Some(m) = maps
                .iter()
                .find(|m| m.start <= pc && pc < m.end && m.row_count > 0)
            else {
                // No mapping, or no table for it: frame pointers, as the kernel does.
                return Rule::FramePointer;
            };
            let at = match windows.iter().position(|(start, _)| *start == m.start) {
                Some(at) => at,
                None => match self.rows.window(m.row_first, m.row_count) {
                    Ok(w) => {
                        windows.push((m.start, w));
                        windows.len() - 1
                    }
                    Err(_) => return Rule::Stop,
                },
            };
            u32::try_from(pc.wrapping_sub(m.bias))
                .ok()
                .and_then(|rel| find_row(&windows[at].1, m, rel))
                .map_or(Rule::Stop, Rule::Row)
        });
        Replayed { frames, complete }
    }
}

/// The executable mappings of a process's entry.
fn mappings(entry: &ProcessUnwind) -> &[ExecMapping] {
    &entry.maps[..(entry.count as usize).min(MAX_MAPPINGS)]
}

/// Whether the entry has a mapping holding `pc`.
pub fn covers(entry: &ProcessUnwind, pc: u64) -> bool {
    mappings(entry).iter().any(|m| m.start <= pc && pc < m.end)
}

/// The last row of the mapping's table at or before `pc` (rows are sorted by pc).
fn find_row(window: &Window, m: &ExecMapping, pc: u32) -> Option<UnwindRow> {
    let count = m.row_count as usize;
    let row = |i: usize| window.read::<UnwindRow>(i);
    let (mut lo, mut hi) = (0usize, count);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if row(mid)?.pc <= pc {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo.checked_sub(1).and_then(row)
}
