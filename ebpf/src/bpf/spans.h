// SPDX-License-Identifier: GPL-2.0
//
// The active OpenTelemetry span of a sampled Python thread. The pyrometer-otel span processor
// (python/pyrometer-otel) keeps, in a table shared by the process's threads, one slot per
// thread (indexed by tid & span_mask) with the trace id, span id and name of the thread's
// innermost active span; the agent finds the table in the process's memory map and puts its
// address in the process's py_procs entry. A slot is read with three bounded reads: its
// sequence number and owner, the body the sequence number names, the sequence number again.
// The writer fills the other body before it moves the sequence number on, so a thread
// interrupted half-way through a write is read with its previous span, and a number that
// moved during the read (a write from another CPU) discards it: a record never carries half
// of one span and half of another.

#pragma once

static __always_inline void span_clear(struct sample_header *hdr)
{
	__builtin_memset(hdr->trace_id, 0, sizeof(hdr->trace_id));
	__builtin_memset(hdr->span_id, 0, sizeof(hdr->span_id));
	__builtin_memset(hdr->span_name, 0, sizeof(hdr->span_name));
}

// Fills hdr->trace_id, span_id and span_name from the current thread's slot (all zero when
// there is none). A global function: verified once, called once per record.
__attribute__((noinline)) int span_read(struct sample_header *hdr)
{
	if (!hdr)
		return 0;
	span_clear(hdr);
	__u32 tgid = hdr->pid;
	__u32 tid = hdr->tid;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	if (!p || !p->span_slots)
		return 0;
	__u64 slot = p->span_slots + (__u64)(tid & p->span_mask) * sizeof(struct span_slot);
	struct {
		__u64 seq;
		__u32 tid;
		__u32 reserved;
	} head;
	if (bpf_probe_read_user(&head, sizeof(head), (void *)slot) || head.tid != tid)
		return 0;
	// The record's three span fields lie in the order of a span_body.
	__u64 body = slot + __builtin_offsetof(struct span_slot, body) +
		     (head.seq & 1) * sizeof(struct span_body);
	if (bpf_probe_read_user(hdr->trace_id, sizeof(struct span_body), (void *)body))
		goto torn;
	__u64 again = 0;
	if (bpf_probe_read_user(&again, sizeof(again), (void *)slot) || again != head.seq)
		goto torn;
	return 1;
torn:
	span_clear(hdr);
	return 0;
}
