/* The span processor's hot path in C: on_start/on_end of an SDK span write the thread's slot
 * of the span table (layout in table.py) without running Python bytecode. processor.py
 * installs a Writer's bound methods as the processor's own on_start/on_end, so the SDK calls
 * straight into C, and keeps its pure-Python path as the fallback.
 *
 * Every call runs with the GIL held (the module refuses free-threaded builds), which guards
 * the Writer's thread states: a thread's own state is found through a C thread-local cache;
 * another thread's (a span ended on another thread than it started on) through the Writer's
 * list. The slot bytes the kernel reads are written exactly as the pure-Python path writes
 * them: the spare body first, then the sequence number with a release store. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef Py_GIL_DISABLED
#define FASTSLOT_UNSUPPORTED "a free-threaded build: its GIL-less calls would race on a thread's state"
#endif

/* Matches table.py. */
#define HEADER_SIZE 64
#define SLOT_SIZE 128
#define SEQ_OFFSET 0
#define TID_OFFSET 8
#define BODY_OFFSET 16
#define BODY_SIZE 40
#define NAME_LEN 16
/* A thread that starts spans and never ends them keeps at most this many; the next ones are
 * still published but not restored when a child ends. */
#define MAX_DEPTH 4096

struct entry {
	uint64_t sid;
	unsigned char body[BODY_SIZE];
};

struct tstate {
	struct tstate *next, *prev;
	uint64_t serial; /* the owning thread's, see tl_serial */
	pid_t tid;
	long offset; /* byte offset of the slot in the table; -1: another live thread holds it */
	uint64_t seq;
	size_t depth, cap;
	struct entry *stack;
};

typedef struct {
	PyObject_HEAD
	Py_buffer view; /* the table, held so it stays mapped */
	unsigned char *base;
	uint32_t mask;
	uint64_t id;
	unsigned fork_gen;
	struct tstate *states;
	size_t count, swept_at;
} Writer;

static uint64_t next_writer_id = 1;
static uint64_t next_serial = 1;
/* Bumped in a forked child: the threads the Writers knew are the parent's. */
static volatile unsigned fork_gen;

/* This thread's last-used state (a new thread starts zeroed: no Writer has id 0). */
static __thread struct {
	uint64_t writer_id;
	struct tstate *st;
	unsigned fork_gen;
	pid_t tid;
	uint64_t serial;
} tl;

static PyObject *str_context, *str_name, *str_trace_id, *str_span_id;

static void after_fork_child(void)
{
	fork_gen++;
}

static pid_t own_tid(void)
{
	if (tl.tid == 0 || tl.fork_gen != fork_gen) {
		tl.tid = (pid_t)syscall(SYS_gettid);
		tl.fork_gen = fork_gen;
		tl.writer_id = 0;
	}
	return tl.tid;
}

static void free_state(Writer *w, struct tstate *st)
{
	if (st->prev)
		st->prev->next = st->next;
	else
		w->states = st->next;
	if (st->next)
		st->next->prev = st->prev;
	w->count--;
	if (tl.st == st)
		tl.writer_id = 0;
	free(st->stack);
	free(st);
}

static int thread_alive(pid_t tid)
{
	char path[32];
	snprintf(path, sizeof(path), "/proc/%d", (int)tid);
	return access(path, F_OK) == 0;
}

/* States of exited threads are freed when the list has doubled since the last sweep, so a
 * process whose threads come and go keeps a bounded list. A thread is asked for by its id in
 * this process's own pid namespace (what gettid gave it), never by a /proc that may be
 * another namespace's: a live thread's state is never freed. */
static void sweep(Writer *w)
{
	if (w->count < 2 * w->swept_at + 64)
		return;
	pid_t pid = getpid();
	struct tstate *st = w->states;
	while (st) {
		struct tstate *next = st->next;
		if (syscall(SYS_tgkill, pid, st->tid, 0) < 0 && errno == ESRCH)
			free_state(w, st);
		st = next;
	}
	w->swept_at = w->count;
}

static void store_seq(unsigned char *slot, uint64_t seq)
{
	__atomic_store_n((uint64_t *)(slot + SEQ_OFFSET), seq, __ATOMIC_RELEASE);
}

