// SPDX-License-Identifier: GPL-2.0
//
// In-kernel CPython frame walker. For a sampled thread of a Python process the agent
// registered (py_procs: the runtime's address and the version's structure offsets), it finds
// the thread's PyThreadState and walks the frame chain (current frame -> previous), writing
// two slots per frame after the native ones: the code object's address, and the instruction's
// byte offset with co_firstlineno and an "entry" bit. The agent reads the code objects
// (name, file, line table) from user space, cached per process and code object, and splices
// the Python frames into the native stack at each _PyEval_EvalFrameDefault; the entry bit
// marks the outermost Python frame of one eval call (3.11+ runs many frames per call).
//
// Thread state: pthread_self() is the thread's fs base on x86-64, and every CPython 3.8-3.13
// stores it in PyThreadState.thread_id, so the thread is found by walking the interpreter's
// thread list for that value; the result is cached per tid (py_threads) and re-checked
// against thread_id on every use, since a thread state can be freed and its tid reused.
// Everything read is the target's memory: reads can fail or race the interpreter, and the
// agent validates what the slots point at before naming anything.

#pragma once

#include "common.h"
#include "userwin.h"

// Registered Python processes (tgid -> struct py_process, 344 bytes). 4096 is the same bound
// as the unwinder's per-process table.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct py_process);
} py_procs SEC(".maps");

struct py_thread {
	__u64 tstate;     // 0: the thread has no thread state (as of checked_ns)
	__u64 checked_ns; // when a search last ran
	__u64 head;       // with tstate 0: the first interpreter's newest thread state then
};

// tid -> thread state. LRU: threads come and go, and a stale entry only costs a search.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct py_thread);
} py_threads SEC(".maps");

// One frame-sized buffer per CPU and context (sampler, sched_switch, probes), which may
// interrupt one another.
struct py_frame_buf {
	__u8 bytes[PY_FRAME_READ_MAX];
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SCRATCH_KINDS);
	__type(key, __u32);
	__type(value, struct py_frame_buf);
} py_frame_bufs SEC(".maps");

// A thread that had no thread state is looked for again after this long, or at once when the
// interpreter has a new thread state since (a native thread calling into Python through
// PyGILState_Ensure makes one, at the head of the list). A thread younger than this is
// looked for on every sample: `threading` makes a new thread's state before it runs, and the
// thread binds it (sets its thread_id) as it starts, so a sample in the microseconds between
// used to hide that thread's Python frames for the next 200 ms, a short thread's whole life.
#define PY_NO_THREAD_TTL_NS 200000000ULL
#define PY_MAX_INTERPRETERS 4
#define PY_MAX_THREADS 512

struct thread_struct {
	unsigned long fsbase;
} __attribute__((preserve_access_index));

struct task_struct___py {
	struct thread_struct thread;
	__u64 start_time;
} __attribute__((preserve_access_index));

static __always_inline __u64 read_user_u64(__u64 addr)
{
	__u64 v = 0;
	if (bpf_probe_read_user(&v, sizeof(v), (void *)addr))
		return 0;
	return v;
}

static __always_inline __u64 buf_u64(__u8 *buf, __u32 off)
{
	if (off > PY_FRAME_READ_MAX - 8)
		return 0;
	return *(__u64 *)(buf + off);
}

static __always_inline __u32 buf_u32(__u8 *buf, __u32 off)
{
	if (off > PY_FRAME_READ_MAX - 4)
		return 0;
	return *(__u32 *)(buf + off);
}

static __always_inline __u8 buf_u8(__u8 *buf, __u32 off)
{
	if (off > PY_FRAME_READ_MAX - 1)
		return 0;
	return buf[off];
}

struct ts_search {
	__u64 ts;
	__u64 want;
	__u64 found;
	__u32 off_next;
	__u32 off_id;
	// 1 once a thread state was looked at. A flag, not a count: a count would make every
	// iteration's callback state distinct, and the verifier walks a bpf_loop callback until
	// its states converge (a counter here took on_cpu_clock past 1M instructions on 6.18).
	__u32 visited;
};

