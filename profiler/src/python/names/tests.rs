//! The name offsets against each build's DWARF and headers, `thread_names` against every
//! installed interpreter's own `threading.enumerate()`, and against fake memory that is torn or
//! garbage. A missing build, header or gdb is a skip in the ledger (`skip_ledger::skip`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use super::super::debug_offsets::Described;
use super::super::memory::ProcessMemory;
use super::super::offsets::ABSENT;
use super::super::tests::{
    FakeMemory, PYENV, compare_fields, described_by_live_process, free_threaded_builds,
    free_threaded_lib, gdb_script, interpreters, libpython, pyenv_root, python_capability,
};
use super::super::version::{self, PythonRuntime};
use super::super::walk::{MAX_STRING, Walker};
use super::{MAX_DICT_ENTRIES, NameOffsets, for_version, thread_names, thread_names_at};
use crate::os::procs::ProcessRegistry;

fn dwarf_fields(o: &NameOffsets) -> Vec<(&'static str, u32)> {
    vec![
        ("runtime_interpreters_main", o.runtime_interpreters_main),
        ("interp_modules", o.interp_modules),
        ("module_dict", o.module_dict),
        ("var_size", o.var_size),
        ("type_basicsize", o.type_basicsize),
        ("type_flags", o.type_flags),
        ("type_dictoffset", o.type_dictoffset),
        ("heaptype_cached_keys", o.heaptype_cached_keys),
        ("dict_used", o.dict_used),
        ("dict_keys", o.dict_keys),
        ("dict_values", o.dict_values),
        ("keys_size", o.keys_size),
        ("keys_log2_size", o.keys_log2_size),
        ("keys_log2_index_bytes", o.keys_log2_index_bytes),
        ("keys_kind", o.keys_kind),
        ("keys_nentries", o.keys_nentries),
        ("keys_indices", o.keys_indices),
        ("entry_size", o.entry_size),
        ("entry_key", o.entry_key),
        ("entry_value", o.entry_value),
        ("unicode_entry_size", o.unicode_entry_size),
        ("unicode_entry_key", o.unicode_entry_key),
        ("unicode_entry_value", o.unicode_entry_value),
        ("values_capacity", o.values_capacity),
        ("values_valid", o.values_valid),
        ("values_values", o.values_values),
        ("long_tag", o.long_tag),
        ("long_digits", o.long_digits),
        ("object_size", o.object_size),
        ("digit_size", o.digit_size),
        ("kind_general", o.kind_general),
        ("kind_unicode", o.kind_unicode),
        ("kind_split", o.kind_split),
    ]
}

#[test]
fn name_offsets_match_dwarf() {
    if Command::new("gdb").arg("--version").output().is_err() {
        skip_ledger::skip("tool:gdb", "gdb is not installed");
        return;
    }
    for &(dir, minor) in PYENV {
        let lib = libpython(dir, minor);
        if !lib.exists() {
            skip_ledger::skip(
                &format!("python:3.{minor}"),
                format!("3.{minor}: {} is missing", lib.display()),
            );
            continue;
        }
        let text = gdb_script("python_name_offsets.py", &lib);
        let table = for_version(3, minor).expect("supported");
        let fields = dwarf_fields(table);
        compare_fields(&format!("3.{minor}"), &fields, &text);
        println!(
            "3.{minor}: {} name offsets agree with {}",
            fields.len(),
            lib.display()
        );
    }
    // The free-threaded builds: what the reader derives from each one's own description.
    for (label, prefix, minor) in free_threaded_builds() {
        let Some(lib) = free_threaded_lib(&label, &prefix, minor) else {
            continue;
        };
        let described =
            described_by_live_process(Command::new(prefix.join(format!("bin/python3.{minor}t"))));
        let table = super::described_names(minor, &described);
        let text = gdb_script("python_name_offsets.py", &lib);
        let fields = dwarf_fields(&table);
        compare_fields(&label, &fields, &text);
        println!(
            "{label}: {} name offsets agree with {}",
            fields.len(),
            lib.display()
        );
    }
}

