// SPDX-License-Identifier: GPL-2.0
//
// The active OpenTelemetry span of a sampled Python thread. The pyrometer-otel span processor
// (python/pyrometer-otel) keeps, in a table shared by the process's threads, one slot per
// thread (indexed by the thread's own id, as gettid gives it in its pid namespace, & span_mask)
// with the trace id, span id and name of the thread's
// innermost active span; the kernel finds the table at its fixed address (span_probe), or the
// agent finds it in the process's memory map, and its address goes in the process's py_procs
// entry. A slot is read with three bounded reads: its
// sequence number and owner, the body the sequence number names, the sequence number again.
// The writer fills the other body before it moves the sequence number on, so a thread
// interrupted half-way through a write is read with its previous span, and a number that
// moved during the read (a write from another CPU) discards it: a record never carries half
// of one span and half of another.

#pragma once

#include "common.h"
#include "python.h"

static __always_inline void span_clear(struct sample_header *hdr)
{
	__builtin_memset(hdr->trace_id, 0, sizeof(hdr->trace_id));
	__builtin_memset(hdr->span_id, 0, sizeof(hdr->span_id));
	__builtin_memset(hdr->span_name, 0, sizeof(hdr->span_name));
}

// The thread id as the thread itself knows it (gettid in its own pid namespace), which is
// what the span processor indexes its slot by: a process in a container sees other ids than
// the kernel's global ones. CO-RE views of task->thread_pid->numbers[level].nr.
struct upid___spans {
	int nr;
} __attribute__((preserve_access_index));
struct pid___spans {
	unsigned int level;
	struct upid___spans numbers[1];
} __attribute__((preserve_access_index));
struct task_struct___spans {
	struct pid___spans *thread_pid;
} __attribute__((preserve_access_index));

// Pid namespaces nest at most 32 deep (MAX_PID_NS_LEVEL).
#define SPANS_MAX_NS_LEVEL 32

static __always_inline __u32 span_own_tid(__u32 tid)
{
	struct task_struct___spans *task = (void *)bpf_get_current_task();
	struct pid___spans *pid = BPF_CORE_READ(task, thread_pid);
	if (!pid)
		return tid;
	unsigned int level = BPF_CORE_READ(pid, level);
	if (level == 0 || level >= SPANS_MAX_NS_LEVEL)
		return tid;
	__u64 off = bpf_core_field_offset(struct pid___spans, numbers) +
		(__u64)level * bpf_core_type_size(struct upid___spans) +
		bpf_core_field_offset(struct upid___spans, nr);
	int nr = 0;
	if (bpf_probe_read_kernel(&nr, sizeof(nr), (void *)pid + off) || nr <= 0)
		return tid;
	return nr;
}

// Where the package maps its table when it can (FIXED_ADDRESS in
// python/pyrometer-otel/src/pyrometer_otel/table.py): the kernel looks there itself, so a table
// is used from the first sample after its header is written, with no wait for the agent's scan
// of /proc/PID/maps (which still finds tables mapped elsewhere).
#define SPAN_TABLE_AT 0x607079720000ULL
// A registered Python process without a table is looked at no more often than every
// SPAN_PROBE_EVERY units of 2^20 ns (~8 ms), SPAN_PROBES at most (at least ~2 s of its
// samples: the package's table is made when tracing is set up, usually at start-up). Then
// the kernel stops looking, so a process without the package pays nothing more: a look at
// one is a failed user read of an unmapped address (a caught page fault, 1-2 us here). A
// table made later is found by the agent's scan of /proc/PID/maps (spans.rs), as one mapped
// elsewhere is.
#define SPAN_PROBE_EVERY 8
#define SPAN_PROBES 256
// "PYROSPAN" read as a little-endian u64.
#define SPAN_MAGIC 0x4e4150534f525950ULL
#define SPAN_MAX_SLOTS (1U << 20)

// Takes the table at SPAN_TABLE_AT into the process's entry when its header checks out (the
// checks of spans.rs's parse_header).
static __always_inline void span_probe(struct py_process *p)
{
	if (p->span_probes >= SPAN_PROBES)
		return;
	__u16 now = bpf_ktime_get_ns() >> 20;
	if ((__u16)(now - p->span_probed_at) < SPAN_PROBE_EVERY)
		return;
	p->span_probed_at = now;
	p->span_probes++;
	struct {
		__u64 magic;
		__u32 version, count, slot_size, header_size;
	} h;
	if (bpf_probe_read_user(&h, sizeof(h), (void *)SPAN_TABLE_AT))
		return;
	if (h.magic != SPAN_MAGIC || h.version != 1 || h.slot_size != sizeof(struct span_slot) ||
	    !h.count || (h.count & (h.count - 1)) || h.count > SPAN_MAX_SLOTS ||
	    h.header_size < sizeof(h) || h.header_size % 8 || h.header_size > 4096)
		return;
	p->span_mask = h.count - 1;
	p->span_slots = SPAN_TABLE_AT + h.header_size;
}

// Fills hdr->trace_id, span_id and span_name from the current thread's slot (all zero when
// there is none). A global function: verified once, called once per record.
__attribute__((noinline)) int span_read(struct sample_header *hdr)
{
	if (!hdr)
		return 0;
	span_clear(hdr);
	__u32 tgid = hdr->pid;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	if (!p)
		return 0;
	if (!p->span_slots)
		span_probe(p);
	if (!p->span_slots)
		return 0;
	__u32 tid = span_own_tid(hdr->tid);
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