static long ts_search_step(__u32 index, struct ts_search *s)
{
	if (!s->ts)
		return 1;
	__u64 id = 0;
	if (bpf_probe_read_user(&id, sizeof(id), (void *)(s->ts + s->off_id)))
		return 1;
	s->visited = 1;
	if (id == s->want) {
		s->found = s->ts;
		return 1;
	}
	__u64 next = read_user_u64(s->ts + s->off_next);
	if (next == s->ts)
		return 1;
	s->ts = next;
	return 0;
}

// The thread id and frame fields of the thread state at `ts`, with one read of the bytes
// between them when they lie within PY_FRAME_READ_MAX of each other (3.11-3.13), into the
// frame buffer `fb`: a user read costs ~100 ns in a VM (the helper and copy_from_user's
// calls and returns), as much as a dozen frames of the walk. Returns 0 on success.
static __always_inline int py_tstate_fields(struct py_process *p, struct py_frame_buf *fb, __u64 ts,
					    __u64 *id, __u64 *frame)
{
	// 64-bit throughout: clang checked a 32-bit copy of the length and passed the other.
	__u64 id_off = p->off.tstate_thread_id, frame_off = p->off.tstate_frame;
	__u64 lo = id_off < frame_off ? id_off : frame_off;
	__u64 len = (id_off < frame_off ? frame_off : id_off) + 8 - lo;
	barrier_var(len);
	// One bound, one register: clang turned `len > 0 && len <= MAX` into a test of a copy,
	// which 6.1's and 6.12's verifiers do not carry back to the helper's argument.
	if (len <= PY_FRAME_READ_MAX) {
		if (bpf_probe_read_user(fb->bytes, len, (void *)(ts + lo)))
			return -1;
		*id = buf_u64(fb->bytes, id_off - lo);
		*frame = buf_u64(fb->bytes, frame_off - lo);
		return 0;
	}
	if (bpf_probe_read_user(id, 8, (void *)(ts + id_off)) ||
	    bpf_probe_read_user(frame, 8, (void *)(ts + frame_off)))
		return -1;
	return 0;
}

// The current thread's PyThreadState, or 0; `*frame` is its frame field (tstate_frame) when
// the cached thread state was confirmed, else 0 (the caller reads it). `*found_new`: a search
// found a thread state the cache did not hold for this tid. `now`: the walk's start, for the
// cache's times.
static __always_inline __u64 py_find_tstate(struct py_process *p, struct py_frame_buf *fb,
					    __u32 tid, __u64 now, __u64 *frame, int *found_new)
{
	*frame = 0;
	*found_new = 0;
	// A trusted BTF pointer: the field is a plain load, not a bpf_probe_read_kernel call.
	struct task_struct___py *task = (void *)bpf_get_current_task_btf();
	__u64 fsbase = task->thread.fsbase;
	if (!fsbase)
		return 0;
	struct py_thread *cached = bpf_map_lookup_elem(&py_threads, &tid);
	// Read only for a thread known to have none (two reads), or for a search.
	__u64 interp = 0, head = 0;
	if (cached) {
		__u64 ts = cached->tstate;
		if (ts) {
			__u64 id = 0, f = 0;
			if (!py_tstate_fields(p, fb, ts, &id, &f) && id == fsbase) {
				*frame = f;
				return ts;
			}
		} else if (now - cached->checked_ns < PY_NO_THREAD_TTL_NS &&
			   now - task->start_time >= PY_NO_THREAD_TTL_NS) {
			interp = read_user_u64(p->runtime + p->off.runtime_interpreters_head);
			head = read_user_u64(interp + p->off.interp_threads_head);
			if (head == cached->head)
				return 0;
		}
	}
	count(COUNTER_PY_TSTATE_SEARCHES);
	if (!interp) {
		interp = read_user_u64(p->runtime + p->off.runtime_interpreters_head);
		head = read_user_u64(interp + p->off.interp_threads_head);
	}
	struct ts_search s = {
		.want = fsbase,
		.off_next = p->off.tstate_next,
		.off_id = p->off.tstate_thread_id,
	};
	for (int k = 0; k < PY_MAX_INTERPRETERS; k++) {
		if (!interp)
			break;
		s.ts = read_user_u64(interp + p->off.interp_threads_head);
		bpf_loop(PY_MAX_THREADS, ts_search_step, &s, 0);
		if (s.found)
			break;
		interp = read_user_u64(interp + p->off.interp_next);
	}
	// An interpreter without thread states yet (a process registered as it starts, before
	// Py_Initialize made the main thread's) says nothing about this thread: caching that
	// answer left a script's first 200 ms without Python frames.
	if (!s.found && !s.visited)
		return 0;
	struct py_thread v = { .tstate = s.found, .checked_ns = now, .head = head };
	bpf_map_update_elem(&py_threads, &tid, &v, BPF_ANY);
	*found_new = s.found != 0;
	return s.found;
}

