// SPDX-License-Identifier: Apache-2.0
// NVTX ranges, through NVTX's own injection hook: with NVTX_INJECTION64_PATH naming this
// library, the first NVTX call of the process (torch.cuda.nvtx.range_push, record_function with
// NVTX on, any nvtx3 user) loads it and calls InitializeInjectionNvtx2, which points the push
// and pop entries of NVTX's function table here. Each thread keeps the names of the ranges it
// has open (copies, bounded); a sampled launch reads them as its `nvtx` label. Start/end ranges
// (not nested, may cross threads) are not followed; wide-character names show as <unicode>.
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <string.h>

#include "common.h"

#define DEPTH 8     // ranges whose names are kept; deeper ones are counted only
#define NAME_LEN 64 // bytes of each name kept

struct ranges {
	int depth; // open ranges, including those past DEPTH
	char name[DEPTH][NAME_LEN];
};

static __thread struct ranges ranges;

static int push(const char *name)
{
	int level = ranges.depth++;
	if (level < DEPTH) {
		const char *n = name != NULL ? name : "";
		size_t len = strnlen(n, NAME_LEN - 1);
		memcpy(ranges.name[level], n, len);
		ranges.name[level][len] = '\0';
	}
	return level;
}

static int pop(void)
{
	if (ranges.depth <= 0)
		return -1;
	return --ranges.depth;
}

static const char *message(const nvtxEventAttributes_t *a)
{
	if (a == NULL || a->size < offsetof(nvtxEventAttributes_t, message) + sizeof(a->message))
		return "";
	switch (a->messageType) {
	case NVTX_MESSAGE_TYPE_ASCII:
		return a->message.ascii;
	case NVTX_MESSAGE_TYPE_UNICODE:
		return "<unicode>";
	case NVTX_MESSAGE_TYPE_REGISTERED:
		return "<registered>";
	default:
		return "";
	}
}

static int NVTX_API push_a(const char *message)
{
	return push(message);
}

static int NVTX_API push_w(const wchar_t *message)
{
	(void)message;
	return push("<unicode>");
}

static int NVTX_API push_ex(const nvtxEventAttributes_t *attr)
{
	return push(message(attr));
}

static int NVTX_API pop_core(void)
{
	return pop();
}

static int NVTX_API domain_push_ex(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attr)
{
	(void)domain;
	return push(message(attr));
}

static int NVTX_API domain_pop(nvtxDomainHandle_t domain)
{
	(void)domain;
	return pop();
}

size_t nvtx_ranges(char *buf, size_t size)
{
	size_t at = 0;
	int n = ranges.depth < DEPTH ? ranges.depth : DEPTH;
	if (size == 0)
		return 0;
	for (int i = 0; i < n; i++) {
		size_t len = strnlen(ranges.name[i], NAME_LEN);
		if (at + len + 2 > size)
			break;
		if (i > 0)
			buf[at++] = '/';
		memcpy(buf + at, ranges.name[i], len);
		at += len;
	}
	buf[at] = '\0';
	return at;
}

static void set(NvtxFunctionTable table, unsigned int size, unsigned int id, NvtxFunctionPointer fn)
{
	if (table != NULL && id < size && table[id] != NULL)
		*table[id] = fn;
}

PYRO_EXPORT int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table)
{
	pyro_common_init();
	if (get_export_table == NULL)
		return 0;
	const NvtxExportTableCallbacks *cb = get_export_table(NVTX_ETID_CALLBACKS);
	if (cb == NULL || cb->struct_size < sizeof(*cb) || cb->GetModuleFunctionTable == NULL)
		return 0;
	NvtxFunctionTable core = NULL, core2 = NULL;
	unsigned int core_size = 0, core2_size = 0;
	if (!cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &core, &core_size))
		return 0;
	set(core, core_size, NVTX_CBID_CORE_RangePushA, (NvtxFunctionPointer)push_a);
	set(core, core_size, NVTX_CBID_CORE_RangePushW, (NvtxFunctionPointer)push_w);
	set(core, core_size, NVTX_CBID_CORE_RangePushEx, (NvtxFunctionPointer)push_ex);
	set(core, core_size, NVTX_CBID_CORE_RangePop, (NvtxFunctionPointer)pop_core);
	if (cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &core2, &core2_size)) {
		set(core2, core2_size, NVTX_CBID_CORE2_DomainRangePushEx,
		    (NvtxFunctionPointer)domain_push_ex);
		set(core2, core2_size, NVTX_CBID_CORE2_DomainRangePop, (NvtxFunctionPointer)domain_pop);
	}
	return 1;
}