/// What a free-threaded build's headers say of the constants the reader uses: the managed
/// dict pointer one word before the object (no GC links there), inline values right after the
/// larger header, the same type flags.
#[test]
fn free_threaded_constants_match_headers() {
    for (label, prefix, minor) in free_threaded_builds() {
        let inc = prefix.join(format!("include/python3.{minor}t"));
        if !inc.exists() {
            skip_ledger::skip(
                &python_capability(&label, minor),
                format!(
                    "{label}: {} is missing (cargo xtask free-threaded)",
                    inc.display()
                ),
            );
            continue;
        }
        let read = |rel: &str| {
            std::fs::read_to_string(inc.join(rel)).unwrap_or_else(|e| panic!("{label}: {rel}: {e}"))
        };
        let object_h = read("internal/pycore_object.h");
        assert!(
            contains_code(
                &object_h,
                &format!(
                    "#ifdef Py_GIL_DISABLED\n# define MANAGED_DICT_OFFSET (((Py_ssize_t)sizeof(PyObject *))*-{})",
                    super::FREE_THREADED_MANAGED_DICT_BEFORE / 8
                )
            ),
            "{label}: MANAGED_DICT_OFFSET"
        );
        // 3.14 puts them after tp_basicsize, which the reader requires to be the header's size.
        assert!(
            contains_code(
                &object_h,
                "return (PyDictValues *)((char *)obj + sizeof(PyObject));"
            ) || contains_code(
                &object_h,
                "return (PyDictValues *)((char *)obj + tp->tp_basicsize);"
            ),
            "{label}: inline values after the header"
        );
        // `PyASCIIObject.state`: 3.14t makes `interned` a byte of its own, moving `kind` to
        // bit 8; 3.13t keeps the 2-bit field.
        let unicode_h = read("cpython/unicodeobject.h");
        let byte_interned = contains_code(
            &unicode_h,
            "#ifdef Py_GIL_DISABLED\n// Needs to be accessed atomically, so can't be a bit field.\nunsigned char interned;",
        );
        let want = if minor >= 14 {
            super::super::debug_offsets::FREE_THREADED_UNICODE_KIND_SHIFT
        } else {
            super::super::debug_offsets::DEFAULT_UNICODE_KIND_SHIFT
        };
        let described =
            described_by_live_process(Command::new(prefix.join(format!("bin/python3.{minor}t"))));
        assert_eq!(described.unicode_kind_shift, want, "{label}");
        assert_eq!(byte_interned, minor >= 14, "{label}: interned's width");
        let public = read("object.h");
        let o = for_version(3, 13).unwrap();
        for (name, bit) in [
            ("Py_TPFLAGS_HEAPTYPE", o.heaptype_bit),
            ("Py_TPFLAGS_MANAGED_DICT", o.managed_dict_bit),
            ("Py_TPFLAGS_INLINE_VALUES", o.inline_values_bit),
        ] {
            assert_eq!(flag_bit(&public, name), Some(bit), "{label}: {name}");
        }
        println!(
            "{label}: the free-threaded constants agree with {}",
            inc.display()
        );
    }
}

/// Whitespace-insensitive: whether `snippet` occurs in `text`.
fn contains_code(text: &str, snippet: &str) -> bool {
    let squash = |s: &str| s.split_whitespace().collect::<String>();
    squash(text).contains(&squash(snippet))
}

/// The bit number of `#define NAME (1 << N)` / `(1UL << N)` in `text`.
fn flag_bit(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|l| {
        let rest = l.trim().strip_prefix("#define")?.trim_start();
        let rest = rest.strip_prefix(name)?;
        let shift = rest.split("<<").nth(1)?;
        shift.trim().trim_end_matches(')').trim().parse().ok()
    })
}

