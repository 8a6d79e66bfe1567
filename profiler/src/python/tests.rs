//! Checks against the real interpreters on the machine: the offset table against each build's
//! DWARF (through gdb and scripts/python_offsets.py), the line-table decoders against what each
//! Python reports for its own code objects. A missing build or gdb is a skip in the ledger
//! (`skip_ledger::skip`).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::offsets::{self, ABSENT, PyOffsets};
use super::{debug_offsets, linetable, version};

/// (version directory, minor) of the pyenv builds the table was made from.
pub(super) const PYENV: &[(&str, u32)] = &[
    ("3.8.18", 8),
    ("3.9.18", 9),
    ("3.10.13", 10),
    ("3.11.7", 11),
    ("3.12.1", 12),
    ("3.13.0", 13),
];

pub(super) fn pyenv_root() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    Path::new(&home).join(".pyenv/versions")
}

fn named_fields(o: &PyOffsets) -> Vec<(&'static str, u32)> {
    vec![
        ("runtime_interpreters_head", o.runtime_interpreters_head),
        ("runtime_gil", o.runtime_gil),
        ("interp_next", o.interp_next),
        ("interp_threads_head", o.interp_threads_head),
        ("interp_gil_ptr", o.interp_gil_ptr),
        ("gil_last_holder", o.gil_last_holder),
        ("gil_locked", o.gil_locked),
        ("gil_size", o.gil_size),
        ("tstate_next", o.tstate_next),
        ("tstate_interp", o.tstate_interp),
        ("tstate_frame", o.tstate_frame),
        ("cframe_current_frame", o.cframe_current_frame),
        ("tstate_thread_id", o.tstate_thread_id),
        ("tstate_native_thread_id", o.tstate_native_thread_id),
        ("frame_code", o.frame_code),
        ("frame_previous", o.frame_previous),
        ("frame_instr", o.frame_instr),
        ("frame_is_entry", o.frame_is_entry),
        ("frame_owner", o.frame_owner),
        ("code_filename", o.code_filename),
        ("code_name", o.code_name),
        ("code_qualname", o.code_qualname),
        ("code_firstlineno", o.code_firstlineno),
        ("code_linetable", o.code_linetable),
        ("code_adaptive", o.code_adaptive),
        ("object_type", o.object_type),
        ("bytes_size", o.bytes_size),
        ("bytes_data", o.bytes_data),
        ("unicode_length", o.unicode_length),
        ("unicode_state", o.unicode_state),
        ("unicode_ascii_data", o.unicode_ascii_data),
        ("unicode_compact_data", o.unicode_compact_data),
        ("frame_tlbc_index", o.frame_tlbc_index),
        ("code_tlbc", o.code_tlbc),
        ("frame_globals", o.frame_globals),
    ]
}

pub(super) fn libpython(dir: &str, minor: u32) -> PathBuf {
    pyenv_root().join(format!("{dir}/lib/libpython3.{minor}.so.1.0"))
}

#[test]
fn offsets_match_dwarf() {
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
        let text = dwarf_offsets(&lib);
        let Some(table) = offsets::for_version(3, minor) else {
            // 3.13+: what the interpreter says of itself, read from a live process.
            let bin = pyenv_root().join(format!("{dir}/bin/python3.{minor}"));
            let described = described_by_live_process(Command::new(&bin));
            let checked = compare_with_dwarf(&format!("3.{minor}"), &described.offsets, &text);
            println!(
                "3.{minor}: {checked} described offsets agree with {}",
                lib.display()
            );
            continue;
        };
        let checked = compare_with_dwarf(&format!("3.{minor}"), table, &text);
        println!("3.{minor}: {checked} offsets agree with {}", lib.display());
    }
    for (label, prefix, minor) in free_threaded_builds() {
        let Some(lib) = free_threaded_lib(&label, &prefix, minor) else {
            continue;
        };
        let text = dwarf_offsets(&lib);
        let bin = prefix.join(format!("bin/python3.{minor}t"));
        let described = described_by_live_process(Command::new(&bin));
        assert!(described.free_threaded, "{label} says it is free-threaded");
        assert_eq!(
            described.offsets.object_type, 24,
            "{label}: ob_type after ob_tid & co"
        );
        let checked = compare_with_dwarf(&label, &described.offsets, &text);
        println!(
            "{label}: {checked} described offsets agree with {}",
            lib.display()
        );
    }
}

