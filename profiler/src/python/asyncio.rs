//! asyncio task stacks (`--async`): what the kernel needs to find a thread's running task and
//! the tasks awaiting it (`ebpf/src/bpf/pyasync.h`), and the names the agent gives them.
//!
//! The kernel reads `_asyncio`'s objects with two kinds of numbers. Structure offsets of the
//! C `Task`/`Future`, coroutine, closure and callable objects are private to each minor
//! version and come from [`for_version`], a table read from the DWARF of pyenv's 3.11.7,
//! 3.12.1 and 3.13.0 (`lib-dynload/_asyncio.cpython-3XX-*.so` and `libpython3.X.so.1.0`) by
//! `scripts/python_asyncio_offsets.py` under gdb; `asyncio_offsets_match_dwarf` re-checks it
//! against every installed build. Addresses (the `_current_tasks` dict, the `Task`, `Future`
//! and `TaskGroup` classes, where a TaskGroup keeps `_parent_task`) are the process's: read
//! from its `sys.modules` once `asyncio` is imported ([`discover`]).

use std::path::Path;

use object::{Object, ObjectSection};
use pyrometer_ebpf::{
    PY_ABSENT, PY_VALUES_INLINE, PY_VALUES_NONE, PY_VALUES_POINTER, PY_VALUES_TAGGED, PyAsync,
};

use super::PythonError;
use super::debug_offsets::Described;
use super::memory::Memory;
use super::names::{self, Reader};
use super::offsets::ABSENT;
use super::version::PythonRuntime;
use crate::os::untrusted::{Kind, Root, UntrustedFile};

/// The private layouts of one minor version's asyncio objects (byte offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncOffsets {
    /// `FutureObj.fut_callback0`, `.fut_callbacks` (a Task begins with the same fields).
    pub fut_callback0: u32,
    pub fut_callbacks: u32,
    pub task_coro: u32,
    pub task_name: u32,
    /// `PyGenObject.gi_iframe` (a coroutine's is at the same place).
    pub gen_iframe: u32,
    /// `PyCFunctionObject.m_self`, `PyMethodObject.im_self`, `PyFunctionObject.func_closure`,
    /// `PyCellObject.ob_ref`.
    pub cfunction_self: u32,
    pub method_self: u32,
    pub function_closure: u32,
    pub cell_ref: u32,
    /// `PyTypeObject.tp_base`, `PyTupleObject.ob_item`, `PyListObject.ob_item`,
    /// `PyVarObject.ob_size`.
    pub type_base: u32,
    pub tuple_items: u32,
    pub list_items: u32,
    pub var_size: u32,
}

const COMMON: AsyncOffsets = AsyncOffsets {
    fut_callback0: 24,
    fut_callbacks: 40,
    task_coro: 0,
    task_name: 0,
    gen_iframe: 0,
    cfunction_self: 24,
    method_self: 24,
    function_closure: 72,
    cell_ref: 16,
    type_base: 256,
    tuple_items: 24,
    list_items: 24,
    var_size: 16,
};

/// The layouts of CPython 3.`minor` (GIL builds), `None` where there is no table. For 3.14
/// and 3.15 (Debian forky's, checked against their `-dbg` DWARF) the task's own fields are
/// taken from the interpreter's [`AsyncioDebug`] instead; the rest is the table's.
pub fn for_version(major: u32, minor: u32) -> Option<AsyncOffsets> {
    let (task_coro, task_name, gen_iframe, tuple_items) = match (major, minor) {
        (3, 11) => (136, 144, 80, 24),
        (3, 12) => (136, 144, 72, 24),
        (3, 13) => (120, 128, 72, 24),
        // Tuples cache their hash from 3.14 on.
        (3, 14) | (3, 15) => (128, 136, 72, 32),
        _ => return None,
    };
    Some(AsyncOffsets {
        task_coro,
        task_name,
        gen_iframe,
        tuple_items,
        ..COMMON
    })
}

/// `_Py_AsyncioModuleDebugOffsets` (3.14+), which the `_asyncio` module keeps in an
/// `.AsyncioDebug` section of its object (the extension module, or the interpreter binary
/// where it is built in): sizes and field offsets of the task, interpreter and thread-state
/// parts `asyncio` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncioDebug {
    pub task_size: u64,
    pub task_name: u64,
    pub task_awaited_by: u64,
    pub task_is_task: u64,
    pub task_awaited_by_is_set: u64,
    pub task_coro: u64,
    pub task_node: u64,
    pub interp_size: u64,
    pub interp_tasks_head: u64,
    pub tstate_size: u64,
    pub tstate_running_loop: u64,
    pub tstate_running_task: u64,
    pub tstate_tasks_head: u64,
}

