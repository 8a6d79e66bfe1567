// SPDX-License-Identifier: GPL-2.0
// The kernel ABI: every struct and constant the kernel programs share with user space. This
// header is the definition: ../../build.rs generates the Rust types and constants from it with
// bindgen (with layout checks), so a field added here is a field of the Rust struct. Nothing
// here may depend on the programs' headers.
#pragma once

#include <linux/types.h>

// Frame-pointer stacks come from bpf_get_stack (perf's limit, 127); the DWARF unwinder
// walks up to this many frames with bpf_loop.
#define MAX_USER_FRAMES 256
#define MAX_KERNEL_FRAMES 127
// perf's callchain limit (kernel.perf_event_max_stack) for frame-pointer stacks.
#define FP_MAX_FRAMES 127
// Python frame pairs a record holds (innermost first, shim markers included), two slots
// each, after the native ones.
#define MAX_PY_FRAMES 128
// Slots of a record: native return addresses, then Python frame pairs. A power of two, so
// an index can be masked for the verifier.
#define MAX_SLOTS (MAX_USER_FRAMES + 2 * MAX_PY_FRAMES)
#define COMM_LEN 16

#define FILTER_ALL 0
#define FILTER_TARGETS 1

// `debug_reject` bits: make the kernel refuse one stage (tests of the degraded paths).
#define REJECT_DWARF 1
#define REJECT_OFFCPU 2
#define REJECT_GIL 4
#define REJECT_ALLOC 8
#define REJECT_SAMPLER 16 // the CPU sampler itself, frame pointers too
#define REJECT_GPU 32
#define REJECT_GC 64
#define REJECT_ASYNC 128 // the asyncio task walk (--async)

#define TARGET_SELECTED 1
#define TARGET_FOLLOW_CHILDREN 2

// sample_header.flags
#define SAMPLE_KERNEL_INLINE 1
// Not a sample: the process exec'd a new image (header only).
#define SAMPLE_EVENT_EXEC 2
// The user stack was walked by the DWARF unwinder (not frame pointers).
#define SAMPLE_DWARF 4
// The DWARF walk reached the outermost frame (an undefined return address, e.g. _start).
#define SAMPLE_COMPLETE 8
// An off-CPU interval (sched_switch): the stack is the one saved when the thread blocked,
// timestamp_ns is when it blocked and value how long (ns) it stayed off the CPU.
#define SAMPLE_OFFCPU 16
// The Python frame chain went on past MAX_PY_FRAMES (or past the slots left).
#define SAMPLE_PY_TRUNCATED 32
// A Python process's thread without a Python thread state (a native thread, or one that
// has not registered yet): native frames only.
#define SAMPLE_PY_NO_THREAD 64
// Reading the Python frame chain failed part way (the frames before the failure are kept).
#define SAMPLE_PY_READ_ERROR 128
// An on-CPU sample of a thread that holds the GIL (record --gil).
#define SAMPLE_GIL_HELD 256
// A contended GIL wait (record --gil): the stack is the one at take_gil's entry,
// timestamp_ns is when the wait began and value its length in ns.
#define SAMPLE_GIL_WAIT 512
// A sampled allocation (record --alloc): value is its size in bytes, aux its address; the
// stack is the allocator's caller's.
#define SAMPLE_ALLOC 1024
// A sampled block was freed (header only): aux is its address.
#define SAMPLE_FREE 2048
// The DWARF walk met a pc in no mapping the agent registered (a new dlopen, a library
// mapped after the tables were made): the agent re-reads the process's maps.
#define SAMPLE_UNKNOWN_MAPPING 4096
// With SAMPLE_ALLOC: reported by the preloaded sampler library (alloc_preload), whose two
// innermost frames are its probe function and the allocator function the program called.
#define SAMPLE_ALLOC_PRELOAD 8192
// With SAMPLE_ALLOC: the block is not tracked for its free (a table was full): it counts as
// allocated, never as in use.
#define SAMPLE_ALLOC_UNTRACKED 16384
// With SAMPLE_FREE: a sampled block was resized (realloc), not freed: value is its new size,
// and the u64 after the header (struct alloc_move_record) its new address.
#define SAMPLE_ALLOC_MOVED 32768
// The Python walk found this thread's thread state by a search, not in its cache: a thread
// new to the sampler (or one the cache let go). The record wakes the agent, which reads the
// thread's `threading` name while the thread still lives: a short thread can end before the
// agent's next poll, and its name with it.
#define SAMPLE_PY_NEW_THREAD 65536
// A sampled GPU launch (gpu.h): the stack at pyrometer_gpu_launch, aux CUPTI's correlation id.
#define SAMPLE_GPU_LAUNCH 131072
// Not a sample: a chunk of libpyrometer_cupti.so's channel follows the header (value bytes of
// the GPU_CHUNK_MAX the record has room for).
#define SAMPLE_GPU_CHANNEL 262144
// A garbage collection of CPython (record --gc, gc.h): the stack is the one at the
// collection's start, timestamp_ns is when it started, value its length in ns and aux the
// generation collected (GC_GENERATION_UNKNOWN where the probe site could not say).
#define SAMPLE_GC 524288
// A copy of the user stack follows the record's slots (a struct stack_copy, its bytes only as
// long as `len`; never with SAMPLE_KERNEL_INLINE): the walk met code whose unwind table the
// agent was still building, or a new process it had not registered yet. The agent unwinds the
// copy with the same tables once they exist (as `perf --call-graph dwarf` does for every
// sample) and replaces the user frames with that walk.
#define SAMPLE_STACK_COPY 1048576

