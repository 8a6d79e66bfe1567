# Prints the CPython structure offsets pyrometer reads thread names with
# (profiler/src/python/names.rs: sys.modules, dicts, ints, instance attributes), one
# `field=value` a line (`field=absent` where this version lacks it), read from a build's DWARF.
# Run under gdb:
#   gdb -batch -nx -ex 'python exec(open("scripts/python_name_offsets.py").read())' LIBPYTHON
import gdb

# field name in NameOffsets -> (type, member path) alternatives, first present wins.
FIELDS = [
    ("runtime_interpreters_main", [("_PyRuntimeState", "interpreters.main")]),
    # 3.12 moved the import state into interp->imports.
    ("interp_modules", [("PyInterpreterState", "imports.modules"), ("PyInterpreterState", "modules")]),
    ("module_dict", [("PyModuleObject", "md_dict")]),
    ("var_size", [("PyVarObject", "ob_size")]),
    ("type_basicsize", [("PyTypeObject", "tp_basicsize")]),
    ("type_flags", [("PyTypeObject", "tp_flags")]),
    ("type_dictoffset", [("PyTypeObject", "tp_dictoffset")]),
    ("heaptype_cached_keys", [("PyHeapTypeObject", "ht_cached_keys")]),
    ("dict_used", [("PyDictObject", "ma_used")]),
    ("dict_keys", [("PyDictObject", "ma_keys")]),
    ("dict_values", [("PyDictObject", "ma_values")]),
    ("keys_size", [("PyDictKeysObject", "dk_size")]),
    ("keys_log2_size", [("PyDictKeysObject", "dk_log2_size")]),
    ("keys_log2_index_bytes", [("PyDictKeysObject", "dk_log2_index_bytes")]),
    ("keys_kind", [("PyDictKeysObject", "dk_kind")]),
    ("keys_nentries", [("PyDictKeysObject", "dk_nentries")]),
    ("keys_indices", [("PyDictKeysObject", "dk_indices")]),
    ("entry_key", [("PyDictKeyEntry", "me_key")]),
    ("entry_value", [("PyDictKeyEntry", "me_value")]),
    ("unicode_entry_key", [("PyDictUnicodeEntry", "me_key")]),
    ("unicode_entry_value", [("PyDictUnicodeEntry", "me_value")]),
    ("values_capacity", [("PyDictValues", "capacity")]),
    ("values_valid", [("PyDictValues", "valid")]),
    ("values_values", [("PyDictValues", "values")]),
    # 3.12 wrapped the digits in _PyLongValue.
    ("long_tag", [("PyLongObject", "long_value.lv_tag")]),
    ("long_digits", [("PyLongObject", "long_value.ob_digit"), ("PyLongObject", "ob_digit")]),
]
SIZES = [
    ("object_size", "PyObject"),
    ("entry_size", "PyDictKeyEntry"),
    ("unicode_entry_size", "PyDictUnicodeEntry"),
    ("digit_size", "digit"),
]
# enum DictKeysKind (3.11+)
CONSTANTS = [
    ("kind_general", "DICT_KEYS_GENERAL"),
    ("kind_unicode", "DICT_KEYS_UNICODE"),
    ("kind_split", "DICT_KEYS_SPLIT"),
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
for name, symbol in CONSTANTS:
    try:
        print("%s=%d" % (name, int(gdb.parse_and_eval(symbol))))
    except gdb.error:
        print("%s=absent" % name)