/// The section's name.
const ASYNCIO_DEBUG_SECTION: &str = ".AsyncioDebug";
/// Sizes past this are not believed (a thread state is about a kilobyte).
const MAX_DEBUG_STRUCT: u64 = 1 << 20;

impl AsyncioDebug {
    /// The 13 words of the section, checked: every size plausible, every offset inside its
    /// structure.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let w = |i: usize| -> Result<u64, String> {
            let b = bytes
                .get(i * 8..i * 8 + 8)
                .ok_or_else(|| format!("{ASYNCIO_DEBUG_SECTION} has {} bytes", bytes.len()))?;
            Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        let d = Self {
            task_size: w(0)?,
            task_name: w(1)?,
            task_awaited_by: w(2)?,
            task_is_task: w(3)?,
            task_awaited_by_is_set: w(4)?,
            task_coro: w(5)?,
            task_node: w(6)?,
            interp_size: w(7)?,
            interp_tasks_head: w(8)?,
            tstate_size: w(9)?,
            tstate_running_loop: w(10)?,
            tstate_running_task: w(11)?,
            tstate_tasks_head: w(12)?,
        };
        let fields = [
            ("asyncio_task_object.task_name", d.task_name, 8, d.task_size),
            (
                "asyncio_task_object.task_awaited_by",
                d.task_awaited_by,
                8,
                d.task_size,
            ),
            (
                "asyncio_task_object.task_awaited_by_is_set",
                d.task_awaited_by_is_set,
                1,
                d.task_size,
            ),
            ("asyncio_task_object.task_coro", d.task_coro, 8, d.task_size),
            (
                "asyncio_thread_state.asyncio_running_task",
                d.tstate_running_task,
                8,
                d.tstate_size,
            ),
        ];
        for (name, at, len, size) in fields {
            if size == 0 || size > MAX_DEBUG_STRUCT || at.saturating_add(len) > size {
                return Err(format!(
                    "{ASYNCIO_DEBUG_SECTION}: {name} ({at}) is outside its structure ({size} bytes)"
                ));
            }
        }
        Ok(d)
    }
}

/// The `_asyncio` description of process `pid` (3.14+): from the `.AsyncioDebug` section of the
/// interpreter binary (`_asyncio` built in) or of a mapped `_asyncio.*.so`, each opened through
/// the process's `map_files` (the very file mapped, wherever its root is) and read sections
/// only. `None` while neither has it (the module not imported yet).
pub fn find_debug(proc_root: &Path, pid: u32, rt: &PythonRuntime) -> Option<AsyncioDebug> {
    let pid_dir = proc_root.join(pid.to_string());
    let maps = std::fs::read_to_string(pid_dir.join("maps")).ok()?;
    let mut seen: Vec<&str> = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(path)) = (fields.next(), fields.nth(4)) else {
            continue;
        };
        let name = path.rsplit('/').next().unwrap_or(path);
        let wanted = name.starts_with("_asyncio.") || path == rt.path;
        if !wanted || seen.contains(&path) {
            continue;
        }
        seen.push(path);
        let link = pid_dir.join("map_files").join(range);
        // Without the capability map_files needs (an agent that dropped it), the path is
        // resolved in the process's root, less the root's own place in ours (a chroot's
        // mappings show the host path).
        let file = UntrustedFile::open_map_file(&link, Kind::Elf).or_else(|_| {
            let root = Root::of_process(proc_root, pid).map_err(|e| e.to_string())?;
            let prefix = std::fs::read_link(pid_dir.join("root")).unwrap_or_default();
            let inner = Path::new(path)
                .strip_prefix(&prefix)
                .unwrap_or(Path::new(path));
            let inner = Path::new("/").join(inner);
            UntrustedFile::open_in_root(&root, &inner, Kind::Elf).map_err(|e| e.to_string())
        });
        let Ok(file) = file else {
            continue;
        };
        let Ok(copy) = file.copy_elf_sections(&[ASYNCIO_DEBUG_SECTION]) else {
            continue;
        };
        let found = object::File::parse(&*copy).ok().and_then(|elf| {
            let data = elf.section_by_name(ASYNCIO_DEBUG_SECTION)?.data().ok()?;
            AsyncioDebug::parse(data).ok()
        });
        if found.is_some() {
            return found;
        }
    }
    None
}