#define PY_WALK_READ_ERROR 1
#define PY_STACKREF_TAG_MASK (~7ULL)

// The first lines of code objects read in the last PY_CODE_LINE_TTL_NS, per CPU and scratch
// kind, direct-mapped by address. A code object's first line is what the agent checks a
// cached code object against, to tell a freed and reused code address apart; reading it is a
// user read (~100 ns in a VM) for each distinct code object on a stack, which through 28
// distinct functions was two thirds of the walk. A line taken from here is at most
// PY_CODE_LINE_TTL_NS old (a hit does not renew it): a code object freed and another made at
// its address within that time is named as the old one for at most that long, and then read
// again. The agent at 19 Hz meets a busy CPU's code objects every ~50 ms, so the TTL is above
// that. An entry is also keyed by the frame's globals (its module's dict, in the frame's bytes
// already read): start-up imports free their module bodies, and the script's functions,
// compiled next, took their addresses within the TTL and were sent with the freed module
// body's first line, which the agent then showed as `<unreadable frame>`. A code object that
// reuses an address within its own module (exec, compile) still can be, for the TTL.
#define PY_CODE_LINES 256
#define PY_CODE_LINE_TTL_NS 100000000ULL
struct py_code_line {
	struct py_body_key key; // the code object, its process, its first line
	__u64 globals;
	__u64 read_ns;
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, (SCRATCH_KINDS * PY_CODE_LINES));
	__type(key, __u32);
	__type(value, struct py_code_line);
} py_code_lines SEC(".maps");

// Module bodies by address (shared.h, struct py_body): written when py_code_lines misses one,
// which is once per body and CPU in the TTL, so a sample's cost is unchanged elsewhere.
#define PY_BODIES 4096
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, PY_BODIES);
	__type(key, struct py_body_key);
	__type(value, struct py_body);
} py_bodies SEC(".maps");

// A new py_bodies entry is made here (per CPU: too big for the stack).
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct py_body);
} py_body_new SEC(".maps");

// Adds the read the py_code_lines miss `e` made of a module body to its address's history
// when the body is another module's than the last one read there: the history is of
// changes, so a long-lived body (the script's) keeps one entry however often it is read.
// Its key and the new entry are map memory: no stack (6.1 counts this frame's bytes with its
// callers').
static __always_inline void py_keep_body(struct py_code_line *e)
{
	struct py_body *b = bpf_map_lookup_elem(&py_bodies, &e->key);
	if (b) {
		__u32 last = (b->next - 1) & (PY_BODY_HISTORY - 1);
		if (b->reads[last].globals == e->globals)
			return;
		__u32 i = b->next & (PY_BODY_HISTORY - 1);
		b->reads[i].globals = e->globals;
		b->reads[i].read_ns = e->read_ns;
		b->next = i + 1;
		return;
	}
	__u32 zero = 0;
	b = bpf_map_lookup_elem(&py_body_new, &zero);
	if (!b)
		return;
	__builtin_memset(b, 0, sizeof(*b));
	b->next = 1;
	b->reads[0].globals = e->globals;
	b->reads[0].read_ns = e->read_ns;
	bpf_map_update_elem(&py_bodies, &e->key, b, BPF_NOEXIST);
}

