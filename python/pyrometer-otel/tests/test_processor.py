"""The span processor's slots as the kernel reads them (body[seq & 1], owner tid), with real
SDK spans: nesting, spans ended out of order or on another thread, slot owners, the header;
and the C fast path writing the very bytes the pure-Python path writes.
Run: python -m unittest discover -s python/pyrometer-otel/tests (with PYROMETER_OTEL_PURE=1
for the pure-Python path; PYROMETER_OTEL_EXPECT=fast|pure fails the run when the other one
is active, so a missing extension cannot pass for the fast path)."""

import os
import struct
import threading
import unittest

from opentelemetry.sdk.trace import TracerProvider

import pyrometer_otel
from pyrometer_otel import table as t


def slot(table, tid):
    """What the kernel would read for thread `tid`: (trace id hex, span id hex, name), or
    None when the slot is another thread's or holds no span."""
    off = t.HEADER_SIZE + (tid & table.mask) * t.SLOT_SIZE
    seq, owner = struct.unpack_from("<QI", table.buffer, off)
    if owner != tid:
        return None
    at = off + t.BODY_OFFSET + (seq & 1) * t.BODY.size
    hi, lo, sid, name = t.BODY.unpack_from(table.buffer, at)
    if hi == 0 and lo == 0:
        return None
    return ("%016x%016x" % (hi, lo), "%016x" % sid, name.rstrip(b"\0").decode())


def ids(span):
    c = span.get_span_context()
    return ("%032x" % c.trace_id, "%016x" % c.span_id)


