//! Samples held back for their unwind tables: a sample taken while the table of code on its
//! stack was being built, or before the process's mappings were read, comes with a copy of
//! its user stack (`SAMPLE_STACK_COPY`). It waits here, bounded in bytes and time, until no
//! table of its process is pending any more; then its copy is walked again with the same
//! tables the kernel uses ([`Unwinder::replay`]) and, when that walk goes further, its user
//! frames are replaced before it is counted. A record whose tables never come is counted as
//! the kernel walked it.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use pyrometer_ebpf::{
    MAX_SLOTS, MAX_USER_FRAMES, ProcessUnwind, RawSample, RawStackCopy, SAMPLE_COMPLETE,
    SAMPLE_DWARF, SAMPLE_STACK_COPY, SampleHeader,
};
use pyrometer_unwind::Regs;

use super::Route;
use crate::unwinder::Unwinder;
use crate::unwinder::replay::covers;

/// Bytes of held records (their copies mostly) past which the oldest is counted as it is.
pub const MAX_HELD_BYTES: usize = 8 << 20;
/// The longest a record waits for its tables: a table build's deadline is 5 s, but one that
/// takes this long is rare, and the record's interval is being pushed meanwhile.
pub const MAX_HOLD: Duration = Duration::from_secs(3);

/// What became of the samples that came with a stack copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldStats {
    /// Samples that came with a copy of their stack.
    pub received: u64,
    /// ... whose frames the walk of the copy replaced (it went further than the kernel's).
    pub rewalked: u64,
    /// ... of those, walks that reached the outermost frame.
    pub complete: u64,
    /// ... counted as the kernel walked them: the tables did not come within [`MAX_HOLD`],
    /// the process was gone, the walk went no further, or there was no room to hold them.
    pub unchanged: u64,
    /// Of those walked again or not, the ones counted before their tables came: for room
    /// ([`MAX_HELD_BYTES`]), after [`MAX_HOLD`], or at the end.
    pub early: u64,
}

struct Held {
    pid: u32,
    since: Instant,
    route: Route,
    /// The record without its copy (the header, its slots and any inline kernel frames).
    record: Vec<u8>,
    regs: Regs,
    base: u64,
    stack: Vec<u8>,
}

impl Held {
    fn bytes(&self) -> usize {
        self.record.len() + self.stack.len()
    }
}

/// The records waiting, oldest first.
#[derive(Default)]
pub struct HeldStacks {
    held: VecDeque<Held>,
    bytes: usize,
    stats: HeldStats,
    /// Processes whose maps should be read again: a held sample's address is in none.
    refresh: Vec<u32>,
    /// The unwinder's generation at the last look.
    looked_at: Option<u64>,
}

impl HeldStacks {
    pub fn stats(&self) -> HeldStats {
        self.stats
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Processes whose maps should be read again for a held sample (since the last call).
    pub fn take_refresh(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.refresh)
    }

    /// Holds `sample` (one with a stack copy) for its tables; a record held longest comes
    /// back, to be counted now, when the bytes held would pass [`MAX_HELD_BYTES`].
    pub fn hold(
        &mut self,
        sample: &RawSample,
        bytes: &[u8],
        route: Route,
    ) -> Vec<(Vec<u8>, Route)> {
        let Some(copy) = sample.stack_copy() else {
            return vec![(bytes.to_vec(), route)];
        };
        self.stats.received += 1;
        let h = sample.header;
        // The copy follows the slots (a record with one has no inline kernel frames).
        let end =
            size_of::<SampleHeader>() + (h.user_frames as usize + 2 * h.py_frames as usize) * 8;
        let mut record = bytes[..end.min(bytes.len())].to_vec();
        // Without its copy now: counted as a plain record.
        let at = std::mem::offset_of!(SampleHeader, flags);
        let flags = h.flags & !SAMPLE_STACK_COPY;
        record[at..at + 4].copy_from_slice(&flags.to_ne_bytes());
        let held = Held {
            pid: h.pid,
            since: Instant::now(),
            route,
            record,
            regs: Regs {
                pc: copy.pc,
                sp: copy.sp,
                bp: copy.bp,
            },
            base: copy.base,
            stack: copy.bytes.to_vec(),
        };
        let mut out = Vec::new();
        while !self.held.is_empty() && self.bytes + held.bytes() > MAX_HELD_BYTES {
            let old = self.pop_front();
            self.stats.early += 1;
            self.stats.unchanged += 1;
            out.push((old.record, old.route));
        }
        self.bytes += held.bytes();
        self.held.push_back(held);
        // A new record is looked at on the next pass, whatever changed.
        self.looked_at = None;
        out
    }

    /// A process whose maps could not be read again yet (the registry spaces its reads): its
    /// held samples are looked at again on the next pass, which asks again.
    pub fn refresh_later(&mut self) {
        self.looked_at = None;
    }