/// The preprocessor constants and inline-function layouts of the table, against the headers
/// each pyenv build installed (DWARF of a `-g` build has no macros).
#[test]
fn name_constants_match_headers() {
    for &(dir, minor) in PYENV {
        let inc = pyenv_root().join(format!("{dir}/include/python3.{minor}"));
        if !inc.exists() {
            skip_ledger::skip(
                &format!("python:3.{minor}"),
                format!("3.{minor}: {} is missing", inc.display()),
            );
            continue;
        }
        let read = |rel: &str| {
            std::fs::read_to_string(inc.join(rel))
                .unwrap_or_else(|e| panic!("3.{minor}: {rel}: {e}"))
        };
        let o = for_version(3, minor).unwrap();
        let object_h = read("object.h");
        let bit_of = |name: &str| flag_bit(&object_h, name).unwrap_or(ABSENT);
        assert_eq!(bit_of("Py_TPFLAGS_HEAPTYPE"), o.heaptype_bit, "3.{minor}");
        assert_eq!(
            bit_of("Py_TPFLAGS_MANAGED_DICT"),
            o.managed_dict_bit,
            "3.{minor}"
        );
        assert_eq!(
            bit_of("Py_TPFLAGS_INLINE_VALUES"),
            o.inline_values_bit,
            "3.{minor}"
        );

        // 30-bit digits are uint32_t, 15-bit ones unsigned short (longintrepr.h).
        let longintrepr = if minor >= 11 {
            read("cpython/longintrepr.h")
        } else {
            read("longintrepr.h")
        };
        assert!(
            contains_code(
                &longintrepr,
                &format!(
                    "#if PYLONG_BITS_IN_DIGIT == {0}\ntypedef uint32_t digit;",
                    o.long_shift
                )
            ) && o.digit_size == 4,
            "3.{minor}: PyLong_SHIFT {}",
            o.long_shift
        );
        if o.long_tag != ABSENT {
            for (name, value) in [
                ("_PyLong_SIGN_MASK", o.long_sign_mask),
                ("_PyLong_NON_SIZE_BITS", o.long_non_size_bits),
            ] {
                assert!(
                    contains_code(&longintrepr, &format!("#define {name} {value}\n")),
                    "3.{minor}: {name} {value}"
                );
            }
        } else {
            assert_eq!(o.long_sign_mask, ABSENT);
            assert_eq!(o.long_non_size_bits, ABSENT);
        }

        let mut layout = Vec::new();
        if o.values_ptr_before != ABSENT {
            layout.push(format!(
                "return ((PyDictValues **)obj)-{};",
                o.values_ptr_before / 8
            ));
        }
        if o.dict_or_values_tag != ABSENT {
            layout.push(format!(
                "return ((PyDictOrValues *)obj)-{};",
                o.managed_dict_before / 8
            ));
            layout.push(format!(
                "return ((uintptr_t)dorv.values) & {};",
                o.dict_or_values_tag
            ));
            layout.push(format!(
                "return (PyDictValues *)(dorv.values + {});",
                o.dict_or_values_tag
            ));
        } else if o.managed_dict_before != ABSENT {
            // 3.11 declares it as int, 3.13 as Py_ssize_t (3.13 also has the -1 of
            // free-threaded builds, which detection refuses).
            let ty = if minor == 11 { "int" } else { "Py_ssize_t" };
            layout.push(format!(
                "#define MANAGED_DICT_OFFSET ((({ty})sizeof(PyObject *))*-{})",
                o.managed_dict_before / 8
            ));
        }
        if o.inline_values_bit != ABSENT {
            assert_eq!(o.object_size, 16);
            layout.push("return (PyDictValues *)((char *)obj + sizeof(PyObject));".into());
        }
        let internal = read("internal/pycore_object.h");
        for snippet in &layout {
            assert!(
                contains_code(&internal, snippet),
                "3.{minor}: pycore_object.h lacks {snippet}"
            );
        }
        if o.keys_log2_index_bytes != ABSENT {
            // DK_ENTRIES: the entries follow 1 << dk_log2_index_bytes bytes of indices.
            let dict_h = read("internal/pycore_dict.h");
            assert!(
                contains_code(&dict_h, "(size_t)1 << (dk)->dk_log2_index_bytes")
                    || contains_code(&dict_h, "(size_t)1 << dk->dk_log2_index_bytes"),
                "3.{minor}: DK_ENTRIES"
            );
        }
        println!(
            "3.{minor}: flags, int layout and {} object-layout facts agree with {}",
            layout.len(),
            inc.display()
        );
    }
}