/// gdb's DWARF reading (scripts/python_offsets.py) of `binary`.
fn dwarf_offsets(binary: &Path) -> String {
    gdb_script("python_offsets.py", binary)
}

/// What scripts/`script` prints run under gdb on `binary`.
pub(super) fn gdb_script(script: &str, binary: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let out = Command::new("gdb")
        .args(["-batch", "-nx", "-ex"])
        .arg(format!(
            "python exec(open({:?}).read())",
            script.display().to_string()
        ))
        .arg(binary)
        .output()
        .expect("gdb runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts `cmd` (a Python that sleeps) and reads its `_Py_DebugOffsets`.
pub(super) fn described_by_live_process(mut cmd: Command) -> super::debug_offsets::Described {
    let mut child = cmd
        .args(["-c", "import time; time.sleep(60)"])
        .spawn()
        .expect("start python");
    let pid = child.id();
    // Wait for the exec (a chroot runs first): the runtime is static data, there at once.
    let mut result = None;
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let mut registry = crate::os::procs::ProcessRegistry::new();
        let Ok(process) = registry.observe(pid) else {
            continue;
        };
        if let Ok(rt) = version::detect(process) {
            let mem = super::memory::ProcessMemory::new(pid);
            result = Some(debug_offsets::for_process(&mem, &rt));
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    result
        .expect("the interpreter was detected")
        .expect("its description reads")
}

/// Compares every field of `table` with gdb's output; the number compared.
fn compare_with_dwarf(label: &str, table: &PyOffsets, text: &str) -> usize {
    // The 3.11 PyFrameObject still has f_back etc.; the table uses the interpreter frame,
    // which the script prefers, so every field must agree.
    compare_fields(label, &named_fields(table), text)
}

/// Every `(name, value)` against gdb's `name=value` lines (`absent`: ABSENT); how many.
pub(super) fn compare_fields(label: &str, fields: &[(&'static str, u32)], text: &str) -> usize {
    for (name, value) in fields {
        let dwarf = text
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("{label}: gdb printed no {name}:\n{text}"));
        let dwarf = if dwarf == "absent" {
            ABSENT
        } else {
            dwarf.parse().expect("a number")
        };
        assert_eq!(
            *value, dwarf,
            "{label} {name}: table {value}, DWARF {dwarf}"
        );
    }
    fields.len()
}

/// Debian forky's 3.14 and 3.15 (`cargo xtask forky-root`): their descriptions, read from
/// live processes in the chroot, against the DWARF of their `-dbg` debug files.
#[test]
fn forky_descriptions_match_dwarf() {
    if Command::new("gdb").arg("--version").output().is_err() {
        skip_ledger::skip("tool:gdb", "gdb is not installed");
        return;
    }
    if !nix_is_root() {
        skip_ledger::skip("root", "chroot needs root");
        return;
    }
    let root = forky_root();
    for minor in [14, 15] {
        let Some(bin) = forky_python(&root, minor) else {
            continue;
        };
        let debug = forky_debug_file(&root, &bin);
        let text = dwarf_offsets(&debug);
        let mut cmd = Command::new("chroot");
        cmd.arg(&root).arg(format!("/usr/bin/python3.{minor}"));
        let described = described_by_live_process(cmd);
        assert!(!described.free_threaded, "3.{minor}");
        let checked = compare_with_dwarf(&format!("3.{minor}"), &described.offsets, &text);
        println!(
            "3.{minor}: {checked} described offsets agree with {}",
            debug.display()
        );
    }
}

/// The Debian forky root the tests run 3.14 and 3.15 in.
/// forky's `python3.MINOR` in the root `root`, `None` (after recording the skip) when missing.
pub(super) fn forky_python(root: &Path, minor: u32) -> Option<PathBuf> {
    let bin = root.join(format!("usr/bin/python3.{minor}"));
    if bin.exists() {
        return Some(bin);
    }
    skip_ledger::skip(
        "forky-root",
        format!(
            "3.{minor}: {} is missing (cargo xtask forky-root)",
            bin.display()
        ),
    );
    None
}

/// The `-dbg` debug file of `binary`, a file of the forky root `root`; panics when missing.
pub(super) fn forky_debug_file(root: &Path, binary: &Path) -> PathBuf {
    crate::symbolize::separate_debug_file(
        binary,
        binary.parent(),
        &binary.to_string_lossy(),
        None,
        &[root.join("usr/lib/debug")],
    )
    .unwrap_or_else(|| panic!("no debug file for {}", binary.display()))
    .path
}

pub(super) fn forky_root() -> PathBuf {
    std::env::var_os("PYROMETER_FORKY_ROOT").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/forky/root"),
        PathBuf::from,
    )
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Prints, for every code object of a sample module: firstlineno, the table in hex, then
/// `offset:line` for each instruction (line `-` for none) as the interpreter itself computes.
const LINES_SNIPPET: &str = r#"
import dis, sys
src = '''
def f(a, b):
    x = a + b
    for i in range(3):
        if i:
            x += i
        else:
            x -= 1
    try:
        y = 1 / 0
    except ZeroDivisionError:
        y = 0
    return (x +
            y)

class C:
    def m(self):
        return [i * 2
                for i in range(10)
                if i]
''' + '\n' * 300 + '''
def far():
    return 1
'''
def walk(co):
    yield co
    for c in co.co_consts:
        if hasattr(c, 'co_code'):
            yield from walk(c)
for co in walk(compile(src, 'sample.py', 'exec')):
    if sys.version_info >= (3, 10):
        table = co.co_linetable
        pairs = []
        for start, end, line in co.co_lines():
            for off in range(start, end, 2):
                pairs.append('%d:%s' % (off, '-' if line is None else line))
    else:
        table = co.co_lnotab
        starts = list(dis.findlinestarts(co))
        pairs = []
        for off in range(0, len(co.co_code), 2):
            line = [l for (o, l) in starts if o <= off][-1]
            pairs.append('%d:%d' % (off, line))
    print(co.co_firstlineno, table.hex() or '-', ' '.join(pairs))
"#;

pub(super) fn interpreters() -> Vec<(String, PathBuf, u32)> {
    let mut out: Vec<(String, PathBuf, u32)> = PYENV
        .iter()
        .map(|&(dir, minor)| {
            let bin = pyenv_root().join(format!("{dir}/bin/python3.{minor}"));
            (dir.to_string(), bin, minor)
        })
        .collect();
    out.push((
        "Debian 3.11".into(),
        PathBuf::from("/usr/bin/python3.11"),
        11,
    ));
    out.extend(
        free_threaded_builds()
            .into_iter()
            .map(|(label, prefix, minor)| {
                (label, prefix.join(format!("bin/python3.{minor}t")), minor)
            }),
    );
    out
}

/// The free-threaded builds the tests run (`3.13t`, `3.14t`): (label, installation prefix,
/// minor), from tests/free-threaded.txt, installed by `cargo xtask free-threaded` under
/// /var/cache/pyrometer-cpython/SHA256 (`PYROMETER_CPYTHON_CACHE` overrides the directory).
pub(super) fn free_threaded_builds() -> Vec<(String, PathBuf, u32)> {
    let cache = std::env::var_os("PYROMETER_CPYTHON_CACHE").map_or_else(
        || PathBuf::from("/var/cache/pyrometer-cpython"),
        PathBuf::from,
    );
    include_str!("../../../tests/free-threaded.txt")
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(version, sha)| {
            let minor = version.split('.').nth(1)?.parse().ok()?;
            Some((format!("3.{minor}t"), cache.join(sha.trim()), minor))
        })
        .collect()
}

/// The libpython of a free-threaded build, or `None` after a skip in the ledger when it was not
/// built.
pub(super) fn free_threaded_lib(label: &str, prefix: &Path, minor: u32) -> Option<PathBuf> {
    let lib = prefix.join(format!("lib/libpython3.{minor}t.so.1.0"));
    if lib.exists() {
        return Some(lib);
    }
    skip_ledger::skip(
        &python_capability(label, minor),
        format!(
            "{label}: {} is missing (cargo xtask free-threaded)",
            lib.display()
        ),
    );
    None
}

/// The skip ledger's name for an interpreter of [`interpreters`].
pub(super) fn python_capability(label: &str, minor: u32) -> String {
    if label.starts_with("Debian") {
        format!("python:debian-3.{minor}")
    } else if label.ends_with('t') {
        format!("python:{label}")
    } else {
        format!("python:3.{minor}")
    }
}

#[test]
fn line_tables_match_python() {
    for (label, bin, minor) in interpreters() {
        if !bin.exists() {
            skip_ledger::skip(
                &python_capability(&label, minor),
                format!("{label}: {} is missing", bin.display()),
            );
            continue;
        }
        let out = Command::new(&bin)
            .args(["-c", LINES_SNIPPET])
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "{label}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let kind = offsets::for_version(3, minor)
            .map_or(offsets::LineTableKind::Locations311, |o| o.line_table_kind);
        let mut checked = 0;
        for row in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = row.splitn(3, ' ');
            let first: u32 = parts.next().unwrap().parse().unwrap();
            let hex = parts.next().unwrap();
            let table: Vec<u8> = if hex == "-" {
                Vec::new()
            } else {
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect()
            };
            for pair in parts.next().unwrap_or("").split_whitespace() {
                let (off, line) = pair.split_once(':').unwrap();
                let expected = (line != "-").then(|| line.parse::<u32>().unwrap());
                let got = linetable::line_for(kind, &table, first, off.parse().unwrap());
                assert_eq!(got, expected, "{label}: offset {off} of {row}");
                checked += 1;
            }
        }
        assert!(checked > 50, "{label}: only {checked} instructions checked");
        println!("{label}: {checked} instruction lines agree");
    }
}

/// Starts `bin -c script` and returns it with the first line it printed: the script prints
/// once it is ready, then waits to be killed (its stdin is a pipe the child holds).
pub(super) fn start_python(bin: &Path, script: &str) -> (std::process::Child, String) {
    let mut child = Command::new(bin)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("piped")),
        &mut line,
    )
    .unwrap_or_else(|e| panic!("{}: no first line: {e}", bin.display()));
    (child, line)
}

