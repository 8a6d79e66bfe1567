// SPDX-License-Identifier: GPL-2.0
//
// asyncio task stacks (record --async), read with the Python frames they belong to. The
// running task of a thread is the value of `_asyncio._current_tasks` ({loop: task}, 3.11-3.13)
// whose coroutine's frame is on the thread's frame chain, or the thread state's running task
// (3.14+): a coroutine's _PyInterpreterFrame lies inside the coroutine object, at gi_iframe,
// and is linked into the chain while it runs.
// The walk of the frames stops after that frame; the task and the ones awaiting it are then
// written as slot pairs (shared.h, PY_TASK_MARK), and the walk goes on with the frames of the
// loop that runs them, so the tasks sit between the two, where they ran.
//
// 3.14+ keep who awaits a future in its `awaited_by`. Before, who awaits a task is read from
// its done callbacks, as asyncio links them:
// - a task awaiting a future adds its wakeup, a builtin method whose self is the task;
// - gather adds `_done_callback`, a closure over `outer`, the future the caller awaits;
// - a TaskGroup adds its bound `_on_task_done`, and the group keeps `_parent_task`.
// Every object is the target's and can change under the read: each step checks types, and
// the walk is bounded (PY_MAX_TASKS futures, PY_TASK_CALLBACKS callbacks each, PY_TASK_CELLS
// cells of a closure). A global function, so it is verified once, on its own.

#pragma once

#include "python.h"

// Callbacks of one future looked at (the first, then the list's), cells of one closure.
#define PY_TASK_CALLBACKS 4
#define PY_TASK_CELLS 8

static __always_inline __u64 py_type_of(struct py_process *p, __u64 obj)
{
	return obj ? read_user_u64(obj + p->off.object_type) : 0;
}

// Whether `obj` is an asyncio future: a Task, a Future, or of a class deriving from Future.
static __always_inline int py_is_future(struct py_process *p, __u64 obj)
{
	__u64 t = py_type_of(p, obj);
	if (!t)
		return 0;
	struct py_async *a = &p->aio;
	return t == a->task_type || t == a->future_type ||
		read_user_u64(t + a->type_base) == a->future_type;
}

// A TaskGroup's `_parent_task`, from its instance values; 0 when they moved to a dict.
static __always_inline __u64 py_taskgroup_parent(struct py_process *p, __u64 group)
{
	struct py_async *a = &p->aio;
	__u64 values = 0;
	if (a->tg_values_mode == PY_VALUES_POINTER) {
		values = read_user_u64(group - a->tg_values_at);
	} else if (a->tg_values_mode == PY_VALUES_TAGGED) {
		__u64 word = read_user_u64(group - a->tg_values_at);
		if (word & 1)
			values = word + 1;
	} else if (a->tg_values_mode == PY_VALUES_INLINE) {
		__u8 valid = 0;
		values = group + a->tg_values_at;
		if (bpf_probe_read_user(&valid, 1, (void *)(values + a->tg_valid_at)) || !valid)
			values = 0;
	}
	if (!values)
		return 0;
	__u64 parent = read_user_u64(values + a->tg_parent_at);
	return py_type_of(p, parent) == a->task_type ? parent : 0;
}

// The future a done callback `cb` leads to (the one that waits for its future), or 0. A
// global function: verified once, not once per callback of the loop that calls it.
__attribute__((noinline)) __u64 py_callback_owner(struct py_walk *w, __u64 cb)
{
	if (!w)
		return 0;
	__u32 tgid = w->tgid;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	if (!p)
		return 0;
	struct py_async *a = &p->aio;
	__u64 t = py_type_of(p, cb);
	if (!t)
		return 0;
	if (t == a->cfunction_type) {
		__u64 self = read_user_u64(cb + a->cfunction_self);
		return py_is_future(p, self) ? self : 0;
	}
	if (t == a->method_type) {
		__u64 self = read_user_u64(cb + a->method_self);
		if (a->taskgroup_type && py_type_of(p, self) == a->taskgroup_type)
			return py_taskgroup_parent(p, self);
		return 0;
	}
	if (t != a->function_type)
		return 0;
	__u64 closure = read_user_u64(cb + a->function_closure);
	if (!closure)
		return 0;
	__u64 n = read_user_u64(closure + a->var_size);
	for (__u32 j = 0; j < PY_TASK_CELLS; j++) {
		if (j >= n)
			break;
		__u64 cell = read_user_u64(closure + a->tuple_items + j * 8);
		__u64 obj = cell ? read_user_u64(cell + a->cell_ref) : 0;
		if (py_is_future(p, obj))
			return obj;
	}
	return 0;
}

// The future waiting for `fut`, through its done callbacks (3.11-3.13) or its `awaited_by`
// (3.14+), or 0.
static __always_inline __u64 py_awaiter(struct py_walk *w, struct py_process *p, __u64 fut)
{
	struct py_async *a = &p->aio;
	if (a->fut_awaited_by != PY_ABSENT) {
		// A set (several futures await this one) is not followed: the chain ends there.
		__u8 is_set = 1;
		if (bpf_probe_read_user(&is_set, 1, (void *)(fut + a->fut_awaited_by_is_set)) ||
		    is_set)
			return 0;
		__u64 by = read_user_u64(fut + a->fut_awaited_by);
		return py_is_future(p, by) ? by : 0;
	}
	__u64 cb = read_user_u64(fut + a->fut_callback0);
	__u64 list = read_user_u64(fut + a->fut_callbacks);
	__u64 n = list ? read_user_u64(list + a->var_size) : 0;
	__u64 items = list ? read_user_u64(list + a->list_items) : 0;
	for (__u32 k = 0; k < PY_TASK_CALLBACKS; k++) {
		if (k > 0) {
			if (k - 1 >= n || !items)
				break;
			// The list holds (callback, context) tuples.
			__u64 pair = read_user_u64(items + (k - 1) * 8);
			cb = pair ? read_user_u64(pair + a->tuple_items) : 0;
		}
		__u64 owner = cb ? py_callback_owner(w, cb) : 0;
		if (owner && owner != fut)
			return owner;
	}
	return 0;
}

