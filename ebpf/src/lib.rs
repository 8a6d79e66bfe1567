//! pyrometer's kernel-side programs, compiled from C by `build.rs`, and the kernel ABI they
//! share with user space: the structs and constants of `src/bpf/shared.h`, generated from the
//! header by bindgen at build time (`abi`, re-exported here with bindgen's layout checks), and
//! the parsers of the records the programs send.

/// The CPU sampler object: `on_cpu_clock` (perf_event), `on_fork`, `on_exec` and `on_exit`
/// (BTF tracepoints), the optional `on_sched_switch` (off-CPU time), and the maps `targets`,
/// `kernel_stacks`, `samples`, `scratch` (one record per CPU for each of the sampler,
/// sched_switch and the probes), `counters`, `offcpu_pending`.
pub static SAMPLER_OBJECT: &[u8] = aligned_bytes!(concat!(env!("OUT_DIR"), "/sampler.bpf.o"));

/// Embeds a file with 8-byte alignment: the ELF parser reads its headers in place.
#[macro_export]
macro_rules! aligned_bytes {
    ($path:expr) => {{
        #[repr(C, align(8))]
        struct Aligned<B: ?Sized>(B);
        static ALIGNED: &Aligned<[u8]> = &Aligned(*include_bytes!($path));
        &ALIGNED.0
    }};
}

/// The kernel ABI, generated from `src/bpf/shared.h` (see build.rs for the names it gives).
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks
)]
mod abi {
    include!(concat!(env!("OUT_DIR"), "/abi.rs"));
}

pub use abi::*;

/// `struct unwind_row`: the row type of the pyrometer-unwind crate, which builds them; the
/// agent writes them into the `unwind_rows` array as they are. Held to the header's layout,
/// field by field, and the row kinds to its constants.
pub use pyrometer_unwind::UnwindRow;

const _: () = {
    use std::mem::offset_of;
    type C = abi::UnwindRow;
    assert!(size_of::<UnwindRow>() == size_of::<C>());
    assert!(offset_of!(UnwindRow, pc) == offset_of!(C, pc));
    assert!(offset_of!(UnwindRow, cfa_type) == offset_of!(C, cfa_type));
    assert!(offset_of!(UnwindRow, rbp_type) == offset_of!(C, rbp_type));
    assert!(offset_of!(UnwindRow, cfa_offset) == offset_of!(C, cfa_offset));
    assert!(offset_of!(UnwindRow, rbp_offset) == offset_of!(C, rbp_offset));
    assert!(offset_of!(UnwindRow, reserved) == offset_of!(C, reserved));
    let kinds = [
        (pyrometer_unwind::CFA_NONE, CFA_NONE),
        (pyrometer_unwind::CFA_RSP, CFA_RSP),
        (pyrometer_unwind::CFA_RBP, CFA_RBP),
        (pyrometer_unwind::CFA_PLT, CFA_PLT),
        (pyrometer_unwind::CFA_SIGNAL, CFA_SIGNAL),
        (pyrometer_unwind::CFA_END, CFA_END),
        (pyrometer_unwind::CFA_UNSUPPORTED, CFA_UNSUPPORTED),
        (pyrometer_unwind::RBP_SAME, RBP_SAME),
        (pyrometer_unwind::RBP_OFFSET, RBP_OFFSET),
        (pyrometer_unwind::RBP_UNSUPPORTED, RBP_UNSUPPORTED),
    ];
    let mut i = 0;
    while i < kinds.len() {
        assert!(kinds[i].0 as u32 == kinds[i].1);
        i += 1;
    }
    // The kernel masks slot indexes.
    assert!(MAX_SLOTS.is_power_of_two());
};

/// Frees (`ALLOC_FREE`, `ALLOC_PY_FREE`) have no return probe.
pub fn is_free_kind(kind: u32) -> bool {
    kind == ALLOC_FREE || kind == ALLOC_PY_FREE
}

