// SPDX-License-Identifier: GPL-2.0
//
// In-kernel DWARF CFI unwinder for x86-64 user stacks. The agent compiles each executable's
// .eh_frame into sorted rows (pyrometer-unwind) stored in `unwind_rows`, and each process's
// executable mappings into `unwind_procs`; this walks 8 frames a bpf_loop step, so the
// verifier checks one batch instead of 256 unrolled frames.
//
// Per frame: find the mapping (the walk keeps the last two it used: consecutive frames are
// mostly in one binary, and a walk out of a library mostly returns to the binary it came
// from), find the row (a per-CPU cache of rows found before, checked against the table;
// else the table's bucket index, then a binary search among the bucket's rows for the last
// row with row.pc <= pc), compute the CFA, read the return
// address at CFA-8 and the saved rbp where the row says. A mapping without a table falls back
// to the frame pointer for that frame, as does an address in no known mapping. Every way a
// walk stops early is counted.
//
// Verification cost is bounded by construction, the same on every kernel: the walk itself
// (`dwarf_walk`), a batch of frames (`unwind_frames`, the row search inline) and the mapping
// scan (`unwind_switch_mapping`) are global functions, which the verifier checks once each, on
// their own, with unknown arguments; a caller is checked against their signatures only. No
// loop sits inside the bpf_loop callback, whose body recent verifiers re-walk until its state
// converges (an inlined search loop there made every exit a distinct callback state: 1M
// instructions on 6.18 and no end in sight on 7.2); the callback only calls `unwind_frames`.
// Nothing here depends on which program calls it.

#pragma once

#include "common.h"
#include "userwin.h"

// 1M rows x 16 bytes (the kernel rounds array values up to 8 bytes) = 16 MiB by default; the agent sets the size (--unwind-rows) and
// maps the array into its address space (BPF_F_MMAPABLE) to write tables without syscalls.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 20);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct unwind_row);
} unwind_rows SEC(".maps");

// Bucket indexes of the tables (see UNWIND_BUCKET_SHIFT), written like the rows. Sized by
// the agent (a quarter of the row capacity by default).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 18);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, __u64);
} unwind_index SEC(".maps");

// Rows found before, per CPU: slot (a hash of the table and the address) -> row index. A
// walk mostly meets the return addresses it met in earlier samples (the same hot stacks),
// and the bucket search is a chain of dependent loads, each waiting for the one before; a
// guess is two adjacent rows (mostly one cache line) and one comparison. A guess is only
// ever used after checking it against the table itself (the row at or before the address,
// the next row after it, both inside the mapping's table), so a stale or overwritten slot,
// a table evicted and another loaded at its rows, or a program interrupting another on the
// same CPU can cost a search, never a wrong row. 16 KiB per CPU.
#define UNWIND_ROW_CACHE 4096
struct unwind_row_cache {
	__u32 row[UNWIND_ROW_CACHE];
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct unwind_row_cache);
} unwind_row_caches SEC(".maps");

// 4096 processes x 6 KiB = 24 MB at most (hash maps allocate on insert).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct process_unwind);
} unwind_procs SEC(".maps");

// Set by the agent when it attaches uretprobes (record --gil): a return address may then be
// the uretprobe trampoline, and the real one is in the kernel's list for the thread.
const volatile __u32 uretprobes_used = 0;

// 0: frame pointers only. Set by the agent (`--unwind fp`, or after a kernel refused the
// DWARF walk), so the verifier never sees the walk at all.
const volatile __u32 unwind_dwarf = 1;

struct return_instance___pyro {
	unsigned long stack;
	unsigned long orig_ret_vaddr;
	struct return_instance___pyro *next;
} __attribute__((preserve_access_index));

struct uprobe_task___pyro {
	struct return_instance___pyro *return_instances;
} __attribute__((preserve_access_index));

struct xol_area___pyro {
	unsigned long vaddr;
} __attribute__((preserve_access_index));

struct uprobes_state___pyro {
	struct xol_area___pyro *xol_area;
} __attribute__((preserve_access_index));

struct mm_struct___pyro {
	struct uprobes_state___pyro uprobes_state;
} __attribute__((preserve_access_index));

