"""The span processor: keeps, per thread, the stack of spans started there and publishes the
innermost one in the thread's slot of the span table.

Its cost is paid on every span start and end. The C extension ``_fastslot`` does it without
running bytecode: the processor's ``on_start``/``on_end`` are then a C writer's methods, which
the SDK calls directly. Where the extension was not built (or ``PYROMETER_OTEL_PURE=1`` is
set) the pure-Python path below writes the same bytes: the thread's slot is claimed once; a
span's 40-byte body is packed once, at its start, and kept on the thread's stack; a publish
writes that body into the slot's spare half and then the sequence number that makes it
current (two ``pack_into`` calls). ``FAST`` says which one new processors use.
"""

import importlib
import logging
import os
import threading
import weakref

from opentelemetry.sdk.trace import SpanProcessor as _SdkSpanProcessor

from . import table as _t

_seq_pack = _t.SEQ.pack_into
_body_pack = _t.BODY.pack
_EMPTY_BODY = _t.EMPTY_BODY
_BODY_OFFSET = _t.BODY_OFFSET
_BODY_SIZE = _t.BODY.size
_MASK64 = (1 << 64) - 1
# Encoded names, by name (span names come from a small set in practice), up to this many.
_MAX_NAMES = 4096

_lock = threading.Lock()
_table = None

_log = logging.getLogger("pyrometer_otel")


def _load_fast():
    if os.environ.get("PYROMETER_OTEL_PURE", "") not in ("", "0"):
        return None, "PYROMETER_OTEL_PURE is set"
    name = __package__ + "._fastslot"
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None, (
            "the C extension was not built (pip needs a C compiler and the interpreter's "
            "headers, e.g. Debian's gcc and python3-dev, when it installs the package)"
        )
    except ImportError as e:
        return None, f"the C extension does not load: {e}"


_fastslot, _pure_reason = _load_fast()
# True when new processors write their slots in C (the default when the extension was built).
FAST = _fastslot is not None
if FAST:
    _log.info("pyrometer_otel: span slots written by the C fast path")
else:
    _log.info("pyrometer_otel: span slots written in pure Python: %s", _pure_reason)


def shared_table():
    """The process's span table, made on first use (one per process, shared by processors)."""
    global _table
    with _lock:
        if _table is None:
            _table = _t.SpanTable()
        return _table


class _ThreadState:
    __slots__ = ("offset", "seq", "stack", "__weakref__")

    def __init__(self, offset):
        # None: the slot belongs to another thread; this one publishes nothing.
        self.offset = offset
        self.seq = 0
        # (span id, packed body), innermost last.
        self.stack = []


class SpanProcessor(_SdkSpanProcessor):
    """An OpenTelemetry SDK ``SpanProcessor`` that publishes each thread's innermost active
    span (trace id, span id, name) for the pyrometer profiler. Add it to a TracerProvider
    beside any exporting processor; it exports nothing itself."""

    def __init__(self, table=None, fast=None):
        """``fast``: write slots in C (True; ImportError without the extension) or in
        Python (False); default ``FAST``."""
        self._table = table or shared_table()
        self._buffer = self._table.buffer
        if fast is None:
            fast = FAST
        elif fast and not FAST:
            raise ImportError(f"pyrometer_otel: no C fast path: {_pure_reason}")
        self.fast = fast
        if fast:
            # The writer's bound methods shadow the Python ones below: the SDK calls C.
            writer = _fastslot.Writer(self._buffer, self._table.slots)
            self.on_start = writer.on_start
            self.on_end = writer.on_end
            return
        self._local = threading.local()
        self._threads = weakref.WeakSet()
        self._names = {}
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self):
        # The child keeps the mapping (shared with its parent, which is fine: slots are per
        # thread id, unique in the pid namespace) but not the parent's threads.
        self._local = threading.local()
        self._threads = weakref.WeakSet()

    def _state(self):
        with _lock:
            st = _ThreadState(self._table.claim(threading.get_native_id()))
        self._local.state = st
        self._threads.add(st)
        return st

    def _publish(self, st, body):
        off = st.offset
        if off is None:
            return
        seq = st.seq + 1
        at = off + _BODY_OFFSET + (seq & 1) * _BODY_SIZE
        buf = self._buffer
        buf[at : at + _BODY_SIZE] = body
        st.seq = seq
        _seq_pack(buf, off, seq)

    def on_start(self, span, parent_context=None):
        try:
            st = self._local.state
        except AttributeError:
            st = self._state()
        # The SDK span's own attributes: its public properties cost a call each.
        try:
            ctx = span._context
            name = span._name
        except AttributeError:
            ctx = span.get_span_context()
            name = span.name
        encoded = self._names.get(name)
        if encoded is None:
            if len(self._names) >= _MAX_NAMES:
                self._names.clear()
            encoded = self._names[name] = name.encode("utf-8", "replace")[: _t.NAME_LEN]
        trace = ctx.trace_id
        sid = ctx.span_id
        body = _body_pack(trace >> 64, trace & _MASK64, sid, encoded)
        st.stack.append((sid, body))
        self._publish(st, body)

    def on_end(self, span):
        try:
            sid = span._context.span_id
        except AttributeError:
            sid = span.context.span_id
        try:
            st = self._local.state
            stack = st.stack
            if not stack or stack[-1][0] != sid:
                raise LookupError
            stack.pop()
        except (AttributeError, LookupError):
            # Ended out of order, or on another thread than the one it started on.
            st = self._owner(sid)
            if st is None:
                return
            stack = st.stack
        self._publish(st, stack[-1][1] if stack else _EMPTY_BODY)

    def _owner(self, sid):
        """The thread state whose stack holds span ``sid``, with the span taken out of it."""
        for st in list(self._threads):
            for i, entry in enumerate(st.stack):
                if entry[0] == sid:
                    del st.stack[i]
                    return st
        return None

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True
