// SPDX-License-Identifier: GPL-2.0
//
// Allocation sampling (`record --alloc`, the agent's `--alloc-pid`/`--alloc-comm`): uprobes on
// the allocator entry points of each target (libc's or jemalloc's/tcmalloc's malloc, calloc,
// realloc, posix_memalign, aligned_alloc, memalign, valloc, free, and CPython's pymalloc,
// which serves small objects from its own arenas), attached per process. The attach cookie
// says which function a probe is on.
//
// Sampling is by bytes, as tcmalloc does: each CPU counts down a random number of bytes drawn
// from an exponential distribution with the configured mean (a Poisson process over the
// bytes allocated), and the allocation that crosses zero is sampled. An allocation of s bytes
// is then sampled with probability 1 - exp(-s/mean), which the agent inverts into a weight,
// so totals are unbiased estimates. Sampled allocations go to the ring buffer with their stack
// (walked at the allocator's return, native and Python frames) and into `alloc_live`; a free
// of a live address sends a small free record, and a resize of one moves its entry (a move
// record), so the agent knows what is still in use and which allocation made it.
//
// A process that preloads libpyrometer_alloc.so (alloc-preload/) samples in process: its
// per-thread byte countdown calls pyrometer_alloc_sampled(ptr, size, flags) for the sampled
// allocations only, pyrometer_free_sampled(ptr) for the frees of those blocks only and
// pyrometer_realloc_sampled(old, new, size) for their resizes. alloc_preload (on the first's
// return), alloc_preload_free and alloc_preload_move sit on these functions, attached once per
// copy of the library for every process (the functions run only in processes that load it,
// and only when they sample), so an unsampled allocator call never enters the kernel.
//
// Allocators call each other (glibc's realloc(NULL, n) jumps to malloc, its aligned
// functions to malloc, pymalloc to malloc for large blocks): a per-thread depth counts only
// the outermost call. Frees have no return probe; one inside another allocator call (the free
// realloc does) is left to that call.

#pragma once

#include "common.h"
#include "stacks.h"

#include "exp_table.h"

// Mean bytes between samples (--alloc-sample-bytes); 1 samples every allocation.
const volatile __u64 alloc_sample_bytes = 524288;
const volatile __u32 alloc_filter = ALLOC_FILTER_TARGETS;

// The agent's allocation targets (tgid -> 1), when alloc_filter is ALLOC_FILTER_MAP.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
} alloc_targets SEC(".maps");

struct alloc_thread {
	__u32 depth;   // allocator calls in progress on this thread
	__u32 kind;    // the outermost call's ALLOC_*
	__u64 size;    // its size
	__u64 old;     // realloc: the block being resized
	__u64 memptr;  // posix_memalign: where the pointer is returned
	__u64 sampled; // the outermost call was picked by the byte sampler
};

// tid -> the thread's allocator call in progress (48 bytes; 16384 threads).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct alloc_thread);
} alloc_threads SEC(".maps");

struct alloc_key {
	__u32 pid;
	__u32 reserved;
	__u64 addr;
};

struct alloc_block {
	__u64 size;
	__u64 timestamp_ns;
};

// Sampled blocks still allocated, (pid, address) -> size and time. The size is set by the
// agent (--alloc-live); an allocation sampled while it is full is counted and not tracked.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct alloc_key);
	__type(value, struct alloc_block);
} alloc_live SEC(".maps");

struct alloc_countdown {
	__s64 remaining; // bytes until the next sample
	__u64 started;   // the first gap was drawn
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct alloc_countdown);
} alloc_countdowns SEC(".maps");

static __always_inline int alloc_target(__u32 tgid)
{
	if (alloc_filter == ALLOC_FILTER_MAP)
		return tgid != self_tgid && bpf_map_lookup_elem(&alloc_targets, &tgid) != 0;
	return is_target(tgid);
}

