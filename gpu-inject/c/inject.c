// SPDX-License-Identifier: Apache-2.0
//
// libpyrometer_cupti.so: loaded by CUDA's injection hook (CUDA_INJECTION64_PATH names it; the
// driver calls InitializeInjection at cuInit), it subscribes to CUPTI for the launch, copy and
// set calls of the runtime and driver APIs and for the activity records of kernels, copies and
// sets. On 1 in N such calls per thread (at random: geometric gaps of mean N) it calls
// pyrometer_gpu_launch(correlation id), where pyrometer's uprobe takes the thread's stack, and
// queues a LAUNCH record saying so; activity records go out as they complete. Everything reaches
// pyrometer through the channel (pyrometer_gpu.h). Without a profiler attached the marker calls
// return at once, so the process pays CUPTI's own cost and the sampling counters only.
//
// Environment (read in state.c): PYROMETER_GPU_SAMPLE_EVERY (N, 256 by default), PYROMETER_GPU_BUFFER_MB
// (activity buffers, default 8 MiB in 1 MiB buffers), PYROMETER_CUPTI_LIB (the libcupti to use),
// PYROMETER_GPU_DUMP (also append every chunk to this file).
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "state.h"

// How often the flusher runs.
#define FLUSH_NS 200000000ull
#define STATUS_TICKS 10 // a STATUS and a CLOCK record every 2 s
#define EPOCH_TICKS 50  // names sent again every 10 s

// Launch kinds of the runtime (CUPTI_CB_DOMAIN_RUNTIME_API) and driver calls, by callback id.
static uint8_t runtime_kinds[CUPTI_RUNTIME_TRACE_CBID_SIZE];
static uint8_t driver_kinds[CUPTI_DRIVER_TRACE_CBID_SIZE];

struct thread_state {
	uint64_t rng;       // 0: not seeded yet
	int64_t countdown;  // calls to the next sampled one
	uint32_t depth;     // launch calls in progress (a runtime call makes driver calls)
	uint32_t corr;      // the outermost one's correlation id
	uint8_t sampled;    // ... and whether it was sampled
	uint32_t tid;
};

static __thread struct thread_state ts;

static int exiting;

// ---- sampling

static uint64_t next_random(struct thread_state *t)
{
	// xorshift64*: per thread, no locks.
	t->rng ^= t->rng >> 12;
	t->rng ^= t->rng << 25;
	t->rng ^= t->rng >> 27;
	return t->rng * 0x2545f4914f6cdd1dull;
}

// Calls until the next sampled one: geometric with mean sample_every, so each call is sampled
// with probability 1/N independently of the others and a sample stands for N calls.
static int64_t gap(struct thread_state *t)
{
	if (pyro.sample_every <= 1)
		return 1;
	double u = (double)(next_random(t) >> 11) * 0x1.0p-53;
	if (u <= 0)
		u = 0x1.0p-53;
	double g = floor(log(u) / pyro.log_keep);
	return 1 + (g > 1e12 ? (int64_t)1e12 : (int64_t)g);
}

static int sample(struct thread_state *t)
{
	if (t->rng == 0) {
		t->tid = (uint32_t)syscall(SYS_gettid);
		t->rng = (pyro_monotonic_ns() ^ ((uint64_t)t->tid << 32)) | 1;
		t->countdown = gap(t);
	}
	if (--t->countdown > 0)
		return 0;
	t->countdown = gap(t);
	return 1;
}

static void launch_note(struct thread_state *t, const CUpti_CallbackData *d, uint8_t kind,
			CUpti_CallbackDomain domain, CUpti_CallbackId cbid)
{
	char ranges[512];
	struct pyro_launch n = {0};
	n.h.type = PYRO_REC_LAUNCH;
	n.h.len = sizeof(n);
	n.correlation = d->correlationId;
	n.tid = t->tid;
	n.weight = pyro.sample_every;
	n.api = kind;
	n.domain = (uint8_t)domain;
	n.cbid = cbid;
	n.nvtx = nvtx_ranges(ranges, sizeof(ranges)) > 0 ? names_intern(ranges, PYRO_STR_NVTX) : 0;
	n.time = pyro_monotonic_ns();
	notes_queue(&n);
}