/// Threads with known names in every state an instance's attributes can be in, blocked in
/// `Event.wait`; prints `threading`'s own view as JSON, then `ready`.
const THREADS_SNIPPET: &str = r#"
import _thread, json, sys, threading, time

release = threading.Event()

def wait():
    release.wait()

class Worker(threading.Thread):
    def run(self):
        release.wait()

threads = [
    threading.Thread(name="worker-\u03b1", target=wait, daemon=True),
    threading.Thread(target=wait, daemon=True),
    Worker(name="sub \U0001f525", daemon=True),
    threading.Thread(name="x" * 2000, target=wait, daemon=True),
    threading.Thread(name="materialized", target=wait, daemon=True),
    threading.Thread(name="many attributes", target=wait, daemon=True),
]
# The attributes moved from split/inline values into a dict made for __dict__, and into a
# combined table grown past the shared keys.
threads[4].__dict__
vars(threads[5]).update(("extra_%d" % i, i) for i in range(40))
for t in threads:
    t.start()

bare = []
hold = _thread.allocate_lock()
hold.acquire()
up = _thread.allocate_lock()
up.acquire()
def bare_thread():
    bare.append(_thread.get_ident())
    up.release()
    hold.acquire()
_thread.start_new_thread(bare_thread, ())
up.acquire()

# Before 3.10 a thread is moved from _limbo to _active after start() returns.
while not all(t.ident in threading._active for t in threads):
    time.sleep(0.01)
print(json.dumps({
    "names": {str(t.ident): t.name for t in threading.enumerate()},
    "bare": bare[0],
}), flush=True)
print("ready", flush=True)
release.wait()
"#;

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cut(name: &str) -> String {
    if name.chars().count() > MAX_STRING {
        let mut s: String = name.chars().take(MAX_STRING).collect();
        s.push('…');
        s
    } else {
        name.to_string()
    }
}

