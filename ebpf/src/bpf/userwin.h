// SPDX-License-Identifier: GPL-2.0
//
// A per-CPU copy of the sampled thread's memory, a page or two at a time, for walks that
// read many words close together: return addresses and saved registers up the native stack,
// and CPython 3.11+ frames, which lie next to one another in the interpreter's data stack.
// A bpf_probe_read_user costs ~35 ns however little it copies (the call, the user-access
// checks and the STAC/CLAC pair, measured with bpf_ktime_get_ns around the calls in a 2-vCPU
// VM), so a walk that copies the rest of the page holding the next word once and takes the
// following words from the copy pays one call per page of stack instead of one or two per
// frame. The copy itself is not free, so a refill leaves out the part of the page the walk
// has already gone past.
//
// A window only ever covers the pages holding an address the walk asked for, so its read
// cannot fault on a neighbouring unmapped page (the top of the main thread's stack, a heap
// chunk's end): a page holding a readable byte is mapped as a whole. When even that read
// fails (a page swapped out) the caller reads the word directly, as before.

#pragma once

#include "common.h"

// A window is (part of) the one or two aligned chunks holding an object of up to
// PY_FRAME_READ_MAX bytes. A chunk divides a page, so a window never reaches past the pages
// of the object. Chunks of 512 B, 1, 2 and 4 KiB measured alike within the noise of a loaded
// 2-vCPU VM through small frames; a page serves the most frames per call.
#define USER_WIN_CHUNK 4096
#define USER_WIN_BYTES (2 * USER_WIN_CHUNK)
#define USER_WIN_MASK ((__u64)USER_WIN_CHUNK - 1)

// The copy, one per CPU and scratch kind (the programs that may interrupt one another each
// have their own, like the scratch records). The native walk and the Python walk of one
// sample use it one after the other. The slack past USER_WIN_BYTES keeps reads at a masked
// offset plus a frame field's offset inside the value for the verifier.
struct user_win_buf {
	__u8 bytes[USER_WIN_BYTES + PY_FRAME_READ_MAX];
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SCRATCH_KINDS);
	__type(key, __u32);
	__type(value, struct user_win_buf);
} user_wins SEC(".maps");

// Which addresses the copy holds: [base, base + len). Lives in the walk's own state, so a new
// walk starts empty (len == 0) and never trusts another sample's copy.
struct user_win {
	__u64 base;
	__u32 len;
	__u16 which; // SCRATCH_*: whose copy
	// The way the walk goes: 1 up the stack (the native walks: a caller's frame lies above
	// its callee's), 0 down (CPython's frames: a caller's lies below, in the data stack).
	__u16 up;
};

// What a refill copies besides the page part the walk goes into: up to this much behind the
// word asked for (a frame's saved registers lie below its return address), whole lines.
#define USER_WIN_BEHIND 128
#define USER_WIN_LINE 64

// A pointer to the `size` bytes at user address `addr` (size <= PY_FRAME_READ_MAX) in the
// copy `b` (the window's buffer, looked up by the caller); the pages holding them are copied
// first when the window does not hold them all. NULL when they cannot be read that way.
// Inlined only into global functions: its branches would multiply the states of a bpf_loop
// callback.
static __always_inline __u8 *user_win_at_buf(struct user_win *w, struct user_win_buf *b, __u64 addr,
					     __u32 size)
{
	if (size == 0 || size > PY_FRAME_READ_MAX)
		return 0;
	// Written so nothing wraps: a garbage address near 2^64 must miss, not hit an empty window.
	__u64 off = addr - w->base;
	if (addr < w->base || off >= w->len || size > w->len - off) {
		// The chunks holding the object, less the part the walk has left behind: copying
		// from just behind the word to the page's end, not the whole page, took the
		// bench's 86 distinct functions (frames of 16-144 bytes, ~8 KB of stack) from
		// 7.7 to 6.7 and from 6.8 to 6.4 us a sample in two side-by-side runs; the
		// recursion (~3 KB, one page) moved within the noise.
		__u64 base = addr & ~USER_WIN_MASK;
		__u64 end = ((addr + size - 1) | USER_WIN_MASK) + 1;
		if (w->up) {
			if ((addr & USER_WIN_MASK) > USER_WIN_BEHIND)
				base = (addr - USER_WIN_BEHIND) & ~(__u64)(USER_WIN_LINE - 1);
		} else {
			end = (addr + size + USER_WIN_LINE - 1) & ~(__u64)(USER_WIN_LINE - 1);
		}
		__u64 len = end - base;
		barrier_var(len);
		if (len > USER_WIN_BYTES) {
			w->len = 0;
			return 0;
		}
		if (bpf_probe_read_user(b->bytes, len, (void *)base)) {
			w->len = 0;
			return 0;
		}
		w->base = base;
		w->len = len;
		off = addr - base;
	}
	// off + size <= len <= USER_WIN_BYTES; the mask only restates that for the verifier.
	barrier_var(off);
	return b->bytes + (off & (USER_WIN_BYTES - 1));
}

static __always_inline struct user_win_buf *user_win_buf(struct user_win *w)
{
	__u32 which = w->which;
	return bpf_map_lookup_elem(&user_wins, &which);
}

// The u64 at user address `addr`, from the window's copy `b` when it can, else read
// directly. Returns 0 on success, like bpf_probe_read_user. For walks that take many words
// in one global function: the buffer is looked up once, and nothing is called while the
// window holds the word (a call and its return cost ~7 ns on an AMD host with retpolines
// and Safe RET, measured: more than the rest of a word's read).
static __always_inline int user_win_u64_buf(struct user_win *w, struct user_win_buf *b, __u64 addr,
					    __u64 *out)
{
	__u8 *p = user_win_at_buf(w, b, addr, 8);
	if (p) {
		*out = *(__u64 *)p;
		return 0;
	}
	return bpf_probe_read_user(out, 8, (void *)addr);
}

// The u64 at user address `addr`, from the window when it can, else read directly. Returns
// 0 on success, like bpf_probe_read_user. Global: verified once on its own, so a walk's
// callback sees one call, not the window's branches at each of its reads.
__attribute__((noinline)) int user_win_u64(struct user_win *w, __u64 addr, __u64 *out)
{
	if (!w || !out)
		return -1;
	struct user_win_buf *b = user_win_buf(w);
	if (!b)
		return bpf_probe_read_user(out, 8, (void *)addr);
	return user_win_u64_buf(w, b, addr, out);
}