struct task_struct___pyro {
	struct mm_struct___pyro *mm;
	struct uprobe_task___pyro *utask;
} __attribute__((preserve_access_index));

// The address of the current process's uretprobe trampoline, 0 when it has none.
static __always_inline __u64 uretprobe_trampoline(void)
{
	if (!uretprobes_used)
		return 0;
	struct task_struct___pyro *task = (void *)bpf_get_current_task();
	return BPF_CORE_READ(task, mm, uprobes_state.xol_area, vaddr);
}

// The return address a uretprobe replaced in the stack slot at `slot`: the kernel keeps one
// instance per pending return (innermost first), each with the slot it hijacked. Global: its
// loop is verified once, not at each of its call sites inside the unwinder's callback.
__attribute__((noinline)) __u64 uretprobe_original(__u64 slot)
{
	struct task_struct___pyro *task = (void *)bpf_get_current_task();
	struct return_instance___pyro *ri = BPF_CORE_READ(task, utask, return_instances);
	for (int k = 0; k < 8 && ri; k++) {
		if (BPF_CORE_READ(ri, stack) == slot)
			return BPF_CORE_READ(ri, orig_ret_vaddr);
		ri = BPF_CORE_READ(ri, next);
	}
	return 0;
}

// A thread stopped inside the trampoline page (returning through a uretprobe): it is really
// at the return address of the innermost pending uretprobe, with the stack as after that
// return. Returns 0 when there is none.
static __always_inline int uretprobe_in_trampoline(__u64 *pc, __u64 *sp)
{
	struct task_struct___pyro *task = (void *)bpf_get_current_task();
	struct return_instance___pyro *ri = BPF_CORE_READ(task, utask, return_instances);
	if (!ri)
		return 0;
	*pc = BPF_CORE_READ(ri, orig_ret_vaddr);
	*sp = BPF_CORE_READ(ri, stack) + 8;
	return 1;
}

// Out bits of a walk (dwarf_walk_args.flags, beside the SAMPLE_* ones) that ask for a copy
// of the stack: the walk met a mapping whose table is being built (always worth one), or an
// address in no mapping of the process or a process with no entry (worth one only while the
// process is young: see STACK_COPY_YOUNG_NS).
#define WALK_COPY_PENDING (1U << 31)
#define WALK_COPY_IF_YOUNG (1U << 30)
// A process younger than this (ns since its first thread started) that has no unwind entry
// yet, or runs code in a mapping the agent has not seen, gets copies: an older one is one the
// agent left out (opted out, over its budget) or one running JIT code, which no table covers.
#define STACK_COPY_YOUNG_NS 5000000000ULL

// Where a mapping's rows and index are.
struct table_ref {
	__u32 row_first;
	__u32 row_count;
	__u32 index_first;
	__u32 index_count;
	__u32 pc_base;
	__u32 flags; // EXEC_MAPPING_*
};

// Frames whose row the cache gave, and those searched for (COUNTER_UNWIND_ROW_*).
struct row_counts {
	__u32 hits;
	__u32 searches;
};

// One executable mapping as the walk uses it (end == 0: none).
struct mapping_lookup {
	__u64 start;
	__u64 end;
	__u64 bias;
	struct table_ref table;
};

struct unwind_state {
	__u64 pc;
	__u64 sp;
	__u64 bp;
	__u64 trampoline; // uretprobe trampoline of the process, 0 when none
	// The mapping the previous frame was in, and the one before that: a walk that left a
	// binary for a library (a callback, libc's start code) mostly comes back to it, and each
	// scan of the process's mappings costs a hash lookup and a loop.
	struct mapping_lookup cur;
	struct mapping_lookup prev;
	__u32 pid;
	__u32 frames;
	__u32 stop_reason; // a COUNTER_UNWIND_* index, or 0 while walking
	__u32 complete;
	// Which per-CPU scratch record (SCRATCH_*) the frames go to: programs that may interrupt
	// one another cannot share one.
	__u32 which;
	__u32 copy; // WALK_COPY_*: whether the sample should keep a copy of its stack
	// Summed here and counted once a walk: a counter map per frame would cost a lookup.
	struct row_counts rows;
	// The copy of the stack pages the walk is in (userwin.h): the return address and saved
	// rbp of the frames of one page come from one read.
	struct user_win win;
};

