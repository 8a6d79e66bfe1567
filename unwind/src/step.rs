//! One unwinding step in user space, by the same rules the BPF unwinder follows
//! (`ebpf/src/bpf/unwind.h`): for walking a stack read from another process (`pyrometer dump
//! --native`) and as the reference of the kernel side's arithmetic.

use crate::{CFA_END, CFA_PLT, CFA_RBP, CFA_RSP, CFA_SIGNAL, RBP_OFFSET, RBP_SAME, UnwindRow};

/// The registers a step needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
}

/// What a step found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `regs` now hold the caller's registers.
    Next,
    /// The outermost frame: the walk is complete.
    End,
    /// The walk cannot go on: no row, an unsupported rule, or unreadable stack memory.
    Stop(&'static str),
}

/// `ucontext_t` on x86-64: uc_flags, uc_link, uc_stack (24 bytes), then mcontext's gregs, in
/// which REG_RBP is 10, REG_RSP 15 and REG_RIP 16. At `__restore_rt` the stack pointer points
/// at the ucontext.
const UC_GREGS: u64 = 40;

/// Unwinds the frame `regs` are in with `row` (the row for `regs.pc`, or for `regs.pc - 1`
/// when it is a return address), leaving the caller's registers in `regs`. `read` reads 8
/// bytes of the thread's memory.
pub fn step(row: &UnwindRow, regs: &mut Regs, read: impl Fn(u64) -> Option<u64>) -> Step {
    let cfa = match row.cfa_type {
        CFA_END => return Step::End,
        CFA_SIGNAL => {
            let greg = |n: u64| read(regs.sp.wrapping_add(UC_GREGS + n * 8));
            let (Some(bp), Some(sp), Some(pc)) = (greg(10), greg(15), greg(16)) else {
                return Step::Stop("unreadable signal frame");
            };
            *regs = Regs { pc, sp, bp };
            return if pc == 0 { Step::End } else { Step::Next };
        }
        CFA_RSP => regs.sp.wrapping_add_signed(i64::from(row.cfa_offset)),
        CFA_RBP => regs.bp.wrapping_add_signed(i64::from(row.cfa_offset)),
        CFA_PLT => regs
            .sp
            .wrapping_add(8 + if regs.pc & 15 >= 11 { 8 } else { 0 }),
        _ => return Step::Stop("no CFI row or an unsupported rule"),
    };
    let Some(ra) = read(cfa.wrapping_sub(8)) else {
        return Step::Stop("unreadable return address");
    };
    match row.rbp_type {
        RBP_OFFSET => match read(cfa.wrapping_add_signed(i64::from(row.rbp_offset))) {
            Some(bp) => regs.bp = bp,
            None => return Step::Stop("unreadable saved rbp"),
        },
        RBP_SAME => {}
        _ => return Step::Stop("an unsupported rbp rule"),
    }
    regs.sp = cfa;
    regs.pc = ra;
    if ra == 0 { Step::End } else { Step::Next }
}

/// How the frame at an address unwinds, as a walk's caller finds it ([`walk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// By this row (the one for the address).
    Row(UnwindRow),
    /// By the frame pointer (code the kernel side would walk so: no table for it).
    FramePointer,
    /// Not at all: the walk ends here, incomplete.
    Stop,
}

/// Walks a stack from `regs`, innermost first (the first address the interrupted
/// instruction, the others return addresses), at most `max_frames`, and says whether it
/// reached the outermost frame. `rule` says how the frame at an address unwinds (it is asked
/// for the call itself, one byte before a return address); `read` reads 8 bytes of the
/// thread's memory.
pub fn walk(
    regs: Regs,
    max_frames: usize,
    read: impl Fn(u64) -> Option<u64>,
    mut rule: impl FnMut(u64) -> Rule,
) -> (Vec<u64>, bool) {
    let mut regs = regs;
    let mut frames = Vec::new();
    while frames.len() < max_frames && regs.pc != 0 {
        let lookup = if frames.is_empty() {
            regs.pc
        } else {
            regs.pc - 1
        };
        frames.push(regs.pc);
        let next = match rule(lookup) {
            Rule::Row(row) => step(&row, &mut regs, &read),
            Rule::FramePointer => frame_pointer_step(&mut regs, &read),
            Rule::Stop => break,
        };
        match next {
            Step::Next => {}
            Step::End => return (frames, true),
            Step::Stop(_) => break,
        }
    }
    (frames, false)
}