struct py_walk {
	__u64 frame;
	__u32 which; // SCRATCH_*: whose record and frame buffer
	__u32 base;  // first slot of the Python frames (after the native frames)
	__u32 used;  // slot pairs written (frames and shim markers)
	__u32 flags; // PY_WALK_*
	__u32 frame_read;
	__u32 frame_kind;
	__u32 frame_code;
	__u32 frame_previous;
	__u32 frame_instr;
	__u32 frame_is_entry;
	__u32 frame_owner;
	__u32 cstack_owner;
	__u32 code_adaptive;
	__u32 code_firstlineno;
	__u32 lasti_unit;
	__u32 frame_tlbc_index; // PY_ABSENT but on 3.14+ free-threaded builds
	__u32 code_tlbc;
	__u32 frame_globals;
	// The copy of the data-stack pages the walk is in (userwin.h): 3.11+ frames lie next to
	// one another there, so one read serves the frames of a page.
	struct user_win win;
	// The code object of the last frame and its co_firstlineno: recursion and loops repeat
	// a code object along one stack, and a code object cannot change or be freed while a
	// frame of the stack holds it.
	__u64 last_code;
	__u32 last_firstline;
	__u32 tgid;
	__u64 now; // the record's timestamp, for py_code_lines and py_bodies
	// --async (pyasync.h): the future a task chain's walk is at (the rest of the task walk's
	// state is in py_task_states: 6.1 counts every byte of this stack frame towards its
	// 512 bytes of combined stack, which the allocation probes' walks had no room left in).
	__u64 fut;
};

// The asyncio task walk's state, per CPU and scratch kind (pyasync.h).
struct py_task_state {
	__u64 frames[PY_TASK_CANDIDATES]; // the running tasks' coroutine frames, 0: none
	__u64 hit;                        // the one the frame walk stopped after
	__u64 tstate;                     // the thread's state (3.14+: its running task)
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SCRATCH_KINDS);
	__type(key, __u32);
	__type(value, struct py_task_state);
} py_task_states SEC(".maps");

// The first line of the code object at `code`, run by a frame with `globals`: from
// py_code_lines while fresh, else read (0 when unreadable).
static __always_inline __u32 py_code_firstline(struct py_walk *w, __u64 code, __u64 globals)
{
	__u32 slot = ((code >> 4) ^ (code >> 12)) & (PY_CODE_LINES - 1);
	__u32 key = (w->which & 3) * PY_CODE_LINES + slot;
	struct py_code_line *e = bpf_map_lookup_elem(&py_code_lines, &key);
	if (e && e->key.code == code && e->globals == globals && e->key.tgid == w->tgid &&
	    w->now - e->read_ns < PY_CODE_LINE_TTL_NS)
		return e->key.firstline;
	__u32 firstline = 0;
	if (bpf_probe_read_user(&firstline, sizeof(firstline),
				(void *)(code + w->code_firstlineno)))
		return 0;
	if (e) {
		e->key.code = code;
		e->key.tgid = w->tgid;
		e->key.firstline = firstline;
		e->globals = globals;
		e->read_ns = w->now;
		// A module body: kept for user space in case it is freed before it is read.
		if (firstline == 1)
			py_keep_body(e);
	}
	return firstline;
}

// The first `len` bytes of the frame at `frame`: in the window for a 3.11+ frame
// (`windowed`: they lie next to one another in the interpreter's data stack), else copied
// into the frame buffer `fb` (a PyFrameObject of 3.8-3.10 is a heap object of its own,
// where a page copy per frame would cost more than the frame's read). NULL when unreadable.
// Either way PY_FRAME_READ_MAX bytes may be read past the pointer: the window has that much
// slack, and the frame buffer is that big.
static __always_inline __u8 *py_frame_bytes(struct user_win *win, struct user_win_buf *wb,
					    struct py_frame_buf *fb, __u64 frame, __u32 len,
					    int windowed)
{
	if (len > PY_FRAME_READ_MAX)
		len = PY_FRAME_READ_MAX;
	if (windowed) {
		__u8 *p = user_win_at_buf(win, wb, frame, len);
		if (p)
			return p;
	}
	__u64 n = len;
	barrier_var(n);
	if (n > PY_FRAME_READ_MAX)
		return 0;
	return bpf_probe_read_user(fb->bytes, n, (void *)frame) ? 0 : fb->bytes;
}