/* Claims thread tid's slot as table.py's SpanTable.claim does: not when another live thread
 * holds it (of this process or, after a fork, of a relative sharing the table: hence /proc,
 * as there); a new owner clears what a dead one left. */
static long claim(Writer *w, pid_t tid)
{
	long off = HEADER_SIZE + (long)((uint32_t)tid & w->mask) * SLOT_SIZE;
	unsigned char *slot = w->base + off;
	uint32_t owner;
	memcpy(&owner, slot + TID_OFFSET, sizeof(owner));
	if (owner != 0 && owner != (uint32_t)tid && thread_alive((pid_t)owner))
		return -1;
	memset(slot + BODY_OFFSET, 0, 2 * BODY_SIZE);
	uint32_t t = (uint32_t)tid;
	memcpy(slot + TID_OFFSET, &t, sizeof(t));
	return off;
}

/* This thread's state in w, made (and its slot claimed) when create is set. */
static struct tstate *state(Writer *w, int create)
{
	pid_t tid = own_tid();
	if (tl.writer_id == w->id)
		return tl.st;
	if (w->fork_gen != fork_gen) {
		while (w->states)
			free_state(w, w->states);
		w->fork_gen = fork_gen;
	}
	if (tl.serial == 0)
		tl.serial = next_serial++;
	struct tstate *st;
	for (st = w->states; st; st = st->next)
		if (st->serial == tl.serial)
			break;
	if (!st) {
		if (!create)
			return NULL;
		sweep(w);
		st = calloc(1, sizeof(*st));
		if (!st) {
			PyErr_NoMemory();
			return NULL;
		}
		st->serial = tl.serial;
		st->tid = tid;
		st->offset = claim(w, tid);
		/* An exited thread's state that held this slot (its id now reused, so not swept
		 * yet) must not write it again, e.g. when one of its spans ends elsewhere. */
		if (st->offset >= 0)
			for (struct tstate *o = w->states; o; o = o->next)
				if (o->offset == st->offset)
					o->offset = -1;
		st->next = w->states;
		if (w->states)
			w->states->prev = st;
		w->states = st;
		w->count++;
	}
	tl.writer_id = w->id;
	tl.st = st;
	return st;
}

static void publish(Writer *w, struct tstate *st, const unsigned char *body)
{
	if (st->offset < 0)
		return;
	unsigned char *slot = w->base + st->offset;
	uint64_t seq = st->seq + 1;
	memcpy(slot + BODY_OFFSET + (seq & 1) * BODY_SIZE, body, BODY_SIZE);
	st->seq = seq;
	store_seq(slot, seq);
}

/* An int id into `len` big-endian bytes; -1 with an exception when it does not fit. */
static int id_bytes(PyObject *v, unsigned char *out, size_t len)
{
	if (!PyLong_Check(v)) {
		PyErr_Format(PyExc_TypeError, "span ids are ints, not %.80s", Py_TYPE(v)->tp_name);
		return -1;
	}
#if PY_VERSION_HEX >= 0x030D0000
	Py_ssize_t need = PyLong_AsNativeBytes(
		v, out, (Py_ssize_t)len,
		Py_ASNATIVEBYTES_BIG_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
			Py_ASNATIVEBYTES_REJECT_NEGATIVE);
	if (need < 0)
		return -1;
	if ((size_t)need > len) {
		PyErr_SetString(PyExc_OverflowError, "span id too large");
		return -1;
	}
	return 0;
#else
	return _PyLong_AsByteArray((PyLongObject *)v, out, len, 0, 0);
#endif
}

/* The span's SpanContext: the SDK span's own attribute, else the public property. */
static PyObject *span_context(PyObject *span)
{
	PyObject *ctx = PyObject_GetAttr(span, str_context);
	if (ctx)
		return ctx;
	if (!PyErr_ExceptionMatches(PyExc_AttributeError))
		return NULL;
	PyErr_Clear();
	return PyObject_CallMethod(span, "get_span_context", NULL);
}