/// Entry k of a table's bucket index: in the low half, the position (from the table's first
/// row) of the last row at or before `pc_base + (k << UNWIND_BUCKET_SHIFT)`; in the high half
/// the same for bucket k + 1, or the last row for the last bucket. `rows` are sorted by pc.
pub fn bucket_index(rows: &[UnwindRow]) -> Vec<u64> {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
        return Vec::new();
    };
    let buckets = ((last.pc - first.pc) >> UNWIND_BUCKET_SHIFT) as usize + 1;
    let mut starts = Vec::with_capacity(buckets + 1);
    let mut at = 0usize;
    for k in 0..buckets {
        let start = first.pc + ((k as u32) << UNWIND_BUCKET_SHIFT);
        while at + 1 < rows.len() && rows[at + 1].pc <= start {
            at += 1;
        }
        starts.push(at as u64);
    }
    starts.push(rows.len() as u64 - 1);
    starts.windows(2).map(|w| w[0] | (w[1] << 32)).collect()
}

/// One Python frame of a record: the code object's address and where it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawPyFrame {
    pub code: u64,
    /// Byte offset of the instruction in the bytecode, or `PY_ADDR_UNKNOWN`.
    pub addr: u32,
    /// `co_firstlineno` as read with the frame, to tell a reused code address apart.
    pub first_line: u32,
    /// The outermost frame of one `_PyEval_EvalFrameDefault` call.
    pub entry: bool,
    /// An asyncio task (`record --async`): the address of its name object, with `code` its
    /// coroutine's code object (0 when unknown) and no position.
    pub task_name: Option<u64>,
}

impl RawPyFrame {
    pub fn from_slots(code: u64, packed: u64) -> Self {
        if packed & PY_TASK_MARK_MASK == PY_TASK_MARK {
            return Self {
                code: packed & !PY_TASK_MARK_MASK,
                addr: PY_ADDR_UNKNOWN,
                first_line: 0,
                entry: false,
                task_name: Some(code),
            };
        }
        Self {
            code,
            addr: (packed & PY_ADDR_MASK) as u32,
            first_line: ((packed >> PY_FIRSTLINE_SHIFT) & PY_FIRSTLINE_MASK) as u32,
            entry: packed & PY_ENTRY_BIT != 0,
            task_name: None,
        }
    }

    /// Whether this is an asyncio task, not a frame.
    pub fn is_task(&self) -> bool {
        self.task_name.is_some()
    }
}

impl OffCpuRecord {
    /// The header this entry's record has when its thread runs again `blocked_ns` after it
    /// blocked, its frame counts bounded by the slots there are.
    fn header_after(&self, blocked_ns: u64) -> SampleHeader {
        let mut header = self.hdr;
        header.value = blocked_ns;
        header.user_frames = header.user_frames.min(MAX_USER_FRAMES as u32);
        header.py_frames = header.py_frames.min(MAX_PY_FRAMES as u32);
        header
    }

    /// The ring-buffer record this entry becomes when its thread runs again `blocked_ns` after
    /// it blocked: the header and the frames it uses.
    pub fn to_record(&self, blocked_ns: u64) -> Vec<u8> {
        let header = self.header_after(blocked_ns);
        let used = header.user_frames as usize + 2 * header.py_frames as usize;
        let mut out = Vec::with_capacity(size_of::<SampleHeader>() + 8 * used);
        // SAFETY: SampleHeader is plain old data without padding; the slice covers exactly it.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(
                (&header as *const SampleHeader).cast::<u8>(),
                size_of::<SampleHeader>(),
            )
        });
        for frame in &self.user[..used] {
            out.extend_from_slice(&frame.to_ne_bytes());
        }
        out
    }
}

/// A thread still blocked: its pending off-CPU interval as if it ran again now.
pub struct PendingOffCpu {
    record: OffCpuRecord,
    blocked_ns: u64,
}

impl PendingOffCpu {
    pub fn new(record: OffCpuRecord, blocked_ns: u64) -> Self {
        Self { record, blocked_ns }
    }

    /// The interval as a sample, read in place.
    pub fn sample(&self) -> RawSample<'_> {
        let header = self.record.header_after(self.blocked_ns);
        let used = header.user_frames as usize + 2 * header.py_frames as usize;
        let slots = &self.record.user[..used];
        RawSample {
            header,
            // SAFETY: any u64 is eight valid bytes; the slice covers exactly `slots`.
            slots: unsafe { std::slice::from_raw_parts(slots.as_ptr().cast::<u8>(), used * 8) },
            kernel: &[],
            copy: None,
        }
    }
}

