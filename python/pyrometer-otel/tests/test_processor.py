"""The span processor's slots as the kernel reads them (body[seq & 1], owner tid), with real
SDK spans: nesting, spans ended out of order or on another thread, slot owners, the header.
Run: python -m unittest discover -s python/pyrometer-otel/tests"""

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


if __name__ == "__main__":
    unittest.main()