class ProcessorTest(unittest.TestCase):
    def setUp(self):
        self.table = t.SpanTable(slots=1024)
        self.provider = TracerProvider()
        self.provider.add_span_processor(pyrometer_otel.SpanProcessor(self.table))
        self.tracer = self.provider.get_tracer("test")
        self.tid = threading.get_native_id()

    def test_header_says_what_the_agent_checks(self):
        magic, version, count, size, header = struct.unpack_from("<8sIIII", self.table.buffer, 0)
        self.assertEqual((magic, version, count, size, header), (b"PYROSPAN", 1, 1024, 128, 64))

    def test_a_process_table_lies_at_the_fixed_address(self):
        # In a fresh process (this one's tables hold the address already) the shared table
        # is mapped where the kernel looks for it, header first-checked there.
        import subprocess
        import sys

        code = (
            "import struct, pyrometer_otel\n"
            "from pyrometer_otel import table as t\n"
            "tb = pyrometer_otel.shared_table()\n"
            "maps = [l for l in open('/proc/self/maps') if t.MEMFD_NAME in l]\n"
            "print(tb.address == t.FIXED_ADDRESS, maps[0].startswith('%x-' % t.FIXED_ADDRESS),\n"
            "      struct.unpack_from('<8sIIII', tb.buffer, 0))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "True True (b'PYROSPAN', 1, 8192, 128, 64)")

    def test_nested_spans_publish_the_innermost_and_restore_the_parent(self):
        self.assertIsNone(slot(self.table, self.tid))
        with self.tracer.start_as_current_span("outer") as outer:
            self.assertEqual(slot(self.table, self.tid), ids(outer) + ("outer",))
            with self.tracer.start_as_current_span("a-rather-long-span-name") as inner:
                self.assertEqual(slot(self.table, self.tid), ids(inner) + ("a-rather-long-sp",))
            self.assertEqual(slot(self.table, self.tid), ids(outer) + ("outer",))
        self.assertIsNone(slot(self.table, self.tid), "no span after the last one ended")

    def test_a_span_ended_out_of_order_leaves_the_others(self):
        a = self.tracer.start_span("a")
        b = self.tracer.start_span("b")
        a.end()
        self.assertEqual(slot(self.table, self.tid), ids(b) + ("b",))
        b.end()
        self.assertIsNone(slot(self.table, self.tid))

    def test_a_span_ended_on_another_thread_leaves_its_own_thread(self):
        started = []

        def worker():
            started.append((threading.get_native_id(), self.tracer.start_span("w")))
            done.wait()

        done = threading.Event()
        th = threading.Thread(target=worker)
        th.start()
        while not started:
            pass
        tid, span = started[0]
        self.assertEqual(slot(self.table, tid), ids(span) + ("w",))
        span.end()  # on this thread
        self.assertIsNone(slot(self.table, tid))
        done.set()
        th.join()

    def test_a_slot_held_by_a_live_thread_is_not_taken(self):
        # A live thread (this one) owns the slot another id maps to: the other gets nothing.
        other = self.tid + self.table.slots
        with self.tracer.start_as_current_span("mine"):
            self.assertIsNone(self.table.claim(other))
            self.assertIsNotNone(slot(self.table, self.tid))


    def test_the_expected_path_is_active(self):
        want = os.environ.get("PYROMETER_OTEL_EXPECT")
        if want not in ("fast", "pure"):
            self.skipTest("PYROMETER_OTEL_EXPECT is not set")
        self.assertEqual(pyrometer_otel.FAST, want == "fast")
        processor = pyrometer_otel.SpanProcessor(self.table)
        self.assertEqual(processor.fast, want == "fast")

    def test_slots_of_short_lived_threads(self):
        # Threads come and go (their states are swept, their slots taken over): each one's
        # span is in its own slot while it runs, and nothing is left once it ended.
        seen = []

        def worker(i):
            with self.tracer.start_as_current_span(f"t{i}") as span:
                tid = threading.get_native_id()
                seen.append((slot(self.table, tid), ids(span) + (f"t{i}",)))
            seen.append((slot(self.table, tid), None))

        for i in range(300):
            th = threading.Thread(target=worker, args=(i,))
            th.start()
            th.join()
        self.assertEqual(len(seen), 600)
        for got, want in seen:
            self.assertEqual(got, want)

    @unittest.skipUnless(hasattr(os, "fork"), "needs fork")
    def test_a_forked_child_publishes_in_its_own_slot(self):
        with self.tracer.start_as_current_span("parent") as parent:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                ok = False
                try:
                    tid = threading.get_native_id()
                    with self.tracer.start_as_current_span("child") as child:
                        ok = slot(self.table, tid) == ids(child) + ("child",)
                    ok = ok and slot(self.table, tid) is None
                finally:
                    os.write(w, b"1" if ok else b"0")
                    os._exit(0)
            os.close(w)
            got = os.read(r, 1)
            os.close(r)
            os.waitpid(pid, 0)
            self.assertEqual(got, b"1", "the child's span in the child's slot")
            self.assertEqual(slot(self.table, self.tid), ids(parent) + ("parent",))


@unittest.skipUnless(pyrometer_otel.FAST, "no C fast path (or PYROMETER_OTEL_PURE is set)")
class FastPathTest(unittest.TestCase):
    """The C writer and the pure-Python one, fed the same spans, leave the same bytes."""

    def setUp(self):
        self.tables = [t.SpanTable(slots=64), t.SpanTable(slots=64)]
        self.processors = [
            pyrometer_otel.SpanProcessor(self.tables[0], fast=True),
            pyrometer_otel.SpanProcessor(self.tables[1], fast=False),
        ]
        self.tracer = TracerProvider().get_tracer("bare")
        self.off = t.HEADER_SIZE + (threading.get_native_id() & 63) * t.SLOT_SIZE

    def same(self, step):
        a, b = (tb.buffer[self.off : self.off + t.SLOT_SIZE] for tb in self.tables)
        self.assertEqual(bytes(a), bytes(b), step)

    def each(self, method, *args, **kwargs):
        for p in self.processors:
            getattr(p, method)(*args, **kwargs)

    def test_the_same_bytes_as_the_pure_path(self):
        names = ["outer", "ünïcødé-ünïcødé-ü", "\udc80surrogate", "x" * 40, ""]
        spans = [self.tracer.start_span(n) for n in names]
        for i, span in enumerate(spans):
            self.each("on_start", span, parent_context=None)
            self.same(f"after starting {names[i]!r}")
        # Out of order, then innermost first.
        self.each("on_end", spans[1])
        self.same("after ending the second span out of order")
        for span in reversed(spans):
            self.each("on_end", span)
            self.same("after ending a span")
        seq, owner = struct.unpack_from("<QI", self.tables[0].buffer, self.off)
        self.assertEqual((seq, owner), (len(names) * 2, threading.get_native_id()))

    def test_the_processor_hooks_are_the_c_writer(self):
        processor = self.processors[0]
        self.assertTrue(processor.fast)
        self.assertEqual(type(processor.on_start).__name__, "builtin_function_or_method")

    def test_bad_spans_raise_instead_of_writing(self):
        with self.assertRaises(AttributeError):
            self.processors[0].on_start(object())
        with self.assertRaises(TypeError):
            self.processors[0].on_start()
        seq, owner = struct.unpack_from("<QI", self.tables[0].buffer, self.off)
        self.assertEqual(seq, 0)


if __name__ == "__main__":
    unittest.main()