// One step of a task chain: writes `w->fut`'s pair when it is a task, then moves to the
// future awaiting it. Returns 1 when the chain ends (or the slots do).
__attribute__((noinline)) int py_task(struct py_walk *w)
{
	if (!w)
		return 1;
	__u32 tgid = w->tgid;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	__u64 *slots = scratch_slots(w->which);
	__u64 fut = w->fut;
	if (!p || !slots || !fut)
		return 1;
	struct py_async *a = &p->aio;
	if (py_type_of(p, fut) == a->task_type) {
		__u32 index = w->used;
		__u32 at = w->base + 2 * index;
		if (index >= MAX_PY_FRAMES || at + 1 >= MAX_SLOTS)
			return 1;
		__u64 name = read_user_u64(fut + a->task_name);
		__u64 coro = read_user_u64(fut + a->task_coro);
		__u64 code = coro ? read_user_u64(coro + a->gen_iframe + p->off.frame_code) : 0;
		code &= PY_STACKREF_TAG_MASK & ~PY_TASK_MARK_MASK;
		__u32 i0 = at, i1 = at + 1;
		barrier_var(i0);
		barrier_var(i1);
		slots[i0 & (MAX_SLOTS - 1)] = name;
		slots[i1 & (MAX_SLOTS - 1)] = code | PY_TASK_MARK;
		w->used = index + 1;
	}
	w->fut = py_awaiter(w, p, fut);
	return w->fut == 0;
}

// Where the coroutine of `task` has its frame, 0 when `task` is no task or has no coroutine.
static __always_inline __u64 py_task_frame(struct py_process *p, __u64 task)
{
	struct py_async *a = &p->aio;
	if (!task || py_type_of(p, task) != a->task_type)
		return 0;
	__u64 coro = read_user_u64(task + a->task_coro);
	return coro ? coro + a->gen_iframe : 0;
}

// One scan of `_current_tasks`' entries (py_task_scan).
struct py_scan {
	__u64 entries;
	__u64 nentries;
	__u64 want;
	__u64 task; // with `want`: the task found
	__u32 found;
	__u32 tgid;
	__u32 which;
};

// One entry. A bpf_loop callback, verified once: unrolled, the entries' branches cost the
// verifier 16k instructions.
static long py_scan_step(__u32 i, struct py_scan *s)
{
	__u32 tgid = s->tgid, which = s->which;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	struct py_task_state *ts = bpf_map_lookup_elem(&py_task_states, &which);
	if (!p || !ts || i >= s->nentries || s->found >= PY_TASK_CANDIDATES)
		return 1;
	struct py_async *a = &p->aio;
	__u64 task = read_user_u64(s->entries + (__u64)i * a->entry_size + a->entry_value);
	__u64 frame = py_task_frame(p, task);
	if (!frame)
		return 0;
	if (s->want) {
		if (frame != s->want)
			return 0;
		s->task = task;
		return 1;
	}
	ts->frames[s->found & (PY_TASK_CANDIDATES - 1)] = frame;
	s->found++;
	return 0;
}

// Finds the running tasks: with `want` 0, puts the frame address of each one's coroutine in
// the walk's py_task_states entry (up to PY_TASK_CANDIDATES, the rest 0) and returns how
// many; else returns the task whose coroutine's frame is at `want` (0 when none is now).
// 3.11-3.13 scan `_current_tasks`; 3.14+ read the thread state's running task.
__attribute__((noinline)) __u64 py_task_scan(struct py_walk *w, __u64 want)
{
	if (!w)
		return 0;
	__u32 tgid = w->tgid, which = w->which;
	struct py_process *p = bpf_map_lookup_elem(&py_procs, &tgid);
	struct py_task_state *ts = bpf_map_lookup_elem(&py_task_states, &which);
	if (!p || !ts || !p->aio.task_type)
		return 0;
	struct py_async *a = &p->aio;
	if (!want) {
		for (__u32 k = 0; k < PY_TASK_CANDIDATES; k++)
			ts->frames[k] = 0;
	}
	if (a->tstate_running_task != PY_ABSENT) {
		__u64 task = read_user_u64(ts->tstate + a->tstate_running_task);
		__u64 frame = py_task_frame(p, task);
		if (!frame)
			return 0;
		if (want)
			return frame == want ? task : 0;
		ts->frames[0] = frame;
		return 1;
	}
	if (!a->current_tasks)
		return 0;
	__u64 keys = read_user_u64(a->current_tasks + a->dict_keys);
	if (!keys)
		return 0;
	__u8 log2_index_bytes = 0;
	if (bpf_probe_read_user(&log2_index_bytes, 1, (void *)(keys + a->keys_log2_index_bytes)) ||
	    log2_index_bytes > 32)
		return 0;
	struct py_scan s = {
		.entries = keys + a->keys_indices + (1ULL << log2_index_bytes),
		.nentries = read_user_u64(keys + a->keys_nentries),
		.want = want,
		.tgid = tgid,
		.which = which,
	};
	bpf_loop(PY_TASK_ENTRIES, py_scan_step, &s, 0);
	return want ? s.task : s.found;
}