// The executable mapping of process `pid` that holds `pc`. A linear scan with constant
// indices: a binary search indexes the array with values the verifier must track precisely.
// Returns 0 when found (copied to `out`, which is left alone otherwise), -1 when the address
// is in no known mapping, -2 when the process has no unwind information.
static __always_inline int find_mapping(__u32 pid, __u64 pc, struct mapping_lookup *out)
{
	struct process_unwind *proc = bpf_map_lookup_elem(&unwind_procs, &pid);
	if (!proc)
		return -2;
	__u32 count = proc->count;
	for (int k = 0; k < MAX_MAPPINGS; k++) {
		if (k >= count)
			break;
		struct exec_mapping *m = &proc->maps[k];
		if (m->start <= pc && pc < m->end) {
			out->start = m->start;
			out->end = m->end;
			out->bias = m->bias;
			out->table.row_first = m->row_first;
			out->table.row_count = m->row_count;
			out->table.index_first = m->index_first;
			out->table.index_count = m->index_count;
			out->table.pc_base = m->pc_base;
			out->table.flags = m->flags;
			return 0;
		}
	}
	return -1;
}

// The last row at or before `rel` in the table `t` (a pointer into unwind_rows), or NULL
// when no row covers `rel`: the row `cache` remembers for (t, rel) when the table confirms
// it, else the bucket index narrows the rows to those of one UNWIND_BUCKET_SHIFT-sized
// stretch of text, then a binary search. Inlined into the global `unwind_frames` only, where
// the verifier checks its loop once per frame of a batch.
static __always_inline struct unwind_row *unwind_find_row(struct table_ref *t, __u32 rel,
							  struct unwind_row_cache *cache,
							  struct row_counts *counts)
{
	__u32 first = t->row_first;
	// Fibonacci hashing of the table's first row and the address.
	__u32 slot = ((rel ^ (first * 0x9E3779B1u)) * 0x9E3779B1u) >> 20;
	slot &= UNWIND_ROW_CACHE - 1;
	// The guess is the answer exactly when it and the row after it are rows of this table
	// and they bracket `rel`: rows are sorted by pc, with distinct pcs.
	__u32 guess = cache->row[slot];
	__u32 after = guess + 1;
	struct unwind_row *g = bpf_map_lookup_elem(&unwind_rows, &guess);
	struct unwind_row *g_next = bpf_map_lookup_elem(&unwind_rows, &after);
	if (g && g_next) {
		// The top bit is set when the guess is not a row of this table with a next row
		// of its own, when rel < g->pc, or when g_next->pc <= rel: one test for the three (the
		// verifier walks each branch here at every frame of a batch). All are differences
		// of 32-bit values taken in 64 bits, negative exactly when the test fails.
		__u64 miss = ((__u64)(t->row_count - 1) - (__u32)(guess - first) - 1) |
			((__u64)rel - g->pc) | ((__u64)g_next->pc - rel - 1);
		barrier_var(miss);
		if (!(miss >> 63)) {
			counts->hits++;
			return g;
		}
	}
	counts->searches++;
	// Every table has its index (the agent loads none without): a bucket holds at most 1024
	// rows past its first, one per byte of its text, so 11 halvings always suffice.
	if (!t->index_count || rel < t->pc_base)
		return 0;
	__u32 k = (rel - t->pc_base) >> UNWIND_BUCKET_SHIFT;
	if (k >= t->index_count)
		k = t->index_count - 1;
	__u32 at = t->index_first + k;
	// Both ends in one entry: the bucket's first candidate row and the next bucket's.
	__u64 *bounds = bpf_map_lookup_elem(&unwind_index, &at);
	if (!bounds)
		return 0;
	__u32 base = first + (__u32)*bounds;
	__u32 hi = first + (__u32)(*bounds >> 32) + 1;
	if (base >= hi || hi > first + t->row_count)
		return 0;
	// The row at `base` starts at or before the bucket, so at or before `rel`; the rows at
	// base + n and past it start after `rel`. Each step halves n without a branch on the
	// comparison: BPF has no conditional move, and a search through distinct functions
	// made each step's branch a coin toss for the CPU's predictor.
	__u32 n = hi - base;
	for (int step = 0; step < UNWIND_SEARCH_STEPS; step++) {
		if (n <= 1)
			break;
		__u32 half = n / 2;
		__u32 mid = base + half;
		struct unwind_row *row = bpf_map_lookup_elem(&unwind_rows, &mid);
		if (!row)
			return 0;
		// All ones when row->pc <= rel: the difference of the two 32-bit values, taken in
		// 64 bits, has its top bit set only when it is negative. The barrier hides the
		// idiom from clang, which otherwise turns it back into a compare and a branch.
		__u64 diff = (__u64)rel - (__u64)row->pc;
		barrier_var(diff);
		__u64 at_or_before = (diff >> 63) - 1;
		base += half & (__u32)at_or_before;
		n -= half;
	}
	if (n > 1)
		return 0;
	struct unwind_row *row = bpf_map_lookup_elem(&unwind_rows, &base);
	if (row)
		cache->row[slot] = base;
	return row;
}

