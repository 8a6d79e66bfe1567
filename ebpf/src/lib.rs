//! pyrometer's kernel-side programs, compiled from C by `build.rs`, and the `#[repr(C)]`
//! mirrors of the structs they share with the agent (`src/bpf/shared.h`).

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

pub const MAX_USER_FRAMES: usize = 256;
/// Python frames a record holds (two slots each, after the native frames).
pub const MAX_PY_FRAMES: usize = 128;
/// Slots of a record: native frames, then Python frame pairs.
pub const MAX_SLOTS: usize = MAX_USER_FRAMES + 2 * MAX_PY_FRAMES;
/// Most frames a frame-pointer stack has (perf's callchain limit).
pub const FP_MAX_FRAMES: usize = 127;
/// Executable mappings per process in the unwinder's table.
pub const MAX_MAPPINGS: usize = 128;
pub const MAX_KERNEL_FRAMES: usize = 127;
pub const COMM_LEN: usize = 16;
/// Bytes of a span name a record carries.
pub const SPAN_NAME_LEN: usize = 16;

/// `filter_mode` values.
pub const FILTER_ALL: u32 = 0;
pub const FILTER_TARGETS: u32 = 1;

/// `debug_reject` bits (tests of the degraded paths): the kernel refuses the stage named.
pub mod reject {
    pub const DWARF: u32 = 1;
    pub const OFFCPU: u32 = 2;
    pub const GIL: u32 = 4;
    pub const ALLOC: u32 = 8;
    /// The CPU sampler itself, with or without the DWARF walk.
    pub const SAMPLER: u32 = 16;
}

/// `targets` value flags.
pub const TARGET_SELECTED: u32 = 1;
pub const TARGET_FOLLOW_CHILDREN: u32 = 2;

/// `SampleHeader::flags`: the kernel stack is inline after the user frame slots.
pub const SAMPLE_KERNEL_INLINE: u32 = 1;
/// `SampleHeader::flags`: not a sample but an exec event (header only).
pub const SAMPLE_EVENT_EXEC: u32 = 2;
/// `SampleHeader::flags`: the user stack was walked with DWARF unwind tables.
pub const SAMPLE_DWARF: u32 = 4;
/// `SampleHeader::flags`: the DWARF walk reached the outermost frame.
pub const SAMPLE_COMPLETE: u32 = 8;
/// `SampleHeader::flags`: an off-CPU interval; `value_ns` is how long the thread was blocked,
/// starting at `timestamp_ns`, in the stack the record carries.
pub const SAMPLE_OFFCPU: u32 = 16;
/// `SampleHeader::flags`: the Python frame chain was longer than the record holds.
pub const SAMPLE_PY_TRUNCATED: u32 = 32;
/// `SampleHeader::flags`: a thread of a Python process without a Python thread state.
pub const SAMPLE_PY_NO_THREAD: u32 = 64;
/// `SampleHeader::flags`: the Python frame chain could not be read to its end.
pub const SAMPLE_PY_READ_ERROR: u32 = 128;

/// `SampleHeader::flags`: an on-CPU sample of a thread holding the GIL (`record --gil`).
pub const SAMPLE_GIL_HELD: u32 = 256;
/// `SampleHeader::flags`: a contended GIL wait; `value` is its length in ns, from
/// `timestamp_ns`, in the stack the record carries (taken when the wait began).
pub const SAMPLE_GIL_WAIT: u32 = 512;