static void alias_note(uint32_t from, uint32_t to)
{
	struct pyro_launch n = {0};
	struct pyro_alias *a = (struct pyro_alias *)&n;
	a->h.type = PYRO_REC_ALIAS;
	a->h.len = sizeof(*a);
	a->from = from;
	a->to = to;
	notes_queue(&n);
}

static uint8_t kind_of(CUpti_CallbackDomain domain, CUpti_CallbackId cbid)
{
	if (domain == CUPTI_CB_DOMAIN_RUNTIME_API)
		return cbid < CUPTI_RUNTIME_TRACE_CBID_SIZE ? runtime_kinds[cbid] : 0;
	if (domain == CUPTI_CB_DOMAIN_DRIVER_API)
		return cbid < CUPTI_DRIVER_TRACE_CBID_SIZE ? driver_kinds[cbid] : 0;
	return 0;
}

static void CUPTIAPI on_api(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
			    const void *data)
{
	(void)userdata;
	uint8_t kind = kind_of(domain, cbid);
	if (kind == 0 || data == NULL || __atomic_load_n(&exiting, __ATOMIC_RELAXED))
		return;
	const CUpti_CallbackData *d = data;
	struct thread_state *t = &ts;
	if (d->callbackSite == CUPTI_API_EXIT) {
		if (t->depth > 0)
			t->depth--;
		return;
	}
	if (t->depth++ > 0) {
		// A call the outer one made: if CUPTI gave it an id of its own, records may carry
		// that one.
		if (t->sampled && d->correlationId != t->corr)
			alias_note(d->correlationId, t->corr);
		return;
	}
	atomic_fetch_add_explicit(&pyro.launches, 1, memory_order_relaxed);
	t->corr = d->correlationId;
	t->sampled = (uint8_t)sample(t);
	if (!t->sampled)
		return;
	atomic_fetch_add_explicit(&pyro.sampled, 1, memory_order_relaxed);
	launch_note(t, d, kind, domain, cbid);
	pyrometer_gpu_launch(d->correlationId);
}

// ---- channel records the flusher puts (channel lock held)

static void status_put(int final)
{
	if (pyro.other != 0)
		names_send(pyro.other);
	struct pyro_status *s = chan_put(PYRO_REC_STATUS, sizeof(*s));
	s->mode = pyro.mode;
	s->state = pyro.state;
	s->lib_version = PYRO_GPU_VERSION;
	s->sample_every = pyro.sample_every;
	s->cupti_version = pyro.cupti_version;
	s->error = pyro.error;
	s->other = pyro.other;
	s->flags = final ? PYRO_STATUS_FINAL : 0;
	s->launches = atomic_load_explicit(&pyro.launches, memory_order_relaxed);
	s->sampled = atomic_load_explicit(&pyro.sampled, memory_order_relaxed);
	s->cupti_dropped = atomic_load_explicit(&pyro.cupti_dropped, memory_order_relaxed);
	s->buffers_refused = atomic_load_explicit(&pyro.buffers_refused, memory_order_relaxed);
	s->notes_dropped = atomic_load_explicit(&pyro.notes_dropped, memory_order_relaxed);
	s->names_dropped = names_dropped();
	s->records_unknown = atomic_load_explicit(&pyro.records_unknown, memory_order_relaxed);
	s->dump_dropped = chan_dump_dropped();
}

static void clock_put(void)
{
	if (pyro.state != PYRO_STATE_ON)
		return;
	struct pyro_clock c = {0};
	c.cupti = activity_timestamp();
	c.monotonic = pyro_monotonic_ns();
	struct pyro_clock *out = chan_put(PYRO_REC_CLOCK, sizeof(c));
	out->cupti = c.cupti;
	out->monotonic = c.monotonic;
}

static void send_status(int final)
{
	chan_lock();
	notes_drain();
	status_put(final);
	clock_put();
	chan_flush();
	chan_unlock();
}

// ---- the flusher thread and the end

