// SPDX-License-Identifier: GPL-2.0
//
// Off-CPU time: how long target threads stay blocked, by the stack they blocked in.
// Included by sampler.bpf.c, so it shares the target filter, the kernel stack map, the
// unwinder and the ring buffer; the agent loads and attaches `on_sched_switch` only when asked
// (`record --off-cpu`), and otherwise shrinks `offcpu_pending` to one entry.
//
// A thread that blocks (switched out in a sleeping state, not preempted) has its stacks taken
// right then, while it is still `current`: the kernel stack from the tracepoint's registers,
// the user stack from the registers saved on kernel entry. They are parked in
// `offcpu_pending` under its tid; when the thread is switched back in, the interval is sent as
// one record if it lasted at least `offcpu_min_ns`. The minimum bounds the ring-buffer cost
// (a thread that blocks for microseconds thousands of times a second sends nothing) at the
// price of not counting those short waits.
//
// Preempted threads are runnable, not blocked: their wait is CPU contention (run-queue
// latency), not something the thread's code chose, so it is not off-CPU time here.
//
// GIL: time a Python thread spends blocked inside take_gil is GIL wait, not off-CPU time: the
// take_gil uprobe (gil.h) marks the waiting thread and this program skips its switch-outs, so
// the wait is counted once, as gil_wait/nanoseconds.

#pragma once

#include "common.h"
#include "gil.h"
#include "stacks.h"

// Minimum blocked time that is reported (set by the agent, --off-cpu-min).
const volatile __u64 offcpu_min_ns = 1000000;

// The sched_switch prev_state of a running task (TASK_RUNNING) and of an exiting one
// (TASK_DEAD), from include/linux/sched.h.
#define TASK_RUNNING_STATE 0
#define TASK_DEAD_STATE 0x80
#define OFFCPU_SKIP_KERNEL_FRAMES 2

// Blocked target threads, tid -> the record sent when they run again. Bounded: 16384 threads
// blocked at once is more than one node runs in practice; a thread that blocks while it is full
// is counted (COUNTER_OFFCPU_MAP_FULL) and not tracked. Not preallocated, so memory follows the
// number of threads actually blocked (4 KiB each, 68 MiB at most). Entries leave on switch-in;
// a thread that exits while blocked is switched in to exit, and a dying thread's last switch
// (TASK_DEAD) is not tracked, so nothing stays behind.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, OFFCPU_PENDING_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct offcpu_record);
} offcpu_pending SEC(".maps");

static __always_inline void offcpu_switch_out(void *ctx, struct task_struct *prev)
{
	__u32 tgid = BPF_CORE_READ(prev, tgid);
	__u32 tid = BPF_CORE_READ(prev, pid);
	if (tid == 0 || !is_target(tgid) || gil_waiting(tid))
		return;

	struct offcpu_record *rec = (struct offcpu_record *)scratch_record(SCRATCH_OFFCPU);
	if (!rec)
		return;
	record_header(&rec->hdr, bpf_ktime_get_ns(), tgid, tid, SAMPLE_OFFCPU);

	// `prev` is still current here, so these are its stacks. The kernel stack is taken from
	// inside this program: its two innermost frames are the BPF program and the tracepoint's
	// bpf_trace_run trampoline, skipped so the stack ends in the scheduler.
	long kid = bpf_get_stackid(ctx, &kernel_stacks, OFFCPU_SKIP_KERNEL_FRAMES);
	rec->hdr.kernel_stack_id = (__s32)kid;
	if (kid < 0)
		count(COUNTER_KERNEL_STACK_ERRORS);

	record_user_stack(ctx, 0, tgid, tid, &rec->hdr, rec->user, SCRATCH_OFFCPU);

	if (bpf_map_update_elem(&offcpu_pending, &tid, rec, BPF_ANY) != 0)
		count(COUNTER_OFFCPU_MAP_FULL);
}

static __always_inline void offcpu_switch_in(struct task_struct *next)
{
	__u32 tid = BPF_CORE_READ(next, pid);
	struct offcpu_record *rec = bpf_map_lookup_elem(&offcpu_pending, &tid);
	if (!rec)
		return;
	__u64 now = bpf_ktime_get_ns();
	__u64 blocked = now - rec->hdr.timestamp_ns;
	if (blocked >= offcpu_min_ns) {
		rec->hdr.value = blocked;
		// Woken at once: the thread may end right after it wakes (a sleeper that exits),
		// and the agent reads a thread's name while the thread is still there.
		if (send_record_wake(rec, record_size(&rec->hdr, sizeof(*rec)), 1) != 0)
			count(COUNTER_RINGBUF_DROPS);
		else
			count(COUNTER_OFFCPU_EVENTS);
	}
	bpf_map_delete_elem(&offcpu_pending, &tid);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(on_sched_switch, _Bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	REJECT_IF(REJECT_OFFCPU);
	// Switch-in first: when a thread switches to itself nothing is pending for it anyway.
	offcpu_switch_in(next);
	if (!preempt && prev_state != TASK_RUNNING_STATE && !(prev_state & TASK_DEAD_STATE))
		offcpu_switch_out(ctx, prev);
	return 0;
}
