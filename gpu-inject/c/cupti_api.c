// SPDX-License-Identifier: Apache-2.0
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

#include "cupti_api.h"

struct found {
	char path[512];
};

// A loaded object whose file name starts with libcupti.so: the process's own CUPTI.
static int find_loaded(struct dl_phdr_info *info, size_t size, void *data)
{
	(void)size;
	struct found *f = data;
	const char *name = info->dlpi_name;
	if (name == NULL || *name == '\0')
		return 0;
	const char *base = strrchr(name, '/');
	base = base != NULL ? base + 1 : name;
	if (strncmp(base, "libcupti.so", 11) != 0)
		return 0;
	size_t n = strnlen(name, sizeof(f->path) - 1);
	memcpy(f->path, name, n);
	f->path[n] = '\0';
	return 1;
}

static void *open_cupti(struct cupti_api *api, const char *override)
{
	void *h;
	if (override != NULL && *override != '\0') {
		h = dlopen(override, RTLD_NOW | RTLD_LOCAL);
		if (h != NULL)
			snprintf(api->path, sizeof(api->path), "%s", override);
		return h;
	}
	struct found f = {{0}};
	if (dl_iterate_phdr(find_loaded, &f) != 0) {
		h = dlopen(f.path, RTLD_NOW | RTLD_NOLOAD);
		if (h != NULL) {
			memcpy(api->path, f.path, sizeof(api->path));
			return h;
		}
	}
	static const char *names[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so"};
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
		if (h != NULL) {
			snprintf(api->path, sizeof(api->path), "%s", names[i]);
			return h;
		}
	}
	return NULL;
}

#define RESOLVE(name) (api->name = (__typeof__(api->name))dlsym(api->handle, #name))

int cupti_open(struct cupti_api *api, const char *override)
{
	api->handle = open_cupti(api, override);
	if (api->handle == NULL)
		return -1;
	int ok = RESOLVE(cuptiGetVersion) && RESOLVE(cuptiSubscribe) && RESOLVE(cuptiUnsubscribe) &&
		 RESOLVE(cuptiEnableCallback) && RESOLVE(cuptiGetCallbackName) &&
		 RESOLVE(cuptiActivityEnable) && RESOLVE(cuptiActivityRegisterCallbacks) &&
		 RESOLVE(cuptiActivityGetNextRecord) && RESOLVE(cuptiActivityGetNumDroppedRecords) &&
		 RESOLVE(cuptiActivityFlushAll) && RESOLVE(cuptiGetTimestamp);
	RESOLVE(cuptiActivityRegisterTimestampCallback);
	RESOLVE(cuptiActivityFlushPeriod);
	RESOLVE(cuptiSubscribe_v2);
	RESOLVE(cuptiActivityEnable_v2);
	RESOLVE(cuptiActivityRegisterCallbacks_v2);
	RESOLVE(cuptiActivityGetNextRecord_v2);
	RESOLVE(cuptiActivityGetNumDroppedRecords_v2);
	RESOLVE(cuptiGetTimestamp_v2);
	return ok ? 0 : -2;
}

int cupti_has_v2(const struct cupti_api *api)
{
	return api->cuptiSubscribe_v2 != NULL && api->cuptiActivityEnable_v2 != NULL &&
	       api->cuptiActivityRegisterCallbacks_v2 != NULL &&
	       api->cuptiActivityGetNextRecord_v2 != NULL &&
	       api->cuptiActivityGetNumDroppedRecords_v2 != NULL && api->cuptiGetTimestamp_v2 != NULL;
}
