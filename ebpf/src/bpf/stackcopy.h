// SPDX-License-Identifier: GPL-2.0
//
// Samples that keep a copy of their user stack (SAMPLE_STACK_COPY): taken while the agent was
// still building a table the walk needed, or before it had read a new process's mappings at
// all. Such a sample's frames stop early (frame pointers, which an optimized program does not
// keep); with a copy of the stack's top pages and the registers, the agent walks it again in
// user space once the table exists, with the same rows. A new process's first samples are
// then as complete as its later ones.

#pragma once

#include "common.h"
#include "unwind.h"

// The copies this CPU may still send: credit in ns of the long-run rate, spent
// NSEC_PER_COPY a copy and earned back with time, up to STACK_COPY_BURST copies' worth.
struct stack_copy_credit {
	__u64 last_ns;
	__u64 credit_ns;
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stack_copy_credit);
} stack_copy_credits SEC(".maps");

#define NSEC_PER_COPY (1000000000ULL / STACK_COPY_RATE)

// Where a copy record is put together, per CPU (only the sampler sends copies, and the
// sampler does not interrupt itself): sent with the pages it holds, not the whole buffer, so
// a main thread near its stack's top costs the ring buffer a page or two, not four.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sample_copy_record);
} stack_copy_scratch SEC(".maps");

static __always_inline int stack_copy_allowed(__u64 now)
{
	__u32 zero = 0;
	struct stack_copy_credit *c = bpf_map_lookup_elem(&stack_copy_credits, &zero);
	if (!c)
		return 0;
	__u64 credit = c->credit_ns + (now - c->last_ns);
	if (credit > STACK_COPY_BURST * NSEC_PER_COPY)
		credit = STACK_COPY_BURST * NSEC_PER_COPY;
	c->last_ns = now;
	if (credit < NSEC_PER_COPY) {
		c->credit_ns = credit;
		return 0;
	}
	c->credit_ns = credit - NSEC_PER_COPY;
	return 1;
}

// Sends the scratch record `rec` (all of it: its slots and inline kernel frames where a full
// record has them) with a copy of the user stack at `user` (the interrupted user registers,
// or NULL: the ones saved on kernel entry). Returns 0 when sent; otherwise nothing was sent,
// and the caller sends the record without a copy.
static __always_inline int send_with_stack_copy(struct sample_record *rec,
						const struct pt_regs *user, __u64 now)
{
	// Past three quarters full (three times where records start waking the agent) the room
	// is the plain records': a burst of copies must not make them drop. A quarter of the
	// agent's smallest ring (1 MiB) holds a second of plain records at 499 Hz on two CPUs.
	if (bpf_ringbuf_query(&samples, BPF_RB_AVAIL_DATA) >= 3 * ringbuf_wakeup_bytes ||
	    !stack_copy_allowed(now))
		return -1;
	__u64 pc, sp, bp;
	if (user) {
		pc = user->rip;
		sp = user->rsp;
		bp = user->rbp;
	} else {
		struct pt_regs *saved =
			(struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
		if (bpf_probe_read_kernel(&pc, sizeof(pc), &saved->rip) ||
		    bpf_probe_read_kernel(&sp, sizeof(sp), &saved->rsp) ||
		    bpf_probe_read_kernel(&bp, sizeof(bp), &saved->rbp))
			return -1;
	}
	__u32 zero = 0;
	pc = uprobe_xol_pc(pc);
	struct sample_copy_record *out = bpf_map_lookup_elem(&stack_copy_scratch, &zero);
	if (!out || bpf_probe_read_kernel(&out->rec, sizeof(out->rec), rec))
		return -1;
	__u64 base = sp & ~((__u64)STACK_COPY_PAGE - 1);
	__u32 len = 0;
	// Page by page: a page past the stack's end (the main thread's) is unmapped, and one read
	// across it would copy nothing at all.
#pragma unroll
	for (int i = 0; i < STACK_COPY_PAGES; i++) {
		if (bpf_probe_read_user(&out->copy.bytes[i * STACK_COPY_PAGE], STACK_COPY_PAGE,
					(void *)(base + i * STACK_COPY_PAGE)))
			break;
		len += STACK_COPY_PAGE;
	}
	out->copy.pc = pc;
	out->copy.sp = sp;
	out->copy.bp = bp;
	out->copy.base = base;
	out->copy.len = len;
	out->copy.reserved = 0;
	__u64 size = sizeof(*out) - STACK_COPY_BYTES + len;
	if (size > sizeof(*out))
		size = sizeof(*out);
	// The agent is waiting for these (it holds them until the table is in).
	return bpf_ringbuf_output(&samples, out, size, BPF_RB_FORCE_WAKEUP) ? -1 : 0;
}