    fn pop_front(&mut self) -> Held {
        let h = self.held.pop_front().expect("not empty");
        self.bytes -= h.bytes();
        h
    }

    /// The records whose tables are in (or that waited [`MAX_HOLD`]; all of them with
    /// `all`), their frames replaced where a walk of their copy goes further. Without an
    /// unwinder they are counted as they are.
    pub fn release(&mut self, unwinder: Option<&Unwinder>, all: bool) -> Vec<(Vec<u8>, Route)> {
        let now = Instant::now();
        // Nothing to look at before an entry changed or a record's time is up: the loop
        // turns every few ms, and a look reads each waiting process's entry from the kernel.
        let generation = unwinder.map(Unwinder::generation);
        let due = self
            .held
            .front()
            .is_some_and(|h| now.duration_since(h.since) >= MAX_HOLD);
        if !all && generation.is_some() && generation == self.looked_at && !due {
            return Vec::new();
        }
        self.looked_at = generation;
        // Per process, once a look: whether it still runs, whether a table of it is still on
        // its way, and its entry.
        let mut processes: HashMap<u32, (bool, bool, Option<ProcessUnwind>)> = HashMap::new();
        let mut out = Vec::new();
        let mut kept = VecDeque::with_capacity(self.held.len());
        while let Some(h) = self.held.pop_front() {
            self.bytes -= h.bytes();
            let (alive, pending, entry) = match unwinder {
                Some(u) => {
                    let p = processes.entry(h.pid).or_insert_with(|| {
                        (
                            crate::os::pids::exists(h.pid),
                            u.pending(h.pid),
                            u.entry(h.pid),
                        )
                    });
                    (p.0, p.1, p.2.as_ref())
                }
                None => (false, false, None),
            };
            // Its tables are in when none of its process's is pending and the mapping the
            // sample was taken in is one the entry has (the loader maps libraries after the
            // exec, whose maps registered the process): until then its maps are read again.
            // A process that is gone gets no more: its samples go with what there is.
            let uncovered = alive && entry.is_some_and(|e| !covers(e, h.regs.pc));
            if uncovered && !self.refresh.contains(&h.pid) {
                self.refresh.push(h.pid);
            }
            let waiting = uncovered || (alive && pending);
            if waiting && !all && now.duration_since(h.since) < MAX_HOLD {
                self.bytes += h.bytes();
                kept.push_back(h);
                continue;
            }
            if waiting {
                self.stats.early += 1;
            }
            let rewalked = match (unwinder, entry) {
                (Some(u), Some(e)) => self.rewalk(u, e, &h),
                _ => None,
            };
            let record = match rewalked {
                Some(r) => r,
                None => {
                    self.stats.unchanged += 1;
                    h.record
                }
            };
            out.push((record, h.route));
        }
        self.held = kept;
        out
    }

    /// The record with the frames of its copy's walk, when that walk goes further than the
    /// kernel's did.
    fn rewalk(&mut self, unwinder: &Unwinder, entry: &ProcessUnwind, h: &Held) -> Option<Vec<u8>> {
        let copy = RawStackCopy {
            pc: h.regs.pc,
            sp: h.regs.sp,
            bp: h.regs.bp,
            base: h.base,
            bytes: &h.stack,
        };
        let walk = unwinder.replay(entry, h.regs, |a| copy.read_u64(a));
        let sample = RawSample::parse(&h.record).ok()?;
        let before = sample.header.user_frames as usize;
        let was_complete = sample.header.flags & SAMPLE_COMPLETE != 0;
        if was_complete || !(walk.complete || walk.frames.len() > before) {
            return None;
        }
        self.stats.rewalked += 1;
        if walk.complete {
            self.stats.complete += 1;
        }
        Some(with_frames(&sample, &h.record, &walk.frames, walk.complete))
    }
}