#define COUNTER_SAMPLES 0
#define COUNTER_RINGBUF_DROPS 1
#define COUNTER_KERNEL_STACK_ERRORS 2
#define COUNTER_USER_STACK_ERRORS 3
#define COUNTER_USER_STACK_TRUNCATED 4
#define COUNTER_TARGETS_FULL 5
// DWARF unwinder: per-reason failures, counted once per sample that stopped there.
#define COUNTER_UNWIND_NO_MAPPING 6 // a pc in no known executable mapping
#define COUNTER_UNWIND_NO_TABLE 7   // a mapping whose table is not loaded (yet): FP fallback
#define COUNTER_UNWIND_NO_ROW 8     // a pc no CFI row covers
#define COUNTER_UNWIND_BAD_CFA 9    // an unsupported rule, or unreadable stack memory
#define COUNTER_UNWIND_TRUNCATED 10 // more than MAX_USER_FRAMES frames
#define COUNTER_UNWIND_COMPLETE 11  // walks that reached the outermost frame
#define COUNTER_UNWIND_SAMPLES 12   // samples the DWARF unwinder walked
#define COUNTER_OFFCPU_EVENTS 13    // off-CPU intervals sent (at least offcpu_min_ns long)
#define COUNTER_OFFCPU_MAP_FULL 14  // a blocking thread not tracked: offcpu_pending was full
#define COUNTER_PY_WALKS 15         // stacks of Python processes whose thread state was looked up
#define COUNTER_PY_NO_THREAD 16     // ... that found no thread state for the thread
#define COUNTER_PY_TRUNCATED 17     // ... whose frame chain was longer than the record holds
#define COUNTER_PY_READ_ERRORS 18   // ... whose frame chain could not be read to its end
// thread-state lists walked (a thread seen for the first time)
#define COUNTER_PY_TSTATE_SEARCHES 19
#define COUNTER_GIL_WAIT_EVENTS 20     // contended GIL waits sent
#define COUNTER_GIL_PENDING_FULL 21    // a contended wait's stack not kept: gil_pending was full
#define COUNTER_GIL_THREADS_FULL 22    // a thread's GIL time not tracked: gil_threads was full
#define COUNTER_ALLOC_SAMPLES 23       // sampled allocations sent
#define COUNTER_ALLOC_FREES 24         // frees of sampled blocks sent
#define COUNTER_ALLOC_LIVE_FULL 25     // a sampled block not tracked for frees: alloc_live was full
#define COUNTER_ALLOC_THREADS_FULL 26  // an allocator call not seen: alloc_threads was full
#define COUNTER_SAMPLE_NS 27           // ns on_cpu_clock spent on target samples (self-timed)
#define COUNTER_PY_NS 28               // ns spent walking Python frame chains (self-timed)
#define COUNTER_ALLOC_PRELOAD_FREES 29 // frees the preloaded library reported (sampled blocks only)
#define COUNTER_UNWIND_ROW_HITS 30     // DWARF frames whose row came from the per-CPU row cache
#define COUNTER_UNWIND_ROW_SEARCHES 31 // ... and those whose row was searched for in the table
#define COUNTER_GPU_LAUNCHES 32        // sampled GPU launches' stacks sent
#define COUNTER_GPU_CHUNKS 33          // channel chunks of the GPU library sent
#define COUNTER_GPU_CHUNKS_REFUSED 34 // ... refused: a length past GPU_CHUNK_MAX, unreadable memory
#define COUNTER_GC_EVENTS 35          // garbage collections sent
#define COUNTER_GC_PENDING_FULL 36    // a collection not tracked: gc_pending was full
#define COUNTER_STACK_COPIES 37       // samples sent with a copy of their user stack
// ... that wanted one and went without: over STACK_COPY_RATE, or no room in the ring buffer
#define COUNTER_STACK_COPIES_SKIPPED 38
#define COUNTER_COUNT 39

