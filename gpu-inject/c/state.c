// SPDX-License-Identifier: Apache-2.0
// The library's state in its process, and what the environment sets of it, read once for
// whichever of CUDA and NVTX loads the library first.
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "state.h"

// A sampled launch costs the launching thread a uprobe trap and a stack walk: 14-16 us for a
// 20-frame Python and native stack on the development VM (docs/src/gpu.md), more for PyTorch's
// deeper stacks. An eager PyTorch op costs the CPU some 10 us with its launch, so 1 in 256 keeps
// the walks near 1 % of a purely launch-bound loop's CPU, leaving room under the 3 % bound for
// CUPTI's own cost; a busy training step still gets tens of stacks a second.
#define DEFAULT_SAMPLE_EVERY 256
// Activity buffers: 1 MiB each, PYROMETER_GPU_BUFFER_MB of them.
#define BUFFER_SIZE (1u << 20)
#define DEFAULT_BUFFER_MB 8

struct pyro pyro = {.sample_every = DEFAULT_SAMPLE_EVERY};

uint64_t pyro_monotonic_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t env_number(const char *name, uint64_t lo, uint64_t hi, uint64_t otherwise)
{
	const char *v = getenv(name);
	if (v == NULL || *v == '\0')
		return otherwise;
	char *end;
	unsigned long long n = strtoull(v, &end, 10);
	if (*end != '\0' || n < lo || n > hi)
		return otherwise;
	return n;
}

static void common_init_once(void)
{
	pyro.sample_every =
		(uint32_t)env_number("PYROMETER_GPU_SAMPLE_EVERY", 1, 1000000, DEFAULT_SAMPLE_EVERY);
	pyro.log_keep = pyro.sample_every > 1 ? log1p(-1.0 / pyro.sample_every) : 0;
	uint64_t mb = env_number("PYROMETER_GPU_BUFFER_MB", 1, 1024, DEFAULT_BUFFER_MB);
	pyro.buffer_size = BUFFER_SIZE;
	pyro.buffer_count = (unsigned)mb;
	chan_open_dump(getenv("PYROMETER_GPU_DUMP"));
}

void pyro_common_init(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	pthread_once(&once, common_init_once);
}