// Makes the mapping holding `lookup` the walk's current one, the current one becoming the
// previous one. Returns 0, or find_mapping's -1 or -2 (`cur` is then unset). Global: the
// scan's loop is verified once, on its own. The scan writes straight into `prev`, which then
// trades places with `cur` word by word, and it is inline here, not a function of its own:
// 6.1's verifier allows a call chain 512 bytes of stack, counting at least 32 for each
// function on it, and alloc_return's chain measured 528 bytes with a mapping copied through
// this function's stack, 544 with the scan a call deeper.
__attribute__((noinline)) int unwind_switch_mapping(struct unwind_state *st, __u64 lookup)
{
	if (!st)
		return -1;
	if (lookup < st->prev.start || lookup >= st->prev.end) {
		int found = find_mapping(st->pid, lookup, &st->prev);
		if (found < 0) {
			st->cur.end = 0;
			return found;
		}
	}
	__u64 *a = (__u64 *)&st->cur, *b = (__u64 *)&st->prev;
	for (int w = 0; w < sizeof(st->cur) / 8; w++) {
		__u64 t = a[w];
		a[w] = b[w];
		b[w] = t;
	}
	return 0;
}

// One frame by the frame pointer. Global, for the same reason as uretprobe_original.
__attribute__((noinline)) int frame_pointer_step(struct unwind_state *st)
{
	if (!st)
		return -1;
	__u64 next_bp = 0, ra = 0;
	if (st->bp == 0 || user_win_u64(&st->win, st->bp, &next_bp) ||
	    user_win_u64(&st->win, st->bp + 8, &ra))
		return -1;
	if (st->trampoline && ra == st->trampoline)
		ra = uretprobe_original(st->bp + 8);
	st->sp = st->bp + 16;
	st->bp = next_bp;
	st->pc = ra;
	return 0;
}

// ucontext_t on x86-64: uc_flags, uc_link, uc_stack (24 bytes), then mcontext's gregs,
// where REG_RBP = 10, REG_RSP = 15, REG_RIP = 16. At __restore_rt the stack pointer points
// at the ucontext (the return address slot was popped by the ret into the trampoline).
#define UC_GREGS 40
static __always_inline int signal_step(struct unwind_state *st)
{
	__u64 bp, sp, ip;
	if (bpf_probe_read_user(&bp, 8, (void *)(st->sp + UC_GREGS + 10 * 8)) ||
	    bpf_probe_read_user(&sp, 8, (void *)(st->sp + UC_GREGS + 15 * 8)) ||
	    bpf_probe_read_user(&ip, 8, (void *)(st->sp + UC_GREGS + 16 * 8)))
		return -1;
	st->bp = bp;
	st->sp = sp;
	st->pc = ip;
	return 0;
}

