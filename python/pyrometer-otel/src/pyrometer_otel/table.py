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

Where it can, the table is mapped at a fixed address (``FIXED_ADDRESS``, the same in every
process, never over an existing mapping): there the kernel program finds it by itself, at
the first sample after the header is written, with no /proc scan (ebpf/src/bpf/spans.h).
Elsewhere (the address taken, e.g. by a second table) it lies wherever mmap puts it and the
agent finds it in /proc/PID/maps, on its slower schedule.
"""

import ctypes
import mmap
import os
import struct
import weakref

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

# Matches SPAN_TABLE_AT in ebpf/src/bpf/spans.h: far from where x86-64 and arm64 (48-bit)
# kernels put programs, heaps and mappings.
FIXED_ADDRESS = 0x6070_7972_0000
_MAP_FIXED_NOREPLACE = 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value

_HEADER_AFTER_MAGIC = struct.Struct("<IIII")
SEQ = struct.Struct("<Q")
TID = struct.Struct("<I")
# trace id (high, low), span id, name: big-endian ids are the W3C byte order.
BODY = struct.Struct(">QQQ16s")
EMPTY_BODY = bytes(BODY.size)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def _map_fixed(fd, size):
    """The memfd mapped at FIXED_ADDRESS as a writable memoryview, or None."""
    libc = _libc()
    if libc is None:
        return None
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = libc.mmap(FIXED_ADDRESS, size, prot, mmap.MAP_SHARED | _MAP_FIXED_NOREPLACE, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    if addr != FIXED_ADDRESS:
        # A kernel older than MAP_FIXED_NOREPLACE (4.17) took the address as a hint.
        libc.munmap(addr, size)
        return None
    memory = (ctypes.c_char * size).from_address(addr)
    # Unmapped once nothing (the processor's C writer included) holds the memory any more.
    weakref.finalize(memory, libc.munmap, addr, size)
    return memoryview(memory).cast("B")


class SpanTable:
    """A process's table; ``buffer`` is written in place by the span processor.
    ``address`` is where it is mapped (``FIXED_ADDRESS`` when the kernel finds it itself)."""

    def __init__(self, slots=DEFAULT_SLOTS):
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, not {slots}")
        self.slots = slots
        self.mask = slots - 1
        size = HEADER_SIZE + slots * SLOT_SIZE
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.buffer = _map_fixed(fd, size)
            if self.buffer is None:
                self.buffer = mmap.mmap(
                    fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                )
        finally:
            os.close(fd)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        # The magic last: a reader that finds it finds the rest of the header too.
        _HEADER_AFTER_MAGIC.pack_into(self.buffer, 8, VERSION, slots, SLOT_SIZE, HEADER_SIZE)
        self.buffer[0:8] = MAGIC

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