#[test]
fn thread_names_match_threading() {
    for (label, bin, minor) in interpreters() {
        if !bin.exists() {
            skip_ledger::skip(
                &python_capability(&label, minor),
                format!("{label}: {} is missing", bin.display()),
            );
            continue;
        }
        let mut child = Command::new(&bin)
            .args(["-c", THREADS_SNIPPET])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python starts");
        let stdout = child.stdout.take().unwrap();
        let child = Reaped(child);
        let mut lines = BufReader::new(stdout).lines();
        let json = lines.next().expect("a line").expect("utf-8");
        assert_eq!(lines.next().unwrap().unwrap(), "ready", "{label}");
        let view: serde_json::Value = serde_json::from_str(&json).expect("JSON");
        let expected: HashMap<u64, String> = view["names"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), cut(v.as_str().unwrap())))
            .collect();
        let bare = view["bare"].as_u64().unwrap();

        let pid = child.0.id();
        let mut registry = ProcessRegistry::with_proc_root("/proc");
        let rt = version::detect(registry.observe(pid).unwrap()).unwrap();
        assert_eq!(rt.version.minor, minor, "{label}");
        let mem = ProcessMemory::new(pid);
        let layout = super::super::debug_offsets::for_process(&mem, &rt).unwrap();
        let names = thread_names(&mem, &rt, &layout).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(names, expected, "{label}");
        assert_eq!(names.len(), 7, "{label}: main thread and six workers");
        let values: Vec<&str> = names.values().map(String::as_str).collect();
        for name in [
            "MainThread",
            "worker-α",
            "sub 🔥",
            "materialized",
            "many attributes",
        ] {
            assert!(values.contains(&name), "{label}: no {name:?} in {values:?}");
        }
        assert!(
            values.iter().any(|n| n.starts_with("Thread-")),
            "{label}: no default name in {values:?}"
        );
        assert!(
            values
                .iter()
                .any(|n| n.ends_with('…') && n.len() > MAX_STRING)
        );

        // The idents are the walker's thread ids; the _thread-started thread is walked but
        // has no name.
        let snapshot = Walker::new(&mem, &layout, &rt).snapshot().unwrap();
        let ids: Vec<u64> = snapshot.threads.iter().map(|t| t.thread_id).collect();
        for ident in names.keys() {
            assert!(ids.contains(ident), "{label}: {ident:#x} not in {ids:x?}");
        }
        assert!(ids.contains(&bare), "{label}: bare thread not walked");
        assert!(!names.contains_key(&bare), "{label}: bare thread named");
        let short: Vec<String> = values
            .iter()
            .map(|n| match n.char_indices().nth(24) {
                Some((i, _)) => format!("{}…({} chars)", &n[..i], n.chars().count()),
                None => n.to_string(),
            })
            .collect();
        println!("{label}: {} thread names agree: {short:?}", names.len());
    }
}

/// A 3.11 image: sys.modules → threading → _active {ident: thread}, the thread's `_name` in
/// values indexed by its class's shared keys.
struct Image {
    mem: FakeMemory,
    rt: PythonRuntime,
    o: &'static NameOffsets,
}

const IDENT: u64 = 0x7f12_3456_7000;
const MODULES_KEYS: u64 = 0x4000;
const ACTIVE_KEYS: u64 = 0xb000;
const THREAD: u64 = 0xd100;
const CACHED_KEYS: u64 = 0x10000;
const NAME: u64 = 0x14000;