// The largest chunk of the GPU library's channel (PYRO_GPU_CHUNK_MAX in gpu-inject/c/).
#define GPU_CHUNK_MAX 4096

// Unwind rows (see the pyrometer-unwind crate for how they are built). 12 bytes.
#define CFA_NONE 0
#define CFA_RSP 1
#define CFA_RBP 2
#define CFA_PLT 3
#define CFA_SIGNAL 4
#define CFA_END 5
#define CFA_UNSUPPORTED 6
#define RBP_SAME 0
#define RBP_OFFSET 1
#define RBP_UNSUPPORTED 2

struct unwind_row {
	__u32 pc; // ELF virtual address where the row starts applying
	__u8 cfa_type;
	__u8 rbp_type;
	__s16 cfa_offset;
	__s16 rbp_offset;
	__u16 reserved;
};

#define MAX_MAPPINGS 128 // executable mappings per process (must stay a power of two)

// The row search's first level: a table's rows are bucketed by UNWIND_BUCKET_SHIFT bytes of
// text from its first row's pc; entry k of a table's index (in `unwind_index`, a u64) holds
// in its low half the position, relative to row_first, of the last row at or before the
// start of bucket k, and in its high half the same for bucket k + 1 (the last row for the
// last bucket). A lookup reads one entry and searches the few rows between the two, instead
// of binary-searching the whole table: a handful of cache lines a frame, not a dozen pages.
#define UNWIND_BUCKET_SHIFT 10
// Halvings that find a row among a bucket's candidates: rows have distinct pcs, so a bucket
// has at most 2^UNWIND_BUCKET_SHIFT of them past its first, and 11 halvings cover 1024.
#define UNWIND_SEARCH_STEPS (UNWIND_BUCKET_SHIFT + 1)

// exec_mapping.flags: row_count is 0 for now, the table is being read or built (not one that
// failed or did not fit): a sample through it keeps a copy of its stack (SAMPLE_STACK_COPY).
#define EXEC_MAPPING_PENDING 1

// One executable mapping of a process. row_count == 0: no table, walk by frame pointer.
struct exec_mapping {
	__u64 start;
	__u64 end;
	__u64 bias; // ELF virtual address = runtime address - bias
	__u32 row_first;
	__u32 row_count;
	__u32 index_first; // the table's first bucket in unwind_index
	__u32 index_count; // its buckets; 0: no index, search all rows
	__u32 pc_base;     // the ELF address bucket 0 starts at (the first row's pc)
	__u32 flags;       // EXEC_MAPPING_*
};

// A process's executable mappings, sorted by start.
struct process_unwind {
	__u32 count;
	__u32 reserved;
	struct exec_mapping maps[MAX_MAPPINGS];
};

// Bytes of a span name a record carries (truncated, NUL-padded).
#define SPAN_NAME_LEN 16