static void *flusher(void *arg)
{
	(void)arg;
	for (uint64_t tick = 1;; tick++) {
		struct timespec d = {.tv_sec = 0, .tv_nsec = (long)FLUSH_NS};
		while (nanosleep(&d, &d) != 0)
			;
		if (__atomic_load_n(&exiting, __ATOMIC_ACQUIRE))
			return NULL;
		if (!pyro.flush_period && tick % 5 == 0)
			activity_flush(0);
		chan_lock();
		notes_drain();
		if (tick % STATUS_TICKS == 0) {
			status_put(0);
			clock_put();
		}
		if (tick % EPOCH_TICKS == 0)
			names_new_epoch();
		chan_flush();
		chan_unlock();
	}
}

// A forked child has one thread and the parent's locks in whatever state they were: it sends
// nothing (CUDA does not work across fork either).
static void after_fork_child(void)
{
	__atomic_store_n(&exiting, 2, __ATOMIC_RELEASE);
}

static void at_exit(void)
{
	if (__atomic_exchange_n(&exiting, 1, __ATOMIC_ACQ_REL) == 2)
		return;
	if (pyro.state == PYRO_STATE_ON)
		activity_flush(1);
	send_status(1);
}

static void start_flusher(void)
{
	// The thread takes no signal of the application's.
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_t t;
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	if (pthread_create(&t, &attr, flusher, NULL) == 0)
		pthread_setname_np(t, "pyrometer-gpu");
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
}

// ---- start

static uint8_t classify(const char *n)
{
	if (strncmp(n, "cudaGraphLaunch", 15) == 0 || strncmp(n, "cuGraphLaunch", 13) == 0)
		return PYRO_API_GRAPH;
	// Host functions run on the CPU, in stream order: no device time to attribute.
	if (strstr(n, "HostFunc") != NULL)
		return 0;
	if (strncmp(n, "cudaLaunch", 10) == 0 || strncmp(n, "cuLaunch", 8) == 0)
		return strstr(n, "Cooperative") != NULL ? PYRO_API_COOPERATIVE : PYRO_API_KERNEL;
	if (strncmp(n, "cudaMemcpy", 10) == 0 || strncmp(n, "cuMemcpy", 8) == 0)
		return PYRO_API_MEMCPY;
	if (strncmp(n, "cudaMemset", 10) == 0 || strncmp(n, "cuMemset", 8) == 0)
		return PYRO_API_MEMSET;
	return 0;
}

// Enables the callbacks of every launch, copy and set call this CUPTI names, of both APIs.
static void enable_launch_callbacks(void)
{
	static const struct {
		CUpti_CallbackDomain domain;
		uint8_t *kinds;
		uint32_t size;
	} domains[] = {
		{CUPTI_CB_DOMAIN_RUNTIME_API, runtime_kinds, CUPTI_RUNTIME_TRACE_CBID_SIZE},
		{CUPTI_CB_DOMAIN_DRIVER_API, driver_kinds, CUPTI_DRIVER_TRACE_CBID_SIZE},
	};
	for (size_t d = 0; d < 2; d++) {
		for (uint32_t cbid = 1; cbid < domains[d].size; cbid++) {
			const char *name = NULL;
			if (pyro.api.cuptiGetCallbackName(domains[d].domain, cbid, &name) !=
				    CUPTI_SUCCESS ||
			    name == NULL)
				continue;
			uint8_t kind = classify(name);
			if (kind == 0)
				continue;
			if (pyro.api.cuptiEnableCallback(1, pyro.sub, domains[d].domain, cbid) ==
			    CUPTI_SUCCESS)
				domains[d].kinds[cbid] = kind;
		}
	}
}