/// An offset for the kernel (`u32`), within the checked structure.
fn narrow(at: u64) -> u32 {
    u32::try_from(at).unwrap_or(PY_ABSENT)
}

/// Why `--async` cannot follow a process's tasks (said once per process), `None` when it can.
pub fn unsupported(rt: &PythonRuntime, layout: &Described) -> Option<String> {
    let v = rt.version;
    if layout.free_threaded {
        return Some(format!(
            "asyncio tasks of free-threaded {v} are not followed"
        ));
    }
    if for_version(v.major, v.minor).is_none() {
        return Some(format!(
            "asyncio tasks of Python {v} are not followed (3.11-3.15 are)"
        ));
    }
    if rt.cfunction_type == 0 || rt.method_type == 0 || rt.function_type == 0 {
        return Some(format!(
            "asyncio tasks not followed: {} does not export PyCFunction_Type, PyMethod_Type and PyFunction_Type",
            rt.path
        ));
    }
    None
}

/// The kernel's description of a process's asyncio objects: `None` while `asyncio` is not
/// imported (or, 3.14+, its description `debug` not found); before 3.14, `taskgroup_type`
/// stays 0 until a TaskGroup has been made (its class learns where `_parent_task` goes from
/// its first instance).
pub fn discover<M: Memory>(
    mem: &M,
    rt: &PythonRuntime,
    layout: &Described,
    debug: Option<&AsyncioDebug>,
) -> Result<Option<PyAsync>, PythonError> {
    let Some(mut off) = for_version(rt.version.major, rt.version.minor) else {
        return Ok(None);
    };
    let described = rt.version.minor >= 14;
    if described {
        let Some(d) = debug else {
            return Ok(None);
        };
        off.task_coro = narrow(d.task_coro);
        off.task_name = narrow(d.task_name);
    }
    names::with_reader(mem, rt, layout, |r| {
        let Some(asyncio) = module_globals(r, rt, "_asyncio")? else {
            return Ok(None);
        };
        let (Some(task), Some(future)) = (r.get(&asyncio, "Task")?, r.get(&asyncio, "Future")?)
        else {
            return Ok(None);
        };
        let current = if described {
            0
        } else {
            let Some(current) = r.get(&asyncio, "_current_tasks")? else {
                return Ok(None);
            };
            r.expect_type(current, rt.dict_type)?;
            current
        };
        let o = r.o;
        let mut a = PyAsync {
            current_tasks: current,
            task_type: task,
            future_type: future,
            cfunction_type: rt.cfunction_type,
            method_type: rt.method_type,
            function_type: rt.function_type,
            taskgroup_type: 0,
            dict_keys: o.dict_keys,
            keys_log2_index_bytes: o.keys_log2_index_bytes,
            keys_nentries: o.keys_nentries,
            keys_indices: o.keys_indices,
            entry_size: o.entry_size,
            entry_value: o.entry_value,
            fut_callback0: off.fut_callback0,
            fut_callbacks: off.fut_callbacks,
            task_coro: off.task_coro,
            task_name: off.task_name,
            gen_iframe: off.gen_iframe,
            cfunction_self: off.cfunction_self,
            method_self: off.method_self,
            function_closure: off.function_closure,
            cell_ref: off.cell_ref,
            type_base: off.type_base,
            tuple_items: off.tuple_items,
            list_items: off.list_items,
            var_size: off.var_size,
            tg_values_mode: PY_VALUES_NONE,
            tg_values_at: 0,
            tg_valid_at: 0,
            tg_parent_at: 0,
            tstate_running_task: PY_ABSENT,
            fut_awaited_by: PY_ABSENT,
            fut_awaited_by_is_set: PY_ABSENT,
            reserved: 0,
        };
        if let Some(d) = debug.filter(|_| described) {
            a.tstate_running_task = narrow(d.tstate_running_task);
            a.fut_awaited_by = narrow(d.task_awaited_by);
            a.fut_awaited_by_is_set = narrow(d.task_awaited_by_is_set);
            // Nothing more to find: the futures say who awaits them.
            return Ok(Some(a));
        }
        if let Some(groups) = module_globals(r, rt, "asyncio.taskgroups")?
            && let Some(class) = r.get(&groups, "TaskGroup")?
            && let Some(place) = parent_task_place(r, class)?
        {
            a.taskgroup_type = class;
            (
                a.tg_values_mode,
                a.tg_values_at,
                a.tg_valid_at,
                a.tg_parent_at,
            ) = place;
        }
        Ok(Some(a))
    })
}