/// Byte offset of the inline kernel frames in a full record.
pub const KERNEL_FRAMES_OFFSET: usize = std::mem::offset_of!(SampleRecord, kernel);
/// Size of a full `struct sample_record`.
pub const FULL_RECORD_SIZE: usize = size_of::<SampleRecord>();

/// A sample record as read from the ring buffer (or made from a still-blocked thread's
/// pending off-CPU interval, [`PendingOffCpu::sample`], without a copy).
#[derive(Debug, Clone)]
pub struct RawSample<'a> {
    pub header: SampleHeader,
    /// What follows the header: user frames, then Python frame pairs (a move record's new
    /// address instead).
    slots: &'a [u8],
    /// Inline kernel frames (`SAMPLE_KERNEL_INLINE` only).
    kernel: &'a [u8],
    /// The copy of the user stack (`SAMPLE_STACK_COPY` only).
    copy: Option<RawStackCopy<'a>>,
}

/// A sample's copy of its user stack (`SAMPLE_STACK_COPY`): the registers at the sample and
/// the stack's top pages.
#[derive(Debug, Clone, Copy)]
pub struct RawStackCopy<'a> {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    /// The user address of `bytes[0]`.
    pub base: u64,
    pub bytes: &'a [u8],
}

impl RawStackCopy<'_> {
    /// Eight bytes of the stack at `addr`, when the copy holds them.
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let off = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        let b = self.bytes.get(off..off.checked_add(8)?)?;
        Some(u64::from_ne_bytes(b.try_into().ok()?))
    }
}

/// The copy's registers and length before its bytes.
pub const STACK_COPY_HEAD: usize = std::mem::offset_of!(StackCopy, bytes);