// Copies of a function's bytecode a free-threaded interpreter may hold (one per thread that
// ran it, reused as threads end): a larger index is not followed.
#define PY_TLBC_MAX 4096

// Where the bytecode copy number `idx` (> 0) begins, given the address of its code object's
// co_tlbc field: the `idx`-th entry of that array ({size, entries[]}), 0 when it cannot be
// read. Copy 0 is co_code_adaptive, the one every GIL build runs. Two or three user reads, for
// frames of threads other than the first to run the function only. Inlined: as a global
// function it cost fewer instructions (37.4k against 45.5k for on_cpu_clock on 6.18), but it
// was a fifth call under the allocation probes, past 6.1's 512 bytes of combined stack.
static __always_inline __u64 py_tlbc_start(__u64 tlbc_field, __u32 idx)
{
	if (idx == 0 || idx >= PY_TLBC_MAX)
		return 0;
	__u64 array = read_user_u64(tlbc_field);
	if (!array || idx >= read_user_u64(array))
		return 0;
	return read_user_u64(array + 8 + (__u64)idx * 8);
}

// Frames per call of `py_frames`, for the same reason as UNWIND_BATCH (unwind.h): a frame
// of a batch costs no call while its frame lies in the window.
#define PY_BATCH 8

// One frame: writes its slot pair, then moves `w` to the previous frame. Returns 0 to go on,
// 1 when the walk ends (no frame left, out of slots, or a read failed: `flags` says).
static __always_inline int py_one(struct py_walk *w, __u64 *slots, struct user_win_buf *wb,
				  struct py_frame_buf *fb, struct py_task_state *ts)
{
	if (!w->frame)
		return 1;
	// The slot pairs written so far; the frame stays in `w` when the slots run out.
	__u32 index = w->used;
	__u32 at = w->base + 2 * index;
	if (index >= MAX_PY_FRAMES || at + 1 >= MAX_SLOTS)
		return 1;
	__u8 *bytes = py_frame_bytes(&w->win, wb, fb, w->frame, w->frame_read,
				     w->frame_kind != PY_FRAME_KIND_FRAME_OBJECT);
	if (!bytes) {
		w->flags |= PY_WALK_READ_ERROR;
		return 1;
	}
	__u64 code = buf_u64(bytes, w->frame_code);
	__u64 previous = buf_u64(bytes, w->frame_previous);
	if (previous == w->frame)
		previous = 0;
	// barrier_var (bpf_helpers.h) keeps the masks below: without it clang drops them on the
	// strength of the range check above, which the verifier does not connect to this register.
	__u32 i0 = at, i1 = at + 1;
	barrier_var(i0);
	barrier_var(i1);
	if (w->cstack_owner != PY_ABSENT &&
	    buf_u8(bytes, w->frame_owner) == (__u8)w->cstack_owner) {
		// A shim _PyEval_EvalFrameDefault pushes on entry (3.12+): the frame below it is
		// the outermost of that call. The agent reads the marker and marks that frame.
		slots[i0 & (MAX_SLOTS - 1)] = 0;
		slots[i1 & (MAX_SLOTS - 1)] = PY_SHIM_MARK;
		w->used = index + 1;
		w->frame = previous;
		return 0;
	}
	__u64 addr = PY_ADDR_UNKNOWN;
	__u64 entry = 0;
	if (w->frame_kind == PY_FRAME_KIND_FRAME_OBJECT) {
		__s32 lasti = (__s32)buf_u32(bytes, w->frame_instr);
		addr = lasti < 0 ? 0 : (__u64)lasti * w->lasti_unit;
		entry = PY_ENTRY_BIT;
	} else {
		// 3.14+: f_executable is a tagged _PyStackRef; object pointers are 8-aligned, so
		// clearing the low bits is right for every 3.11+ frame.
		code &= PY_STACKREF_TAG_MASK;
		__u64 instr = buf_u64(bytes, w->frame_instr);
		__u64 start = code + w->code_adaptive;
		if (w->frame_tlbc_index != PY_ABSENT) {
			// 3.14+ free-threaded: the thread may run a copy of its own (0: unknown
			// offset, as the test below then fails).
			__s32 idx = (__s32)buf_u32(bytes, w->frame_tlbc_index);
			if (idx > 0)
				start = py_tlbc_start(code + w->code_tlbc, idx);
		}
		if (start && instr >= start && instr - start < PY_ADDR_UNKNOWN)
			addr = instr - start;
		else if (instr + 2 == start)
			// 3.11/3.12 push a frame with prev_instr one code unit before its first
			// instruction: the frame is entering, at its first line.
			addr = 0;
		if (w->frame_is_entry != PY_ABSENT && buf_u8(bytes, w->frame_is_entry))
			entry = PY_ENTRY_BIT;
	}
	__u32 firstline = w->last_firstline;
	if (code != w->last_code) {
		firstline = py_code_firstline(w, code, buf_u64(bytes, w->frame_globals));
		w->last_code = code;
		w->last_firstline = firstline;
	}
	slots[i0 & (MAX_SLOTS - 1)] = code;
	slots[i1 & (MAX_SLOTS - 1)] = (addr & PY_ADDR_MASK) |
		(((__u64)firstline & PY_FIRSTLINE_MASK) << PY_FIRSTLINE_SHIFT) | entry;
	w->used = index + 1;
	__u64 here = w->frame;
	w->frame = previous;
	// A running task's coroutine: its tasks go right after it (pyasync.h).
	if (ts->frames[0] &&
	    (here == ts->frames[0] || here == ts->frames[1] || here == ts->frames[2] ||
	     here == ts->frames[3])) {
		ts->hit = here;
		return 1;
	}
	return 0;
}