/* SpanContext is a tuple (trace id, span id, ...); anything else is asked by name. */
static int context_ids(PyObject *ctx, unsigned char *trace16, unsigned char *span8)
{
	if (PyTuple_Check(ctx) && PyTuple_GET_SIZE(ctx) >= 2) {
		if (trace16 && id_bytes(PyTuple_GET_ITEM(ctx, 0), trace16, 16) < 0)
			return -1;
		return id_bytes(PyTuple_GET_ITEM(ctx, 1), span8, 8);
	}
	if (trace16) {
		PyObject *t = PyObject_GetAttr(ctx, str_trace_id);
		if (!t)
			return -1;
		int r = id_bytes(t, trace16, 16);
		Py_DECREF(t);
		if (r < 0)
			return -1;
	}
	PyObject *s = PyObject_GetAttr(ctx, str_span_id);
	if (!s)
		return -1;
	int r = id_bytes(s, span8, 8);
	Py_DECREF(s);
	return r;
}

/* The name's UTF-8 bytes, truncated to NAME_LEN (as str.encode("utf-8", "replace")). */
static int name_bytes(PyObject *span, unsigned char *out)
{
	PyObject *name = PyObject_GetAttr(span, str_name);
	if (!name) {
		if (!PyErr_ExceptionMatches(PyExc_AttributeError))
			return -1;
		PyErr_Clear();
		name = PyObject_GetAttrString(span, "name");
		if (!name)
			return -1;
	}
	int r = 0;
	if (!PyUnicode_Check(name)) {
		PyErr_Format(PyExc_TypeError, "span names are str, not %.80s", Py_TYPE(name)->tp_name);
		r = -1;
	} else {
		Py_ssize_t n;
		const char *s = PyUnicode_AsUTF8AndSize(name, &n);
		PyObject *encoded = NULL;
		if (!s) {
			/* Lone surrogates: replaced, as the pure path does. */
			PyErr_Clear();
			encoded = PyUnicode_AsEncodedString(name, "utf-8", "replace");
			if (!encoded)
				r = -1;
			else
				PyBytes_AsStringAndSize(encoded, (char **)&s, &n);
		}
		if (r == 0)
			memcpy(out, s, n < NAME_LEN ? (size_t)n : NAME_LEN);
		Py_XDECREF(encoded);
	}
	Py_DECREF(name);
	return r;
}

static uint64_t be64(const unsigned char *b)
{
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v = (v << 8) | b[i];
	return v;
}

static PyObject *Writer_on_start(Writer *w, PyObject *const *args, Py_ssize_t nargs,
				 PyObject *kwnames)
{
	/* on_start(span, parent_context=None): the parent is not needed. */
	Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
	if (nargs < 1 || nargs + nkw > 2) {
		PyErr_SetString(PyExc_TypeError, "on_start(span, parent_context=None)");
		return NULL;
	}
	PyObject *span = args[0];
	struct entry e;
	memset(&e, 0, sizeof(e));
	PyObject *ctx = span_context(span);
	if (!ctx)
		return NULL;
	int r = context_ids(ctx, e.body, e.body + 16);
	Py_DECREF(ctx);
	if (r < 0 || name_bytes(span, e.body + 24) < 0)
		return NULL;
	e.sid = be64(e.body + 16);
	struct tstate *st = state(w, 1);
	if (!st)
		return NULL;
	if (st->depth < MAX_DEPTH) {
		if (st->depth == st->cap) {
			size_t cap = st->cap ? 2 * st->cap : 8;
			struct entry *grown = realloc(st->stack, cap * sizeof(*grown));
			if (!grown)
				return PyErr_NoMemory();
			st->stack = grown;
			st->cap = cap;
		}
		st->stack[st->depth++] = e;
	}
	publish(w, st, e.body);
	Py_RETURN_NONE;
}

static const unsigned char empty_body[BODY_SIZE];

/* Takes span sid out of whichever thread's stack holds it; that thread's state, or NULL. */
static struct tstate *owner(Writer *w, uint64_t sid)
{
	for (struct tstate *st = w->states; st; st = st->next)
		for (size_t i = st->depth; i-- > 0;)
			if (st->stack[i].sid == sid) {
				memmove(&st->stack[i], &st->stack[i + 1],
					(st->depth - i - 1) * sizeof(struct entry));
				st->depth--;
				return st;
			}
	return NULL;
}