// Frames per call of `unwind_frames`: the frames of a batch cost no call at all while they
// stay in one mapping and one window page (a call and its return measured ~7 ns on this
// kind of AMD host, with retpolines and Safe RET; one frame used to make three or four).
// The verifier checks the batch's loop, row search included, once per frame of the batch:
// 8 against 4 took ~10 % off a 90-frame walk for +17k processed instructions on 6.18 (+28k
// on 6.1, whose verifier prunes less), every kernel of the matrix staying under 64k.
#define UNWIND_BATCH 8

// One frame: writes its address, then moves `st` to the caller's frame. Returns 0 to go on,
// 1 when the walk ends (`stop_reason` or `complete` say why). `user` is the scratch record's
// slots, `wb` the window's buffer, `cache` this CPU's row cache.
static __always_inline int unwind_one(struct unwind_state *st, __u64 *user, struct user_win_buf *wb,
				      struct unwind_row_cache *cache)
{
	__u32 n = st->frames;
	if (n >= MAX_USER_FRAMES) {
		st->stop_reason = COUNTER_UNWIND_TRUNCATED;
		return 1;
	}
	user[n & (MAX_SLOTS - 1)] = st->pc;
	st->frames = n + 1;

	// A return address points after the call; look up the call itself.
	__u64 lookup = n == 0 ? st->pc : st->pc - 1;
	if ((lookup < st->cur.start || lookup >= st->cur.end) &&
	    unwind_switch_mapping(st, lookup)) {
		// Code the agent has not seen mapped yet (a fresh dlopen, JIT code): frame
		// pointers, which the counter records when they fail too.
		st->stop_reason = COUNTER_UNWIND_NO_MAPPING;
		st->copy |= WALK_COPY_IF_YOUNG;
		if (frame_pointer_step(st))
			return 1;
		st->stop_reason = 0;
		return st->pc == 0;
	}
	if (st->cur.table.row_count == 0) {
		st->stop_reason = COUNTER_UNWIND_NO_TABLE;
		if (st->cur.table.flags & EXEC_MAPPING_PENDING)
			st->copy |= WALK_COPY_PENDING;
		if (frame_pointer_step(st))
			return 1;
		st->stop_reason = 0;
		return st->pc == 0;
	}
	__u64 rel = lookup - st->cur.bias;
	struct unwind_row *row = rel > 0xffffffffULL
		? 0
		: unwind_find_row(&st->cur.table, (__u32)rel, cache, &st->rows);
	// A CFA_NONE row ends a range of text with no CFI (between functions, or past the last).
	if (!row || row->cfa_type == CFA_NONE) {
		st->stop_reason = COUNTER_UNWIND_NO_ROW;
		return 1;
	}
	__u64 cfa;
	switch (row->cfa_type) {
	case CFA_END:
		st->complete = 1;
		return 1;
	case CFA_SIGNAL:
		if (signal_step(st)) {
			st->stop_reason = COUNTER_UNWIND_BAD_CFA;
			return 1;
		}
		return st->pc == 0;
	case CFA_RSP:
		cfa = st->sp + row->cfa_offset;
		break;
	case CFA_RBP:
		cfa = st->bp + row->cfa_offset;
		break;
	case CFA_PLT:
		cfa = st->sp + 8 + (((st->pc & 15) >= 11) ? 8 : 0);
		break;
	default:
		st->stop_reason = COUNTER_UNWIND_BAD_CFA;
		return 1;
	}
	__u64 ra = 0;
	if (user_win_u64_buf(&st->win, wb, cfa - 8, &ra)) {
		st->stop_reason = COUNTER_UNWIND_BAD_CFA;
		return 1;
	}
	if (st->trampoline && ra == st->trampoline)
		ra = uretprobe_original(cfa - 8);
	if (row->rbp_type == RBP_OFFSET) {
		__u64 bp = 0;
		if (user_win_u64_buf(&st->win, wb, cfa + row->rbp_offset, &bp)) {
			st->stop_reason = COUNTER_UNWIND_BAD_CFA;
			return 1;
		}
		st->bp = bp;
	} else if (row->rbp_type != RBP_SAME) {
		st->stop_reason = COUNTER_UNWIND_BAD_CFA;
		return 1;
	}
	st->sp = cfa;
	st->pc = ra;
	if (ra == 0) {
		// A zero return address ends the chain (thread start routines clear it).
		st->complete = 1;
		return 1;
	}
	return 0;
}