// cuptiSubscribe_v2 allowing other subscribers (CUPTI 13.2+ keeps them apart), else the
// single-subscriber cuptiSubscribe. Returns the result; the other tool's name when it holds
// CUPTI's only subscription.
static CUptiResult subscribe(char *other, size_t other_size)
{
	if (pyro.api.cuptiSubscribe_v2 != NULL) {
		CUpti_SubscriberParams p;
		memset(&p, 0, sizeof(p));
		p.structSize = CUpti_SubscriberParams_STRUCT_SIZE;
		p.subscriberName = "pyrometer";
		p.oldSubscriberName = other;
		p.oldSubscriberSize = other_size;
		p.allowMultipleSubscribers = 1;
		CUptiResult st = pyro.api.cuptiSubscribe_v2(&pyro.sub, on_api, NULL, &p);
		if (st == CUPTI_ERROR_INVALID_PARAMETER) {
			// A CUPTI from before allowMultipleSubscribers: the structure it knows.
			p.structSize = offsetof(CUpti_SubscriberParams, allowMultipleSubscribers);
			st = pyro.api.cuptiSubscribe_v2(&pyro.sub, on_api, NULL, &p);
			if (st == CUPTI_SUCCESS)
				pyro.mode = PYRO_MODE_SINGLE;
			return st;
		}
		if (st == CUPTI_SUCCESS)
			pyro.mode = cupti_has_v2(&pyro.api) && pyro.cupti_version >= 130200
					    ? PYRO_MODE_SHARED
					    : PYRO_MODE_SINGLE;
		return st;
	}
	CUptiResult st = pyro.api.cuptiSubscribe(&pyro.sub, on_api, NULL);
	if (st == CUPTI_SUCCESS)
		pyro.mode = PYRO_MODE_SINGLE;
	return st;
}

static void say_off(const char *why)
{
	fprintf(stderr, "pyrometer: GPU kernels of pid %d are not recorded: %s\n", (int)getpid(),
		why);
}

static void start_cupti(void)
{
	pyro_common_init();
	char why[640];
	int found = cupti_open(&pyro.api, getenv("PYROMETER_CUPTI_LIB"));
	if (found != 0) {
		pyro.state = found == -1 ? PYRO_STATE_NO_CUPTI : PYRO_STATE_CUPTI_ERROR;
		snprintf(why, sizeof(why), "%s%s",
			 found == -1 ? "no libcupti found (set PYROMETER_CUPTI_LIB to its path)"
				     : "this libcupti lacks an entry point the library needs: ",
			 found == -1 ? "" : pyro.api.path);
		say_off(why);
		send_status(0);
		return;
	}
	uint32_t version = 0;
	pyro.api.cuptiGetVersion(&version);
	pyro.cupti_version = version;
	char other[CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN + 1] = {0};
	CUptiResult st = subscribe(other, CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN);
	if (st == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
		pyro.state = PYRO_STATE_STEPPED_ASIDE;
		pyro.other = names_intern(other[0] != '\0' ? other : "another CUPTI client",
					  PYRO_STR_TOOL);
		snprintf(why, sizeof(why), "CUPTI is held by %s, which allows no other subscriber",
			 other[0] != '\0' ? other : "another tool");
		say_off(why);
		send_status(0);
		return;
	}
	if (st != CUPTI_SUCCESS) {
		pyro.state = PYRO_STATE_CUPTI_ERROR;
		pyro.error = st;
		snprintf(why, sizeof(why), "CUPTI refused to subscribe (error %d)", (int)st);
		say_off(why);
		send_status(0);
		return;
	}
	pyro.shared = pyro.mode == PYRO_MODE_SHARED;
	st = activity_start();
	if (st != CUPTI_SUCCESS) {
		pyro.api.cuptiUnsubscribe(pyro.sub);
		pyro.mode = PYRO_MODE_OFF;
		pyro.state = PYRO_STATE_CUPTI_ERROR;
		pyro.error = st;
		snprintf(why, sizeof(why), "CUPTI refused its activity records (error %d)", (int)st);
		say_off(why);
		send_status(0);
		return;
	}
	enable_launch_callbacks();
	pyro.state = PYRO_STATE_ON;
	send_status(0);
	start_flusher();
}

// Called by the CUDA driver at cuInit when CUDA_INJECTION64_PATH names this library. The
// result is not an error channel: whatever happens here, CUDA goes on.
PYRO_EXPORT int InitializeInjection(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	pthread_once(&once, start_cupti);
	static int registered;
	if (!__atomic_exchange_n(&registered, 1, __ATOMIC_ACQ_REL)) {
		pthread_atfork(NULL, NULL, after_fork_child);
		atexit(at_exit);
	}
	return 1;
}