fn image() -> Image {
    let rt = PythonRuntime {
        version: version::from_hexversion(0x030b07f0),
        path: "libpython3.11.so".into(),
        runtime: 0x1000,
        code_type: 0xc0de_0000,
        unicode_type: 0x57a0_0000,
        bytes_type: 0xb7e5_0000,
        dict_type: 0xd1c7_0000,
        long_type: 0x1019_0000,
        module_type: 0x30d0_0000,
        type_type: 0x7e9e_0000,
        cfunction_type: 0,
        method_type: 0,
        function_type: 0,
    };
    let o = for_version(3, 11).unwrap();
    let b = super::super::offsets::for_version(3, 11).unwrap();
    let at = |base: u64, off: u32| base + u64::from(off);
    let mut m = FakeMemory::default();
    let string = |m: &mut FakeMemory, addr: u64, text: &str| {
        m.put_u64(at(addr, b.object_type), rt.unicode_type);
        m.put_u64(at(addr, b.unicode_length), text.len() as u64);
        m.put(
            at(addr, b.unicode_state),
            &((1u32 << 2) | (1 << 5) | (1 << 6)).to_le_bytes(),
        );
        m.put(at(addr, b.unicode_ascii_data), text.as_bytes());
    };
    // A dict at `dict` over a table at `keys` of one kind, with (key, value) entries.
    let table = |m: &mut FakeMemory, keys: u64, kind: u32, entries: &[(u64, u64)]| {
        m.put(at(keys, o.keys_log2_size), &[3]);
        m.put(at(keys, o.keys_log2_index_bytes), &[3]);
        m.put(at(keys, o.keys_kind), &[kind as u8]);
        m.put_u64(at(keys, o.keys_nentries), entries.len() as u64);
        let first = at(keys, o.keys_indices) + 8;
        for (i, &(k, v)) in entries.iter().enumerate() {
            if kind == o.kind_general {
                let e = first + (i as u64) * u64::from(o.entry_size);
                m.put_u64(at(e, o.entry_key), k);
                m.put_u64(at(e, o.entry_value), v);
            } else {
                let e = first + (i as u64) * u64::from(o.unicode_entry_size);
                m.put_u64(at(e, o.unicode_entry_key), k);
                m.put_u64(at(e, o.unicode_entry_value), v);
            }
        }
    };
    let dict = |m: &mut FakeMemory, dict: u64, keys: u64, used: u64| {
        m.put_u64(at(dict, b.object_type), rt.dict_type);
        m.put_u64(at(dict, o.dict_used), used);
        m.put_u64(at(dict, o.dict_keys), keys);
    };

    m.put_u64(at(rt.runtime, o.runtime_interpreters_main), 0x2000);
    m.put_u64(at(0x2000, o.interp_modules), 0x3000);
    dict(&mut m, 0x3000, MODULES_KEYS, 2);
    string(&mut m, 0x5000, "sys");
    string(&mut m, 0x5800, "threading");
    table(
        &mut m,
        MODULES_KEYS,
        o.kind_unicode,
        &[(0x5000, 0x9999_0000), (0x5800, 0x6000)],
    );
    m.put_u64(at(0x6000, b.object_type), rt.module_type);
    m.put_u64(at(0x6000, o.module_dict), 0x7000);
    dict(&mut m, 0x7000, 0x8000, 1);
    string(&mut m, 0x9000, "_active");
    table(&mut m, 0x8000, o.kind_unicode, &[(0x9000, 0xa000)]);
    dict(&mut m, 0xa000, ACTIVE_KEYS, 1);
    table(&mut m, ACTIVE_KEYS, o.kind_general, &[(0xc000, THREAD)]);
    m.put_u64(at(0xc000, b.object_type), rt.long_type);
    m.put_u64(at(0xc000, o.var_size), 2);
    m.put(
        at(0xc000, o.long_digits),
        &((IDENT & 0x3fff_ffff) as u32).to_le_bytes(),
    );
    m.put(
        at(0xc000, o.long_digits) + 4,
        &((IDENT >> 30) as u32).to_le_bytes(),
    );
    m.put_u64(at(THREAD, b.object_type), 0xe000);
    m.put_u64(THREAD - u64::from(o.values_ptr_before), 0xf000);
    m.put_u64(at(0xe000, b.object_type), rt.type_type);
    m.put_u64(
        at(0xe000, o.type_flags),
        (1 << o.heaptype_bit) | (1 << o.managed_dict_bit),
    );
    m.put_u64(at(0xe000, o.heaptype_cached_keys), CACHED_KEYS);
    string(&mut m, 0x11000, "_target");
    string(&mut m, 0x12000, "_name");
    table(
        &mut m,
        CACHED_KEYS,
        o.kind_split,
        &[(0x11000, 0), (0x12000, 0)],
    );
    m.put_u64(0xf000, 0x13000);
    m.put_u64(0xf008, NAME);
    string(&mut m, NAME, "fake-worker");
    Image { mem: m, rt, o }
}

fn names_of(img: &Image) -> Result<HashMap<u64, String>, super::PythonError> {
    let base = super::super::offsets::for_version(3, 11).unwrap();
    thread_names(&img.mem, &img.rt, &Described::tabled(*base))
}

#[test]
fn fake_image_reads_back() {
    let img = image();
    let names = names_of(&img).unwrap();
    assert_eq!(names, HashMap::from([(IDENT, "fake-worker".to_string())]));
}

