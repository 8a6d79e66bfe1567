//! `threading.Thread.name` of a live interpreter's threads, read from outside like the rest of
//! `dump`: the main interpreter's `sys.modules` → the `threading` module → its `_active` dict
//! (`get_ident()` → `Thread`) → each thread's `_name` attribute. The idents are
//! `pthread_self()` values, the same numbers as `PyThreadState.thread_id`
//! ([`super::walk::PyThread::thread_id`]), which is how names meet stacks.
//!
//! Everything here is a private CPython layout read from a process that keeps running, so every
//! object is type-checked against the runtime's type objects, every table is checked against
//! the invariants CPython keeps (a power-of-two size, index width matching the size, entries
//! within the usable fraction), at most [`MAX_DICT_ENTRIES`] entries of a dict are scanned, and
//! a thread whose object does not validate just has no name.
//!
//! Offsets: the `DWARF` fields of [`NameOffsets`] were read from the pyenv builds 3.8.18, 3.9.18,
//! 3.10.13, 3.11.7, 3.12.1 and 3.13.0 (`lib/libpython3.X.so.1.0`) by
//! `scripts/python_name_offsets.py` under gdb:
//!
//! ```sh
//! gdb -batch -nx -ex 'python exec(open("scripts/python_name_offsets.py").read())' \
//!     ~/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0
//! ```
//!
//! The `header` fields are preprocessor constants and inline functions, which the DWARF of a
//! `-g` build does not keep; they were read from each build's installed headers
//! (`include/python3.X/`, `internal/pycore_object.h`, `cpython/longintrepr.h`). The unit tests
//! `name_offsets_match_dwarf` and `name_constants_match_headers` re-check both against every
//! installed build.

use std::cell::Cell;
use std::collections::HashMap;

use super::PythonError;
use super::debug_offsets::Described;
use super::memory::Memory;
use super::offsets::{ABSENT, PyOffsets};
use super::version::PythonRuntime;
use super::walk::Walker;

#[cfg(test)]
mod tests;

/// Entries scanned per dict, `sys.modules` included (dicts keep insertion order, and
/// `threading` is imported early): bounds the work and the buffer (96 KiB) a torn size can ask
/// for.
pub const MAX_DICT_ENTRIES: usize = 4096;

/// Entries read plus keys compared per call, all dicts together: with every dict at its bound
/// a garbage image could otherwise ask for 4096 threads × 4096 attributes. A real process
/// needs its modules up to `threading` and a few dozen per thread.
const MAX_WORK: usize = 256 * 1024;