/// pyenv's CPython 3.11 running `script`, once it printed `up` (which it must do when
/// ready); None, the skip recorded, where that interpreter is missing.
pub(super) fn pyenv_311(script: &str) -> Option<std::process::Child> {
    let python = pyenv_root().join("3.11.7/bin/python3.11");
    if !python.exists() {
        skip_ledger::skip(
            "python:3.11",
            format!("3.11: {} is missing", python.display()),
        );
        return None;
    }
    let (child, line) = start_python(&python, script);
    assert_eq!(line.trim(), "up", "{}", python.display());
    Some(child)
}

/// The version read from each interpreter's binary (`Py_Version`, else the `PY_VERSION`
/// literal in its read-only data, from a sparse copy of its symbol tables and read-only data)
/// is the one the interpreter reports itself.
#[test]
fn versions_read_from_the_binaries_are_the_interpreters_own() {
    for (label, bin, minor) in interpreters() {
        if !bin.exists() {
            skip_ledger::skip(
                &python_capability(&label, minor),
                format!("{label}: {} is missing", bin.display()),
            );
            continue;
        }
        let (mut child, own) = start_python(
            &bin,
            "import sys, time\nprint('%d.%d.%d' % sys.version_info[:3], flush=True)\ntime.sleep(60)",
        );
        let mut registry = crate::os::procs::ProcessRegistry::new();
        let read = registry
            .observe(child.id())
            .map_err(|e| e.to_string())
            .and_then(|p| version::detect(p).map_err(|e| e.to_string()));
        let _ = child.kill();
        let _ = child.wait();
        let rt = read.unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(rt.version.to_string(), own.trim(), "{label}");
    }
}