/// `SampleHeader::flags`: a sampled allocation; `value` is its size, `aux` its address.
pub const SAMPLE_ALLOC: u32 = 1024;
/// `SampleHeader::flags`: a sampled block was freed (header only); `aux` is its address.
pub const SAMPLE_FREE: u32 = 2048;
/// `SampleHeader::flags`: the DWARF walk met a pc in no registered mapping.
pub const SAMPLE_UNKNOWN_MAPPING: u32 = 4096;
/// `SampleHeader::flags`, with `SAMPLE_ALLOC`: reported by the preloaded sampler library,
/// whose two innermost frames are its probe function and the allocator function called.
pub const SAMPLE_ALLOC_PRELOAD: u32 = 8192;
/// `SampleHeader::flags`, with `SAMPLE_ALLOC`: not tracked for its free (a table was full):
/// it counts as allocated, never as in use.
pub const SAMPLE_ALLOC_UNTRACKED: u32 = 16384;
/// `SampleHeader::flags`, with `SAMPLE_FREE`: a sampled block was resized, not freed: `aux`
/// is its old address, `value` its new size and [`RawSample::moved_to`] its new address.
pub const SAMPLE_ALLOC_MOVED: u32 = 32768;
/// `SampleHeader::flags`: the Python walk found the thread's state by a search (a thread
/// new to the kernel side's cache); the record woke the agent.
pub const SAMPLE_PY_NEW_THREAD: u32 = 65536;

/// Allocator entry points, the probe cookie the kernel side dispatches on (`ALLOC_*` in
/// alloc.h).
pub mod alloc_kind {
    pub const MALLOC: u32 = 1;
    pub const CALLOC: u32 = 2;
    pub const REALLOC: u32 = 3;
    pub const ALIGNED: u32 = 4;
    pub const POSIX_MEMALIGN: u32 = 5;
    pub const FREE: u32 = 6;
    pub const VALLOC: u32 = 7;
    pub const PY_MALLOC: u32 = 8;
    pub const PY_CALLOC: u32 = 9;
    pub const PY_REALLOC: u32 = 10;
    pub const PY_FREE: u32 = 11;
    pub const REALLOCARRAY: u32 = 12;

    /// Frees have no return probe.
    pub fn is_free(kind: u32) -> bool {
        kind == FREE || kind == PY_FREE
    }
}

/// Mirror of `struct gil_thread`: one thread's GIL state and sums in `gil_threads`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GilThread {
    pub pid: u32,
    pub reserved: u32,
    /// In take_gil since then (CLOCK_MONOTONIC ns), else 0.
    pub wait_start: u64,
    /// Holding the GIL since then, else 0.
    pub hold_start: u64,
    pub wait_ns: u64,
    pub hold_ns: u64,
    pub acquisitions: u64,
    /// Acquisitions that found the GIL taken.
    pub contended: u64,
    /// The thread's first take_gil (CLOCK_MONOTONIC ns).
    pub first_ns: u64,
    /// Its latest take_gil or drop_gil event.
    pub last_ns: u64,
}

/// Second slot of a Python frame pair: the instruction's byte offset in the bytecode.
pub const PY_ADDR_MASK: u64 = 0xffff_ffff;
/// The instruction offset could not be told (an incomplete frame).
pub const PY_ADDR_UNKNOWN: u32 = u32::MAX;
pub const PY_FIRSTLINE_SHIFT: u32 = 32;
pub const PY_FIRSTLINE_MASK: u64 = 0x7fff_ffff;
/// The outermost Python frame of one `_PyEval_EvalFrameDefault` call.
pub const PY_ENTRY_BIT: u64 = 1 << 63;
/// Second slot of a pair whose code is 0: a 3.12+ shim frame; the frame before it is the
/// outermost of its eval call.
pub const PY_SHIM_MARK: u64 = 0x5348_494d;
/// Bytes of a frame the kernel walker reads at once.
pub const PY_FRAME_READ_MAX: u32 = 128;
/// Number of `u32` fields of `struct py_offsets` (the agent's `PyOffsets`).
pub const PY_OFFSET_FIELDS: usize = 38;

/// Capacity of the kernel's `offcpu_pending` map (threads blocked at once that are tracked).
pub const OFFCPU_PENDING_ENTRIES: u32 = 16384;

/// `struct unwind_row`: the row type of the pyrometer-unwind crate, which builds them; the
/// agent writes them into the `unwind_rows` array as they are.
pub use pyrometer_unwind::UnwindRow;