/// One frame by the frame pointer, as the kernel side's fallback takes it: a zero return
/// address ends the chain without completing it.
pub fn frame_pointer_step(regs: &mut Regs, read: impl Fn(u64) -> Option<u64>) -> Step {
    if regs.bp == 0 {
        return Step::Stop("no frame pointer");
    }
    let (Some(next_bp), Some(ra)) = (read(regs.bp), read(regs.bp.wrapping_add(8))) else {
        return Step::Stop("unreadable frame record");
    };
    *regs = Regs {
        pc: ra,
        sp: regs.bp.wrapping_add(16),
        bp: next_bp,
    };
    if ra == 0 {
        Step::Stop("a zero return address")
    } else {
        Step::Next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn row(cfa_type: u8, cfa_offset: i16, rbp_type: u8, rbp_offset: i16) -> UnwindRow {
        UnwindRow {
            pc: 0,
            cfa_type,
            rbp_type,
            cfa_offset,
            rbp_offset,
            reserved: 0,
        }
    }

    #[test]
    fn rsp_and_rbp_frames() {
        // A frame with rbp pushed at entry: CFA = rsp + 16, the return address at CFA - 8,
        // the caller's rbp at CFA - 16.
        let mem: HashMap<u64, u64> = [(0x1008, 0x4242), (0x1000, 0xbeef)].into();
        let read = |a: u64| mem.get(&a).copied();
        let mut regs = Regs {
            pc: 0x10,
            sp: 0x1000,
            bp: 0x1,
        };
        assert_eq!(
            step(&row(CFA_RSP, 16, RBP_OFFSET, -16), &mut regs, read),
            Step::Next
        );
        assert_eq!(
            regs,
            Regs {
                pc: 0x4242,
                sp: 0x1010,
                bp: 0xbeef
            }
        );
        // CFA from rbp: CFA = rbp + 16.
        let mut regs = Regs {
            pc: 0x10,
            sp: 0,
            bp: 0xff8,
        };
        assert_eq!(
            step(&row(CFA_RBP, 16, RBP_SAME, 0), &mut regs, read),
            Step::Next
        );
        assert_eq!((regs.pc, regs.sp), (0xbeef, 0x1008));
    }

    /// A walk asks for the call (one byte before a return address), follows rows and frame
    /// pointers as told, and ends complete only at an end row.
    #[test]
    fn walks_by_rows_and_frame_pointers() {
        // 0x10 by a row (CFA = rsp + 8, return to 0x20); 0x20 by the frame pointer at 0x2000
        // (saved rbp 0x3000, return to 0x30); 0x30 ends the stack.
        let mem: HashMap<u64, u64> = [(0x1000, 0x20), (0x2000, 0x3000), (0x2008, 0x30)].into();
        let read = |a: u64| mem.get(&a).copied();
        let start = Regs {
            pc: 0x10,
            sp: 0x1000,
            bp: 0x2000,
        };
        let mut asked = Vec::new();
        let (frames, complete) = walk(start, 8, read, |pc| {
            asked.push(pc);
            match pc {
                0x10 => Rule::Row(row(CFA_RSP, 8, RBP_SAME, 0)),
                0x1f => Rule::FramePointer,
                _ => Rule::Row(row(CFA_END, 0, RBP_SAME, 0)),
            }
        });
        assert_eq!((frames, complete), (vec![0x10, 0x20, 0x30], true));
        assert_eq!(asked, [0x10, 0x1f, 0x2f]);
        // A stop, or the frame limit, leaves it incomplete with the frames so far.
        assert_eq!(walk(start, 8, read, |_| Rule::Stop), (vec![0x10], false));
        let (frames, complete) = walk(start, 2, read, |pc| match pc {
            0x10 => Rule::Row(row(CFA_RSP, 8, RBP_SAME, 0)),
            _ => Rule::FramePointer,
        });
        assert_eq!((frames, complete), (vec![0x10, 0x20], false));
        // A frame pointer chain that ends on a zero return address is not complete.
        let mut regs = Regs {
            pc: 1,
            sp: 0,
            bp: 0x2000,
        };
        let zero: HashMap<u64, u64> = [(0x2000, 0), (0x2008, 0)].into();
        assert!(matches!(
            frame_pointer_step(&mut regs, |a| zero.get(&a).copied()),
            Step::Stop(_)
        ));
    }

    #[test]
    fn ends_and_stops() {
        let read = |_| None;
        let mut regs = Regs::default();
        assert_eq!(
            step(&row(CFA_END, 0, RBP_SAME, 0), &mut regs, read),
            Step::End
        );
        assert!(matches!(
            step(&row(CFA_RSP, 8, RBP_SAME, 0), &mut regs, read),
            Step::Stop(_)
        ));
        assert!(matches!(
            step(&row(crate::CFA_NONE, 0, RBP_SAME, 0), &mut regs, read),
            Step::Stop(_)
        ));
        // A zero return address ends the chain (thread start routines clear it).
        let zero = |_| Some(0);
        assert_eq!(
            step(&row(CFA_RSP, 8, RBP_SAME, 0), &mut regs, zero),
            Step::End
        );
    }

    #[test]
    fn signal_frames_read_the_ucontext() {
        let sp = 0x2000u64;
        let mem: HashMap<u64, u64> = [
            (sp + UC_GREGS + 80, 0x77),
            (sp + UC_GREGS + 120, 0x3000),
            (sp + UC_GREGS + 128, 0x555),
        ]
        .into();
        let mut regs = Regs { pc: 0x1, sp, bp: 0 };
        assert_eq!(
            step(&row(CFA_SIGNAL, 0, RBP_SAME, 0), &mut regs, |a| mem
                .get(&a)
                .copied()),
            Step::Next
        );
        assert_eq!(
            regs,
            Regs {
                pc: 0x555,
                sp: 0x3000,
                bp: 0x77
            }
        );
    }
}