/// Why a ring-buffer record could not be read.
#[derive(Debug, PartialEq, Eq)]
pub struct BadRecord(pub &'static str);

impl<'a> RawSample<'a> {
    /// Parses one record; lengths are checked, so a short record is an error, not a panic.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, BadRecord> {
        let hsize = size_of::<SampleHeader>();
        if bytes.len() < hsize {
            return Err(BadRecord("record shorter than its header"));
        }
        // SAFETY: SampleHeader is plain old data and the slice holds at least its size;
        // read_unaligned copes with any alignment of the ring-buffer slot.
        let header = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<SampleHeader>()) };
        let user = header.user_frames as usize;
        if user > MAX_USER_FRAMES || bytes.len() < hsize + user * 8 {
            return Err(BadRecord("user frame count exceeds record"));
        }
        let py = header.py_frames as usize;
        if py > MAX_PY_FRAMES || bytes.len() < hsize + (user + 2 * py) * 8 {
            return Err(BadRecord("Python frame count exceeds record"));
        }
        let kernel = if header.flags & SAMPLE_KERNEL_INLINE != 0 {
            let n = header.kernel_frames as usize;
            if n > MAX_KERNEL_FRAMES || bytes.len() < KERNEL_FRAMES_OFFSET + n * 8 {
                return Err(BadRecord("kernel frame count exceeds record"));
            }
            &bytes[KERNEL_FRAMES_OFFSET..KERNEL_FRAMES_OFFSET + n * 8]
        } else {
            &[]
        };
        if header.flags & SAMPLE_ALLOC_MOVED != 0 && bytes.len() < size_of::<AllocMoveRecord>() {
            return Err(BadRecord("move record without its new address"));
        }
        if header.flags & SAMPLE_GPU_CHANNEL != 0
            && (header.value as usize > GPU_CHUNK_MAX
                || bytes.len() < hsize + header.value as usize)
        {
            return Err(BadRecord("GPU channel chunk longer than its record"));
        }
        // A copy follows the slots the record uses.
        let used = hsize + (user + 2 * py) * 8;
        let copy = if header.flags & SAMPLE_STACK_COPY != 0 {
            if header.flags & SAMPLE_KERNEL_INLINE != 0 {
                return Err(BadRecord("stack copy with inline kernel frames"));
            }
            Some(parse_copy(bytes, used)?)
        } else {
            None
        };
        let slots = if copy.is_some() {
            &bytes[hsize..used]
        } else {
            &bytes[hsize..]
        };
        Ok(Self {
            header,
            slots,
            kernel,
            copy,
        })
    }

    /// The copy of the user stack the record carries (`SAMPLE_STACK_COPY`).
    pub fn stack_copy(&self) -> Option<RawStackCopy<'a>> {
        self.copy
    }

    /// A move record's (`SAMPLE_ALLOC_MOVED`) new address: the word after the header.
    pub fn moved_to(&self) -> Option<u64> {
        if self.header.flags & SAMPLE_ALLOC_MOVED == 0 {
            return None;
        }
        words(&self.slots[..8]).next()
    }

    /// A GPU channel record's (`SAMPLE_GPU_CHANNEL`) chunk: the bytes after the header.
    pub fn gpu_chunk(&self) -> Option<&'a [u8]> {
        if self.header.flags & SAMPLE_GPU_CHANNEL == 0 {
            return None;
        }
        Some(&self.slots[..self.header.value as usize])
    }

    /// User-space return addresses, leaf first.
    pub fn user_frames(&self) -> impl Iterator<Item = u64> + '_ {
        words(&self.slots[..self.header.user_frames as usize * 8])
    }

    /// Python frames, innermost first; shim markers become the entry mark of the frame
    /// before them.
    pub fn python_frames(&self) -> Vec<RawPyFrame> {
        let start = self.header.user_frames as usize * 8;
        let bytes = &self.slots[start..start + self.header.py_frames as usize * 16];
        let mut out: Vec<RawPyFrame> = Vec::with_capacity(self.header.py_frames as usize);
        for c in bytes.chunks_exact(16) {
            let w = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8 bytes"));
            let (code, packed) = (w(&c[..8]), w(&c[8..]));
            if code == 0 && packed == PY_SHIM_MARK {
                if let Some(last) = out.last_mut() {
                    last.entry = true;
                }
                continue;
            }
            out.push(RawPyFrame::from_slots(code, packed));
        }
        // Tasks follow their coroutine's frame, which 3.11 marks as the outermost of its eval
        // call itself (3.12+ mark it with a shim after the tasks): the mark goes to the last
        // task, so the tasks stay with the coroutine frames they ran.
        for i in 0..out.len() {
            if out[i].entry && !out[i].is_task() {
                let run = out[i + 1..].iter().take_while(|f| f.is_task()).count();
                if run > 0 {
                    out[i].entry = false;
                    out[i + run].entry = true;
                }
            }
        }
        out
    }

    /// Kernel addresses copied into the record (stack-map collisions only), leaf first.
    pub fn inline_kernel_frames(&self) -> impl Iterator<Item = u64> + '_ {
        words(self.kernel)
    }

    /// The thread's comm (15 bytes at most, as the kernel truncates it).
    pub fn comm(&self) -> String {
        comm_to_string(&self.header.comm)
    }

    /// The OpenTelemetry span the thread was in, when its process publishes a span table
    /// and the thread was in one (a trace id of zeros is none, as in W3C trace context).
    pub fn span(&self) -> Option<RawSpan> {
        let h = &self.header;
        if h.trace_id == [0; 16] {
            return None;
        }
        Some(RawSpan {
            trace_id: h.trace_id,
            span_id: h.span_id,
            name: comm_to_string(&h.span_name),
        })
    }
}

/// A record's OpenTelemetry span: ids in W3C byte order, the name as far as the record holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RawSpan {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub name: String,
}