// Up to PY_BATCH frames. Global, like `unwind_frames`: verified once on its own with `w`'s
// contents unknown (so the slot count is bounded here), the bpf_loop callback a single call.
// Returns 1 when the walk ended.
__attribute__((noinline)) int py_frames(struct py_walk *w)
{
	if (!w)
		return 1;
	__u32 which = w->which;
	__u64 *slots = scratch_slots(which);
	struct user_win_buf *wb = user_win_buf(&w->win);
	struct py_frame_buf *fb = bpf_map_lookup_elem(&py_frame_bufs, &which);
	struct py_task_state *ts = bpf_map_lookup_elem(&py_task_states, &which);
	if (!slots || !wb || !fb || !ts)
		return 1;
	for (int i = 0; i < PY_BATCH; i++) {
		if (py_one(w, slots, wb, fb, ts))
			return 1;
	}
	return 0;
}

static long py_walk_step(__u32 index, struct py_walk *w)
{
	return py_frames(w) != 0;
}

// --async: set at load time, so without it the verifier prunes the task walk.
const volatile __u32 py_async_walk = 0;

// The asyncio task walk (pyasync.h, which defines them: it needs this header's maps and
// helpers). Global functions, verified on their own.
__u64 py_task_scan(struct py_walk *w, __u64 want);
int py_task(struct py_walk *w);

static long py_task_step(__u32 index, struct py_walk *w)
{
	return py_task(w) != 0;
}

// What `py_walk` needs and gives back (on the caller's stack).
struct py_walk_args {
	__u32 tgid;
	__u32 tid;
	__u32 which;      // SCRATCH_*
	__u32 base;       // first slot of the Python frames (after the native frames)
	__u32 used;       // out: slot pairs written
	__u32 flags;      // out: SAMPLE_PY_*
	__u32 registered; // out: 1 when the process is a registered Python process
	__u64 now;        // the record's timestamp
};