/// The globals of the module `name` in `sys.modules`, `None` when it is not imported.
fn module_globals<M: Memory>(
    r: &Reader<'_, M>,
    rt: &PythonRuntime,
    name: &str,
) -> Result<Option<names::Table>, PythonError> {
    let o = r.o;
    let interp = r.field(rt.runtime, o.runtime_interpreters_main)?;
    if interp == 0 {
        return Ok(None);
    }
    let modules = r.dict(r.field(interp, o.interp_modules)?)?;
    let Some(module) = r.get(&modules, name)? else {
        return Ok(None);
    };
    r.expect_type(module, rt.module_type)?;
    r.dict(r.field(module, o.module_dict)?).map(Some)
}

/// Where a TaskGroup instance keeps `_parent_task`: (PY_VALUES_* mode, values at, valid at,
/// slot at), from the class's shared keys; `None` before a first instance set it.
fn parent_task_place<M: Memory>(
    r: &Reader<'_, M>,
    class: u64,
) -> Result<Option<(u32, u32, u32, u32)>, PythonError> {
    let o = r.o;
    let flags = r.field(class, o.type_flags)?;
    let bit = |b: u32| b != ABSENT && b < 64 && flags & (1 << b) != 0;
    if !bit(o.heaptype_bit) || !bit(o.managed_dict_bit) {
        return Ok(None);
    }
    let keys = r.field(class, o.heaptype_cached_keys)?;
    if keys == 0 {
        return Ok(None);
    }
    let table = r.keys(keys, None)?;
    let Some(index) = r.key_index(&table, "_parent_task")? else {
        return Ok(None);
    };
    let values_values = if o.values_values == ABSENT {
        0
    } else {
        o.values_values
    };
    let slot = values_values + 8 * index as u32;
    Ok(if bit(o.inline_values_bit) {
        let basicsize = r.field(class, o.type_basicsize)?;
        u32::try_from(basicsize)
            .ok()
            .map(|at| (PY_VALUES_INLINE, at, o.values_valid, slot))
    } else if o.values_ptr_before != ABSENT {
        Some((PY_VALUES_POINTER, o.values_ptr_before, 0, slot))
    } else if o.dict_or_values_tag == 1 {
        Some((PY_VALUES_TAGGED, o.managed_dict_before, 0, slot))
    } else {
        None
    })
}