impl RawSpan {
    /// The trace id as W3C trace context writes it: 32 lowercase hex digits.
    pub fn trace_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The span id: 16 lowercase hex digits.
    pub fn span_hex(&self) -> String {
        hex(&self.span_id)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The stack copy of a `SAMPLE_STACK_COPY` record, at `at` (after the slots), its length
/// checked against the record.
fn parse_copy(bytes: &[u8], at: usize) -> Result<RawStackCopy<'_>, BadRecord> {
    let head = bytes
        .get(at..at + STACK_COPY_HEAD)
        .ok_or(BadRecord("stack copy record shorter than its copy's head"))?;
    let mut w = words(head);
    let mut next = || w.next().unwrap_or(0);
    let (pc, sp, bp, base) = (next(), next(), next(), next());
    let len = next() as u32 as usize;
    let start = at + STACK_COPY_HEAD;
    if len > STACK_COPY_BYTES as usize || bytes.len() < start + len {
        return Err(BadRecord("stack copy longer than its record"));
    }
    Ok(RawStackCopy {
        pc,
        sp,
        bp,
        base,
        bytes: &bytes[start..start + len],
    })
}

fn words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("chunks_exact yields 8 bytes")))
}

/// A NUL-terminated kernel comm as a string (lossy for non-UTF-8 names).
pub fn comm_to_string(comm: &[u8]) -> String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

// The map values: plain-old-data #[repr(C)] structs (bindgen's layout checks hold them to
// the header's layout).
// SAFETY: integers only, no padding (u64s, then u32 pairs).
unsafe impl aya::Pod for ExecMapping {}
// SAFETY: two u32s, then ExecMappings: no padding.
unsafe impl aya::Pod for ProcessUnwind {}
// SAFETY: the header (no padding) and u64 slots.
unsafe impl aya::Pod for OffCpuRecord {}
// SAFETY: integers and PyOffsets (u32s and u32-sized enums the kernel never writes, so every
// value read back is one user space wrote).
unsafe impl aya::Pod for PyProcess {}
// SAFETY: two u32s, then u64s: no padding.
unsafe impl aya::Pod for GilThread {}
// SAFETY: a u64 and two u32s: no padding.
unsafe impl aya::Pod for PyBodyKey {}
// SAFETY: two u32s, then pairs of u64s: no padding.
unsafe impl aya::Pod for PyBody {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_index_brackets_each_bucket() {
        // bindgen's checks hold the structs to the header's layout; the record's own sums:
        assert_eq!(FULL_RECORD_SIZE, 112 + (512 + 127) * 8);
        assert_eq!(KERNEL_FRAMES_OFFSET, 112 + 512 * 8);
        let row = |pc| UnwindRow::bare(pc, 1);
        // Rows at 0x1000, 0x1100, 0x1500, 0x1d00: buckets start at 0x1000, 0x1400, 0x1800,
        // 0x1c00; the last row at or before each is row 0, 1, 2, 2, and the table's last 3.
        let rows = [row(0x1000), row(0x1100), row(0x1500), row(0x1d00)];
        let pair = |a: u64, b: u64| a | (b << 32);
        assert_eq!(
            bucket_index(&rows),
            vec![pair(0, 1), pair(1, 2), pair(2, 2), pair(2, 3)]
        );
        assert!(bucket_index(&[]).is_empty());
    }

    #[test]
    fn pending_off_cpu_entry_becomes_a_record() {
        let mut rec = OffCpuRecord {
            hdr: SampleHeader {
                flags: SAMPLE_OFFCPU,
                user_frames: 2,
                ..SampleHeader::default()
            },
            user: [0; MAX_SLOTS],
        };
        rec.user[..2].copy_from_slice(&[0x1000, 0x2000]);
        let bytes = rec.to_record(42);
        let s = RawSample::parse(&bytes).unwrap();
        assert_eq!(s.header.value, 42);
        assert_eq!(s.user_frames().collect::<Vec<_>>(), [0x1000, 0x2000]);
        let pending = PendingOffCpu::new(rec, 42);
        let s = pending.sample();
        assert_eq!(s.header.value, 42);
        assert_eq!(s.user_frames().collect::<Vec<_>>(), [0x1000, 0x2000]);
        rec.hdr.user_frames = 10_000;
        assert!(
            RawSample::parse(&rec.to_record(1)).is_ok(),
            "a bad count is clamped"
        );
        let clamped = PendingOffCpu::new(rec, 1);
        assert_eq!(clamped.sample().user_frames().count(), MAX_USER_FRAMES);
    }

