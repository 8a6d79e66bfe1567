# Prints the asyncio layouts `--async` uses (profiler/src/python/asyncio.rs, AsyncOffsets), one
# `field=value` a line, from the DWARF of a build's `_asyncio` extension
# (lib-dynload/_asyncio.cpython-3XX-*.so: the Task and Future objects) or of its libpython (the
# rest); a field the binary does not describe is left out. Run under gdb:
#   gdb -batch -nx -ex 'python exec(open("scripts/python_asyncio_offsets.py").read())' BINARY
import gdb

FIELDS = [
    ("fut_callback0", "FutureObj", "fut_callback0"),
    ("fut_callbacks", "FutureObj", "fut_callbacks"),
    # A Task begins with the Future's fields (FutureObj_HEAD, its own prefix).
    ("task_callback0", "TaskObj", "task_callback0"),
    ("task_callbacks", "TaskObj", "task_callbacks"),
    ("task_coro", "TaskObj", "task_coro"),
    ("task_name", "TaskObj", "task_name"),
    ("gen_iframe", "PyGenObject", "gi_iframe"),
    ("coro_iframe", "PyCoroObject", "cr_iframe"),
    ("cfunction_self", "PyCFunctionObject", "m_self"),
    ("method_self", "PyMethodObject", "im_self"),
    ("function_closure", "PyFunctionObject", "func_closure"),
    ("cell_ref", "PyCellObject", "ob_ref"),
    ("type_base", "PyTypeObject", "tp_base"),
    ("tuple_items", "PyTupleObject", "ob_item"),
    ("list_items", "PyListObject", "ob_item"),
    ("var_size", "PyVarObject", "ob_size"),
]

for field, ty, member in FIELDS:
    try:
        off = int(gdb.parse_and_eval("(long)&((%s *)0)->%s" % (ty, member)))
    except gdb.error:
        continue
    print("%s=%d" % (field, off))