// Walks the current thread's Python frames into the scratch record `a->which` names, after
// `a->base` native slots, when the process is a registered Python process. A global
// function: verified once, on its own, whichever program samples (see unwind.h).
__attribute__((noinline)) int py_walk(struct py_walk_args *a)
{
	if (!a)
		return 0;
	__u32 tgid = a->tgid;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	if (!p)
		return 0;
	a->registered = 1;
	__u64 start = bpf_ktime_get_ns();
	count(COUNTER_PY_WALKS);
	__u32 which = a->which;
	struct py_frame_buf *fb = bpf_map_lookup_elem(&py_frame_bufs, &which);
	if (!fb)
		return 0;
	__u64 frame = 0;
	int found_new = 0;
	__u64 tstate = py_find_tstate(p, fb, a->tid, start, &frame, &found_new);
	if (found_new)
		a->flags |= SAMPLE_PY_NEW_THREAD;
	if (!tstate) {
		a->flags |= SAMPLE_PY_NO_THREAD;
		count(COUNTER_PY_NO_THREAD);
		count_n(COUNTER_PY_NS, bpf_ktime_get_ns() - start);
		return 0;
	}
	if (!frame)
		frame = read_user_u64(tstate + p->off.tstate_frame);
	if (frame && p->off.cframe_current_frame != PY_ABSENT)
		frame = read_user_u64(frame + p->off.cframe_current_frame);
	struct py_walk w = {
		.frame = frame,
		.which = a->which,
		.base = a->base,
		.frame_read = p->frame_read,
		.frame_kind = p->off.frame_kind,
		.frame_code = p->off.frame_code,
		.frame_previous = p->off.frame_previous,
		.frame_instr = p->off.frame_instr,
		.frame_is_entry = p->off.frame_is_entry,
		.frame_owner = p->off.frame_owner,
		.cstack_owner = p->off.frame_owned_by_cstack,
		.code_adaptive = p->off.code_adaptive,
		.code_firstlineno = p->off.code_firstlineno,
		.lasti_unit = p->off.lasti_unit,
		.frame_tlbc_index = p->off.frame_tlbc_index,
		.code_tlbc = p->off.code_tlbc,
		.frame_globals = p->off.frame_globals,
		.win = { .which = a->which },
		.tgid = tgid,
		.now = a->now,
	};
	struct py_task_state *ts = bpf_map_lookup_elem(&py_task_states, &which);
	if (!ts)
		return 0;
	ts->frames[0] = 0;
	ts->hit = 0;
	if (py_async_walk) {
		REJECT_IF(REJECT_ASYNC);
		if (p->aio.task_type) {
			ts->tstate = tstate;
			py_task_scan(&w, 0);
		}
	}
	bpf_loop(MAX_PY_FRAMES / PY_BATCH + 1, py_walk_step, &w, 0);
	if (ts->hit) {
		w.fut = py_task_scan(&w, ts->hit);
		ts->frames[0] = 0;
		if (w.fut)
			bpf_loop(PY_MAX_TASKS, py_task_step, &w, 0);
		bpf_loop(MAX_PY_FRAMES / PY_BATCH + 1, py_walk_step, &w, 0);
	}
	a->used = w.used;
	if (w.flags & PY_WALK_READ_ERROR) {
		a->flags |= SAMPLE_PY_READ_ERROR;
		count(COUNTER_PY_READ_ERRORS);
	} else if (w.frame) {
		a->flags |= SAMPLE_PY_TRUNCATED;
		count(COUNTER_PY_TRUNCATED);
	}
	count_n(COUNTER_PY_NS, bpf_ktime_get_ns() - start);
	return w.used;
}

// Appends the current thread's Python frames after the `hdr->user_frames` native ones in the
// `which` scratch record, when the process is a registered Python process. Returns 1 when it
// is one.
static __always_inline int py_walk_current(__u32 tgid, __u32 tid, struct sample_header *hdr,
					   __u32 which)
{
	hdr->py_frames = 0;
	struct py_walk_args a = {
		.tgid = tgid,
		.tid = tid,
		.which = which,
		.base = hdr->user_frames,
		.now = hdr->timestamp_ns,
	};
	py_walk(&a);
	hdr->py_frames = a.used;
	hdr->flags |= a.flags;
	return a.registered;
}