// Whether the preloaded library's reports from `tgid` are recorded: `record`'s targets, or
// for the agent every process but pyrometer itself (the probes fire only in processes that
// load the library, and `alloc_preload_all` says the agent samples them all).
const volatile __u32 alloc_preload_all = 0;
static __always_inline int alloc_preload_target(__u32 tgid)
{
	if (alloc_filter == ALLOC_FILTER_MAP && alloc_preload_all)
		return tgid != self_tgid;
	return alloc_target(tgid);
}

// Bytes to the next sample: mean * -ln(U), U uniform, from the table of conditional means.
static __always_inline __s64 alloc_gap(void)
{
	__u32 r = bpf_get_prandom_u32() & (EXP_TABLE_SIZE - 1);
	__u64 gap = (alloc_sample_bytes * (__u64)exp_table[r]) >> EXP_TABLE_SHIFT;
	return gap ? (__s64)gap : 1;
}

// Whether an allocation of `size` bytes is sampled.
static __always_inline __u64 alloc_sample(__u64 size)
{
	if (alloc_sample_bytes <= 1)
		return 1;
	__u32 zero = 0;
	struct alloc_countdown *c = bpf_map_lookup_elem(&alloc_countdowns, &zero);
	if (!c)
		return 0;
	if (!c->started) {
		c->started = 1;
		c->remaining = alloc_gap();
	}
	c->remaining -= (__s64)size;
	if (c->remaining > 0)
		return 0;
	// One sample however many points the block covers: the weight accounts for it.
	c->remaining = alloc_gap();
	return 1;
}

// A free (or a realloc's old block): when the block was sampled, it leaves alloc_live and
// the agent hears of it. Not inlined, like alloc_move: their records' stack space would
// otherwise be alloc_return's own, under the stack walk's calls, and 6.1's verifier refuses a
// call chain over 512 bytes of stack.
static __attribute__((noinline)) void alloc_forget(__u32 tgid, __u32 tid, __u64 addr)
{
	struct alloc_key key = { .pid = tgid, .addr = addr };
	if (bpf_map_delete_elem(&alloc_live, &key))
		return;
	struct sample_header ev = {};
	ev.timestamp_ns = bpf_ktime_get_ns();
	ev.pid = tgid;
	ev.tid = tid;
	ev.cpu = bpf_get_smp_processor_id();
	ev.kernel_stack_id = -1;
	ev.flags = SAMPLE_FREE;
	ev.aux = addr;
	if (send_record(&ev, sizeof(ev)))
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_ALLOC_FREES);
}

// A sampled block was resized from `old` to `to` (`size` bytes): its entry moves there with
// the new size, keeping its allocation time (user space keeps its stack and weight), and
// user space hears of the move. A block not tracked here (not sampled, sampled while
// alloc_live was full, or before the probes were attached) is left alone.
static __attribute__((noinline)) void alloc_move(__u32 tgid, __u32 tid, __u64 old, __u64 to,
						 __u64 size)
{
	struct alloc_key key = { .pid = tgid, .addr = old };
	struct alloc_block *b = bpf_map_lookup_elem(&alloc_live, &key);
	if (!b)
		return;
	struct alloc_block moved = { .size = size, .timestamp_ns = b->timestamp_ns };
	if (old != to)
		bpf_map_delete_elem(&alloc_live, &key);
	key.addr = to;
	__u32 flags = SAMPLE_FREE | SAMPLE_ALLOC_MOVED;
	if (bpf_map_update_elem(&alloc_live, &key, &moved, BPF_ANY)) {
		// No room after all (another thread took the slot): user space forgets it too.
		count(COUNTER_ALLOC_LIVE_FULL);
		flags = SAMPLE_FREE;
	}
	struct alloc_move_record rec = {};
	rec.hdr.timestamp_ns = bpf_ktime_get_ns();
	rec.hdr.pid = tgid;
	rec.hdr.tid = tid;
	rec.hdr.cpu = bpf_get_smp_processor_id();
	rec.hdr.kernel_stack_id = -1;
	rec.hdr.flags = flags;
	rec.hdr.aux = old;
	rec.hdr.value = size;
	rec.to = to;
	if (send_record(&rec, sizeof(rec)))
		count(COUNTER_RINGBUF_DROPS);
}

