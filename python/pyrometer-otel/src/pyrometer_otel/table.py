"""The span table: one 128-byte slot per thread, in memory the pyrometer agent finds.

The agent finds the table by its memfd name in /proc/PID/maps, checks the header, and hands
the slots' address to its kernel program, which reads the sampled thread's slot at each
sample (index = native thread id, as gettid gives it in the thread's pid namespace,
& (slots - 1)). Layout (little-endian), matched by ``struct span_slot`` in
ebpf/src/bpf/shared.h and profiler/src/python/spans.rs:

header (64 bytes): magic b"PYROSPAN", version u32, slot count u32, slot size u32, header
size u32.
slot (128 bytes): seq u64, tid u32, pad u32, then two 40-byte bodies: trace id (16 bytes,
W3C order), span id (8 bytes), span name (16 bytes, UTF-8, truncated, NUL-padded). The body
in use is ``body[seq & 1]``: a writer fills the other one and then stores seq + 1, so a
reader that interrupts it half-way still finds a whole span.
"""

import mmap
import os
import struct

MEMFD_NAME = "pyrometer-otel-spans"
MAGIC = b"PYROSPAN"
VERSION = 1
HEADER_SIZE = 64
SLOT_SIZE = 128
BODY_OFFSET = 16
NAME_LEN = 16
# 8192 slots: 1 MiB of address space, of which only the pages of threads that ran a span
# are ever touched.
DEFAULT_SLOTS = 8192

_HEADER = struct.Struct("<8sIIII")
SEQ = struct.Struct("<Q")
TID = struct.Struct("<I")
# trace id (high, low), span id, name: big-endian ids are the W3C byte order.
BODY = struct.Struct(">QQQ16s")
EMPTY_BODY = bytes(BODY.size)


class SpanTable:
    """A process's table; ``buffer`` is written in place by the span processor."""

    def __init__(self, slots=DEFAULT_SLOTS):
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, not {slots}")
        self.slots = slots
        self.mask = slots - 1
        size = HEADER_SIZE + slots * SLOT_SIZE
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.buffer = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self.buffer, 0, MAGIC, VERSION, slots, SLOT_SIZE, HEADER_SIZE)

    def claim(self, tid):
        """The byte offset of thread ``tid``'s slot, or None when another live thread (of
        this process or, after a fork, of a relative sharing the table) holds it."""
        off = HEADER_SIZE + (tid & self.mask) * SLOT_SIZE
        (owner,) = TID.unpack_from(self.buffer, off + 8)
        if owner not in (0, tid) and os.path.exists(f"/proc/{owner}"):
            return None
        # A new owner: whatever a dead thread left in the slot is not this thread's span.
        self.buffer[off + BODY_OFFSET : off + SLOT_SIZE - 32] = bytes(2 * BODY.size)
        TID.pack_into(self.buffer, off + 8, tid)
        return off
