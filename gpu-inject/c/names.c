// SPDX-License-Identifier: Apache-2.0
// Names (kernels, NVTX ranges, tools) get small ids, so a record carries 4 bytes, not the
// name: each id's text goes out in a STRING record before the first record that uses it, and
// again in every later epoch (a few seconds) in which it is used, so that a profiler that
// attached late learns it. The table is bounded in entries and bytes; a name beyond it gets
// PYRO_NAME_DROPPED, counted.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define SLOTS 16384          // open addressing, a power of two
#define ENTRIES (SLOTS / 2)  // at most half full
#define TEXT_BYTES (4u << 20) // all names' text together
#define FIRST_ID 3            // after PYRO_NAME_DROPPED and PYRO_NAME_EMPTY
// Kernel-name pointers remembered (CUPTI's string of a kernel stays put): most records then
// cost one compare, not a hash of a long name.
#define PTR_CACHE 1024

struct entry {
	uint64_t hash;
	char *text;
	uint16_t len;
	uint16_t kind;
	uint16_t cut;
	uint32_t sent_epoch;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t slots[SLOTS];            // entry index + 1, 0 free
static struct entry entries[ENTRIES + FIRST_ID];
static uint32_t count = FIRST_ID;        // next id
static uint64_t text_bytes;
static uint64_t dropped;
static uint32_t epoch = 1;

static struct {
	const char *ptr;
	uint64_t head; // the first 8 bytes, checked: a pointer reused for another name misses
	uint32_t id;
} ptr_cache[PTR_CACHE];

static uint64_t fnv1a(const char *s, size_t n, uint16_t kind)
{
	uint64_t h = 0xcbf29ce484222325ull ^ kind;
	for (size_t i = 0; i < n; i++) {
		h ^= (uint8_t)s[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

static void init_fixed(void)
{
	static const char *fixed[FIRST_ID] = {"", "<names over limit>", "<no name>"};
	for (uint32_t id = 1; id < FIRST_ID; id++) {
		entries[id].text = (char *)fixed[id];
		entries[id].len = (uint16_t)strlen(fixed[id]);
		entries[id].kind = PYRO_STR_KERNEL;
	}
}

uint32_t names_intern(const char *text, uint16_t kind)
{
	if (text == NULL || *text == '\0')
		return PYRO_NAME_EMPTY;
	size_t n = strnlen(text, PYRO_GPU_NAME_MAX + 1);
	uint16_t cut = n > PYRO_GPU_NAME_MAX;
	if (cut)
		n = PYRO_GPU_NAME_MAX;
	uint64_t h = fnv1a(text, n, kind);
	uint32_t id = PYRO_NAME_DROPPED;
	pthread_mutex_lock(&lock);
	if (entries[1].text == NULL)
		init_fixed();
	for (uint32_t i = (uint32_t)h & (SLOTS - 1);; i = (i + 1) & (SLOTS - 1)) {
		uint32_t e = slots[i];
		if (e == 0) {
			if (count >= ENTRIES + FIRST_ID || text_bytes + n > TEXT_BYTES) {
				dropped++;
				break;
			}
			char *copy = malloc(n + 1);
			if (copy == NULL) {
				dropped++;
				break;
			}
			memcpy(copy, text, n);
			copy[n] = '\0';
			text_bytes += n;
			id = count++;
			entries[id] = (struct entry){
				.hash = h, .text = copy, .len = (uint16_t)n, .kind = kind, .cut = cut};
			slots[i] = id;
			break;
		}
		struct entry *x = &entries[e];
		if (x->hash == h && x->len == n && x->kind == kind && memcmp(x->text, text, n) == 0) {
			id = e;
			break;
		}
	}
	pthread_mutex_unlock(&lock);
	return id;
}

uint32_t names_kernel(const char *text)
{
	if (text == NULL)
		return PYRO_NAME_EMPTY;
	uint64_t head = 0;
	memcpy(&head, text, strnlen(text, sizeof(head)));
	size_t slot = ((uintptr_t)text >> 4) & (PTR_CACHE - 1);
	if (ptr_cache[slot].ptr == text && ptr_cache[slot].head == head)
		return ptr_cache[slot].id;
	uint32_t id = names_intern(text, PYRO_STR_KERNEL);
	if (id != PYRO_NAME_DROPPED) {
		ptr_cache[slot].ptr = text;
		ptr_cache[slot].head = head;
		ptr_cache[slot].id = id;
	}
	return id;
}

void names_send(uint32_t id)
{
	pthread_mutex_lock(&lock);
	if (entries[1].text == NULL)
		init_fixed();
	if (id == 0 || id >= count || entries[id].sent_epoch == epoch) {
		pthread_mutex_unlock(&lock);
		return;
	}
	struct entry *e = &entries[id];
	e->sent_epoch = epoch;
	uint16_t len = (uint16_t)((sizeof(struct pyro_string) + e->len + 7) & ~7u);
	struct pyro_string *s = chan_put(PYRO_REC_STRING, len);
	s->id = id;
	s->kind = e->kind;
	s->flags = e->cut ? PYRO_STRING_CUT : 0;
	s->bytes = e->len;
	memcpy(s + 1, e->text, e->len);
	pthread_mutex_unlock(&lock);
}

void names_new_epoch(void)
{
	pthread_mutex_lock(&lock);
	epoch++;
	pthread_mutex_unlock(&lock);
}

uint64_t names_dropped(void)
{
	pthread_mutex_lock(&lock);
	uint64_t n = dropped;
	pthread_mutex_unlock(&lock);
	return n;
}
