// SPDX-License-Identifier: GPL-2.0
//
// pyrometer's CPU sampler: one perf_event program per online CPU on the software cpu-clock
// event (hardware PMU events are often missing in VMs), plus BTF tracepoints that keep the
// in-kernel target set current as targeted processes fork and exit, and (optional, with
// `record --off-cpu`) the sched_switch program of offcpu.h that measures blocked time.
//
// Every sample becomes one variable-length record in a BPF ring buffer (header + user frames),
// so a shallow stack costs the ring buffer only what it uses. The layout is shared.h's
// `struct sample_header`, from which the Rust side's `SampleHeader` is generated.

#include "common.h"

char LICENSE[] SEC("license") = "GPL";

#include "userwin.h"
#include "unwind.h"
#include "python.h"
#include "pyasync.h"
#include "spans.h"
#include "stacks.h"
#include "stackcopy.h"

#include "gil.h"
#include "gc.h"
#include "alloc.h"
#include "gpu.h"

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
	// The period of the perf event that fired: the agent tells a capture's own events (a
	// higher frequency, on the capture's threads) from its always-on ones by it.
	rec->hdr.aux = ctx->sample_period;
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
	int wake =
		(unwind_dwarf &&
		 (!(rec->hdr.flags & SAMPLE_DWARF) || (rec->hdr.flags & SAMPLE_UNKNOWN_MAPPING))) ||
		(rec->hdr.flags & SAMPLE_PY_NEW_THREAD);
	// A sample that asked for a copy of its stack goes with one, or as it is (its flag off).
	int copied = 0;
	if (rec->hdr.flags & SAMPLE_STACK_COPY) {
		copied = send_with_stack_copy(rec, user, start) == 0;
		count(copied ? COUNTER_STACK_COPIES : COUNTER_STACK_COPIES_SKIPPED);
		rec->hdr.flags &= ~SAMPLE_STACK_COPY;
	}
	if (!copied && send_record_wake(rec, size, wake) != 0)
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
