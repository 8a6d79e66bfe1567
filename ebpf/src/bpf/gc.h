// SPDX-License-Identifier: GPL-2.0
//
// CPython's garbage-collector pauses (`record --gc`): a probe where a collection starts and
// one where it ends, attached by the agent to every interpreter binary a target maps. Where
// the build has them (Debian's, which guard them by semaphores the kernel raises while the
// probes are attached), CPython's own USDT probes `python:gc__start` (whose argument is the
// generation) and `python:gc__done`; otherwise the entry and return of the collector
// function (`collect`, `gc_collect_main`), whose `generation` parameter DWARF locates.
// gc_start's attach cookie says where the generation is (GC_ARG_* in shared.h).
//
// The stack is walked at the start (native and Python frames: the allocation or the
// gc.collect() call that set the collection off) and parked under the thread's id; the end
// sends it as one SAMPLE_GC record weighted by the pause.

#pragma once

#include "common.h"
#include "python.h"
#include "stacks.h"

// tid -> the stack of a collection in progress (4 KiB each, allocated as collections start;
// a collection runs on one thread at a time per interpreter).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, GC_PENDING_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct offcpu_record);
} gc_pending SEC(".maps");

// Register `reg` (GC_REG_*, its slot) of the probed user context. Read with a helper, as
// libbpf's USDT support does: a load from the context at a variable offset is refused.
static __always_inline __u64 gc_reg(struct pt_regs *ctx, __u32 reg)
{
	__u64 v = 0;
	if (reg > GC_REG_RSP)
		return 0;
	if (bpf_probe_read_kernel(&v, sizeof(v), (void *)ctx + reg * sizeof(__u64)))
		return 0;
	return v;
}

// The generation collected, as the cookie says to find it.
static __always_inline __u64 gc_generation(struct pt_regs *ctx)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 kind = cookie & 0xff, reg = (cookie >> 8) & 0xff, size = (cookie >> 16) & 0xff;
	__s32 imm = (__s32)(cookie >> 32);
	__u64 v = 0;
	switch (kind) {
	case GC_ARG_CONST:
		return (__u64)imm;
	case GC_ARG_REG:
		v = gc_reg(ctx, reg);
		break;
	case GC_ARG_MEM: {
		__u64 at = gc_reg(ctx, reg) + (__s64)imm;
		if (bpf_probe_read_user(&v, sizeof(v), (void *)at))
			return GC_GENERATION_UNKNOWN;
		break;
	}
	default:
		return GC_GENERATION_UNKNOWN;
	}
	if (size == 1)
		v &= 0xff;
	else if (size == 2)
		v &= 0xffff;
	else if (size == 4)
		v &= 0xffffffff;
	// CPython has three generations (four in 3.14's incremental collector's numbering at
	// most): anything else is a misread, not a generation.
	return v < 16 ? v : GC_GENERATION_UNKNOWN;
}

SEC("uprobe")
int gc_start(struct pt_regs *ctx)
{
	REJECT_IF(REJECT_GC);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!is_target(tgid))
		return 0;
	struct offcpu_record *rec = (struct offcpu_record *)scratch_record(SCRATCH_PROBE);
	if (!rec)
		return 0;
	record_header(&rec->hdr, bpf_ktime_get_ns(), tgid, tid, SAMPLE_GC);
	rec->hdr.aux = gc_generation(ctx);
	record_user_stack(ctx, ctx, tgid, tid, &rec->hdr, rec->user, SCRATCH_PROBE);
	// The walk took time: the pause starts now.
	rec->hdr.timestamp_ns = bpf_ktime_get_ns();
	if (bpf_map_update_elem(&gc_pending, &tid, rec, BPF_ANY))
		count(COUNTER_GC_PENDING_FULL);
	return 0;
}

// The collection's end: the USDT probe gc__done (an entry probe) or the collector
// function's return (a return probe) run the same code.
static __always_inline int gc_end(void)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct offcpu_record *rec = bpf_map_lookup_elem(&gc_pending, &tid);
	if (!rec)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	rec->hdr.value = now > rec->hdr.timestamp_ns ? now - rec->hdr.timestamp_ns : 0;
	if (send_record_wake(rec, record_size(&rec->hdr, sizeof(*rec)), 0))
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_GC_EVENTS);
	bpf_map_delete_elem(&gc_pending, &tid);
	return 0;
}

SEC("uprobe")
int gc_done(struct pt_regs *ctx)
{
	return gc_end();
}

SEC("uretprobe")
int gc_return(struct pt_regs *ctx)
{
	return gc_end();
}