struct sample_header {
	__u64 timestamp_ns; // CLOCK_MONOTONIC
	__u32 pid;          // thread group id
	__u32 tid;
	__u32 cpu;
	__s32 kernel_stack_id; // index in kernel_stacks, or a negative errno
	__u32 user_frames;     // number of user frames that follow the header
	__u32 kernel_frames;   // number of inline kernel frames (SAMPLE_KERNEL_INLINE)
	__u32 flags;
	__u32 py_frames; // Python frames (two slots each) that follow the user frames
	__u8 comm[COMM_LEN];
	__u64 value; // SAMPLE_OFFCPU: blocked ns; 0 for on-CPU samples
	__u64 aux;   // the kinds that carry an address; on-CPU samples: the event's period (ns)
	// The thread's active OpenTelemetry span (spans.h), as the span table holds it; all
	// zero when the thread has none (or its process publishes no table).
	__u8 trace_id[16];
	__u8 span_id[8];
	__u8 span_name[SPAN_NAME_LEN]; // trace_id, span_id, span_name: a struct span_body
};

// Slot pairs of a Python frame: the code object's address, then PY_* packed fields.
#define PY_ADDR_MASK 0xffffffffULL // bits 0-31: byte offset of the instruction in the bytecode
#define PY_ADDR_UNKNOWN 0xffffffffULL
#define PY_FIRSTLINE_SHIFT 32 // bits 32-62: co_firstlineno, to tell a reused address apart
#define PY_FIRSTLINE_MASK 0x7fffffffULL
#define PY_ENTRY_BIT (1ULL << 63) // the outermost frame of one _PyEval_EvalFrameDefault call
// A pair whose code is 0 and second slot this: a 3.12+ shim frame, no Python code; the frame
// before it (innermost side) is the outermost of its eval call.
#define PY_SHIM_MARK 0x5348494dULL

// The module bodies (code objects whose co_firstlineno is 1) the kernel last met at an address
// of a process (python.h, py_bodies): each change of module (globals) there, from when it was
// first read. A body is freed after its one run, often before user space reads the samples
// taken in it, and bodies of the same size take its address one after another; the module's
// dict, its globals, lives on with the module. So user space names a sample's body by the
// `__file__` of the last change at or before the sample.
#define PY_BODY_HISTORY 8
struct py_body_key {
	__u64 code;
	__u32 tgid;
	__u32 firstline; // 1 in py_bodies
};
struct py_body_read {
	__u64 globals; // the frame's globals (its module's dict)
	__u64 read_ns; // the timestamp of the record whose walk read it; 0: an unused slot
};
struct py_body {
	__u32 next; // the slot of reads the next read goes to (modulo PY_BODY_HISTORY)
	__u32 reserved;
	struct py_body_read reads[PY_BODY_HISTORY];
};

struct sample_record {
	struct sample_header hdr;
	__u64 user[MAX_SLOTS];           // native frames leaf first, then Python frame pairs
	__u64 kernel[MAX_KERNEL_FRAMES]; // leaf first, only with SAMPLE_KERNEL_INLINE
};

// Bytes of user stack a SAMPLE_STACK_COPY record carries: whole pages from the one holding the
// stack pointer up, so every read is one page at a constant offset (at least 12 KiB above the
// stack pointer; the main thread's copy ends where its stack does).
#define STACK_COPY_PAGE 4096
#define STACK_COPY_PAGES 4
#define STACK_COPY_BYTES (STACK_COPY_PAGES * STACK_COPY_PAGE)
// Copies a CPU sends a second in the long run, and at once: a process whose tables never
// come (a budget spent, a read that hangs) costs the ring buffer at most the rate; a new
// large program takes a few hundred ms to get its table, which the burst covers at 499 Hz.
// Copies also leave the ring buffer's last quarter to the plain records (stackcopy.h).
#define STACK_COPY_RATE 100
#define STACK_COPY_BURST 256