#[test]
fn unsupported_versions_are_named() {
    assert!(offsets::for_version(3, 7).is_none());
    assert!(offsets::for_version(3, 13).is_none());
    assert!(offsets::is_supported(3, 14) && !offsets::is_supported(3, 7));
    assert_eq!(offsets::supported_range(), "3.8 and newer");
    let e = super::PythonError::Unsupported {
        version: "3.6.15".into(),
        reason: String::new(),
    };
    assert_eq!(
        e.to_string(),
        "Python 3.6.15 is not supported by dump (3.8 and newer are)"
    );
    let _ = version::from_hexversion(0);
}

/// A sparse fake address space for the walker: regions of bytes, anything else unreadable.
#[derive(Default)]
pub(super) struct FakeMemory {
    regions: std::collections::BTreeMap<u64, Vec<u8>>,
}

impl FakeMemory {
    pub(super) fn put_u64(&mut self, addr: u64, value: u64) {
        self.put(addr, &value.to_le_bytes());
    }

    pub(super) fn put(&mut self, addr: u64, bytes: &[u8]) {
        // Every object here lives in its own 4 KiB page.
        let page = addr & !0xfff;
        let region = self.regions.entry(page).or_insert_with(|| vec![0; 0x1000]);
        let at = (addr - page) as usize;
        region[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

impl super::memory::Memory for FakeMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), super::PythonError> {
        let page = addr & !0xfff;
        let region = self
            .regions
            .get(&page)
            .ok_or(super::PythonError::BadAddress(addr))?;
        let at = (addr - page) as usize;
        let src = region
            .get(at..at + buf.len())
            .ok_or(super::PythonError::BadAddress(addr))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn walker_marks_bad_frames_and_stops_on_cycles() {
    let o = offsets::for_version(3, 11).unwrap();
    let rt = version::PythonRuntime {
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
    let at = |base: u64, off: u32| base + u64::from(off);
    let mut m = FakeMemory::default();
    m.put_u64(at(0x1000, o.runtime_interpreters_head), 0x2000);
    m.put_u64(at(0x1000, o.runtime_gil + o.gil_last_holder), 0x3000);
    m.put(
        at(0x1000, o.runtime_gil + o.gil_locked),
        &1u32.to_le_bytes(),
    );
    m.put_u64(at(0x2000, o.interp_threads_head), 0x3000);
    m.put_u64(at(0x3000, o.tstate_native_thread_id), 77);
    m.put_u64(at(0x3000, o.tstate_frame), 0x3800);
    m.put_u64(at(0x3800, o.cframe_current_frame), 0x4000);
    // Frame 1: a valid code object at its second code unit.
    m.put_u64(at(0x4000, o.frame_code), 0x5000);
    m.put_u64(at(0x4000, o.frame_instr), at(0x5000, o.code_adaptive) + 2);
    m.put_u64(at(0x4000, o.frame_previous), 0x9000);
    m.put_u64(at(0x5000, o.object_type), rt.code_type);
    m.put_u64(at(0x5000, o.code_qualname), 0x7000);
    m.put_u64(at(0x5000, o.code_filename), 0x8000);
    m.put(at(0x5000, o.code_firstlineno), &10u32.to_le_bytes());
    m.put_u64(at(0x5000, o.code_linetable), 0xa000);
    for (addr, text) in [(0x7000u64, "f"), (0x8000, "a.py")] {
        m.put_u64(at(addr, o.object_type), rt.unicode_type);
        m.put_u64(at(addr, o.unicode_length), text.len() as u64);
        // kind 1, compact, ascii
        m.put(
            at(addr, o.unicode_state),
            &((1u32 << 2) | (1 << 5) | (1 << 6)).to_le_bytes(),
        );
        m.put(at(addr, o.unicode_ascii_data), text.as_bytes());
    }
    m.put_u64(at(0xa000, o.object_type), rt.bytes_type);
    m.put_u64(at(0xa000, o.bytes_size), 2);
    m.put(at(0xa000, o.bytes_data), &[0x80 | (13 << 3) | 1, 2]);
    // Frame 2: its "code object" has the wrong type (a torn read); it links back to frame 1.
    m.put_u64(at(0x9000, o.frame_code), 0x7000);
    m.put_u64(at(0x9000, o.frame_previous), 0x4000);

    let layout = debug_offsets::Described::tabled(*o);
    let snap = super::walk::Walker::new(&m, &layout, &rt)
        .snapshot()
        .unwrap();
    assert_eq!(snap.threads.len(), 1);
    let t = &snap.threads[0];
    assert_eq!(t.tid, Some(77));
    assert!(t.holds_gil);
    assert_eq!(t.frames.len(), 2);
    assert_eq!(t.frames[0].function.as_deref(), Some("f"));
    assert_eq!(t.frames[0].file.as_deref(), Some("a.py"));
    assert_eq!(t.frames[0].line, Some(11));
    assert_eq!(
        t.frames[1].function, None,
        "a frame that does not validate is not decoded"
    );
    assert!(t.truncated, "the cycle back to frame 1 cuts the stack");
    assert_eq!(snap.gil, Some((0x1000 + u64::from(o.runtime_gil), 208)));
}
