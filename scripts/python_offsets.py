# Prints the CPython structure offsets pyrometer's dump uses (profiler/src/python/offsets.rs),
# one `field=value` a line (`field=absent` where this version lacks it), read from a build's
# DWARF. Run under gdb:
#   gdb -batch -nx -ex 'python exec(open("scripts/python_offsets.py").read())' LIBPYTHON
import gdb

# field name in PyOffsets -> (type, member path) alternatives, first present wins.
FIELDS = [
    ("runtime_interpreters_head", [("_PyRuntimeState", "interpreters.head")]),
    ("runtime_gil", [("_PyRuntimeState", "ceval.gil")]),
    ("interp_next", [("PyInterpreterState", "next")]),
    ("interp_threads_head", [("PyInterpreterState", "tstate_head"), ("PyInterpreterState", "threads.head")]),
    ("interp_gil_ptr", [("PyInterpreterState", "ceval.gil")]),
    ("gil_last_holder", [("struct _gil_runtime_state", "last_holder")]),
    ("gil_locked", [("struct _gil_runtime_state", "locked")]),
    ("tstate_next", [("PyThreadState", "next")]),
    ("tstate_interp", [("PyThreadState", "interp")]),
    ("tstate_frame", [("PyThreadState", "current_frame"), ("PyThreadState", "frame"), ("PyThreadState", "cframe")]),
    ("cframe_current_frame", [("_PyCFrame", "current_frame")]),
    ("tstate_thread_id", [("PyThreadState", "thread_id")]),
    ("tstate_native_thread_id", [("PyThreadState", "native_thread_id")]),
    ("frame_code", [("struct _PyInterpreterFrame", "f_executable"), ("struct _PyInterpreterFrame", "f_code"), ("PyFrameObject", "f_code")]),
    ("frame_previous", [("struct _PyInterpreterFrame", "previous"), ("PyFrameObject", "f_back")]),
    ("frame_instr", [("struct _PyInterpreterFrame", "instr_ptr"), ("struct _PyInterpreterFrame", "prev_instr"), ("PyFrameObject", "f_lasti")]),
    ("frame_is_entry", [("struct _PyInterpreterFrame", "is_entry")]),
    ("frame_owner", [("struct _PyInterpreterFrame", "owner")]),
    ("code_filename", [("PyCodeObject", "co_filename")]),
    ("code_name", [("PyCodeObject", "co_name")]),
    ("code_qualname", [("PyCodeObject", "co_qualname")]),
    ("code_firstlineno", [("PyCodeObject", "co_firstlineno")]),
    ("code_linetable", [("PyCodeObject", "co_linetable"), ("PyCodeObject", "co_lnotab")]),
    ("code_adaptive", [("PyCodeObject", "co_code_adaptive")]),
    ("frame_globals", [("struct _PyInterpreterFrame", "f_globals"), ("PyFrameObject", "f_globals")]),
    # 3.14+ free-threaded builds: per-thread bytecode copies.
    ("frame_tlbc_index", [("struct _PyInterpreterFrame", "tlbc_index")]),
    ("code_tlbc", [("PyCodeObject", "co_tlbc")]),
    ("object_type", [("PyObject", "ob_type")]),
    ("bytes_size", [("PyBytesObject", "ob_base.ob_size")]),
    ("bytes_data", [("PyBytesObject", "ob_sval")]),
    ("unicode_length", [("PyASCIIObject", "length")]),
    ("unicode_state", [("PyASCIIObject", "state")]),
]
SIZES = [
    ("gil_size", "struct _gil_runtime_state"),
    ("unicode_ascii_data", "PyASCIIObject"),
    ("unicode_compact_data", "PyCompactUnicodeObject"),
]


def offset(tname, path):
    try:
        t = gdb.lookup_type(tname)
    except gdb.error:
        return None
    total = 0
    for part in path.split("."):
        t = t.strip_typedefs()
        found = [f for f in t.fields() if f.name == part]
        if not found:
            return None
        total += found[0].bitpos // 8
        t = found[0].type
    return total


# 3.11 has both a PyFrameObject and a _PyInterpreterFrame: the interpreter frame wins by order.
for name, alternatives in FIELDS:
    value = None
    for tname, path in alternatives:
        value = offset(tname, path)
        if value is not None:
            break
    print("%s=%s" % (name, "absent" if value is None else value))
for name, tname in SIZES:
    try:
        print("%s=%d" % (name, gdb.lookup_type(tname).strip_typedefs().sizeof))
    except gdb.error:
        print("%s=absent" % name)
