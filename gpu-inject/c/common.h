// SPDX-License-Identifier: Apache-2.0
// What the parts of libpyrometer_cupti.so share. Only InitializeInjection,
// InitializeInjectionNvtx2 and the two marker functions are exported.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "pyrometer_gpu.h"

#define PYRO_EXPORT __attribute__((visibility("default")))
// The functions pyrometer's uprobes attach to: exported (pyrometer finds them in .dynsym), bound
// inside the library (a library that defines the same name elsewhere cannot take the calls),
// never inlined or merged.
#define PYRO_MARKER __attribute__((noinline, noclone, used, visibility("protected")))

// ---- markers.c
PYRO_MARKER void pyrometer_gpu_launch(uint64_t correlation);
PYRO_MARKER void pyrometer_gpu_channel(const void *chunk, uint32_t len);

// ---- channel.c: the chunk being filled, behind one lock. Records are put only with the lock
// held, and nothing that can call back into the library (CUPTI) is called while it is held.
void chan_open_dump(const char *path);
void chan_lock(void);
void chan_unlock(void);
// Room for a record of `len` bytes (a multiple of 8, at most a chunk's room), zeroed, its
// header filled; sends the chunk first when the record does not fit.
void *chan_put(uint16_t type, uint16_t len);
// Sends the chunk being filled, if it holds any record.
void chan_flush(void);
uint64_t chan_dump_dropped(void);

// ---- names.c: ids for names, each sent in a STRING record before its first use.
// Ids 1 and 2 are fixed: the text of a name the table had no room for, and of an empty name.
#define PYRO_NAME_DROPPED 1
#define PYRO_NAME_EMPTY 2
// The id of `text` (at most PYRO_GPU_NAME_MAX bytes of it) of `kind`; thread-safe.
uint32_t names_intern(const char *text, uint16_t kind);
// A kernel name as CUPTI gives it: CUPTI keeps one string per kernel, so the pointer is
// remembered too (only from CUPTI's thread, with the channel lock held).
uint32_t names_kernel(const char *text);
// Puts a STRING record for `id` unless it was sent in this epoch (channel lock held).
void names_send(uint32_t id);
// Starts a new epoch: every name is sent again before its next use.
void names_new_epoch(void);
uint64_t names_dropped(void);

// ---- nvtx.c: the NVTX ranges the calling thread has open.
// Writes them, outermost first and '/'-joined, into buf; returns the length (0: none).
size_t nvtx_ranges(char *buf, size_t size);

// ---- inject.c
// Reads the environment and opens the dump once, for whichever of CUDA and NVTX loads the
// library first.
void pyro_common_init(void);
uint64_t pyro_monotonic_ns(void);