/// Whether `name` is an automatic task name (`Task-N`): such tasks are shown by their
/// coroutine's qualified name, so labels stay few.
pub fn automatic_name(name: &str) -> bool {
    name.strip_prefix("Task-")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::process::Command;

    use object::{Object, ObjectSection};

    use super::super::tests::{
        PYENV, forky_debug_file, forky_python, forky_root, gdb_script, libpython, pyenv_root,
    };
    use super::*;

    /// `field=value` lines as a map.
    fn parse(text: &str) -> HashMap<String, u32> {
        text.lines()
            .filter_map(|l| {
                let (k, v) = l.trim().split_once('=')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// The table's entries the interpreter's own DWARF describes, by the script's names.
    fn libpython_fields(t: &AsyncOffsets) -> [(&'static str, u32); 10] {
        [
            ("gen_iframe", t.gen_iframe),
            ("coro_iframe", t.gen_iframe),
            ("cfunction_self", t.cfunction_self),
            ("method_self", t.method_self),
            ("function_closure", t.function_closure),
            ("cell_ref", t.cell_ref),
            ("type_base", t.type_base),
            ("tuple_items", t.tuple_items),
            ("list_items", t.list_items),
            ("var_size", t.var_size),
        ]
    }

    #[test]
    fn asyncio_offsets_match_dwarf() {
        if Command::new("gdb").arg("--version").output().is_err() {
            skip_ledger::skip("tool:gdb", "gdb is not installed");
            return;
        }
        let mut checked = 0;
        for &(dir, minor) in PYENV {
            let Some(table) = for_version(3, minor) else {
                continue;
            };
            let dynload = pyenv_root().join(format!("{dir}/lib/python3.{minor}/lib-dynload"));
            let module = std::fs::read_dir(&dynload).ok().and_then(|d| {
                d.filter_map(Result::ok).map(|e| e.path()).find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("_asyncio."))
                })
            });
            let lib = libpython(dir, minor);
            let (Some(module), true) = (module, lib.exists()) else {
                skip_ledger::skip(
                    &format!("python:3.{minor}"),
                    format!(
                        "3.{minor}: {} or its _asyncio module is missing",
                        lib.display()
                    ),
                );
                continue;
            };
            let mut dwarf = parse(&gdb_script("python_asyncio_offsets.py", &lib));
            dwarf.extend(parse(&gdb_script("python_asyncio_offsets.py", &module)));
            let want = [
                ("fut_callback0", table.fut_callback0),
                ("fut_callbacks", table.fut_callbacks),
                ("task_callback0", table.fut_callback0),
                ("task_callbacks", table.fut_callbacks),
                ("task_coro", table.task_coro),
                ("task_name", table.task_name),
            ]
            .into_iter()
            .chain(libpython_fields(&table));
            let mut n = 0;
            for (field, value) in want {
                assert_eq!(
                    dwarf.get(field),
                    Some(&value),
                    "3.{minor} {field}: DWARF of {} and {}",
                    lib.display(),
                    module.display()
                );
                checked += 1;
                n += 1;
            }
            println!("3.{minor}: {n} asyncio offsets agree with DWARF");
        }
        assert!(checked > 0 || PYENV.iter().all(|&(_, m)| for_version(3, m).is_none()));
    }

    /// forky's 3.14 and 3.15: the table's entries against their `-dbg` DWARF, and the
    /// `.AsyncioDebug` section of each (the `_asyncio` module's, the interpreter's) against it
    /// too.
    #[test]
    fn forky_asyncio_offsets_match_dwarf() {
        if Command::new("gdb").arg("--version").output().is_err() {
            skip_ledger::skip("tool:gdb", "gdb is not installed");
            return;
        }
        let root = forky_root();
        for minor in [14, 15] {
            let Some(bin) = forky_python(&root, minor) else {
                continue;
            };
            let debug = forky_debug_file(&root, &bin);
            let dwarf = parse(&gdb_script("python_asyncio_offsets.py", &debug));
            let table = for_version(3, minor).expect("a table");
            for (field, value) in libpython_fields(&table) {
                assert_eq!(
                    dwarf.get(field),
                    Some(&value),
                    "3.{minor} {field}: {}",
                    debug.display()
                );
            }
            // The section: in the extension module (3.14) or the interpreter (3.15).
            let dynload = root.join(format!(
                "usr/lib/python3.{minor}/lib-dynload/_asyncio.cpython-3{minor}-x86_64-linux-gnu.so"
            ));
            let holder = if dynload.exists() {
                dynload
            } else {
                bin.clone()
            };
            let data = std::fs::read(&holder).unwrap();
            let elf = object::File::parse(&*data).unwrap();
            let section = elf
                .section_by_name(ASYNCIO_DEBUG_SECTION)
                .unwrap_or_else(|| panic!("3.{minor}: no section in {}", holder.display()));
            let d = AsyncioDebug::parse(section.data().unwrap()).unwrap();
            let module = parse(&gdb_script(
                "python_asyncio_offsets.py",
                &forky_debug_file(&root, &holder),
            ));
            assert_eq!(
                module.get("task_coro"),
                Some(&narrow(d.task_coro)),
                "3.{minor}"
            );
            assert_eq!(
                module.get("task_name"),
                Some(&narrow(d.task_name)),
                "3.{minor}"
            );
            assert_eq!(table.task_coro, narrow(d.task_coro), "3.{minor}");
            assert_eq!(table.task_name, narrow(d.task_name), "3.{minor}");
            println!("3.{minor}: asyncio offsets agree with {}", debug.display());
        }
    }

    #[test]
    fn asyncio_debug_sections_are_checked() {
        // forky 3.14's section.
        let words: [u64; 13] = [
            168, 136, 96, 108, 109, 128, 152, 0x37248, 0x2a80, 0x3a8, 0x360, 0x368, 0x370,
        ];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let d = AsyncioDebug::parse(&bytes).unwrap();
        assert_eq!((d.task_coro, d.tstate_running_task), (128, 0x368));
        assert!(AsyncioDebug::parse(&bytes[..96]).is_err());
        let mut bad = words;
        bad[11] = 0x3a8; // the running task at the thread state's very end
        let bytes: Vec<u8> = bad.iter().flat_map(|w| w.to_le_bytes()).collect();
        let err = AsyncioDebug::parse(&bytes).unwrap_err();
        assert!(err.contains("asyncio_running_task"), "{err}");
    }

    #[test]
    fn automatic_names_are_task_and_a_number() {
        assert!(automatic_name("Task-1"));
        assert!(automatic_name("Task-20417"));
        assert!(!automatic_name("Task-"));
        assert!(!automatic_name("Task-1a"));
        assert!(!automatic_name("worker"));
    }
}
