// SPDX-License-Identifier: GPL-2.0
//
// GIL wait and hold time (`record --gil`): uprobes on CPython's take_gil (entry and return)
// and drop_gil, attached by the agent to every interpreter binary a target maps (the symbols
// are static: found in .symtab or the separate debug file, plus drop_gil's inlined copies
// from DWARF). Per thread, `gil_threads` sums the time from take_gil's entry to its return
// (waiting) and from there to drop_gil (holding); the agent reads the sums at the end.
//
// A wait that finds the GIL taken (contended) has its stack walked at take_gil's entry (native
// and Python frames, into `gil_pending`) and is sent as one SAMPLE_GIL_WAIT record when
// take_gil returns, weighted by the wait. Uncontended acquisitions cost two map updates and
// are only summed. On-CPU samples of a thread that holds the GIL get SAMPLE_GIL_HELD, and the
// sched_switch program does not count time blocked inside take_gil as off-CPU (gil_waiting).

#pragma once

#include "common.h"
#include "python.h"
#include "stacks.h"

// tid -> the thread's GIL state and sums. Threads of targets only; bounded like the other
// per-thread maps (16384 threads, 72 bytes each, allocated as threads first take the GIL).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct gil_thread);
} gil_threads SEC(".maps");

// tid -> the stack of a contended wait in progress (4 KiB each, 4096 threads waiting at once).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct offcpu_record);
} gil_pending SEC(".maps");

// tgid -> the thread that last acquired the GIL: when another thread acquires it, the previous
// holder has released it, even where drop_gil was not seen (a copy inlined somewhere the
// agent found no probe site for).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
} gil_holders SEC(".maps");

// 1 with `--gil` (set at load time): without it no thread's GIL state is kept, and a sample or
// a context switch needs no lookup in gil_threads (a hash lookup, ~50-100 ns in a VM) to learn so.
const volatile __u32 gil_view = 0;

static __always_inline int gil_waiting(__u32 tid)
{
	if (!gil_view)
		return 0;
	struct gil_thread *g = bpf_map_lookup_elem(&gil_threads, &tid);
	return g && g->wait_start;
}

static __always_inline int gil_held(__u32 tid)
{
	if (!gil_view)
		return 0;
	struct gil_thread *g = bpf_map_lookup_elem(&gil_threads, &tid);
	return g && g->hold_start;
}

static __always_inline void gil_close_hold(struct gil_thread *g, __u64 now)
{
	if (g->hold_start && now > g->hold_start)
		g->hold_ns += now - g->hold_start;
	g->hold_start = 0;
}

// Whether the GIL is taken right now (the `locked` word of the process's GIL state). Taken
// when a registered process's GIL address is not known yet, so the stack is kept; not taken
// for a process the agent has not registered yet (its interpreter is still starting, one
// thread, and its stacks could not be walked anyway).
static __always_inline int gil_locked(__u32 tgid)
{
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	if (!p)
		return 0;
	if (!p->gil || p->off.gil_locked == PY_ABSENT)
		return 1;
	__u32 locked = 1;
	if (bpf_probe_read_user(&locked, sizeof(locked), (void *)(p->gil + p->off.gil_locked)))
		return 1;
	return locked != 0;
}

SEC("uprobe")
int gil_take_enter(struct pt_regs *ctx)
{
	REJECT_IF(REJECT_GIL);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!is_target(tgid))
		return 0;
	__u64 now = bpf_ktime_get_ns();
	struct gil_thread *g = bpf_map_lookup_elem(&gil_threads, &tid);
	if (!g) {
		struct gil_thread fresh = { .pid = tgid, .first_ns = now };
		bpf_map_update_elem(&gil_threads, &tid, &fresh, BPF_NOEXIST);
		g = bpf_map_lookup_elem(&gil_threads, &tid);
		if (!g) {
			count(COUNTER_GIL_THREADS_FULL);
			return 0;
		}
	}
	// A thread asking for the GIL does not hold it.
	gil_close_hold(g, now);
	g->wait_start = now;
	g->last_ns = now;
	if (!gil_locked(tgid)) {
		bpf_map_delete_elem(&gil_pending, &tid);
		return 0;
	}

	struct offcpu_record *rec = (struct offcpu_record *)scratch_record(SCRATCH_PROBE);
	if (!rec)
		return 0;
	record_header(&rec->hdr, now, tgid, tid, SAMPLE_GIL_WAIT);
	record_user_stack(ctx, ctx, tgid, tid, &rec->hdr, rec->user, SCRATCH_PROBE);
	if (bpf_map_update_elem(&gil_pending, &tid, rec, BPF_ANY))
		count(COUNTER_GIL_PENDING_FULL);
	return 0;
}

SEC("uretprobe")
int gil_take_return(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct gil_thread *g = bpf_map_lookup_elem(&gil_threads, &tid);
	if (!g || !g->wait_start)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	__u64 waited = now > g->wait_start ? now - g->wait_start : 0;
	g->wait_ns += waited;
	g->acquisitions += 1;
	g->wait_start = 0;
	g->hold_start = now;
	g->last_ns = now;

	// The previous holder let go before this thread got the GIL.
	__u32 *holder = bpf_map_lookup_elem(&gil_holders, &tgid);
	if (holder && *holder != tid) {
		__u32 prev = *holder;
		struct gil_thread *p = bpf_map_lookup_elem(&gil_threads, &prev);
		if (p)
			gil_close_hold(p, now);
	}
	bpf_map_update_elem(&gil_holders, &tgid, &tid, BPF_ANY);

	struct offcpu_record *rec = bpf_map_lookup_elem(&gil_pending, &tid);
	if (!rec)
		return 0;
	g->contended += 1;
	rec->hdr.value = waited;
	if (send_record_wake(rec, record_size(&rec->hdr, sizeof(*rec)), 1))
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_GIL_WAIT_EVENTS);
	bpf_map_delete_elem(&gil_pending, &tid);
	return 0;
}

SEC("uprobe")
int gil_drop(struct pt_regs *ctx)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct gil_thread *g = bpf_map_lookup_elem(&gil_threads, &tid);
	if (g) {
		__u64 now = bpf_ktime_get_ns();
		gil_close_hold(g, now);
		g->last_ns = now;
	}
	return 0;
}
