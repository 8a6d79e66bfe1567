// SPDX-License-Identifier: Apache-2.0
// The library's state in a process (state.c), shared by inject.c (start, API callbacks,
// sampling, the flusher thread), activity.c (activity buffers and their records) and notes.c
// (sampled launches waiting for the channel).
#pragma once

#include <stdatomic.h>

#include "common.h"
#include "cupti_api.h"

struct pyro {
	struct cupti_api api;
	CUpti_SubscriberHandle sub;
	int shared;      // the subscriber-aware (_v2) activity API is in use
	int flush_period; // CUPTI flushes its buffers itself (cuptiActivityFlushPeriod)
	uint16_t mode;   // enum pyro_mode
	uint16_t state;  // enum pyro_state
	uint32_t error;
	uint32_t other;  // STRING id of the subscriber that holds CUPTI
	uint32_t cupti_version;
	uint32_t sample_every;
	double log_keep; // ln(1 - 1/sample_every): geometric gaps between sampled launches
	size_t buffer_size;
	unsigned buffer_count;
	_Atomic uint64_t launches;
	_Atomic uint64_t sampled;
	_Atomic uint64_t cupti_dropped;
	_Atomic uint64_t buffers_refused;
	_Atomic uint64_t notes_dropped;
	_Atomic uint64_t records_unknown;
};

extern struct pyro pyro;

// activity.c
// Registers the buffer callbacks (and CUPTI's clock) and enables the activity kinds; returns
// the first CUptiResult that failed, or CUPTI_SUCCESS.
CUptiResult activity_start(void);
// Asks CUPTI for the records it holds (forced: also those of buffers not yet full). Never
// called with the channel lock held: CUPTI may complete buffers from inside it.
void activity_flush(int forced);
// CUPTI's clock now (channel lock may be held: it calls back nothing of ours but the clock).
uint64_t activity_timestamp(void);

// notes.c: a LAUNCH or ALIAS record for the next flush (any thread; counted when full), and
// the queued ones into the channel (channel lock held).
void notes_queue(const struct pyro_launch *note);
void notes_drain(void);