// Sends a sampled allocation of `size` bytes at `addr`: its record carries the stack walked
// from `ctx`, the program's registers right after its allocator call returned.
static __always_inline void alloc_send(struct pt_regs *ctx, __u32 tgid, __u32 tid, __u64 now,
				       __u32 flags, __u64 size, __u64 addr)
{
	struct offcpu_record *rec = (struct offcpu_record *)scratch_record(SCRATCH_PROBE);
	if (!rec)
		return;
	record_header(&rec->hdr, now, tgid, tid, flags);
	rec->hdr.value = size;
	rec->hdr.aux = addr;
	record_user_stack(ctx, ctx, tgid, tid, &rec->hdr, rec->user, SCRATCH_PROBE);
	__u64 bytes = record_size(&rec->hdr, sizeof(*rec));
	// A new Python thread's first record wakes the agent, as the CPU sampler's does.
	if (send_record_wake(rec, bytes, rec->hdr.flags & SAMPLE_PY_NEW_THREAD))
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_ALLOC_SAMPLES);
}

SEC("uprobe")
int alloc_enter(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!alloc_target(tgid))
		return 0;
	__u32 kind = (__u32)bpf_get_attach_cookie(ctx);
	// Every argument register is read at a fixed offset, before any choice between them:
	// clang would otherwise fold a choice into a computed context offset, which the
	// verifier refuses.
	__u64 arg1 = PT_REGS_PARM1(ctx), arg2 = PT_REGS_PARM2(ctx), arg3 = PT_REGS_PARM3(ctx);
	barrier_var(arg1);
	barrier_var(arg2);
	barrier_var(arg3);
	struct alloc_thread *t = bpf_map_lookup_elem(&alloc_threads, &tid);
	if (kind == ALLOC_FREE || kind == ALLOC_PY_FREE) {
		if (t && t->depth > 0)
			return 0;
		__u64 addr = kind == ALLOC_FREE ? arg1 : arg2;
		if (addr)
			alloc_forget(tgid, tid, addr);
		return 0;
	}
	if (!t) {
		struct alloc_thread fresh = {};
		bpf_map_update_elem(&alloc_threads, &tid, &fresh, BPF_NOEXIST);
		t = bpf_map_lookup_elem(&alloc_threads, &tid);
		if (!t) {
			count(COUNTER_ALLOC_THREADS_FULL);
			return 0;
		}
	}
	if (t->depth++ > 0)
		return 0;
	__u64 size = 0, old = 0, memptr = 0;
	switch (kind) {
	case ALLOC_MALLOC:
	case ALLOC_VALLOC:
		size = arg1;
		break;
	case ALLOC_CALLOC:
		size = arg1 * arg2;
		break;
	case ALLOC_REALLOC:
		old = arg1;
		size = arg2;
		break;
	case ALLOC_REALLOCARRAY:
		old = arg1;
		size = arg2 * arg3;
		break;
	case ALLOC_ALIGNED:
		size = arg2;
		break;
	case ALLOC_POSIX_MEMALIGN:
		memptr = arg1;
		size = arg3;
		break;
	case ALLOC_PY_MALLOC:
		size = arg2;
		break;
	case ALLOC_PY_CALLOC:
		size = arg2 * arg3;
		break;
	case ALLOC_PY_REALLOC:
		old = arg2;
		size = arg3;
		break;
	default:
		break;
	}
	t->kind = kind;
	t->size = size;
	t->old = old;
	t->memptr = memptr;
	t->sampled = alloc_sample(size);
	return 0;
}