    #[test]
    fn a_move_record_carries_the_new_address() {
        let header = SampleHeader {
            flags: SAMPLE_FREE | SAMPLE_ALLOC_MOVED,
            aux: 0x1000,
            value: 2048,
            ..SampleHeader::default()
        };
        // SAFETY: SampleHeader is plain old data.
        let mut bytes = unsafe {
            std::slice::from_raw_parts(
                (&header as *const SampleHeader).cast::<u8>(),
                size_of::<SampleHeader>(),
            )
        }
        .to_vec();
        assert!(
            RawSample::parse(&bytes).is_err(),
            "a move record cut short is refused"
        );
        bytes.extend_from_slice(&0x2000u64.to_ne_bytes());
        let s = RawSample::parse(&bytes).unwrap();
        assert_eq!(s.moved_to(), Some(0x2000));
        let mut free = header;
        free.flags = SAMPLE_FREE;
        // SAFETY: as above.
        let plain = unsafe {
            std::slice::from_raw_parts(
                (&free as *const SampleHeader).cast::<u8>(),
                size_of::<SampleHeader>(),
            )
        };
        assert_eq!(RawSample::parse(plain).unwrap().moved_to(), None);
    }

    #[test]
    fn object_is_bpf_elf() {
        assert_eq!(&SAMPLER_OBJECT[..4], b"\x7fELF");
        // e_machine EM_BPF = 247
        assert_eq!(
            u16::from_le_bytes([SAMPLER_OBJECT[18], SAMPLER_OBJECT[19]]),
            247
        );
    }

    #[test]
    fn python_frames_follow_the_native_ones() {
        let mut rec = OffCpuRecord {
            hdr: SampleHeader {
                user_frames: 1,
                py_frames: 3,
                ..SampleHeader::default()
            },
            user: [0; MAX_SLOTS],
        };
        rec.hdr.py_frames = 3;
        rec.user[0] = 0x4000;
        rec.user[1] = 0xc0de;
        rec.user[2] = 12 | (7 << PY_FIRSTLINE_SHIFT);
        // A shim marker: the frame before it is the outermost of its eval call.
        rec.user[3] = 0;
        rec.user[4] = PY_SHIM_MARK;
        rec.user[5] = 0xc0df;
        rec.user[6] = u64::from(PY_ADDR_UNKNOWN) | PY_ENTRY_BIT;
        let bytes = rec.to_record(0);
        let s = RawSample::parse(&bytes).unwrap();
        assert_eq!(s.user_frames().collect::<Vec<_>>(), [0x4000]);
        let py = s.python_frames();
        assert_eq!(
            py,
            [
                RawPyFrame {
                    code: 0xc0de,
                    addr: 12,
                    first_line: 7,
                    entry: true,
                    task_name: None,
                },
                RawPyFrame {
                    code: 0xc0df,
                    addr: PY_ADDR_UNKNOWN,
                    first_line: 0,
                    entry: true,
                    task_name: None,
                }
            ]
        );
        assert_eq!(
            RawSample::parse(&bytes[..bytes.len() - 8]).unwrap_err(),
            BadRecord("Python frame count exceeds record")
        );
    }

    #[test]
    fn asyncio_tasks_stay_with_the_coroutine_frames_they_ran() {
        let mut rec = OffCpuRecord {
            hdr: SampleHeader {
                py_frames: 4,
                ..SampleHeader::default()
            },
            user: [0; MAX_SLOTS],
        };
        // 3.11: the coroutine's frame is marked the outermost of its eval call itself.
        rec.user[0] = 0xc0de;
        rec.user[1] = 3 | PY_ENTRY_BIT;
        // Its task, then the task awaiting it.
        rec.user[2] = 0x7a5c;
        rec.user[3] = 0xc0de | PY_TASK_MARK;
        rec.user[4] = 0x7a5d;
        rec.user[5] = 0xc0e0 | PY_TASK_MARK;
        rec.user[6] = 0xc0df;
        rec.user[7] = 9 | PY_ENTRY_BIT;
        let bytes = rec.to_record(0);
        let py = RawSample::parse(&bytes).unwrap().python_frames();
        let summary: Vec<_> = py.iter().map(|f| (f.code, f.task_name, f.entry)).collect();
        assert_eq!(
            summary,
            [
                (0xc0de, None, false),
                (0xc0de, Some(0x7a5c), false),
                (0xc0e0, Some(0x7a5d), true),
                (0xc0df, None, true),
            ]
        );
    }