/// `record` (parsed as `sample`) with `frames` for its user frames; its Python frame pairs
/// stay as they were. Frames past what a record holds are cut (the
/// outermost ones).
fn with_frames(sample: &RawSample, record: &[u8], frames: &[u64], complete: bool) -> Vec<u8> {
    let mut h = sample.header;
    let hsize = size_of::<SampleHeader>();
    let old_user = h.user_frames as usize;
    let py_slots = 2 * h.py_frames as usize;
    let room = (MAX_SLOTS - py_slots).min(MAX_USER_FRAMES);
    let cut = frames.len() > room;
    let frames = &frames[..frames.len().min(room)];
    h.user_frames = frames.len() as u32;
    h.flags = (h.flags & !SAMPLE_STACK_COPY) | SAMPLE_DWARF;
    if complete && !cut {
        h.flags |= SAMPLE_COMPLETE;
    }
    // A record with a copy has no inline kernel frames (the kernel sends none with one).
    let mut out = Vec::with_capacity(hsize + (frames.len() + py_slots) * 8);
    // SAFETY: SampleHeader is plain old data (bindgen's repr(C) struct, no padding).
    out.extend_from_slice(unsafe {
        std::slice::from_raw_parts((&raw const h).cast::<u8>(), hsize)
    });
    for f in frames {
        out.extend_from_slice(&f.to_ne_bytes());
    }
    let py = hsize + old_user * 8;
    out.extend_from_slice(&record[py..py + py_slots * 8]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyrometer_ebpf::MAX_PY_FRAMES;

    fn record(user: &[u64], py: &[u64], flags: u32) -> Vec<u8> {
        let h = SampleHeader {
            user_frames: user.len() as u32,
            py_frames: (py.len() / 2) as u32,
            flags,
            ..SampleHeader::default()
        };
        // SAFETY: plain old data.
        let mut out = unsafe {
            std::slice::from_raw_parts((&raw const h).cast::<u8>(), size_of::<SampleHeader>())
        }
        .to_vec();
        for w in user.iter().chain(py) {
            out.extend_from_slice(&w.to_ne_bytes());
        }
        out
    }

    /// The new frames take the old ones' place; the Python pairs follow them unchanged and
    /// the record says the walk's flags.
    #[test]
    fn frames_are_replaced_and_python_pairs_kept() {
        let old = record(&[0x10, 0x20], &[0xc0de, 7, 0xc0df, 9], 0);
        let sample = RawSample::parse(&old).unwrap();
        let new = with_frames(&sample, &old, &[0x10, 0x21, 0x31, 0x41], true);
        let parsed = RawSample::parse(&new).unwrap();
        assert_eq!(
            parsed.user_frames().collect::<Vec<_>>(),
            [0x10, 0x21, 0x31, 0x41]
        );
        let py: Vec<u64> = parsed.python_frames().iter().map(|f| f.code).collect();
        assert_eq!(py, [0xc0de, 0xc0df]);
        let flags = parsed.header.flags;
        assert_ne!(flags & SAMPLE_COMPLETE, 0);
        assert_ne!(flags & SAMPLE_DWARF, 0);
    }

    /// A walk longer than a record's native frames is cut, and is then not complete.
    #[test]
    fn a_walk_is_cut_to_the_frames_a_record_holds() {
        let py: Vec<u64> = (0..2 * MAX_PY_FRAMES as u64).collect();
        let old = record(&[1], &py, 0);
        let sample = RawSample::parse(&old).unwrap();
        let frames: Vec<u64> = (1..=300).collect();
        let new = with_frames(&sample, &old, &frames, true);
        let parsed = RawSample::parse(&new).unwrap();
        assert_eq!(parsed.header.user_frames as usize, MAX_USER_FRAMES);
        assert_eq!(parsed.header.flags & SAMPLE_COMPLETE, 0);
        assert_eq!(parsed.python_frames().len(), MAX_PY_FRAMES);
    }

    /// Held bytes are bounded: the oldest record comes back once the bound would pass.
    #[test]
    fn holding_is_bounded_in_bytes() {
        let mut held = HeldStacks::default();
        let mut bytes = record(&[1], &[], SAMPLE_STACK_COPY);
        // The copy's head: pc, sp, bp, base, then the length, then the bytes.
        for w in [0x1000u64, 0x7f00, 0, 0x7000] {
            bytes.extend_from_slice(&w.to_ne_bytes());
        }
        let len = pyrometer_ebpf::STACK_COPY_BYTES as usize;
        bytes.extend_from_slice(&(len as u64).to_ne_bytes());
        bytes.resize(bytes.len() + len, 0);
        let sample = RawSample::parse(&bytes).unwrap();
        let copy = sample.stack_copy().expect("a copy");
        assert_eq!(
            (copy.pc, copy.base, copy.bytes.len()),
            (0x1000, 0x7000, len)
        );
        let mut back = 0;
        let n = MAX_HELD_BYTES / len + 10;
        for _ in 0..n {
            back += held.hold(&sample, &bytes, Route::Main).len();
            assert!(held.bytes <= MAX_HELD_BYTES);
        }
        assert!(back >= 10, "{back} of {n} came back");
        assert_eq!(held.stats().early as usize, back);
        assert_eq!(held.stats().unchanged as usize, back);
        // Without an unwinder everything goes, as it came.
        let all = held.release(None, false);
        assert_eq!(all.len() + back, n);
        assert_eq!(held.bytes, 0);
        let first = RawSample::parse(&all[0].0).unwrap();
        assert_eq!(first.user_frames().collect::<Vec<_>>(), [1]);
        assert_eq!(first.header.flags & SAMPLE_STACK_COPY, 0);
        assert!(first.stack_copy().is_none());
    }
}
