// SPDX-License-Identifier: Apache-2.0
// The two functions pyrometer's uprobes sit on (ebpf/src/bpf/gpu.h). Without a profiler
// attached they are plain calls that return at once.
#include "common.h"

// A sampled launch: the uprobe takes the calling thread's native and Python stack and tags it
// with `correlation` (CUPTI's id of the API call, which the kernel's activity record carries).
PYRO_MARKER void pyrometer_gpu_launch(uint64_t correlation)
{
	// Keeps the argument in its register and the call in place.
	__asm__ volatile("" : : "r"(correlation) : "memory");
}

// A chunk of the channel (pyrometer_gpu.h), `len` bytes at `chunk`: the uprobe copies it into
// the ring buffer.
PYRO_MARKER void pyrometer_gpu_channel(const void *chunk, uint32_t len)
{
	__asm__ volatile("" : : "r"(chunk), "r"(len) : "memory");
}
