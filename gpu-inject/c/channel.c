// SPDX-License-Identifier: Apache-2.0
// The chunk being filled and where it goes: pyrometer_gpu_channel (the uprobe), and the dump
// file when PYROMETER_GPU_DUMP names one.
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

// The dump stops growing here: a forgotten variable must not fill a disk.
#define DUMP_MAX (256ull << 20)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static union {
	uint8_t bytes[PYRO_GPU_CHUNK_MAX];
	uint64_t align;
} chunk;
static uint32_t used; // bytes of `chunk` in use, header included; 0: empty
static uint32_t seq;
static int dump_fd = -1;
static uint64_t dump_bytes;
static uint64_t dump_dropped;

void chan_open_dump(const char *path)
{
	if (path == NULL || *path == '\0')
		return;
	dump_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
}

void chan_lock(void)
{
	pthread_mutex_lock(&lock);
}

void chan_unlock(void)
{
	pthread_mutex_unlock(&lock);
}

void *chan_put(uint16_t type, uint16_t len)
{
	if (used != 0 && used + len > sizeof(chunk.bytes))
		chan_flush();
	if (used == 0)
		used = sizeof(struct pyro_chunk_header);
	uint8_t *at = chunk.bytes + used;
	memset(at, 0, len);
	struct pyro_record_header *h = (struct pyro_record_header *)at;
	h->type = type;
	h->len = len;
	used += len;
	return at;
}

static void dump(const uint8_t *p, uint32_t len)
{
	if (dump_fd < 0)
		return;
	if (dump_bytes + len > DUMP_MAX) {
		dump_dropped++;
		return;
	}
	while (len > 0) {
		ssize_t n = write(dump_fd, p, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			dump_dropped++;
			return;
		}
		p += n;
		len -= (uint32_t)n;
		dump_bytes += (uint64_t)n;
	}
}

void chan_flush(void)
{
	if (used <= sizeof(struct pyro_chunk_header)) {
		used = 0;
		return;
	}
	struct pyro_chunk_header *h = (struct pyro_chunk_header *)chunk.bytes;
	h->magic = PYRO_GPU_MAGIC;
	h->version = PYRO_GPU_VERSION;
	h->header_len = sizeof(*h);
	h->seq = seq++;
	h->len = used;
	pyrometer_gpu_channel(chunk.bytes, used);
	dump(chunk.bytes, used);
	used = 0;
}

uint64_t chan_dump_dropped(void)
{
	return dump_dropped;
}