static PyObject *Writer_on_end(Writer *w, PyObject *span)
{
	unsigned char sid8[8];
	PyObject *ctx = span_context(span);
	if (!ctx)
		return NULL;
	int r = context_ids(ctx, NULL, sid8);
	Py_DECREF(ctx);
	if (r < 0)
		return NULL;
	uint64_t sid = be64(sid8);
	struct tstate *st = state(w, 0);
	if (st && st->depth && st->stack[st->depth - 1].sid == sid) {
		st->depth--;
	} else {
		/* Ended out of order, or on another thread than the one it started on. */
		st = owner(w, sid);
		if (!st)
			Py_RETURN_NONE;
	}
	publish(w, st, st->depth ? st->stack[st->depth - 1].body : empty_body);
	Py_RETURN_NONE;
}

static int Writer_init(Writer *w, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = {"buffer", "slots", NULL};
	PyObject *buffer;
	unsigned long slots;
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ok", kwlist, &buffer, &slots))
		return -1;
	if (slots == 0 || (slots & (slots - 1)) || slots > (1UL << 20)) {
		PyErr_Format(PyExc_ValueError, "slots must be a power of two up to 2**20, not %lu", slots);
		return -1;
	}
	if (w->base) {
		PyErr_SetString(PyExc_RuntimeError, "a Writer is initialised once");
		return -1;
	}
	if (PyObject_GetBuffer(buffer, &w->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
		return -1;
	if ((size_t)w->view.len < HEADER_SIZE + slots * SLOT_SIZE) {
		PyErr_Format(PyExc_ValueError, "a table of %lu slots needs %lu bytes, not %zd", slots,
			     (unsigned long)(HEADER_SIZE + slots * SLOT_SIZE), w->view.len);
		PyBuffer_Release(&w->view);
		return -1;
	}
	w->base = w->view.buf;
	w->mask = (uint32_t)(slots - 1);
	w->id = next_writer_id++;
	w->fork_gen = fork_gen;
	return 0;
}

static void Writer_dealloc(Writer *w)
{
	while (w->states)
		free_state(w, w->states);
	if (w->base)
		PyBuffer_Release(&w->view);
	Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef Writer_methods[] = {
	{"on_start", (PyCFunction)(void (*)(void))Writer_on_start, METH_FASTCALL | METH_KEYWORDS,
	 "Publishes span as this thread's innermost."},
	{"on_end", (PyCFunction)Writer_on_end, METH_O,
	 "Takes span off its thread's stack and publishes the span under it (or none)."},
	{NULL},
};

static PyTypeObject WriterType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pyrometer_otel._fastslot.Writer",
	.tp_basicsize = sizeof(Writer),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "Writer(buffer, slots): writes span slots of the table in buffer.",
	.tp_new = PyType_GenericNew,
	.tp_init = (initproc)Writer_init,
	.tp_dealloc = (destructor)Writer_dealloc,
	.tp_methods = Writer_methods,
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "pyrometer_otel._fastslot",
	.m_doc = "The span processor's slot writes in C (see processor.py).",
	.m_size = -1,
};

PyMODINIT_FUNC PyInit__fastslot(void)
{
#ifdef FASTSLOT_UNSUPPORTED
	PyErr_SetString(PyExc_ImportError, FASTSLOT_UNSUPPORTED);
	return NULL;
#endif
	static int forks_hooked;
	if (!forks_hooked) {
		int err = pthread_atfork(NULL, NULL, after_fork_child);
		if (err) {
			errno = err;
			return PyErr_SetFromErrno(PyExc_ImportError);
		}
		forks_hooked = 1;
	}
	str_context = PyUnicode_InternFromString("_context");
	str_name = PyUnicode_InternFromString("_name");
	str_trace_id = PyUnicode_InternFromString("trace_id");
	str_span_id = PyUnicode_InternFromString("span_id");
	if (!str_context || !str_name || !str_trace_id || !str_span_id)
		return NULL;
	if (PyType_Ready(&WriterType) < 0)
		return NULL;
	PyObject *m = PyModule_Create(&module);
	if (!m)
		return NULL;
	Py_INCREF(&WriterType);
	if (PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
		Py_DECREF(&WriterType);
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
