// SPDX-License-Identifier: Apache-2.0
//
// The channel from libpyrometer_cupti.so to pyrometer: what the library says about a process's
// GPU work (activity records, sampled launches, names, counters), in chunks it hands to
// pyrometer_gpu_channel(chunk, len). A uprobe on that function copies each chunk into the
// kernel's ring buffer, where `record` and the agent read it
// (profiler/src/capture/gpu/channel.rs parses it; everything in it is treated as untrusted
// there). The same chunks can be appended to a file (PYROMETER_GPU_DUMP) for a look at what a
// process sent, or to keep a real run as test data.
//
// Layout: little-endian, every field at its natural alignment, every record a multiple of 8
// bytes, so a chunk is a plain sequence of the structs below. Version 1.
#pragma once

#include <stdint.h>

#define PYRO_GPU_MAGIC 0x55504750u // "PGPU" as bytes
#define PYRO_GPU_VERSION 1
// A chunk's largest size, header included: what the uprobe copies at most.
#define PYRO_GPU_CHUNK_MAX 4096
// The longest name a STRING record carries (longer ones are cut, flagged).
#define PYRO_GPU_NAME_MAX 2048

struct pyro_chunk_header {
	uint32_t magic;
	uint16_t version;
	uint16_t header_len; // sizeof(struct pyro_chunk_header)
	uint32_t seq;        // the process's chunk count before this one: a gap is lost chunks
	uint32_t len;        // bytes of the chunk, header included
};

// Every record starts with this; len counts the header and is a multiple of 8. Unknown types
// are skipped by their length.
struct pyro_record_header {
	uint16_t type;
	uint16_t len;
};

enum pyro_record_type {
	PYRO_REC_STATUS = 1,
	PYRO_REC_STRING = 2,
	PYRO_REC_DEVICE = 3,
	PYRO_REC_KERNEL = 4,
	PYRO_REC_MEMCPY = 5,
	PYRO_REC_MEMSET = 6,
	PYRO_REC_LAUNCH = 7,
	PYRO_REC_ALIAS = 8,
	PYRO_REC_CLOCK = 9,
};

// STATUS.mode: which CUPTI API the library drives.
enum pyro_mode {
	PYRO_MODE_OFF = 0,    // not subscribed (see state)
	PYRO_MODE_SINGLE = 1, // cuptiSubscribe: this library is CUPTI's only subscriber
	PYRO_MODE_SHARED = 2, // cuptiSubscribe_v2 with other subscribers allowed, _v2 activity API
};

// STATUS.state.
enum pyro_state {
	PYRO_STATE_STARTING = 0,
	PYRO_STATE_ON = 1,
	PYRO_STATE_STEPPED_ASIDE = 2, // another tool holds CUPTI's only subscription
	PYRO_STATE_NO_CUPTI = 3,      // no libcupti found
	PYRO_STATE_CUPTI_ERROR = 4,   // CUPTI refused to start (error in `error`)
};

// STATUS.flags
#define PYRO_STATUS_FINAL 1 // the process is exiting: its last status

// Where the library stands, and its counters since it started (cumulative: a reader takes
// differences). Sent at start, every few seconds, and at exit.
struct pyro_status {
	struct pyro_record_header h;
	uint16_t mode;
	uint16_t state;
	uint32_t lib_version;   // PYRO_GPU_VERSION
	uint32_t sample_every;  // N of 1-in-N: the weight of a sampled launch
	uint32_t cupti_version; // cuptiGetVersion, 0 when unknown
	uint32_t error;         // the CUptiResult that stopped it (PYRO_STATE_CUPTI_ERROR)
	uint32_t other;         // STRING id: the subscriber that holds CUPTI (stepped aside), or 0
	uint32_t flags;
	uint64_t launches;      // launch, copy and set calls seen (outermost API call of each)
	uint64_t sampled;       // ... of which sampled (a marker call each)
	uint64_t cupti_dropped; // records CUPTI dropped (cuptiActivityGetNumDroppedRecords)
	uint64_t buffers_refused; // CUPTI's requests for a buffer refused: all in use
	uint64_t notes_dropped;   // sampled launches whose LAUNCH record found the queue full
	uint64_t names_dropped;   // names not kept: the name table was full
	uint64_t records_unknown; // activity records of kinds the library does not translate
	uint64_t dump_dropped;    // chunks not written to the dump file (its size limit)
};

enum pyro_string_kind {
	PYRO_STR_KERNEL = 1, // a kernel's name as CUPTI gives it (mangled)
	PYRO_STR_NVTX = 2,   // the NVTX ranges open at a launch, outermost first, '/'-joined
	PYRO_STR_TOOL = 3,   // another CUPTI subscriber's name
};

// STRING.flags
#define PYRO_STRING_CUT 1 // the name was longer than PYRO_GPU_NAME_MAX