/// Offsets past which no plausible instance dict pointer lies (`tp_dictoffset`).
const MAX_DICT_OFFSET: u64 = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameOffsets {
    pub minor: u32,

    // DWARF.
    /// `_PyRuntimeState.interpreters.main`.
    pub runtime_interpreters_main: u32,
    /// `PyInterpreterState.modules` (≤3.11), `.imports.modules` (3.12+).
    pub interp_modules: u32,
    pub module_dict: u32,
    /// `PyVarObject.ob_size`: an int's signed digit count before 3.12.
    pub var_size: u32,
    pub type_basicsize: u32,
    pub type_flags: u32,
    pub type_dictoffset: u32,
    pub heaptype_cached_keys: u32,
    pub dict_used: u32,
    pub dict_keys: u32,
    pub dict_values: u32,
    /// ≤3.10 `dk_size` (a `Py_ssize_t`).
    pub keys_size: u32,
    /// 3.11+ `dk_log2_size`, `dk_log2_index_bytes`, `dk_kind` (one byte each).
    pub keys_log2_size: u32,
    pub keys_log2_index_bytes: u32,
    pub keys_kind: u32,
    pub keys_nentries: u32,
    pub keys_indices: u32,
    pub entry_size: u32,
    pub entry_key: u32,
    pub entry_value: u32,
    /// 3.11+ `PyDictUnicodeEntry` (no cached hash), used by every table whose kind is not
    /// general.
    pub unicode_entry_size: u32,
    pub unicode_entry_key: u32,
    pub unicode_entry_value: u32,
    /// `PyDictValues`: 3.13 has a header (`capacity`, `valid`, ...) before `values`; before 3.11
    /// `ma_values` points at the array itself.
    pub values_capacity: u32,
    pub values_valid: u32,
    pub values_values: u32,
    /// 3.12+ `long_value.lv_tag`.
    pub long_tag: u32,
    pub long_digits: u32,
    pub object_size: u32,
    pub digit_size: u32,
    /// `enum DictKeysKind` (3.11+).
    pub kind_general: u32,
    pub kind_unicode: u32,
    pub kind_split: u32,

    // Headers.
    /// `Py_TPFLAGS_HEAPTYPE` as a bit number.
    pub heaptype_bit: u32,
    /// `Py_TPFLAGS_MANAGED_DICT` (3.11+).
    pub managed_dict_bit: u32,
    /// `Py_TPFLAGS_INLINE_VALUES` (3.13).
    pub inline_values_bit: u32,
    /// Bytes before the object where a managed dict's pointer lives (`MANAGED_DICT_OFFSET`,
    /// 3.12's `PyDictOrValues`).
    pub managed_dict_before: u32,
    /// 3.11: bytes before the object where the `PyDictValues` pointer lives.
    pub values_ptr_before: u32,
    /// 3.12: a `PyDictOrValues` word with this bit set holds `values - 1`.
    pub dict_or_values_tag: u32,
    /// `PyLong_SHIFT`.
    pub long_shift: u32,
    /// 3.12+ `_PyLong_NON_SIZE_BITS` and `_PyLong_SIGN_MASK`.
    pub long_non_size_bits: u32,
    pub long_sign_mask: u32,
}

/// 3.8.18 DWARF.
const PY38: NameOffsets = NameOffsets {
    minor: 8,
    runtime_interpreters_main: 40,
    interp_modules: 56,
    module_dict: 16,
    var_size: 16,
    type_basicsize: 32,
    type_flags: 168,
    type_dictoffset: 288,
    heaptype_cached_keys: 872,
    dict_used: 16,
    dict_keys: 32,
    dict_values: 40,
    keys_size: 8,
    keys_log2_size: ABSENT,
    keys_log2_index_bytes: ABSENT,
    keys_kind: ABSENT,
    keys_nentries: 32,
    keys_indices: 40,
    entry_size: 24,
    entry_key: 8,
    entry_value: 16,
    unicode_entry_size: ABSENT,
    unicode_entry_key: ABSENT,
    unicode_entry_value: ABSENT,
    values_capacity: ABSENT,
    values_valid: ABSENT,
    values_values: ABSENT,
    long_tag: ABSENT,
    long_digits: 24,
    object_size: 16,
    digit_size: 4,
    kind_general: ABSENT,
    kind_unicode: ABSENT,
    kind_split: ABSENT,
    heaptype_bit: 9,
    managed_dict_bit: ABSENT,
    inline_values_bit: ABSENT,
    managed_dict_before: ABSENT,
    values_ptr_before: ABSENT,
    dict_or_values_tag: ABSENT,
    long_shift: 30,
    long_non_size_bits: ABSENT,
    long_sign_mask: ABSENT,
};

/// 3.9.18 DWARF: the interpreter state grew (per-interpreter ceval state before `modules`).
const PY39: NameOffsets = NameOffsets {
    minor: 9,
    interp_modules: 856,
    heaptype_cached_keys: 864,
    ..PY38
};

/// 3.10.13 DWARF.
const PY310: NameOffsets = NameOffsets {
    minor: 10,
    heaptype_cached_keys: 872,
    ..PY39
};