/// Mirror of `struct exec_mapping`. `row_count == 0`: no table, frame pointers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecMapping {
    pub start: u64,
    pub end: u64,
    pub bias: u64,
    pub row_first: u32,
    pub row_count: u32,
    /// The table's first bucket in `unwind_index`.
    pub index_first: u32,
    /// Its buckets (0 only without a table: the kernel searches a bucket's rows, never a
    /// whole table).
    pub index_count: u32,
    /// The ELF address bucket 0 starts at (the table's first row's pc).
    pub pc_base: u32,
    pub reserved: u32,
}

/// Bytes of text per bucket of a table's row index (`UNWIND_BUCKET_SHIFT`).
pub const UNWIND_BUCKET_SHIFT: u32 = 10;

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

/// Mirror of `struct py_process`: a registered Python process in `py_procs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyProcess {
    /// Run-time address of `_PyRuntime`.
    pub runtime: u64,
    /// Run-time address of the GIL state, 0 when unknown.
    pub gil: u64,
    /// Bytes of a frame to read (at most `PY_FRAME_READ_MAX`).
    pub frame_read: u32,
    pub reserved: u32,
    /// `struct py_offsets`, field by field in its order.
    pub offsets: [u32; PY_OFFSET_FIELDS],
    /// Run-time address of the process's first span-table slot, 0 when it has no table.
    pub span_slots: u64,
    /// Slots in the table less one (a power of two less one).
    pub span_mask: u32,
    /// When the kernel last looked for a table at its fixed address (2^20 ns units,
    /// wrapping) and how often it looked in vain; 0 from user space.
    pub span_probed_at: u16,
    pub span_probes: u16,
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
}

impl RawPyFrame {
    pub fn from_slots(code: u64, packed: u64) -> Self {
        Self {
            code,
            addr: (packed & PY_ADDR_MASK) as u32,
            first_line: ((packed >> PY_FIRSTLINE_SHIFT) & PY_FIRSTLINE_MASK) as u32,
            entry: packed & PY_ENTRY_BIT != 0,
        }
    }
}

/// Mirror of `struct process_unwind`: a process's executable mappings sorted by start.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessUnwind {
    pub count: u32,
    pub reserved: u32,
    pub maps: [ExecMapping; MAX_MAPPINGS],
}

/// Indices into the per-CPU `counters` map.
pub mod counter {
    pub const SAMPLES: u32 = 0;
    pub const RINGBUF_DROPS: u32 = 1;
    pub const KERNEL_STACK_ERRORS: u32 = 2;
    pub const USER_STACK_ERRORS: u32 = 3;
    pub const USER_STACK_TRUNCATED: u32 = 4;
    pub const TARGETS_FULL: u32 = 5;
    pub const UNWIND_NO_MAPPING: u32 = 6;
    pub const UNWIND_NO_TABLE: u32 = 7;
    pub const UNWIND_NO_ROW: u32 = 8;
    pub const UNWIND_BAD_CFA: u32 = 9;
    pub const UNWIND_TRUNCATED: u32 = 10;
    pub const UNWIND_COMPLETE: u32 = 11;
    pub const UNWIND_SAMPLES: u32 = 12;
    pub const OFFCPU_EVENTS: u32 = 13;
    pub const OFFCPU_MAP_FULL: u32 = 14;
    pub const PY_WALKS: u32 = 15;
    pub const PY_NO_THREAD: u32 = 16;
    pub const PY_TRUNCATED: u32 = 17;
    pub const PY_READ_ERRORS: u32 = 18;
    pub const PY_TSTATE_SEARCHES: u32 = 19;
    pub const GIL_WAIT_EVENTS: u32 = 20;
    pub const GIL_PENDING_FULL: u32 = 21;
    pub const GIL_THREADS_FULL: u32 = 22;
    pub const ALLOC_SAMPLES: u32 = 23;
    pub const ALLOC_FREES: u32 = 24;
    pub const ALLOC_LIVE_FULL: u32 = 25;
    pub const ALLOC_THREADS_FULL: u32 = 26;
    /// Nanoseconds `on_cpu_clock` spent on target samples (the program times itself, so
    /// the figure leaves out the quick exits for other processes).
    pub const SAMPLE_NS: u32 = 27;
    /// Nanoseconds spent walking Python frame chains (every program, self-timed).
    pub const PY_NS: u32 = 28;
    /// Frees the preloaded sampler library reported: it reports sampled blocks only.
    pub const ALLOC_PRELOAD_FREES: u32 = 29;
    /// DWARF frames whose row the kernel's per-CPU row cache gave (checked against the table).
    pub const UNWIND_ROW_HITS: u32 = 30;
    /// DWARF frames whose row was searched for in the table's bucket.
    pub const UNWIND_ROW_SEARCHES: u32 = 31;
    pub const COUNT: u32 = 32;
}

