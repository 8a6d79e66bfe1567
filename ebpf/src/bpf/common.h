// SPDX-License-Identifier: GPL-2.0
//
// What every program of the sampler object shares: the load-time settings, the target set
// and its filter, the kernel stack map, the ring buffer, the per-CPU scratch records and the
// health counters. Every header includes this one; sampler.bpf.c includes them all into one
// object (one translation unit, so each program is verified as it always was: no global
// function is added by the split into headers).

#pragma once

#include <linux/bpf.h>
#include <linux/bpf_perf_event.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "shared.h"

// Minimal CO-RE view of task_struct: clang records the field accesses and the loader
// relocates them against the running kernel's BTF, so no vmlinux.h is needed.
struct task_struct {
	int pid;
	int tgid;
} __attribute__((preserve_access_index));

// Set by the agent at load time (.rodata), so the verifier prunes the unused branches.
const volatile __u32 filter_mode = FILTER_ALL;
const volatile __u32 self_tgid = 0;

// REJECT_* bits, set only by tests (`--debug-reject`): the stage they name reads past its
// stack frame, which every verifier refuses. With the bit clear the verifier prunes the read
// as dead code (the value is known at load time), so normal loads never see it.
const volatile __u32 debug_reject = 0;
#define REJECT_IF(bit)                                                   \
	do {                                                             \
		if (debug_reject & (bit))                                \
			asm volatile("r0 = *(u64 *)(r10 + 8)" ::: "r0"); \
	} while (0)

// Targeted processes (tgid -> TARGET_* flags). 16384 processes is far more than one
// `record` or one node agent selects; an insert into a full map is counted, not silent.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u32);
} targets SEC(".maps");

// Kernel stacks are interned by the kernel: most samples of one workload share a few
// kernel stacks. Bucket collisions (-EEXIST, no BPF_F_REUSE_STACKID so that ids the agent
// cached stay valid) fall back to copying the stack into the record itself, so none is lost.
// 16384 buckets x 127 frames x 8 bytes = 16.6 MB, the biggest fixed cost of the sampler.
struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, 16384);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, MAX_KERNEL_FRAMES * sizeof(__u64));
} kernel_stacks SEC(".maps");

// Sample records for the agent. The size is set by the agent at load time (--ring-buffer-mb).
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20);
} samples SEC(".maps");

// Which scratch record a stack walk writes to. The cpu-clock program may interrupt the
// sched_switch one (a BTF tracepoint has no cross-program recursion guard), so each has its
// own; uprobe programs share the third (the kernel runs one of them per CPU at a time).
#define SCRATCH_SAMPLE 0
#define SCRATCH_OFFCPU 1
#define SCRATCH_PROBE 2
#define SCRATCH_KINDS 3

// Per-CPU scratch records, one per SCRATCH_* kind: a sample is too big for the 512-byte BPF
// stack. One map for all three, so a walk's pointer to its record has one type whichever
// kind it writes: with three maps, 6.1's verifier checked each batch of frames once per map
// (79k processed instructions against 35k). sched_switch and the probes send no inline
// kernel frames and use the prefix `struct offcpu_record`.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SCRATCH_KINDS);
	__type(key, __u32);
	__type(value, struct sample_record);
} scratch SEC(".maps");

// Health counters, one slot per COUNTER_* index, summed over CPUs by the agent.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, COUNTER_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline void count_n(__u32 index, __u64 n)
{
	__u64 *slot = bpf_map_lookup_elem(&counters, &index);
	if (slot)
		*slot += n;
}

static __always_inline void count(__u32 index)
{
	count_n(index, 1);
}

// Bytes waiting in the ring buffer past which a record wakes the agent (set at load time to
// a quarter of the buffer). Below it records are sent without a wakeup and the agent reads
// them on its next poll (every 10-20 ms): a wakeup is an irq_work, a self-interrupt,
// which costs ~3 us a sample in a virtual machine, more than the rest of a sample together.
const volatile __u64 ringbuf_wakeup_bytes = 2 << 20;

static __always_inline long send_record_wake(void *data, __u64 size, int wake)
{
	__u64 flags = wake || bpf_ringbuf_query(&samples, BPF_RB_AVAIL_DATA) >= ringbuf_wakeup_bytes
		? BPF_RB_FORCE_WAKEUP
		: BPF_RB_NO_WAKEUP;
	return bpf_ringbuf_output(&samples, data, size, flags);
}

static __always_inline long send_record(void *data, __u64 size)
{
	return send_record_wake(data, size, 0);
}

// The scratch record of kind `which` (SCRATCH_*).
static __always_inline struct sample_record *scratch_record(__u32 which)
{
	return bpf_map_lookup_elem(&scratch, &which);
}

// The slot array (native frames, then Python frame pairs) of a scratch record.
static __always_inline __u64 *scratch_slots(__u32 which)
{
	struct sample_record *rec = scratch_record(which);
	return rec ? rec->user : 0;
}

// Whether samples of process `tgid` are taken: every process but the idle task and pyrometer
// itself node-wide, else those in `targets`.
static __always_inline int is_target(__u32 tgid)
{
	if (tgid == 0 || tgid == self_tgid)
		return 0;
	if (filter_mode == FILTER_ALL)
		return 1;
	return bpf_map_lookup_elem(&targets, &tgid) != 0;
}