/// 3.11.7 DWARF and headers: log2-sized key tables with unicode-only entries, managed dicts
/// (values pointer 4 words and dict pointer 3 words before the object).
const PY311: NameOffsets = NameOffsets {
    minor: 11,
    runtime_interpreters_main: 48,
    interp_modules: 888,
    keys_size: ABSENT,
    keys_log2_size: 8,
    keys_log2_index_bytes: 9,
    keys_kind: 10,
    keys_nentries: 24,
    keys_indices: 32,
    unicode_entry_size: 16,
    unicode_entry_key: 0,
    unicode_entry_value: 8,
    values_values: 0,
    kind_general: 0,
    kind_unicode: 1,
    kind_split: 2,
    managed_dict_bit: 4,
    managed_dict_before: 24,
    values_ptr_before: 32,
    ..PY310
};

/// 3.12.1 DWARF and headers: `interp->imports.modules`, ints with `lv_tag`, one tagged
/// `PyDictOrValues` word 3 words before the object.
const PY312: NameOffsets = NameOffsets {
    minor: 12,
    interp_modules: 944,
    heaptype_cached_keys: 880,
    long_tag: 16,
    values_ptr_before: ABSENT,
    dict_or_values_tag: 1,
    long_non_size_bits: 3,
    long_sign_mask: 3,
    ..PY311
};

/// 3.13.0 DWARF and headers: the main interpreter inside `_PyRuntime`, values inline after
/// the object with a header of their own.
const PY313: NameOffsets = NameOffsets {
    minor: 13,
    runtime_interpreters_main: 640,
    interp_modules: 7656,
    values_capacity: 0,
    values_valid: 3,
    values_values: 8,
    dict_or_values_tag: ABSENT,
    inline_values_bit: 2,
    ..PY312
};

/// Every supported minor version, oldest first (3.8–3.13; later versions have no name table).
pub const SUPPORTED: &[NameOffsets] = &[PY38, PY39, PY310, PY311, PY312, PY313];

/// The name offsets for CPython `major.minor`, or `None` when that version is not supported.
pub fn for_version(major: u32, minor: u32) -> Option<&'static NameOffsets> {
    if major != 3 {
        return None;
    }
    SUPPORTED.iter().find(|o| o.minor == minor)
}

/// 3.13+: 3.13's layout of dicts, ints, modules and types (unchanged in 3.14 and 3.15, as
/// their DWARF shows), with what moved taken from the interpreter's own description:
/// `imports.modules`, `ht_cached_keys` (described from 3.15; 3.13's 880 before), and
/// `interpreters.main`, which the description lacks but which follows `interpreters.head`.
fn described_names(minor: u32, layout: &Described) -> NameOffsets {
    let names = NameOffsets {
        minor,
        runtime_interpreters_main: layout.offsets.runtime_interpreters_head + 8,
        interp_modules: layout.interp_modules,
        heaptype_cached_keys: layout
            .heaptype_cached_keys
            .unwrap_or(PY313.heaptype_cached_keys),
        ..PY313
    };
    if layout.free_threaded {
        free_threaded(names, layout)
    } else {
        names
    }
}