SEC("uretprobe")
int alloc_return(struct pt_regs *ctx)
{
	REJECT_IF(REJECT_ALLOC);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct alloc_thread *t = bpf_map_lookup_elem(&alloc_threads, &tid);
	if (!t || t->depth == 0)
		return 0;
	t->depth -= 1;
	if (t->depth > 0)
		return 0;
	__u64 ret = PT_REGS_RC(ctx);
	__u64 addr = ret;
	__u32 kind = t->kind;
	if (kind == ALLOC_POSIX_MEMALIGN) {
		addr = 0;
		if (ret == 0 && t->memptr)
			bpf_probe_read_user(&addr, sizeof(addr), (void *)t->memptr);
	}
	// A sampled block moves with its resize (its entry stays the allocation's that made it),
	// realloc(p, 0) frees it, a failed resize leaves it.
	if (t->old && addr)
		alloc_move(tgid, tid, t->old, addr, t->size);
	else if (t->old && t->size == 0)
		alloc_forget(tgid, tid, t->old);
	if (!addr || !t->sampled)
		return 0;
	__u64 size = t->size;
	__u64 now = bpf_ktime_get_ns();
	struct alloc_key key = { .pid = tgid, .addr = addr };
	struct alloc_block block = { .size = size, .timestamp_ns = now };
	__u32 flags = SAMPLE_ALLOC;
	if (t->old) {
		// A resize counts as allocated, never as in use, as in the library.
		flags |= SAMPLE_ALLOC_UNTRACKED;
	} else if (bpf_map_update_elem(&alloc_live, &key, &block, BPF_ANY)) {
		count(COUNTER_ALLOC_LIVE_FULL);
		flags |= SAMPLE_ALLOC_UNTRACKED;
	}
	alloc_send(ctx, tgid, tid, now, flags, size, addr);
	return 0;
}

#define PRELOAD_TRACKED 1 // pyrometer_alloc_sampled's flags: the library tracks the block
#define PRELOAD_RESIZED 2 // a realloc: counted as allocated, never in use (see alloc_preload_move)

// The return of pyrometer_alloc_sampled(ptr, size, flags), which returns ptr and leaves
// size and flags in their argument registers: the allocator functions tail-call it, so this
// runs on the program's registers right after its allocator call returned, and the stack is
// the program's, as at alloc_return.
SEC("uretprobe")
int alloc_preload(struct pt_regs *ctx)
{
	REJECT_IF(REJECT_ALLOC);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!alloc_preload_target(tgid))
		return 0;
	__u64 addr = PT_REGS_RC(ctx), size = PT_REGS_PARM2(ctx), flags = PT_REGS_PARM3(ctx);
	barrier_var(addr);
	barrier_var(size);
	barrier_var(flags);
	__u64 now = bpf_ktime_get_ns();
	__u32 record_flags = SAMPLE_ALLOC | SAMPLE_ALLOC_PRELOAD;
	struct alloc_key key = { .pid = tgid, .addr = addr };
	struct alloc_block block = { .size = size, .timestamp_ns = now };
	if (flags & PRELOAD_RESIZED) {
		record_flags |= SAMPLE_ALLOC_UNTRACKED;
	} else if (!(flags & PRELOAD_TRACKED) ||
		   bpf_map_update_elem(&alloc_live, &key, &block, BPF_ANY)) {
		count(COUNTER_ALLOC_LIVE_FULL);
		record_flags |= SAMPLE_ALLOC_UNTRACKED;
	}
	alloc_send(ctx, tgid, tid, now, record_flags, size, addr);
	return 0;
}

// pyrometer_free_sampled(ptr): a block the library sampled is being freed.
SEC("uprobe")
int alloc_preload_free(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!alloc_preload_target(tgid))
		return 0;
	count(COUNTER_ALLOC_PRELOAD_FREES);
	__u64 addr = PT_REGS_PARM1(ctx);
	if (addr)
		alloc_forget(tgid, tid, addr);
	return 0;
}

// pyrometer_realloc_sampled(old, new, size): a block the library sampled was resized.
SEC("uprobe")
int alloc_preload_move(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!alloc_preload_target(tgid))
		return 0;
	__u64 old = PT_REGS_PARM1(ctx), to = PT_REGS_PARM2(ctx), size = PT_REGS_PARM3(ctx);
	barrier_var(old);
	barrier_var(to);
	barrier_var(size);
	alloc_move(tgid, tid, old, to, size);
	return 0;
}