// Up to UNWIND_BATCH frames. Global: the verifier checks it once, on its own, with `st`'s
// contents unknown (so the frame count is bounded here, not trusted), and the bpf_loop
// callback that calls it stays a single call whose state converges at once: the row search's
// loop inlined into a callback made every exit a distinct callback state (1M instructions on
// 6.18 and no end on 7.2). Returns 1 when the walk ended.
__attribute__((noinline)) int unwind_frames(struct unwind_state *st)
{
	if (!st)
		return 1;
	__u64 *user = scratch_slots(st->which);
	struct user_win_buf *wb = user_win_buf(&st->win);
	__u32 zero = 0;
	struct unwind_row_cache *cache = bpf_map_lookup_elem(&unwind_row_caches, &zero);
	if (!user || !wb || !cache)
		return 1;
	for (int i = 0; i < UNWIND_BATCH; i++) {
		if (unwind_one(st, user, wb, cache))
			return 1;
	}
	return 0;
}

static long unwind_step(__u32 index, struct unwind_state *st)
{
	return unwind_frames(st) != 0;
}

// Where a walk starts and what it found (on the caller's stack: the argument of `dwarf_walk`).
struct dwarf_walk_args {
	__u64 pc;
	__u64 sp;
	__u64 bp;
	__u32 pid;
	__u32 which;  // SCRATCH_*
	__u32 frames; // out: frames written
	__u32 flags;  // out: SAMPLE_DWARF, SAMPLE_COMPLETE
};

// Walks a user stack from the registers in `a` into the scratch record `a->which` names.
// Returns the number of frames, or -1 when the process has no unwind information (the
// caller then uses frame pointers).
__attribute__((noinline)) int dwarf_walk(struct dwarf_walk_args *a)
{
	if (!a)
		return -1;
	__u32 pid = a->pid;
	struct unwind_state st = {
		.pc = a->pc,
		.sp = a->sp,
		.bp = a->bp,
		.pid = pid,
		.which = a->which,
		.trampoline = uretprobe_trampoline(),
		.win = { .which = a->which, .up = 1 },
	};
	if (st.trampoline && st.pc - st.trampoline < 4096)
		uretprobe_in_trampoline(&st.pc, &st.sp);
	// The first frame's mapping, found here because the scan's lookup of the process also
	// says whether it has unwind information at all: one hash lookup for both.
	if (unwind_switch_mapping(&st, st.pc) == -2) {
		// A kernel thread has no user registers: nothing to copy.
		a->flags = st.pc && st.sp ? WALK_COPY_IF_YOUNG : 0;
		return -1;
	}
	if (st.pc == 0)
		return 0;
	bpf_loop(MAX_USER_FRAMES / UNWIND_BATCH + 1, unwind_step, &st, 0);
	count(COUNTER_UNWIND_SAMPLES);
	count_n(COUNTER_UNWIND_ROW_HITS, st.rows.hits);
	count_n(COUNTER_UNWIND_ROW_SEARCHES, st.rows.searches);
	if (st.stop_reason)
		count(st.stop_reason);
	__u32 flags = SAMPLE_DWARF;
	if (st.stop_reason == COUNTER_UNWIND_NO_MAPPING)
		flags |= SAMPLE_UNKNOWN_MAPPING;
	if (st.complete) {
		count(COUNTER_UNWIND_COMPLETE);
		flags |= SAMPLE_COMPLETE;
	} else {
		flags |= st.copy & (WALK_COPY_PENDING | WALK_COPY_IF_YOUNG);
	}
	a->flags = flags;
	a->frames = st.frames;
	return st.frames;
}

struct task_struct___copy {
	struct task_struct___copy *group_leader;
	__u64 start_time;
} __attribute__((preserve_access_index));