/// Mirror of `struct sample_header`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SampleHeader {
    pub timestamp_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub cpu: u32,
    pub kernel_stack_id: i32,
    pub user_frames: u32,
    pub kernel_frames: u32,
    pub flags: u32,
    /// Python frames (two slots each) after the user frames.
    pub py_frames: u32,
    pub comm: [u8; COMM_LEN],
    /// `SAMPLE_OFFCPU`: blocked nanoseconds; 0 for on-CPU samples.
    pub value: u64,
    /// Reserved for record kinds that carry an address.
    pub aux: u64,
    /// The thread's active OpenTelemetry span as its span table held it (all zero: none).
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// The span's name, truncated to `SPAN_NAME_LEN` bytes, NUL-padded.
    pub span_name: [u8; SPAN_NAME_LEN],
}

/// Mirror of `struct offcpu_record`: a blocked thread's pending interval in `offcpu_pending`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuRecord {
    pub header: SampleHeader,
    pub user: [u64; MAX_SLOTS],
}

impl OffCpuRecord {
    /// The ring-buffer record this entry becomes when its thread runs again `blocked_ns` after
    /// it blocked: the header and the frames it uses.
    pub fn to_record(&self, blocked_ns: u64) -> Vec<u8> {
        let mut header = self.header;
        header.value = blocked_ns;
        header.user_frames = header.user_frames.min(MAX_USER_FRAMES as u32);
        header.py_frames = header.py_frames.min(MAX_PY_FRAMES as u32);
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

/// Byte offset of the inline kernel frames in a full record.
pub const KERNEL_FRAMES_OFFSET: usize = size_of::<SampleHeader>() + MAX_SLOTS * size_of::<u64>();
/// Size of a full `struct sample_record`.
pub const FULL_RECORD_SIZE: usize = KERNEL_FRAMES_OFFSET + MAX_KERNEL_FRAMES * size_of::<u64>();

/// A sample record as read from the ring buffer.
#[derive(Debug, Clone)]
pub struct RawSample<'a> {
    pub header: SampleHeader,
    bytes: &'a [u8],
}

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
        if header.flags & SAMPLE_KERNEL_INLINE != 0
            && (header.kernel_frames as usize > MAX_KERNEL_FRAMES
                || bytes.len() < KERNEL_FRAMES_OFFSET + header.kernel_frames as usize * 8)
        {
            return Err(BadRecord("kernel frame count exceeds record"));
        }
        if header.flags & SAMPLE_ALLOC_MOVED != 0 && bytes.len() < hsize + 8 {
            return Err(BadRecord("move record without its new address"));
        }
        Ok(Self { header, bytes })
    }

    /// A move record's (`SAMPLE_ALLOC_MOVED`) new address: the word after the header.
    pub fn moved_to(&self) -> Option<u64> {
        if self.header.flags & SAMPLE_ALLOC_MOVED == 0 {
            return None;
        }
        let start = size_of::<SampleHeader>();
        words(&self.bytes[start..start + 8]).next()
    }

    /// User-space return addresses, leaf first.
    pub fn user_frames(&self) -> impl Iterator<Item = u64> + '_ {
        let start = size_of::<SampleHeader>();
        words(&self.bytes[start..start + self.header.user_frames as usize * 8])
    }

    /// Python frames, innermost first; shim markers become the entry mark of the frame
    /// before them.
    pub fn python_frames(&self) -> Vec<RawPyFrame> {
        let start = size_of::<SampleHeader>() + self.header.user_frames as usize * 8;
        let bytes = &self.bytes[start..start + self.header.py_frames as usize * 16];
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
        out
    }

    /// Kernel addresses copied into the record (stack-map collisions only), leaf first.
    pub fn inline_kernel_frames(&self) -> impl Iterator<Item = u64> + '_ {
        let bytes = if self.header.flags & SAMPLE_KERNEL_INLINE != 0 {
            let n = self.header.kernel_frames as usize;
            // Bounds were checked by parse.
            &self.bytes[KERNEL_FRAMES_OFFSET..KERNEL_FRAMES_OFFSET + n * 8]
        } else {
            &[]
        };
        words(bytes)
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