/// A free-threaded build (`3.13t`, `3.14t`): its object header is larger (`ob_tid`, the
/// biased reference counts, `ob_mutex` and `ob_gc_bits` come before `ob_type`, at 24 where
/// the default header has it at 8), which moves every field of an object by the same amount;
/// the dict key tables, their entries and the values arrays are no objects and do not move.
/// The managed dict pointer is one word before the object, not three (no GC links before a
/// free-threaded object: `MANAGED_DICT_OFFSET` in `internal/pycore_object.h`). Checked
/// against 3.13.15t's and 3.14.7t's DWARF and headers by `name_offsets_match_dwarf` and
/// `free_threaded_constants_match_headers`. `ht_cached_keys` moves with the header where the
/// interpreter does not describe it (3.13, 3.14).
fn free_threaded(names: NameOffsets, layout: &Described) -> NameOffsets {
    let extra = layout
        .offsets
        .object_type
        .saturating_sub(DEFAULT_OBJECT_TYPE);
    let object = |at: u32| if at == ABSENT { ABSENT } else { at + extra };
    NameOffsets {
        module_dict: object(names.module_dict),
        var_size: object(names.var_size),
        type_basicsize: object(names.type_basicsize),
        type_flags: object(names.type_flags),
        type_dictoffset: object(names.type_dictoffset),
        heaptype_cached_keys: match layout.heaptype_cached_keys {
            Some(described) => described,
            None => object(names.heaptype_cached_keys),
        },
        dict_used: object(names.dict_used),
        dict_keys: object(names.dict_keys),
        dict_values: object(names.dict_values),
        long_tag: object(names.long_tag),
        long_digits: object(names.long_digits),
        object_size: object(names.object_size),
        managed_dict_before: FREE_THREADED_MANAGED_DICT_BEFORE,
        ..names
    }
}

/// `ob_type`'s offset in the default object header.
const DEFAULT_OBJECT_TYPE: u32 = 8;

/// `-MANAGED_DICT_OFFSET` of a free-threaded build.
const FREE_THREADED_MANAGED_DICT_BEFORE: u32 = 8;

/// The `threading` name of every thread of the main interpreter that `threading` knows about,
/// keyed by its ident (`threading.get_ident()`, i.e. `pthread_self()`, the same value as
/// [`super::walk::PyThread::thread_id`]).
///
/// Reads with `mem` only (`process_vm_readv` for a live process, which keeps running). The map
/// is empty when the process never imported `threading`. Threads that `threading` does not
/// track (started with `_thread.start_new_thread` and never asked for
/// `threading.current_thread()`, or still starting up) are absent, and so is any thread whose
/// object or name does not validate; names are cut at [`super::walk::MAX_STRING`] characters.
///
/// Errors when the path to `_active` cannot be read or does not validate: the process is gone,
/// no permission, an unsupported version, or a structure changed under the reader.
pub fn thread_names<M: Memory>(
    mem: &M,
    rt: &PythonRuntime,
    layout: &Described,
) -> Result<HashMap<u64, String>, PythonError> {
    thread_names_at(mem, rt, layout, &mut None)
}

/// [`thread_names`] for a caller that reads one process's names again and again: `active` is
/// where `threading._active` was found the last time (None at first), and is set to where
/// it was found. A module global's dict stays where it is for the module's life, and finding
/// it walks `sys.modules` key by key, one read a key: most of a read's cost, paid by an agent
/// once per short thread a process starts. The dict is taken from `active` when it still is
/// a `dict` with named threads in it; else it is searched for again.
pub fn thread_names_at<M: Memory>(
    mem: &M,
    rt: &PythonRuntime,
    layout: &Described,
    active: &mut Option<u64>,
) -> Result<HashMap<u64, String>, PythonError> {
    with_reader(mem, rt, layout, |reader| reader.names(active))
}