/// An agent reads one process's names again and again: a read takes `threading._active` from
/// where the read before found it (here `sys.modules` leads nowhere after the first read, and
/// the names still come), and an address that no longer holds a dict is searched for again.
#[test]
fn threading_active_is_taken_from_where_it_was_found() {
    let mut img = image();
    let base = super::super::offsets::for_version(3, 11).unwrap();
    let layout = Described::tabled(*base);
    let expected = HashMap::from([(IDENT, "fake-worker".to_string())]);
    let mut active = None;
    let names = thread_names_at(&img.mem, &img.rt, &layout, &mut active).unwrap();
    assert_eq!(names, expected);
    assert_eq!(active, Some(0xa000));

    let modules = 0x2000 + u64::from(img.o.interp_modules);
    img.mem.put_u64(modules, 0);
    assert!(names_of(&img).is_err(), "the search itself fails now");
    let names = thread_names_at(&img.mem, &img.rt, &layout, &mut active).unwrap();
    assert_eq!(names, expected);
    assert_eq!(active, Some(0xa000));

    img.mem.put_u64(modules, 0x3000);
    // The threading module object: not a dict.
    let mut stale = Some(0x6000);
    let names = thread_names_at(&img.mem, &img.rt, &layout, &mut stale).unwrap();
    assert_eq!(names, expected);
    assert_eq!(stale, Some(0xa000));
}

#[test]
fn torn_tables_give_errors_or_no_names() {
    let o = for_version(3, 11).unwrap();
    let at = |base: u64, off: u32| base + u64::from(off);
    let b = super::super::offsets::for_version(3, 11).unwrap();
    // (what, address, bytes, whether the whole read fails rather than one thread's name)
    let cases: Vec<(&str, u64, Vec<u8>, bool)> = vec![
        (
            "index width not matching the size",
            at(MODULES_KEYS, o.keys_log2_index_bytes),
            vec![7],
            true,
        ),
        (
            "more entries than a table of that size holds",
            at(MODULES_KEYS, o.keys_nentries),
            1_000_000u64.to_le_bytes().to_vec(),
            true,
        ),
        (
            "negative entry count",
            at(ACTIVE_KEYS, o.keys_nentries),
            (-1i64).to_le_bytes().to_vec(),
            true,
        ),
        ("unknown kind", at(ACTIVE_KEYS, o.keys_kind), vec![9], true),
        (
            "huge table",
            at(ACTIVE_KEYS, o.keys_log2_size),
            vec![62],
            true,
        ),
        (
            "_active is not a dict",
            at(0xa000, b.object_type),
            0x1234u64.to_le_bytes().to_vec(),
            true,
        ),
        (
            "shared keys not split",
            at(CACHED_KEYS, o.keys_kind),
            vec![o.kind_unicode as u8],
            false,
        ),
        (
            "thread's class not a class",
            at(0xe000, b.object_type),
            0u64.to_le_bytes().to_vec(),
            false,
        ),
        (
            "name not a str",
            at(NAME, b.object_type),
            0x1019_0000u64.to_le_bytes().to_vec(),
            false,
        ),
        (
            "name with a torn length",
            at(NAME, b.unicode_length),
            (-5i64).to_le_bytes().to_vec(),
            false,
        ),
        (
            "ident negative",
            at(0xc000, o.var_size),
            (-2i64).to_le_bytes().to_vec(),
            false,
        ),
        (
            "ident with a digit over 30 bits",
            at(0xc000, o.long_digits),
            u32::MAX.to_le_bytes().to_vec(),
            false,
        ),
        (
            "ident too long for 64 bits",
            at(0xc000, o.var_size),
            4u64.to_le_bytes().to_vec(),
            false,
        ),
        (
            "values pointer unmapped",
            THREAD - u64::from(o.values_ptr_before),
            0xdead_0000u64.to_le_bytes().to_vec(),
            false,
        ),
    ];
    for (what, addr, bytes, fatal) in cases {
        let mut img = image();
        img.mem.put(addr, &bytes);
        match names_of(&img) {
            Ok(names) => {
                assert!(!fatal, "{what}: read anyway: {names:?}");
                assert!(names.is_empty(), "{what}: {names:?}");
            }
            Err(e) => assert!(fatal, "{what}: the whole read failed: {e}"),
        }
    }

    // No `threading` in sys.modules: no names, not an error.
    let mut img = image();
    img.mem.put(at(0x5800, b.unicode_ascii_data), b"threadinh");
    assert_eq!(names_of(&img).unwrap(), HashMap::new());
}

