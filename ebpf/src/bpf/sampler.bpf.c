// SPDX-License-Identifier: GPL-2.0
//
// pyrometer's CPU sampler: one perf_event program per online CPU on the software cpu-clock
// event (hardware PMU events are often missing in VMs), plus BTF tracepoints that keep the
// in-kernel target set current as targeted processes fork and exit, and (optional, with
// `record --off-cpu`) the sched_switch program of offcpu.h that measures blocked time.
//
// Every sample becomes one variable-length record in a BPF ring buffer (header + user frames),
// so a shallow stack costs the ring buffer only what it uses. The layout is mirrored by
// `SampleHeader` in ../lib.rs; change both together.

#include <linux/bpf.h>
#include <linux/bpf_perf_event.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "shared.h"

// perf's callchain limit (kernel.perf_event_max_stack) for frame-pointer stacks.
#define FP_MAX_FRAMES 127

char LICENSE[] SEC("license") = "GPL";

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
#define REJECT_IF(bit)                                                                  \
	do {                                                                            \
		if (debug_reject & (bit))                                               \
			asm volatile("r0 = *(u64 *)(r10 + 8)" ::: "r0");                \
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

#include "userwin.h"
#include "unwind.h"
#include "python.h"
#include "spans.h"
#include "stacks.h"

static __always_inline int is_target(__u32 tgid)
{
	if (tgid == 0 || tgid == self_tgid)
		return 0;
	if (filter_mode == FILTER_ALL)
		return 1;
	return bpf_map_lookup_elem(&targets, &tgid) != 0;
}

#include "gil.h"
#include "alloc.h"

SEC("perf_event")
int on_cpu_clock(struct bpf_perf_event_data *ctx)
{
	REJECT_IF(REJECT_SAMPLER);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	__u32 tid = (__u32)pid_tgid;

	// The idle task runs as pid 0 on every CPU; it is never a target.
	if (tid == 0 || !is_target(tgid))
		return 0;

	struct sample_record *rec = scratch_record(SCRATCH_SAMPLE);
	if (!rec)
		return 0;

	__u64 start = bpf_ktime_get_ns();
	record_header(&rec->hdr, start, tgid, tid, 0);
	// A sample that interrupted user mode has no kernel stack: the helper would only say so,
	// at the cost of a callchain walk setup (~1 us a sample measured in a VM).
	const int in_user = (ctx->regs.cs & 3) == 3;
	long kid = in_user ? -14 /* EFAULT: no kernel stack */
			   : bpf_get_stackid(ctx, &kernel_stacks, 0);
	rec->hdr.kernel_stack_id = (__s32)kid;
	if (kid == -17 /* EEXIST: bucket holds another stack */) {
		long n = bpf_get_stack(ctx, rec->kernel, sizeof(rec->kernel), 0);
		if (n > 0) {
			rec->hdr.kernel_frames = n / sizeof(__u64);
			rec->hdr.flags |= SAMPLE_KERNEL_INLINE;
		} else {
			count(COUNTER_KERNEL_STACK_ERRORS);
		}
	} else if (kid < 0 && kid != -14) {
		count(COUNTER_KERNEL_STACK_ERRORS);
	}

	const struct pt_regs *user = in_user ? &ctx->regs : 0;
	record_user_stack(ctx, user, tgid, tid, &rec->hdr, rec->user, SCRATCH_SAMPLE);
	if (gil_held(tid))
		rec->hdr.flags |= SAMPLE_GIL_HELD;

	// Records carry only the slots they use: the user frames and Python frame pairs follow
	// the header, then the inline kernel frames (if any), all in place in the scratch record.
	// Inline kernel stacks are rare (bucket collisions): such a record is sent whole.
	__u64 size = rec->hdr.flags & SAMPLE_KERNEL_INLINE ? sizeof(*rec)
							    : record_size(&rec->hdr, sizeof(*rec));

	// A process the agent has no tables for yet (a new one), or a stack through a mapping
	// it has not registered: wake it now, so tables, maps and the Python registration are
	// current before the next samples, not a poll later. A new Python thread: so its name
	// is read before it ends.
	int wake = (unwind_dwarf && (!(rec->hdr.flags & SAMPLE_DWARF) ||
				     (rec->hdr.flags & SAMPLE_UNKNOWN_MAPPING))) ||
		   (rec->hdr.flags & SAMPLE_PY_NEW_THREAD);
	if (send_record_wake(rec, size, wake) != 0)
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_SAMPLES);
	count_n(COUNTER_SAMPLE_NS, bpf_ktime_get_ns() - start);
	return 0;
}

// A targeted process that starts a child process (not a thread) passes its flags on when it
// asked to be followed (`-- CMD`, or `--pid` with `--subprocesses`).
SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	if (filter_mode != FILTER_TARGETS)
		return 0;
	__u32 parent_tgid = BPF_CORE_READ(parent, tgid);
	__u32 child_tgid = BPF_CORE_READ(child, tgid);
	if (child_tgid == parent_tgid)
		return 0;
	__u32 *flags = bpf_map_lookup_elem(&targets, &parent_tgid);
	if (!flags || !(*flags & TARGET_FOLLOW_CHILDREN))
		return 0;
	__u32 value = *flags;
	if (bpf_map_update_elem(&targets, &child_tgid, &value, BPF_ANY) != 0)
		count(COUNTER_TARGETS_FULL);
	return 0;
}

// An exec replaces the process image: tell the agent, so it re-reads the memory map before
// symbolizing the new image's samples with the old image's mappings.
SEC("tp_btf/sched_process_exec")
int BPF_PROG(on_exec, struct task_struct *task)
{
	__u32 tgid = BPF_CORE_READ(task, tgid);
	if (!is_target(tgid))
		return 0;
	// The old image's mappings no longer describe this process: until the agent has read
	// the new ones, frame pointers are a better guess than a lookup that finds nothing, and
	// the new image may not be Python (or another version).
	bpf_map_delete_elem(&unwind_procs, &tgid);
	bpf_map_delete_elem(&py_procs, &tgid);
	struct sample_header ev = {};
	ev.timestamp_ns = bpf_ktime_get_ns();
	ev.pid = tgid;
	ev.tid = BPF_CORE_READ(task, pid);
	ev.cpu = bpf_get_smp_processor_id();
	ev.kernel_stack_id = -1;
	ev.flags = SAMPLE_EVENT_EXEC;
	bpf_get_current_comm(ev.comm, sizeof(ev.comm));
	// The agent must re-read the maps before the new image's samples: wake it.
	if (send_record_wake(&ev, sizeof(ev), 1) != 0)
		count(COUNTER_RINGBUF_DROPS);
	return 0;
}

// Forget a process when its last thread leader exits, so pid reuse cannot pull an unrelated
// process into the capture.
SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit, struct task_struct *task)
{
	if (filter_mode != FILTER_TARGETS)
		return 0;
	__u32 pid = BPF_CORE_READ(task, pid);
	__u32 tgid = BPF_CORE_READ(task, tgid);
	if (pid != tgid)
		return 0;
	bpf_map_delete_elem(&targets, &tgid);
	return 0;
}

#include "offcpu.h"
