// SPDX-License-Identifier: Apache-2.0
// The libcupti the library drives, and its entry points resolved by name: the process's own
// copy where one is loaded (PyTorch ships one), else one found by name.
#pragma once

#include <cupti.h>

#define PYRO_FN(name) __typeof__(name) *name

struct cupti_api {
	void *handle;
	char path[512];
	// Present in every CUPTI the library supports (CUDA 11 and later).
	PYRO_FN(cuptiGetVersion);
	PYRO_FN(cuptiSubscribe);
	PYRO_FN(cuptiUnsubscribe);
	PYRO_FN(cuptiEnableCallback);
	PYRO_FN(cuptiGetCallbackName);
	PYRO_FN(cuptiActivityEnable);
	PYRO_FN(cuptiActivityRegisterCallbacks);
	PYRO_FN(cuptiActivityGetNextRecord);
	PYRO_FN(cuptiActivityGetNumDroppedRecords);
	PYRO_FN(cuptiActivityFlushAll);
	PYRO_FN(cuptiGetTimestamp);
	// Newer, each used only where the copy has it.
	PYRO_FN(cuptiActivityRegisterTimestampCallback);
	PYRO_FN(cuptiActivityFlushPeriod);
	PYRO_FN(cuptiSubscribe_v2);
	// The subscriber-aware activity API (CUPTI 13.2+): used only when all of these are there.
	PYRO_FN(cuptiActivityEnable_v2);
	PYRO_FN(cuptiActivityRegisterCallbacks_v2);
	PYRO_FN(cuptiActivityGetNextRecord_v2);
	PYRO_FN(cuptiActivityGetNumDroppedRecords_v2);
	PYRO_FN(cuptiGetTimestamp_v2);
};

// Finds and opens libcupti: $PYROMETER_CUPTI_LIB, else a copy already loaded, else
// libcupti.so.13, .so.12, .so by the loader's search. 0 on success; -1 when none was found;
// -2 when one lacks a required entry point (its path is kept in api->path).
int cupti_open(struct cupti_api *api, const char *override);
// Whether the subscriber-aware activity API is all there.
int cupti_has_v2(const struct cupti_api *api);