/// xorshift64*: deterministic garbage.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Pages of random words, many of them pointers back into the pages or type addresses, under
/// every version's layout: an error or some names, never a panic, a hang or a huge buffer.
#[test]
fn garbage_never_panics() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let img = image();
    let types = [
        img.rt.dict_type,
        img.rt.long_type,
        img.rt.module_type,
        img.rt.type_type,
        img.rt.unicode_type,
    ];
    let mut runs = 0;
    for round in 0..300 {
        let mut m = FakeMemory::default();
        let pages: Vec<u64> = (0..24).map(|i| 0x10_0000 + i * 0x1000).collect();
        for &page in &pages {
            for w in 0..512u64 {
                let value = match rng.next() % 8 {
                    0..=2 => {
                        pages[(rng.next() % pages.len() as u64) as usize] + (rng.next() % 512) * 8
                    }
                    3 => types[(rng.next() % types.len() as u64) as usize],
                    4 => rng.next() % 16,
                    5 => 0,
                    _ => rng.next(),
                };
                m.put_u64(page + w * 8, value);
            }
        }
        for (minor, hex) in [
            (8, 0x030812f0u64),
            (9, 0x030912f0),
            (10, 0x030a0df0),
            (11, 0x030b07f0),
            (12, 0x030c01f0),
            (13, 0x030d00f0),
        ] {
            let rt = PythonRuntime {
                version: version::from_hexversion(hex),
                runtime: pages[round % pages.len()],
                ..img.rt.clone()
            };
            assert_eq!(rt.version.minor, minor);
            // 3.13 describes itself; its objects' headers are 3.12's.
            let base = super::super::offsets::for_version(3, minor.min(12)).unwrap();
            let layout = Described {
                interp_modules: 7656,
                ..Described::tabled(*base)
            };
            if let Ok(names) = thread_names(&m, &rt, &layout) {
                assert!(names.len() <= MAX_DICT_ENTRIES);
                assert!(names.values().all(|n| n.chars().count() <= MAX_STRING + 1));
            }
            runs += 1;
        }
    }
    assert_eq!(runs, 1800);
    let _ = img.o;
}

/// The valid 3.11 image with a few words or bytes of its objects overwritten, as a read racing
/// the interpreter might see it: never a panic, names stay bounded.
#[test]
fn torn_images_never_panic() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let objects = [
        0x1000u64,
        0x2000,
        0x3000,
        MODULES_KEYS,
        0x5000,
        0x5800,
        0x6000,
        0x7000,
        0x8000,
        0x9000,
        0xa000,
        ACTIVE_KEYS,
        0xc000,
        THREAD - 32,
        THREAD,
        0xe000,
        0xf000,
        CACHED_KEYS,
        0x11000,
        0x12000,
        NAME,
    ];
    let mut named = 0;
    for _ in 0..3000 {
        let mut img = image();
        for _ in 0..1 + rng.next() % 3 {
            let addr = objects[(rng.next() % objects.len() as u64) as usize] + rng.next() % 72;
            if rng.next() & 1 == 0 {
                img.mem.put(addr, &[rng.next() as u8]);
            } else {
                img.mem.put_u64(addr & !7, rng.next() % 0x20000);
            }
        }
        if let Ok(names) = names_of(&img) {
            for (ident, name) in &names {
                assert!(name.chars().count() <= MAX_STRING + 1);
                if *ident == IDENT && name == "fake-worker" {
                    named += 1;
                }
            }
        }
    }
    // Most single-word tears hit bytes no read depends on.
    assert!(named > 300, "only {named} images still read back");
}
