// SPDX-License-Identifier: Apache-2.0
// CUPTI's activity records: a bounded pool of buffers handed to CUPTI, and each completed buffer
// translated into channel records on the thread CUPTI completes it on (its own worker, or the
// one calling cuptiActivityFlushAll), never on the application's launching threads.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "state.h"

// The newest record layouts of the pinned headers. CUPTI only appends fields to a record kind's
// layout between versions, and every field read here is in the part all CUDA 12 and 13 CUPTIs
// write, so an older libcupti's records read the same.
typedef CUpti_ActivityKernel13 kernel_record;
typedef CUpti_ActivityMemcpy7 memcpy_record;
typedef CUpti_ActivityMemset5 memset_record;
typedef CUpti_ActivityDevice6 device_record;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t **pool_free;
static unsigned pool_free_n;
static unsigned pool_made;

// A free buffer, or a new one while fewer than buffer_count exist; NULL when all are in use
// (CUPTI then drops records and counts them).
static uint8_t *pool_take(void)
{
	uint8_t *b = NULL;
	pthread_mutex_lock(&pool_lock);
	if (pool_free == NULL)
		pool_free = calloc(pyro.buffer_count, sizeof(*pool_free));
	if (pool_free != NULL && pool_free_n > 0) {
		b = pool_free[--pool_free_n];
	} else if (pool_free != NULL && pool_made < pyro.buffer_count) {
		b = aligned_alloc(8, pyro.buffer_size);
		if (b != NULL)
			pool_made++;
	}
	pthread_mutex_unlock(&pool_lock);
	return b;
}

static void pool_give(uint8_t *b)
{
	pthread_mutex_lock(&pool_lock);
	if (pool_free != NULL && pool_free_n < pyro.buffer_count)
		pool_free[pool_free_n++] = b;
	else
		free(b);
	pthread_mutex_unlock(&pool_lock);
}

static void kernel(const kernel_record *k)
{
	uint32_t name = names_kernel(k->name);
	names_send(name);
	struct pyro_kernel *o = chan_put(PYRO_REC_KERNEL, sizeof(*o));
	o->correlation = k->correlationId;
	o->device = k->deviceId;
	o->context = k->contextId;
	o->stream = k->streamId;
	o->name = name;
	o->graph = k->graphId;
	o->launch_type = k->launchType;
	o->start = k->start;
	o->end = k->end;
	o->grid[0] = k->gridX;
	o->grid[1] = k->gridY;
	o->grid[2] = k->gridZ;
	o->block[0] = k->blockX;
	o->block[1] = k->blockY;
	o->block[2] = k->blockZ;
}

static void copy(const memcpy_record *m)
{
	struct pyro_memcpy *o = chan_put(PYRO_REC_MEMCPY, sizeof(*o));
	o->correlation = m->correlationId;
	o->runtime_correlation = m->runtimeCorrelationId;
	o->device = m->deviceId;
	o->context = m->contextId;
	o->stream = m->streamId;
	o->copy_kind = m->copyKind;
	o->src_kind = m->srcKind;
	o->dst_kind = m->dstKind;
	o->flags = m->flags;
	o->graph = m->graphId;
	o->bytes = m->bytes;
	o->start = m->start;
	o->end = m->end;
}

static void set(const memset_record *m)
{
	struct pyro_memcpy *o = chan_put(PYRO_REC_MEMSET, sizeof(*o));
	o->correlation = m->correlationId;
	o->device = m->deviceId;
	o->context = m->contextId;
	o->stream = m->streamId;
	o->dst_kind = (uint8_t)m->memoryKind;
	o->flags = (uint8_t)m->flags;
	o->graph = m->graphId;
	o->bytes = m->bytes;
	o->start = m->start;
	o->end = m->end;
}

static void device(const device_record *d)
{
	struct pyro_device *o = chan_put(PYRO_REC_DEVICE, sizeof(*o));
	o->device = d->id;
	memcpy(o->uuid, d->uuid.bytes, sizeof(o->uuid));
}