// An id's text, sent before the first record that uses the id and again now and then (a reader
// that started late learns it). bytes follow, then zero padding to a multiple of 8.
struct pyro_string {
	struct pyro_record_header h;
	uint32_t id; // > 0
	uint16_t kind;
	uint16_t flags;
	uint16_t bytes;
	uint16_t reserved;
	// char text[bytes];
};

// A device CUPTI reported: its CUDA ordinal in the process (which CUDA_VISIBLE_DEVICES
// renumbers) and its UUID (which it does not).
struct pyro_device {
	struct pyro_record_header h;
	uint32_t device; // CUPTI's deviceId
	uint8_t uuid[16];
	uint32_t reserved[2];
};

// KERNEL.launch_type (CUpti_ActivityLaunchType)
#define PYRO_LAUNCH_REGULAR 0
#define PYRO_LAUNCH_COOPERATIVE_SINGLE 1
#define PYRO_LAUNCH_COOPERATIVE_MULTI 2

// One kernel's execution. Times are CUPTI's (see CLOCK), in ns.
struct pyro_kernel {
	struct pyro_record_header h;
	uint32_t correlation; // the launching API call's correlation id (a graph launch's for its kernels)
	uint32_t device;
	uint32_t context;
	uint32_t stream;
	uint32_t name; // STRING id
	uint32_t graph; // CUDA graph id, 0 when not in a graph
	uint32_t launch_type;
	uint64_t start;
	uint64_t end;
	int32_t grid[3];
	int32_t block[3];
};

// MEMCPY.copy_kind follows CUpti_ActivityMemcpyKind: 1 HtoD, 2 DtoH, 3 HtoA, 4 AtoH, 5 AtoA,
// 6 AtoD, 7 DtoA, 8 DtoD, 9 HtoH, 10 PtoP.
struct pyro_memcpy {
	struct pyro_record_header h;
	uint32_t correlation;         // CUPTI's (the driver call's)
	uint32_t runtime_correlation; // the runtime call's, when it came through one (else 0)
	uint32_t device;
	uint32_t context;
	uint32_t stream;
	uint8_t copy_kind; // for MEMSET: 0
	uint8_t src_kind;  // CUpti_ActivityMemoryKind
	uint8_t dst_kind;
	uint8_t flags;     // CUpti_ActivityFlag's low byte (async)
	uint32_t graph;
	uint64_t bytes;
	uint64_t start;
	uint64_t end;
};

// LAUNCH.api
enum pyro_api {
	PYRO_API_KERNEL = 1,
	PYRO_API_COOPERATIVE = 2,
	PYRO_API_GRAPH = 3,
	PYRO_API_MEMCPY = 4,
	PYRO_API_MEMSET = 5,
};

// A sampled launch: the marker pyrometer_gpu_launch(correlation) was called on thread tid at
// time (CLOCK_MONOTONIC ns), so the kernel's probe took that thread's stack there.
struct pyro_launch {
	struct pyro_record_header h;
	uint32_t correlation;
	uint32_t tid;
	uint32_t weight; // launches this one stands for
	uint16_t api;    // pyro_api
	uint8_t domain;  // CUpti_CallbackDomain of the call (1 driver, 2 runtime)
	uint8_t reserved;
	uint32_t cbid;
	uint32_t nvtx; // STRING id of the open NVTX ranges, 0 when none
	uint32_t reserved2;
	uint64_t time;
};

// A call inside a sampled launch's call (a driver call the runtime made) had its own
// correlation id: records that carry `from` belong to the launch `to`.
struct pyro_alias {
	struct pyro_record_header h;
	uint32_t from;
	uint32_t to;
	uint32_t reserved;
};

// CUPTI's clock against CLOCK_MONOTONIC, read one after the other: activity times are CUPTI's,
// and another tool may have given CUPTI its own timestamp callback after the library did.
struct pyro_clock {
	struct pyro_record_header h;
	uint32_t reserved;
	uint64_t cupti; // cuptiGetTimestamp
	uint64_t monotonic;
};

#define PYRO_STATIC_SIZE(t, n) _Static_assert(sizeof(struct t) == (n), #t " is " #n " bytes")
PYRO_STATIC_SIZE(pyro_chunk_header, 16);
PYRO_STATIC_SIZE(pyro_status, 96);
PYRO_STATIC_SIZE(pyro_string, 16);
PYRO_STATIC_SIZE(pyro_device, 32);
PYRO_STATIC_SIZE(pyro_kernel, 72);
PYRO_STATIC_SIZE(pyro_memcpy, 56);
PYRO_STATIC_SIZE(pyro_launch, 40);
PYRO_STATIC_SIZE(pyro_alias, 16);
PYRO_STATIC_SIZE(pyro_clock, 24);