/// Runs `f` with a reader of `mem`'s dicts, modules and instance attributes, for the
/// interpreter `rt` described by `layout` (also [`super::asyncio`]'s way to its objects).
pub(super) fn with_reader<M: Memory, R>(
    mem: &M,
    rt: &PythonRuntime,
    layout: &Described,
    f: impl FnOnce(&Reader<'_, M>) -> Result<R, PythonError>,
) -> Result<R, PythonError> {
    let (major, minor) = (rt.version.major, rt.version.minor);
    let base = &layout.offsets;
    let described;
    let o = if major == 3 && minor >= super::offsets::FIRST_MINOR {
        described = described_names(minor, layout);
        Some(&described)
    } else {
        for_version(major, minor)
    };
    // The name tables assume the default object header (`ob_type` at 8) or a free-threaded
    // one as described: a trace-refs build is not read.
    let header_known = base.object_type == DEFAULT_OBJECT_TYPE || layout.free_threaded;
    let (Some(o), true) = (o, header_known) else {
        return Err(PythonError::Unsupported {
            version: rt.version.to_string(),
            reason: String::new(),
        });
    };
    f(&Reader {
        mem,
        o,
        base,
        rt,
        walker: Walker::new(mem, layout, rt),
        kind_shift: layout.unicode_kind_shift,
        work: Cell::new(0),
    })
}

/// A dict's key table as validated, and where its values are.
pub(super) struct Table {
    pub(super) entries: u64,
    /// Entries to scan, at most `MAX_DICT_ENTRIES`.
    count: usize,
    unicode: bool,
    /// Split tables: the values array, indexed like the entries.
    values: Option<u64>,
}

pub(super) struct Reader<'a, M: Memory> {
    mem: &'a M,
    pub(super) o: &'a NameOffsets,
    base: &'a PyOffsets,
    rt: &'a PythonRuntime,
    walker: Walker<'a, M>,
    /// [`Described::unicode_kind_shift`].
    kind_shift: u32,
    /// Spent of `MAX_WORK`.
    work: Cell<usize>,
}

fn at(base: u64, offset: u32) -> u64 {
    base.wrapping_add(u64::from(offset))
}