static void translate(uint8_t *buffer, size_t valid)
{
	CUpti_Activity *r = NULL;
	for (;;) {
		CUptiResult st = pyro.shared ? pyro.api.cuptiActivityGetNextRecord_v2(pyro.sub, buffer,
										      valid, &r)
					     : pyro.api.cuptiActivityGetNextRecord(buffer, valid, &r);
		if (st != CUPTI_SUCCESS)
			break;
		switch (r->kind) {
		case CUPTI_ACTIVITY_KIND_KERNEL:
		case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
			kernel((const kernel_record *)r);
			break;
		case CUPTI_ACTIVITY_KIND_MEMCPY:
			copy((const memcpy_record *)r);
			break;
		case CUPTI_ACTIVITY_KIND_MEMSET:
			set((const memset_record *)r);
			break;
		case CUPTI_ACTIVITY_KIND_DEVICE:
			device((const device_record *)r);
			break;
		default:
			atomic_fetch_add_explicit(&pyro.records_unknown, 1, memory_order_relaxed);
		}
	}
}

static void count_dropped(CUcontext ctx, uint32_t stream)
{
	size_t dropped = 0;
	CUptiResult st =
		pyro.shared
			? pyro.api.cuptiActivityGetNumDroppedRecords_v2(pyro.sub, ctx, stream, &dropped)
			: pyro.api.cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
	if (st == CUPTI_SUCCESS && dropped > 0)
		atomic_fetch_add_explicit(&pyro.cupti_dropped, dropped, memory_order_relaxed);
}

static void completed_buffer(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t valid)
{
	chan_lock();
	// Launch records first: a kernel's record then never reaches the reader before its launch.
	notes_drain();
	if (buffer != NULL && valid > 0)
		translate(buffer, valid);
	count_dropped(ctx, stream);
	chan_flush();
	chan_unlock();
	if (buffer != NULL)
		pool_give(buffer);
}

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
	*max_records = 0;
	*buffer = pool_take();
	*size = *buffer != NULL ? pyro.buffer_size : 0;
	if (*buffer == NULL)
		atomic_fetch_add_explicit(&pyro.buffers_refused, 1, memory_order_relaxed);
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
			       size_t valid)
{
	(void)size;
	completed_buffer(ctx, stream, buffer, valid);
}

static void CUPTIAPI requested_v2(uint8_t **buffer, size_t *size, size_t *max_records,
				  CUpti_BufferCallbackRequestInfo *info)
{
	(void)info;
	requested(buffer, size, max_records);
}

static void CUPTIAPI completed_v2(uint8_t *buffer, size_t size, size_t valid,
				  CUpti_BufferCallbackCompleteInfo *info)
{
	(void)size;
	(void)info;
	completed_buffer(NULL, 0, buffer, valid);
}

static uint64_t CUPTIAPI monotonic_timestamp(void)
{
	return pyro_monotonic_ns();
}

static CUptiResult enable(CUpti_ActivityKind kind)
{
	return pyro.shared ? pyro.api.cuptiActivityEnable_v2(pyro.sub, kind, NULL)
			   : pyro.api.cuptiActivityEnable(kind);
}

CUptiResult activity_start(void)
{
	CUptiResult st;
	// CUPTI's times on CLOCK_MONOTONIC, the clock of the kernel's samples. Process-wide: the
	// CLOCK records say what CUPTI's clock is if another tool sets its own later.
	if (pyro.api.cuptiActivityRegisterTimestampCallback != NULL)
		pyro.api.cuptiActivityRegisterTimestampCallback(monotonic_timestamp);
	st = pyro.shared ? pyro.api.cuptiActivityRegisterCallbacks_v2(pyro.sub, requested_v2,
								       completed_v2)
			 : pyro.api.cuptiActivityRegisterCallbacks(requested, completed);
	if (st != CUPTI_SUCCESS)
		return st;
	st = enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
	if (st != CUPTI_SUCCESS)
		return st;
	// Copies and sets are worth having but not worth failing for.
	enable(CUPTI_ACTIVITY_KIND_MEMCPY);
	enable(CUPTI_ACTIVITY_KIND_MEMSET);
	enable(CUPTI_ACTIVITY_KIND_DEVICE);
	if (pyro.api.cuptiActivityFlushPeriod != NULL &&
	    pyro.api.cuptiActivityFlushPeriod(500) == CUPTI_SUCCESS)
		pyro.flush_period = 1;
	return CUPTI_SUCCESS;
}

void activity_flush(int forced)
{
	pyro.api.cuptiActivityFlushAll(forced ? CUPTI_ACTIVITY_FLAG_FLUSH_FORCED : 0);
}

uint64_t activity_timestamp(void)
{
	uint64_t t = 0;
	if (pyro.shared)
		pyro.api.cuptiGetTimestamp_v2(pyro.sub, &t);
	else
		pyro.api.cuptiGetTimestamp(&t);
	return t;
}
