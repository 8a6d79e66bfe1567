// SPDX-License-Identifier: GPL-2.0
//
// GPU kernels by launching stack (`record --gpu-kernels`, the agent): two uprobes on the
// functions of libpyrometer_cupti.so, the CUPTI library CUDA's injection hook loads into a
// process (gpu-inject/):
//
// - gpu_launch, on pyrometer_gpu_launch(correlation), which the library calls at 1 in N of the
//   process's launch, copy and set calls: the launching thread's stack (native and Python, as
//   a sampled allocation's), tagged with CUPTI's correlation id of the call (SAMPLE_GPU_LAUNCH,
//   aux = the id).
// - gpu_channel, on pyrometer_gpu_channel(chunk, len): a chunk of the library's channel
//   (gpu-inject/c/pyrometer_gpu.h: activity records, sampled launches, names, counters) copied
//   as it is into the ring buffer after a header (SAMPLE_GPU_CHANNEL, value = len), at its own
//   length. User space parses it as the untrusted bytes it is; here only its length is bounded.
//
// Both are attached once per copy of the library for every process (they fire only in
// processes that load it); `gpu_all` says whether every such process counts (the agent) or
// only the capture's targets (`record`).

#pragma once

#include "common.h"
#include "stacks.h"

const volatile __u32 gpu_all = 0;

static __always_inline int gpu_target(__u32 tgid)
{
	if (gpu_all)
		return tgid != 0 && tgid != self_tgid;
	return is_target(tgid);
}

SEC("uprobe")
int gpu_launch(struct pt_regs *ctx)
{
	REJECT_IF(REJECT_GPU);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!gpu_target(tgid))
		return 0;
	__u64 correlation = PT_REGS_PARM1(ctx);
	barrier_var(correlation);
	struct offcpu_record *rec = (struct offcpu_record *)scratch_record(SCRATCH_PROBE);
	if (!rec)
		return 0;
	record_header(&rec->hdr, bpf_ktime_get_ns(), tgid, tid, SAMPLE_GPU_LAUNCH);
	rec->hdr.aux = correlation;
	// At the marker's entry: its return address is the library's caller's, the walk starts
	// from the library's frame.
	record_user_stack(ctx, ctx, tgid, tid, &rec->hdr, rec->user, SCRATCH_PROBE);
	__u64 bytes = record_size(&rec->hdr, sizeof(*rec));
	if (send_record_wake(rec, bytes, rec->hdr.flags & SAMPLE_PY_NEW_THREAD))
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_GPU_LAUNCHES);
	return 0;
}

struct gpu_chunk_record {
	struct sample_header hdr;
	__u8 data[GPU_CHUNK_MAX];
};

// Where a chunk is put together before it goes to the ring buffer at its own length: most
// chunks are a status, a clock and a few launches, far from GPU_CHUNK_MAX, and a reservation of
// the whole record for each would fill the ring buffer (the agent's is 1 MiB on a small
// machine) with padding.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gpu_chunk_record);
} gpu_chunk_scratch SEC(".maps");

SEC("uprobe")
int gpu_channel(struct pt_regs *ctx)
{
	REJECT_IF(REJECT_GPU);
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	if (!gpu_target(tgid))
		return 0;
	__u64 chunk = PT_REGS_PARM1(ctx), len = PT_REGS_PARM2(ctx) & 0xffffffff;
	barrier_var(chunk);
	barrier_var(len);
	if (len == 0 || len > GPU_CHUNK_MAX) {
		count(COUNTER_GPU_CHUNKS_REFUSED);
		return 0;
	}
	__u32 zero = 0;
	struct gpu_chunk_record *rec = bpf_map_lookup_elem(&gpu_chunk_scratch, &zero);
	if (!rec)
		return 0;
	record_header(&rec->hdr, bpf_ktime_get_ns(), tgid, tid, SAMPLE_GPU_CHANNEL);
	rec->hdr.user_frames = 0;
	rec->hdr.value = len;
	if (bpf_probe_read_user(rec->data, len, (const void *)chunk)) {
		count(COUNTER_GPU_CHUNKS_REFUSED);
		return 0;
	}
	if (send_record(rec, sizeof(rec->hdr) + len))
		count(COUNTER_RINGBUF_DROPS);
	else
		count(COUNTER_GPU_CHUNKS);
	return 0;
}