fn word(buf: &[u8], at: usize) -> Option<u64> {
    let bytes = buf.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

fn bit(flags: u64, bit: u32) -> bool {
    bit != ABSENT && bit < 64 && flags & (1 << bit) != 0
}

impl<M: Memory> Reader<'_, M> {
    pub(super) fn field(&self, base: u64, offset: u32) -> Result<u64, PythonError> {
        self.mem.read_u64(at(base, offset))
    }

    fn spend(&self, units: usize, addr: u64) -> Result<(), PythonError> {
        let work = self.work.get() + units;
        if work > MAX_WORK {
            return Err(PythonError::BadAddress(addr));
        }
        self.work.set(work);
        Ok(())
    }

    pub(super) fn type_of(&self, obj: u64) -> Result<u64, PythonError> {
        if obj == 0 {
            return Err(PythonError::BadAddress(obj));
        }
        self.field(obj, self.base.object_type)
    }

    pub(super) fn expect_type(&self, obj: u64, ty: u64) -> Result<(), PythonError> {
        if self.type_of(obj)? == ty {
            Ok(())
        } else {
            Err(PythonError::BadAddress(obj))
        }
    }

    fn names(&self, known: &mut Option<u64>) -> Result<HashMap<u64, String>, PythonError> {
        if let Some(at) = known.take()
            && let Ok(active) = self.dict(at)
            && let Ok(names) = self.names_in(&active)
            && !names.is_empty()
        {
            *known = Some(at);
            return Ok(names);
        }
        let o = self.o;
        let interp = self.field(self.rt.runtime, o.runtime_interpreters_main)?;
        if interp == 0 {
            // Not initialized yet, or finalizing.
            return Ok(HashMap::new());
        }
        let modules = self.field(interp, o.interp_modules)?;
        let modules = self.dict(modules)?;
        let Some(threading) = self.get(&modules, "threading")? else {
            return Ok(HashMap::new());
        };
        self.expect_type(threading, self.rt.module_type)?;
        let globals = self.dict(self.field(threading, o.module_dict)?)?;
        let Some(at) = self.get(&globals, "_active")? else {
            return Ok(HashMap::new());
        };
        let names = self.names_in(&self.dict(at)?)?;
        *known = Some(at);
        Ok(names)
    }

    /// The names of the threads in `threading._active`'s table.
    fn names_in(&self, active: &Table) -> Result<HashMap<u64, String>, PythonError> {
        let mut names = HashMap::new();
        for (key, thread) in self.items(active)? {
            let Some(ident) = self.ident(key) else {
                continue;
            };
            if let Ok(Some(name)) = self.thread_name(thread) {
                names.insert(ident, name);
            }
        }
        Ok(names)
    }

    /// A `dict` object's table.
    pub(super) fn dict(&self, obj: u64) -> Result<Table, PythonError> {
        let o = self.o;
        self.expect_type(obj, self.rt.dict_type)?;
        let used = self.field(obj, o.dict_used)? as i64;
        let keys = self.field(obj, o.dict_keys)?;
        let values = self.field(obj, o.dict_values)?;
        let table = self.keys(keys, (values != 0).then_some(values))?;
        // A scan cut at MAX_DICT_ENTRIES legitimately sees fewer entries than are used.
        let too_many = used as u64 > table.count as u64 && table.count < MAX_DICT_ENTRIES;
        if used < 0 || too_many {
            return Err(PythonError::BadAddress(obj));
        }
        Ok(table)
    }

    /// A `PyDictKeysObject`, with the values array of a split table.
    pub(super) fn keys(&self, keys: u64, values: Option<u64>) -> Result<Table, PythonError> {
        let o = self.o;
        if keys == 0 {
            return Err(PythonError::BadAddress(keys));
        }
        let bad = || PythonError::BadAddress(keys);
        let (size, index_bytes, unicode) = if o.keys_size != ABSENT {
            let size = self.field(keys, o.keys_size)?;
            if size < 8 || !size.is_power_of_two() || size > 1 << 40 {
                return Err(bad());
            }
            // DK_IXSIZE in 3.8–3.10's dictobject.c.
            let width = match size {
                0..=0xff => 1,
                0x100..=0xffff => 2,
                0x1_0000..=0xffff_ffff => 4,
                _ => 8,
            };
            (size, size * width, false)
        } else {
            let mut head = [0u8; 3];
            self.mem.read(at(keys, o.keys_log2_size), &mut head[..1])?;
            self.mem
                .read(at(keys, o.keys_log2_index_bytes), &mut head[1..2])?;
            self.mem.read(at(keys, o.keys_kind), &mut head[2..])?;
            let [log2_size, log2_index_bytes, kind] = head.map(u32::from);
            // new_keys_object: indices are 1, 2, 4 or 8 bytes wide by table size.
            let expected = match log2_size {
                0..=7 => log2_size,
                8..=15 => log2_size + 1,
                16..=31 => log2_size + 2,
                _ => log2_size + 3,
            };
            if !(3..=40).contains(&log2_size) || log2_index_bytes != expected {
                return Err(bad());
            }
            let unicode = if kind == o.kind_general {
                false
            } else if kind == o.kind_unicode || kind == o.kind_split {
                true
            } else {
                return Err(bad());
            };
            if values.is_some() && kind != o.kind_split {
                return Err(bad());
            }
            (1u64 << log2_size, 1u64 << log2_index_bytes, unicode)
        };
        let nentries = self.field(keys, o.keys_nentries)? as i64;
        // USABLE_FRACTION
        let usable = (size << 1) / 3;
        if nentries < 0 || nentries as u64 > usable {
            return Err(bad());
        }
        let mut count = (nentries as usize).min(MAX_DICT_ENTRIES);
        let values = match values {
            Some(v) if o.values_capacity != ABSENT => {
                // 3.13 says how many slots the values array has.
                let capacity = self.mem.read_u8(at(v, o.values_capacity))?;
                count = count.min(usize::from(capacity));
                Some(at(v, o.values_values))
            }
            Some(v) if o.values_values != ABSENT => Some(at(v, o.values_values)),
            other => other,
        };
        Ok(Table {
            entries: at(keys, o.keys_indices).wrapping_add(index_bytes),
            count,
            unicode,
            values,
        })
    }

    /// The (key, value) pairs of a table in entry order, skipping deleted and empty slots.
    pub(super) fn items(&self, t: &Table) -> Result<Vec<(u64, u64)>, PythonError> {
        let o = self.o;
        let (size, key, value) = if t.unicode {
            (
                o.unicode_entry_size,
                o.unicode_entry_key,
                o.unicode_entry_value,
            )
        } else {
            (o.entry_size, o.entry_key, o.entry_value)
        };
        self.spend(t.count, t.entries)?;
        let size = size as usize;
        let mut entries = vec![0u8; t.count * size];
        self.mem.read(t.entries, &mut entries)?;
        let values = match t.values {
            Some(v) => {
                let mut buf = vec![0u8; t.count * 8];
                self.mem.read(v, &mut buf)?;
                Some(buf)
            }
            None => None,
        };
        let mut items = Vec::with_capacity(t.count);
        for i in 0..t.count {
            let entry = i * size;
            let k = word(&entries, entry + key as usize).unwrap_or(0);
            let v = match &values {
                Some(values) => word(values, i * 8),
                None => word(&entries, entry + value as usize),
            }
            .unwrap_or(0);
            if k != 0 && v != 0 {
                items.push((k, v));
            }
        }
        Ok(items)
    }

    /// The value under the `str` key `name` (ASCII), by scanning: the key's hash is salted
    /// per process, so it cannot be computed here.
    pub(super) fn get(&self, t: &Table, name: &str) -> Result<Option<u64>, PythonError> {
        for (key, value) in self.items(t)? {
            self.spend(1, t.entries)?;
            if self.key_is(key, name) {
                return Ok(Some(value));
            }
        }
        Ok(None)
    }

    /// The entry index of the `str` key `name` in a table (values or not: a class's shared
    /// keys have none), `None` when absent.
    pub(super) fn key_index(&self, t: &Table, name: &str) -> Result<Option<usize>, PythonError> {
        let o = self.o;
        let (size, key) = if t.unicode {
            (o.unicode_entry_size, o.unicode_entry_key)
        } else {
            (o.entry_size, o.entry_key)
        };
        self.spend(t.count, t.entries)?;
        let mut entries = vec![0u8; t.count * size as usize];
        self.mem.read(t.entries, &mut entries)?;
        Ok((0..t.count).find(|&i| {
            word(&entries, i * size as usize + key as usize)
                .is_some_and(|k| k != 0 && self.key_is(k, name))
        }))
    }

    /// Whether `key` is the compact ASCII `str` `name`, in one read: the header and the text.
    fn key_is(&self, key: u64, name: &str) -> bool {
        let b = self.base;
        let data = b.unicode_ascii_data as usize;
        let mut buf = vec![0u8; data + name.len()];
        if key == 0 || self.mem.read(key, &mut buf).is_err() {
            return false;
        }
        let state = buf
            .get(b.unicode_state as usize..b.unicode_state as usize + 4)
            .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]));
        let (kind, compact, ascii) = super::walk::string_state(state, self.kind_shift);
        let compact_ascii = compact && ascii && kind == 1;
        word(&buf, b.object_type as usize) == Some(self.rt.unicode_type)
            && word(&buf, b.unicode_length as usize) == Some(name.len() as u64)
            && compact_ascii
            && &buf[data..] == name.as_bytes()
    }

    /// A non-negative `int` that fits in 64 bits (a thread ident), else `None`.
    fn ident(&self, obj: u64) -> Option<u64> {
        let o = self.o;
        if self.type_of(obj).ok()? != self.rt.long_type || o.digit_size != 4 {
            return None;
        }
        let ndigits = if o.long_tag != ABSENT {
            let tag = self.field(obj, o.long_tag).ok()?;
            // Sign 0 is positive; zero (1) and negative (2) are no thread's ident.
            if tag & u64::from(o.long_sign_mask) != 0 {
                return None;
            }
            tag.checked_shr(o.long_non_size_bits)?
        } else {
            let size = self.field(obj, o.var_size).ok()? as i64;
            if size <= 0 {
                return None;
            }
            size as u64
        };
        // Three 30-bit digits already exceed 64 bits.
        if !(1..=3).contains(&ndigits) {
            return None;
        }
        let mut digits = [0u8; 12];
        let digits = &mut digits[..ndigits as usize * 4];
        self.mem.read(at(obj, o.long_digits), digits).ok()?;
        let mut value: u128 = 0;
        for (i, d) in digits.chunks_exact(4).enumerate() {
            let d = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
            if o.long_shift >= 32 || d >> o.long_shift != 0 {
                return None;
            }
            value |= u128::from(d) << (o.long_shift as usize * i);
        }
        u64::try_from(value).ok().filter(|&v| v != 0)
    }

    /// `thread._name`, from the instance's attributes wherever this version keeps them.
    fn thread_name(&self, thread: u64) -> Result<Option<String>, PythonError> {
        let ty = self.type_of(thread)?;
        // Thread and its subclasses are classes whose metaclass is `type`.
        self.expect_type(ty, self.rt.type_type)?;
        let Some(attrs) = self.instance_attributes(thread, ty)? else {
            return Ok(None);
        };
        match self.get(&attrs, "_name")? {
            Some(name) => self.walker.string(name).map(Some),
            None => Ok(None),
        }
    }

    /// The table holding an object's instance attributes, `None` when it has none yet.
    fn instance_attributes(&self, obj: u64, ty: u64) -> Result<Option<Table>, PythonError> {
        let o = self.o;
        let flags = self.field(ty, o.type_flags)?;
        if !bit(flags, o.managed_dict_bit) {
            // _PyObject_GetDictPtr: a positive tp_dictoffset; negative ones belong to
            // variable-size objects, which a Thread is not.
            let offset = self.field(ty, o.type_dictoffset)? as i64;
            if offset <= 0 || offset as u64 > MAX_DICT_OFFSET || offset % 8 != 0 {
                return Err(PythonError::BadAddress(ty));
            }
            let dict = self.mem.read_u64(obj.wrapping_add(offset as u64))?;
            return if dict == 0 {
                Ok(None)
            } else {
                self.dict(dict).map(Some)
            };
        }
        if bit(flags, o.inline_values_bit) {
            // 3.13 _PyObject_InlineValues: right after the PyObject header, valid until the
            // attributes move to a dict of their own.
            if self.field(ty, o.type_basicsize)? != u64::from(o.object_size) {
                return Err(PythonError::BadAddress(ty));
            }
            let values = at(obj, o.object_size);
            if self.mem.read_u8(at(values, o.values_valid))? != 0 {
                return self.shared_keys(ty, flags, values).map(Some);
            }
        }
        if o.values_ptr_before != ABSENT {
            // 3.11 _PyObject_ValuesPointer: values until a dict is made from them.
            let values = self
                .mem
                .read_u64(obj.wrapping_sub(u64::from(o.values_ptr_before)))?;
            if values != 0 {
                return self.shared_keys(ty, flags, values).map(Some);
            }
        }
        let managed = self
            .mem
            .read_u64(obj.wrapping_sub(u64::from(o.managed_dict_before)))?;
        if o.dict_or_values_tag != ABSENT && managed & u64::from(o.dict_or_values_tag) != 0 {
            // 3.12 _PyDictOrValues_GetValues: the word holds values - 1.
            let values = managed.wrapping_add(u64::from(o.dict_or_values_tag));
            return self.shared_keys(ty, flags, values).map(Some);
        }
        if managed == 0 {
            return Ok(None);
        }
        self.dict(managed).map(Some)
    }

    /// Values indexed by the class's shared keys (`CACHED_KEYS`, `ht_cached_keys`).
    fn shared_keys(&self, ty: u64, flags: u64, values: u64) -> Result<Table, PythonError> {
        if !bit(flags, self.o.heaptype_bit) {
            return Err(PythonError::BadAddress(ty));
        }
        let keys = self.field(ty, self.o.heaptype_cached_keys)?;
        self.keys(keys, Some(values))
    }
}
