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
#include "stacks.h"

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
	__type(value, struct sample_copy_buf);
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

_Static_assert(STACK_COPY_PAGES == 4, "send_with_stack_copy reads four pages");

// Page `i` from `base` into the copy; non-zero when it cannot be read.
static __always_inline long copy_page(struct stack_copy *copy, __u64 base, int i)
{
	return bpf_probe_read_user(&copy->bytes[i * STACK_COPY_PAGE], STACK_COPY_PAGE,
				   (void *)(base + i * STACK_COPY_PAGE));
}

// The header and the slots a record uses: where its copy goes.
#define COPY_RECORD_MAX (sizeof(struct sample_header) + MAX_SLOTS * 8)

// Sends the scratch record `rec` (the slots it uses; never one with inline kernel frames) with
// a copy of the user stack at `user` (the interrupted user registers, or NULL: the ones saved
// on kernel entry) right after them. Returns 0 when sent; otherwise nothing was sent, and the
// caller sends the record without a copy. A call of its own: its locals inlined into the
// sampler's frame took 6.1's combined stack of the walk's call chain past 512 bytes.
static __attribute__((noinline)) int send_with_stack_copy(struct sample_record *rec,
							  const struct pt_regs *user, __u64 now)
{
	// Past three quarters full (three times where records start waking the agent) the room
	// is the plain records': a burst of copies must not make them drop. A quarter of the
	// agent's smallest ring (1 MiB) holds a second of plain records at 499 Hz on two CPUs.
	// Past a quarter a copy keeps only the stack pointer's page (the innermost frames, and
	// a main thread's whole stack near its top), so more of them fit while the agent is busy.
	__u64 waiting = bpf_ringbuf_query(&samples, BPF_RB_AVAIL_DATA);
	if (rec->hdr.flags & SAMPLE_KERNEL_INLINE || waiting >= 3 * ringbuf_wakeup_bytes ||
	    !stack_copy_allowed(now))
		return -1;
	int pages = waiting >= ringbuf_wakeup_bytes ? 1 : STACK_COPY_PAGES;
	__u64 pc, sp, bp;
	if (walk_start_regs(user, &pc, &sp, &bp))
		return -1;
	__u32 zero = 0;
	struct sample_copy_buf *out = bpf_map_lookup_elem(&stack_copy_scratch, &zero);
	if (!out)
		return -1;
	__u64 used = record_size(&rec->hdr, COPY_RECORD_MAX);
	if (used < sizeof(struct sample_header) || used > COPY_RECORD_MAX)
		return -1;
	if (bpf_probe_read_kernel(out->bytes, used, rec))
		return -1;
	struct stack_copy *copy = (struct stack_copy *)(out->bytes + used);
	__u64 base = sp & ~((__u64)STACK_COPY_PAGE - 1);
	// Page by page: a page past the stack's end (the main thread's) is unmapped, and one read
	// across it would copy nothing at all.
	__u32 len = 0;
	if (!copy_page(copy, base, 0)) {
		len = STACK_COPY_PAGE;
		if (pages > 1 && !copy_page(copy, base, 1)) {
			len = 2 * STACK_COPY_PAGE;
			if (!copy_page(copy, base, 2)) {
				len = 3 * STACK_COPY_PAGE;
				if (!copy_page(copy, base, 3))
					len = 4 * STACK_COPY_PAGE;
			}
		}
	}
	copy->pc = pc;
	copy->sp = sp;
	copy->bp = bp;
	copy->base = base;
	copy->len = len;
	copy->reserved = 0;
	__u64 size = used + sizeof(*copy) - STACK_COPY_BYTES + len;
	if (size > sizeof(*out))
		size = sizeof(*out);
	// The agent is waiting for these (it holds them until the table is in).
	return bpf_ringbuf_output(&samples, out, size, BPF_RB_FORCE_WAKEUP) ? -1 : 0;
}