struct stack_copy {
	__u64 pc; // the user registers at the sample
	__u64 sp;
	__u64 bp;
	__u64 base; // the user address of bytes[0] (the stack pointer's page)
	__u32 len;  // bytes copied, whole pages
	__u32 reserved;
	__u8 bytes[STACK_COPY_BYTES];
};

// Where a SAMPLE_STACK_COPY record is put together: the header, the slots it uses, then the
// copy (struct stack_copy) right after them.
struct sample_copy_buf {
	__u8 bytes[sizeof(struct sample_header) + MAX_SLOTS * 8 + sizeof(struct stack_copy)];
};

// What sched_switch keeps for a blocked thread until it runs again: the header and user
// frames of the record it will send (no inline kernel frames: a stack-map collision is
// counted as a kernel stack error instead, which keeps each pending entry at 4 KiB).
struct offcpu_record {
	struct sample_header hdr;
	__u64 user[MAX_SLOTS];
};

// CPython structure offsets of one process's interpreter version: the agent's `PyOffsets`
// (profiler/src/python/offsets.rs) as it is. ABSENT (all ones): no such field.
#define PY_ABSENT 0xffffffffU

// How a frame's instruction position is stored.
enum py_frame_kind {
	PY_FRAME_KIND_FRAME_OBJECT = 0, // <= 3.10: PyFrameObject, f_lasti an int
	PY_FRAME_KIND_INTERPRETER = 1,  // 3.11+: _PyInterpreterFrame, an instruction pointer
};

// How a code object's line table is encoded (read by user space only).
enum py_line_table_kind {
	PY_LINE_TABLE_KIND_LNOTAB = 0,       // 3.8-3.9 co_lnotab
	PY_LINE_TABLE_KIND_LINETABLE310 = 1, // 3.10 co_linetable
	PY_LINE_TABLE_KIND_LOCATIONS311 = 2, // 3.11+ location table (PEP 626/657)
};

struct py_offsets {
	__u32 major;
	__u32 minor;
	enum py_frame_kind frame_kind;
	enum py_line_table_kind line_table_kind;
	__u32 lasti_unit;
	__u32 runtime_interpreters_head;
	__u32 runtime_gil;
	__u32 interp_next;
	__u32 interp_threads_head;
	__u32 interp_gil_ptr;
	__u32 gil_last_holder;
	__u32 gil_locked;
	__u32 gil_size;
	__u32 tstate_next;
	__u32 tstate_interp;
	__u32 tstate_frame;
	__u32 cframe_current_frame;
	__u32 tstate_thread_id;
	__u32 tstate_native_thread_id;
	__u32 frame_code;
	__u32 frame_previous;
	__u32 frame_instr;
	__u32 frame_is_entry;
	__u32 frame_owner;
	__u32 frame_owned_by_cstack;
	__u32 code_filename;
	__u32 code_name;
	__u32 code_qualname;
	__u32 code_firstlineno;
	__u32 code_linetable;
	__u32 code_adaptive;
	__u32 object_type;
	__u32 bytes_size;
	__u32 bytes_data;
	__u32 unicode_length;
	__u32 unicode_state;
	__u32 unicode_ascii_data;
	__u32 unicode_compact_data;
	// 3.14+ free-threaded builds: a thread may run its own copy of a function's bytecode,
	// the frame's tlbc_index-th entry of the code object's co_tlbc array (copy 0 is
	// co_code_adaptive itself). ABSENT elsewhere.
	__u32 frame_tlbc_index;
	__u32 code_tlbc;
	// The frame's globals (its module's dict): with the code object's address, what the
	// kernel's cache of first lines is keyed by (python.h, py_code_lines).
	__u32 frame_globals;
};

// asyncio task stacks (record --async, pyasync.h). A task is a slot pair among the Python
// frames, placed after (rootward of) its coroutine's outermost frame, the tasks awaiting it
// after it, root last: the task's name object, then the code object of its coroutine with
// PY_TASK_MARK in the top 16 bits (user addresses have them clear).
#define PY_TASK_MARK 0xa51c000000000000ULL
#define PY_TASK_MARK_MASK 0xffff000000000000ULL
// Futures (tasks, and the futures between them such as gather's) followed per sample.
#define PY_MAX_TASKS 16
// Running tasks (one per running event loop) looked for in `_asyncio._current_tasks`.
#define PY_TASK_CANDIDATES 4
// Entries of `_current_tasks`' table scanned, deleted ones included.
#define PY_TASK_ENTRIES 16