// SAFETY: plain-old-data #[repr(C)] structs without padding holes the kernel would read.
unsafe impl aya::Pod for ExecMapping {}
unsafe impl aya::Pod for ProcessUnwind {}
unsafe impl aya::Pod for OffCpuRecord {}
unsafe impl aya::Pod for PyProcess {}
unsafe impl aya::Pod for GilThread {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_matches_c() {
        // 8 + 4*8 + 16 + 8 + 8 + 16 + 8 + 16: the C struct has no padding.
        assert_eq!(size_of::<SampleHeader>(), 112);
        assert_eq!(
            MAX_SLOTS, 512,
            "a power of two: the kernel side masks slot indexes"
        );
        assert_eq!(FULL_RECORD_SIZE, 112 + (512 + 127) * 8);
        assert_eq!(size_of::<UnwindRow>(), 12);
        assert_eq!(size_of::<ExecMapping>(), 48);
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
        assert_eq!(size_of::<ProcessUnwind>(), 8 + 48 * MAX_MAPPINGS);
        assert_eq!(size_of::<OffCpuRecord>(), 112 + 512 * 8);
        assert_eq!(size_of::<PyProcess>(), 24 + 4 * PY_OFFSET_FIELDS + 16);
        assert_eq!(size_of::<GilThread>(), 72);
    }

    #[test]
    fn pending_off_cpu_entry_becomes_a_record() {
        let mut rec = OffCpuRecord {
            header: SampleHeader {
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
        rec.header.user_frames = 10_000;
        assert!(
            RawSample::parse(&rec.to_record(1)).is_ok(),
            "a bad count is clamped"
        );
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
            header: SampleHeader {
                user_frames: 1,
                py_frames: 3,
                ..SampleHeader::default()
            },
            user: [0; MAX_SLOTS],
        };
        rec.header.py_frames = 3;
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
                    entry: true
                },
                RawPyFrame {
                    code: 0xc0df,
                    addr: PY_ADDR_UNKNOWN,
                    first_line: 0,
                    entry: true
                }
            ]
        );
        assert_eq!(
            RawSample::parse(&bytes[..bytes.len() - 8]).unwrap_err(),
            BadRecord("Python frame count exceeds record")
        );
    }

    #[test]
    fn span_ids_read_as_w3c_hex() {
        let mut header = SampleHeader::default();
        let rec = OffCpuRecord {
            header,
            user: [0; MAX_SLOTS],
        };
        let bytes = rec.to_record(0);
        assert_eq!(RawSample::parse(&bytes).unwrap().span(), None);
        header.trace_id[15] = 0xab;
        header.trace_id[0] = 0x01;
        header.span_id[7] = 0x2c;
        header.span_name[..4].copy_from_slice(b"work");
        let bytes = OffCpuRecord { header, ..rec }.to_record(0);
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
}