// A thread that hit a uprobe (an allocation probe, --gil, --gc) runs the probed instruction
// out of line, in the process's [uprobes] page, and traps back: sampled then, its pc is in
// that page, which no table covers, and its stack stopped short or went astray (frame
// pointers from the probed function's first instruction). `vaddr` is where the instruction
// belongs and `xol_vaddr` its slot (in an anonymous union and struct of uprobe_task, which
// CO-RE finds by name).
struct uprobe_task___xol {
	unsigned long vaddr;
	unsigned long xol_vaddr;
} __attribute__((preserve_access_index));
struct task_struct___xol {
	struct uprobe_task___xol *utask;
} __attribute__((preserve_access_index));

// Bytes of a slot past its start that a pc may be at: the instruction (at most 15 bytes),
// before or after it ran.
#define XOL_SLOT_REACH 64

// `pc` moved from the current thread's out-of-line slot to the probed code it stands for.
static __always_inline __u64 uprobe_xol_pc(__u64 pc)
{
	struct task_struct___xol *task = (void *)bpf_get_current_task_btf();
	struct uprobe_task___xol *ut = task->utask;
	if (!ut)
		return pc;
	__u64 xol = ut->xol_vaddr;
	if (xol == 0 || pc - xol >= XOL_SLOT_REACH)
		return pc;
	return ut->vaddr + (pc - xol);
}

// Whether a walk that ended with `flags` should keep a copy of the stack: one through a table
// being built, or one the agent could not know yet in a process that started moments ago.
static __always_inline int walk_wants_copy(__u32 flags)
{
	if (flags & WALK_COPY_PENDING)
		return 1;
	if (!(flags & WALK_COPY_IF_YOUNG))
		return 0;
	struct task_struct___copy *task = (void *)bpf_get_current_task_btf();
	__u64 started = BPF_CORE_READ(task, group_leader, start_time);
	return bpf_ktime_get_ns() - started < STACK_COPY_YOUNG_NS;
}

// The user registers a stack walk starts from: `user` (those of a probe or an interrupted
// user-mode sample), or when NULL the ones saved on kernel entry (a sample in a system call,
// a thread switched out); the pc moved out of a uprobe's slot. Non-zero when unreadable.
static __always_inline int walk_start_regs(const struct pt_regs *user, __u64 *pc, __u64 *sp,
					   __u64 *bp)
{
	if (user) {
		*pc = user->rip;
		*sp = user->rsp;
		*bp = user->rbp;
	} else {
		struct task_struct *task = bpf_get_current_task_btf();
		struct pt_regs *saved = (struct pt_regs *)bpf_task_pt_regs(task);
		if (bpf_probe_read_kernel(pc, sizeof(*pc), &saved->rip) ||
		    bpf_probe_read_kernel(sp, sizeof(*sp), &saved->rsp) ||
		    bpf_probe_read_kernel(bp, sizeof(*bp), &saved->rbp))
			return -1;
	}
	*pc = uprobe_xol_pc(*pc);
	return 0;
}

// Walks the user stack of the current task into the scratch record `which` names, setting
// SAMPLE_* flags in `hdr`. `regs` are the user registers when the program interrupted user
// mode, or NULL: then the ones saved on kernel entry are used (a sample in a system call,
// or a thread switched out by the scheduler). Returns the number of frames, or -1 when the
// process has no unwind information (the caller then uses frame pointers).
static __always_inline int dwarf_unwind_regs(const struct pt_regs *user_regs, __u32 tgid,
					     struct sample_header *hdr, __u32 which)
{
	if (!unwind_dwarf)
		return -1;
	REJECT_IF(REJECT_DWARF);
	// Three registers, not a copy of pt_regs: 6.1's verifier caps the stack of the whole
	// call chain (this program, dwarf_walk, its callback, the searches) at 512 bytes.
	struct dwarf_walk_args a = {
		.pid = tgid,
		.which = which,
	};
	if (walk_start_regs(user_regs, &a.pc, &a.sp, &a.bp))
		return 0;
	int frames = dwarf_walk(&a);
	// Only the sampler sends copies; a walk for another program only drops the bits.
	if (which == SCRATCH_SAMPLE && walk_wants_copy(a.flags))
		hdr->flags |= SAMPLE_STACK_COPY;
	if (frames < 0)
		return -1;
	hdr->flags |= a.flags & ~(WALK_COPY_PENDING | WALK_COPY_IF_YOUNG);
	return frames;
}