// Where a TaskGroup keeps its attribute values (its `_parent_task`).
#define PY_VALUES_NONE 0    // not known: TaskGroup children end their chain
#define PY_VALUES_POINTER 1 // 3.11: a pointer `values_at` bytes before the object (0: a dict)
#define PY_VALUES_TAGGED 2  // 3.12: a word `values_at` bytes before it, values - 1 when bit 0
#define PY_VALUES_INLINE 3  // 3.13: `values_at` bytes after it, while the `valid` byte is set

// What the kernel needs to follow a thread's asyncio tasks, all 0 while --async is off or
// `_asyncio` is not imported yet (task_type 0). Layouts of 3.11-3.13 from a per-version table
// (profiler/src/python/asyncio.rs), 3.14+'s task and thread-state fields from the
// interpreter's own `_Py_AsyncioModuleDebugOffsets`, the objects' addresses from the process.
struct py_async {
	__u64 current_tasks; // 3.11-3.13: the `_current_tasks` dict ({loop: task})
	__u64 task_type;     // _asyncio.Task
	__u64 future_type;   // _asyncio.Future (gather's _GatheringFuture derives from it)
	__u64 cfunction_type;
	__u64 method_type;
	__u64 function_type;
	__u64 taskgroup_type; // asyncio.TaskGroup, 0 until known
	__u32 dict_keys;
	__u32 keys_log2_index_bytes;
	__u32 keys_nentries;
	__u32 keys_indices;
	__u32 entry_size;
	__u32 entry_value;
	__u32 fut_callback0;
	__u32 fut_callbacks;
	__u32 task_coro;
	__u32 task_name;
	__u32 gen_iframe;
	__u32 cfunction_self;
	__u32 method_self;
	__u32 function_closure;
	__u32 cell_ref;
	__u32 type_base;
	__u32 tuple_items;
	__u32 list_items;
	__u32 var_size;
	__u32 tg_values_mode; // PY_VALUES_*
	__u32 tg_values_at;
	__u32 tg_valid_at;  // PY_VALUES_INLINE: the `valid` byte, from the values
	__u32 tg_parent_at; // `_parent_task`'s slot, from the values
	// 3.14+ (PY_ABSENT before): the thread state's running task, and a future's
	// `awaited_by` (a future, or a set of them when the byte at awaited_by_is_set is 1),
	// which replace `_current_tasks` and the done callbacks.
	__u32 tstate_running_task;
	__u32 fut_awaited_by;
	__u32 fut_awaited_by_is_set;
	__u32 reserved;
};

// Bytes of a frame the walker reads at once; every frame field used lies below this.
#define PY_FRAME_READ_MAX 128

// A Python process the agent registered (py_procs).
struct py_process {
	__u64 runtime;    // run-time address of _PyRuntime
	__u64 gil;        // run-time address of the GIL state, 0 when unknown
	__u32 frame_read; // bytes of a frame to read (<= PY_FRAME_READ_MAX)
	__u32 reserved;
	struct py_offsets off;
	// The process's span table (pyrometer-otel, spans.h): the run-time address of its first
	// slot, 0 when the process publishes none, and the slot count less one (a power of two).
	__u64 span_slots;
	__u32 span_mask;
	// When the kernel last looked for a table at SPAN_TABLE_AT (spans.h; in 2^20 ns, wrapping)
	// and how often it looked in vain (saturating).
	__u16 span_probed_at;
	__u16 span_probes;
	struct py_async aio;
};

// What a span table slot says of its thread's innermost active span (40 bytes).
struct span_body {
	__u8 trace_id[16]; // all zero: the thread is in no span
	__u8 span_id[8];
	__u8 name[SPAN_NAME_LEN];
};