    #[test]
    fn span_ids_read_as_w3c_hex() {
        let mut header = SampleHeader::default();
        let rec = OffCpuRecord {
            hdr: header,
            user: [0; MAX_SLOTS],
        };
        let bytes = rec.to_record(0);
        assert_eq!(RawSample::parse(&bytes).unwrap().span(), None);
        header.trace_id[15] = 0xab;
        header.trace_id[0] = 0x01;
        header.span_id[7] = 0x2c;
        header.span_name[..4].copy_from_slice(b"work");
        let bytes = OffCpuRecord { hdr: header, ..rec }.to_record(0);
        let span = RawSample::parse(&bytes).unwrap().span().unwrap();
        assert_eq!(span.trace_hex(), "010000000000000000000000000000ab");
        assert_eq!(span.span_hex(), "000000000000002c");
        assert_eq!(span.name, "work");
    }

    #[test]
    fn short_records_are_errors() {
        assert!(RawSample::parse(&[0u8; 10]).is_err());
        let mut rec = vec![0u8; 112];
        rec[24..28].copy_from_slice(&5u32.to_ne_bytes());
        assert_eq!(
            RawSample::parse(&rec).unwrap_err(),
            BadRecord("user frame count exceeds record")
        );
        rec.extend_from_slice(&[1u8; 40]);
        let s = RawSample::parse(&rec).unwrap();
        assert_eq!(s.user_frames().count(), 5);
        assert_eq!(s.inline_kernel_frames().count(), 0);
    }

    /// A stack copy's length is checked against the record, and its bytes are read where
    /// the copy holds them only.
    #[test]
    fn stack_copies_are_bounded_by_their_record() {
        let flags = std::mem::offset_of!(SampleHeader, flags);
        let user = std::mem::offset_of!(SampleHeader, user_frames);
        // The header and one user frame, then the copy.
        let mut rec = vec![0u8; size_of::<SampleHeader>() + 8];
        rec[flags..flags + 4].copy_from_slice(&SAMPLE_STACK_COPY.to_ne_bytes());
        rec[user..user + 4].copy_from_slice(&1u32.to_ne_bytes());
        rec[size_of::<SampleHeader>()..].copy_from_slice(&0x401000u64.to_ne_bytes());
        assert_eq!(
            RawSample::parse(&rec).unwrap_err(),
            BadRecord("stack copy record shorter than its copy's head")
        );
        // pc, sp, bp, base, then the length: two pages said, one there.
        for w in [0x401000u64, 0x7000_0010, 0x7000_0100, 0x7000_0000, 8192] {
            rec.extend_from_slice(&w.to_ne_bytes());
        }
        rec.extend((0..4096u32).map(|i| i as u8));
        assert_eq!(
            RawSample::parse(&rec).unwrap_err(),
            BadRecord("stack copy longer than its record")
        );
        rec.extend(std::iter::repeat_n(0u8, 4096));
        let s = RawSample::parse(&rec).unwrap();
        let copy = s.stack_copy().expect("the copy");
        assert_eq!(
            (copy.pc, copy.sp, copy.bytes.len()),
            (0x401000, 0x7000_0010, 8192)
        );
        assert_eq!(
            copy.read_u64(0x7000_0008),
            Some(u64::from_ne_bytes([8, 9, 10, 11, 12, 13, 14, 15]))
        );
        assert_eq!(copy.read_u64(0x7000_0000 + 8190), None);
        assert_eq!(copy.read_u64(0x6fff_fff8), None);
        assert_eq!(copy.read_u64(u64::MAX), None);
        // The slots end where the copy starts.
        assert_eq!(s.user_frames().collect::<Vec<_>>(), [0x401000]);
        assert!(s.python_frames().is_empty());
    }
}
