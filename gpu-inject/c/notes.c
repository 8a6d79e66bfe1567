// SPDX-License-Identifier: Apache-2.0
// Sampled launches (LAUNCH records) and the ids of calls nested in them (ALIAS records), queued
// by the launching threads under a short lock and put into the channel by whoever flushes next:
// the flusher, or the thread translating a completed activity buffer (before its records, so a
// kernel's record never reaches the reader before its launch).
#include <pthread.h>
#include <string.h>

#include "state.h"

#define NOTES 4096

static pthread_mutex_t notes_lock = PTHREAD_MUTEX_INITIALIZER;
static struct pyro_launch notes[NOTES]; // LAUNCH, or ALIAS in the same room
static uint32_t notes_n;
static struct pyro_launch draining[NOTES]; // the drainer's copy (channel lock held)


void notes_queue(const struct pyro_launch *note)
{
	pthread_mutex_lock(&notes_lock);
	if (notes_n < NOTES)
		notes[notes_n++] = *note;
	else
		atomic_fetch_add_explicit(&pyro.notes_dropped, 1, memory_order_relaxed);
	pthread_mutex_unlock(&notes_lock);
}

void notes_drain(void)
{
	pthread_mutex_lock(&notes_lock);
	uint32_t n = notes_n;
	memcpy(draining, notes, n * sizeof(notes[0]));
	notes_n = 0;
	pthread_mutex_unlock(&notes_lock);
	for (uint32_t i = 0; i < n; i++) {
		const struct pyro_launch *note = &draining[i];
		if (note->h.type == PYRO_REC_LAUNCH && note->nvtx != 0)
			names_send(note->nvtx);
		void *out = chan_put(note->h.type, note->h.len);
		memcpy(out, note, note->h.len);
	}
}