// One thread's slot in a span table (python/pyrometer-otel writes it; 128 bytes). Slots are
// indexed by tid & span_mask, so two threads could map to one: the slot is the thread's whose
// id it holds. The writer fills body[(seq + 1) & 1], then stores seq + 1: the body seq & 1
// names is complete, and a seq that changed across a read says the read may be torn.
struct span_slot {
	__u64 seq;
	__u32 tid;
	__u32 reserved;
	struct span_body body[2];
	__u8 pad[32];
};
_Static_assert(sizeof(struct span_slot) == 128, "python/pyrometer-otel writes 128-byte slots");

// Off-CPU intervals of threads blocked at once that are tracked (`offcpu_pending`).
#define OFFCPU_PENDING_ENTRIES 16384

// GIL wait and hold time (`record --gil`, gil.h): one thread's state and sums in gil_threads.
struct gil_thread {
	__u32 pid;
	__u32 reserved;
	__u64 wait_start; // take_gil entered and not returned yet, else 0
	__u64 hold_start; // take_gil returned and drop_gil not hit yet, else 0
	__u64 wait_ns;    // closed waits
	__u64 hold_ns;    // closed holds
	__u64 acquisitions;
	__u64 contended; // acquisitions that found the GIL taken
	__u64 first_ns;  // the thread's first take_gil
	__u64 last_ns;   // its latest take_gil/drop_gil event
};

// Where gc_start finds the generation being collected, in its attach cookie: the kind in
// bits 0-7, a pt_regs register (GC_REG_*) in bits 8-15, the value's size in bytes in bits
// 16-23, and a constant or a signed displacement in bits 32-63. A USDT probe's argument is
// a register, a memory operand (register + displacement) or a constant; a function entry's
// is a register or, in a copy the compiler specialised, a constant.
#define GC_ARG_NONE 0  // not known: aux is GC_GENERATION_UNKNOWN
#define GC_ARG_CONST 1 // the constant
#define GC_ARG_REG 2   // the register's low bytes
#define GC_ARG_MEM 3   // the bytes at register + displacement, in user memory
#define GC_GENERATION_UNKNOWN 0xffffffffULL
// x86-64 `struct pt_regs` registers, numbered by their slot.
#define GC_REG_R15 0
#define GC_REG_R14 1
#define GC_REG_R13 2
#define GC_REG_R12 3
#define GC_REG_RBP 4
#define GC_REG_RBX 5
#define GC_REG_R11 6
#define GC_REG_R10 7
#define GC_REG_R9 8
#define GC_REG_R8 9
#define GC_REG_RAX 10
#define GC_REG_RCX 11
#define GC_REG_RDX 12
#define GC_REG_RSI 13
#define GC_REG_RDI 14
#define GC_REG_RIP 16
#define GC_REG_RSP 19
// Collections in progress tracked at once (gc_pending): one per thread collecting.
#define GC_PENDING_ENTRIES 4096

// Allocator entry points (alloc.h): the probe cookie the kernel side dispatches on.
#define ALLOC_MALLOC 1         // (size)
#define ALLOC_CALLOC 2         // (n, size)
#define ALLOC_REALLOC 3        // (ptr, size)
#define ALLOC_ALIGNED 4        // (alignment, size): aligned_alloc, memalign
#define ALLOC_POSIX_MEMALIGN 5 // (&ptr, alignment, size), returns 0 on success
#define ALLOC_FREE 6           // (ptr)
#define ALLOC_VALLOC 7         // (size), page-aligned
#define ALLOC_PY_MALLOC 8      // (ctx, size)
#define ALLOC_PY_CALLOC 9      // (ctx, n, size)
#define ALLOC_PY_REALLOC 10    // (ctx, ptr, size)
#define ALLOC_PY_FREE 11       // (ctx, ptr)
#define ALLOC_REALLOCARRAY 12  // (ptr, n, size)

#define ALLOC_FILTER_TARGETS 0 // `record`: the sampler's target set
#define ALLOC_FILTER_MAP 1     // the agent: only processes in alloc_targets

struct alloc_move_record {
	struct sample_header
		hdr; // SAMPLE_FREE | SAMPLE_ALLOC_MOVED: aux the old address, value the size
	__u64 to;    // the new address
};
