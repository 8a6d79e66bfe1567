// SPDX-License-Identifier: GPL-2.0
//
// Building a record: the header every kind shares, and the user stack (DWARF unwinding,
// frame pointers where the process has no tables, then the Python frames) into one of the
// scratch records. Used by the sampler, sched_switch and the uprobe programs.

#pragma once

#include "common.h"
#include "unwind.h"
#include "python.h"
#include "spans.h"

static __always_inline void record_header(struct sample_header *hdr, __u64 now, __u32 tgid,
					  __u32 tid, __u32 flags)
{
	hdr->timestamp_ns = now;
	hdr->pid = tgid;
	hdr->tid = tid;
	hdr->cpu = bpf_get_smp_processor_id();
	hdr->kernel_stack_id = -1;
	hdr->kernel_frames = 0;
	hdr->flags = flags;
	hdr->py_frames = 0;
	hdr->value = 0;
	hdr->aux = 0;
	bpf_get_current_comm(hdr->comm, sizeof(hdr->comm));
}

// Walks the current thread's user stack into `user` (the slots of the `which` scratch
// record): from `regs` (the user registers of a probe or an interrupted user-mode sample), or
// from the registers saved on kernel entry when `regs` is NULL.
static __always_inline void record_user_stack(void *ctx, const struct pt_regs *regs, __u32 tgid,
					      __u32 tid, struct sample_header *hdr, __u64 *user,
					      __u32 which)
{
	__u32 frames = 0;
	int walked = dwarf_unwind_regs(regs, tgid, hdr, which);
	if (walked >= 0) {
		frames = walked;
	} else {
		// No unwind tables for this process (yet): frame pointers, as perf does.
		long bytes =
			bpf_get_stack(ctx, user, FP_MAX_FRAMES * sizeof(__u64), BPF_F_USER_STACK);
		if (bytes > 0)
			frames = bytes / sizeof(__u64);
		else if (bytes < 0 && bytes != -14 /* EFAULT: no user stack */)
			count(COUNTER_USER_STACK_ERRORS);
		if (frames >= FP_MAX_FRAMES) {
			frames = FP_MAX_FRAMES;
			count(COUNTER_USER_STACK_TRUNCATED);
		}
	}
	if (frames > MAX_USER_FRAMES)
		frames = MAX_USER_FRAMES;
	hdr->user_frames = frames;
	// Only a registered Python process has a span table: another needs no second lookup
	// in py_procs (a hash lookup, ~100 ns a sample in a VM) to learn that it has none.
	if (py_walk_current(tgid, tid, hdr, which))
		span_read(hdr);
	else
		span_clear(hdr);
}

// Bytes of a record that carries only the slots it uses (no inline kernel frames).
static __always_inline __u64 record_size(const struct sample_header *hdr, __u64 max)
{
	__u64 size = sizeof(*hdr) +
		((__u64)hdr->user_frames + 2 * (__u64)hdr->py_frames) * sizeof(__u64);
	return size > max ? max : size;
}
