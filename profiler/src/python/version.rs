//! Which CPython a process runs and where its runtime lives: the `libpython3.X.so` mapping of a
//! `--enable-shared` build, else the executable itself (static builds such as Debian's
//! `/usr/bin/python3.11`). Binaries are opened through the process registry, so a
//! containerized process's files are read through `/proc/PID/root`.

use crate::os::untrusted::{Kind, UntrustedFile};
use std::fmt;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

use super::PythonError;
use crate::os::elfsyms::load_bias;
use crate::os::procs::{Mapping, Process};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PythonVersion {
    pub major: u32,
    pub minor: u32,
    /// Unknown when neither `Py_Version` nor a `PY_VERSION` string was found.
    pub micro: Option<u32>,
}

impl fmt::Display for PythonVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(micro) = self.micro {
            write!(f, ".{micro}")?;
        }
        Ok(())
    }
}

/// The binary holding a process's interpreter, with the addresses the walker needs.
#[derive(Debug, Clone)]
pub struct PythonRuntime {
    pub version: PythonVersion,
    /// The path as the process maps it.
    pub path: String,
    /// Run-time addresses (load bias applied).
    pub runtime: u64,
    pub code_type: u64,
    pub unicode_type: u64,
    pub bytes_type: u64,
    /// For reading `threading`'s thread names ([`super::names`]).
    pub dict_type: u64,
    pub long_type: u64,
    pub module_type: u64,
    pub type_type: u64,
    /// For following asyncio's done callbacks ([`super::asyncio`]); 0 when not exported.
    pub cfunction_type: u64,
    pub method_type: u64,
    pub function_type: u64,
}

/// `libpython3.11.so.1.0` → (3, 11, ""), `libpython3.7m.so` → (3, 7, "m").
pub fn parse_libpython_name(name: &str) -> Option<(u32, u32, &str)> {
    let rest = name.strip_prefix("libpython")?;
    let so = rest.find(".so")?;
    let (major, rest) = rest[..so].split_once('.')?;
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    Some((
        major.parse().ok()?,
        rest[..digits].parse().ok()?,
        &rest[digits..],
    ))
}

/// `python3.11` → (3, 11); also `python3.13t` etc. with the suffix.
pub fn parse_executable_name(name: &str) -> Option<(u32, u32, &str)> {
    let rest = name.strip_prefix("python")?;
    let (major, rest) = rest.split_once('.')?;
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    Some((
        major.parse().ok()?,
        rest[..digits].parse().ok()?,
        &rest[digits..],
    ))
}

/// `Py_Version`/`PY_HEXVERSION`: 0x030b07f0 → 3.11.7.
pub fn from_hexversion(hex: u64) -> PythonVersion {
    PythonVersion {
        major: ((hex >> 24) & 0xff) as u32,
        minor: ((hex >> 16) & 0xff) as u32,
        micro: Some(((hex >> 8) & 0xff) as u32),
    }
}

/// Finds the `PY_VERSION` literal ("3.8.18", which `Py_GetVersion` formats from) in read-only
/// data; versions before 3.11 export no `Py_Version`. The linker merges string tails, so the
/// literal may be the end of a longer string (pyenv's "/root/.pyenv/versions/3.8.18"): a
/// NUL-delimited match wins, else one preceded by anything but a digit or a dot.
pub fn find_version_string(rodata: &[u8], major: u32, minor: u32) -> Option<u32> {
    let prefix = format!("{major}.{minor}.");
    let prefix = prefix.as_bytes();
    let mut tail_merged = None;
    let mut i = 0;
    while let Some(pos) = find(&rodata[i..], prefix) {
        let start = i + pos;
        i = start + 1;
        let before = if start > 0 { rodata[start - 1] } else { 0 };
        if before.is_ascii_digit() || before == b'.' {
            continue;
        }
        let tail = &rodata[start + prefix.len()..];
        let digits = tail.iter().take_while(|b| b.is_ascii_digit()).count();
        // A release candidate or alpha still names its micro version ("3.13.0rc1").
        let end = tail[digits..].iter().position(|&b| b == 0);
        if digits == 0 || end.is_none_or(|e| e > 8) {
            continue;
        }
        let micro = std::str::from_utf8(&tail[..digits]).ok()?.parse().ok();
        if before == 0 {
            return micro;
        }
        tail_merged = tail_merged.or(micro);
    }
    tail_merged
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Link-time facts about an interpreter binary: its version and the addresses of the symbols
/// the walkers need, so a binary mapped by many processes is parsed once.
#[derive(Debug, Clone)]
pub struct PyBinary {
    pub version: PythonVersion,
    runtime: Option<u64>,
    code_type: Option<u64>,
    unicode_type: Option<u64>,
    bytes_type: Option<u64>,
    dict_type: Option<u64>,
    long_type: Option<u64>,
    module_type: Option<u64>,
    type_type: Option<u64>,
    cfunction_type: Option<u64>,
    method_type: Option<u64>,
    function_type: Option<u64>,
    /// PT_LOAD segments: (file offset, virtual address, file size).
    segments: Vec<(u64, u64, u64)>,
}

/// What reading an interpreter binary came to, as the cache keeps it.
pub type Analyzed = Result<Arc<PyBinary>, Failure>;

/// The read of an interpreter binary, for the caller to run where it chooses (a worker, off
/// the sampling loop).
pub type ReadJob = Box<dyn FnOnce() -> Analyzed + Send>;

impl From<PythonError> for Failure {
    fn from(e: PythonError) -> Self {
        match e {
            PythonError::NotPython { .. } => Failure::NotPython,
            PythonError::Unsupported { version, reason } => {
                Failure::Unsupported { version, reason }
            }
            e => Failure::Other(e.to_string()),
        }
    }
}

/// Interpreter binaries already looked at, by the binary's identity.
#[derive(Debug, Default)]
pub struct BinaryCache {
    binaries:
        std::collections::HashMap<crate::os::procs::BinaryKey, Result<Arc<PyBinary>, Failure>>,
}

/// Why a binary is not usable, kept in the cache (errors themselves are not `Clone`).
#[derive(Debug, Clone)]
pub enum Failure {
    NotPython,
    Unsupported { version: String, reason: String },
    Other(String),
}

impl BinaryCache {
    /// Reads an interpreter binary before any process maps it (the interpreter of a command
    /// about to start), so registering the process once it runs is quick: its samples have no
    /// Python frames until then. `path` is `interpreter_binary`'s answer.
    pub fn prewarm(&mut self, path: &Path) {
        let Ok(key) = crate::os::procs::BinaryKey::of_file(path) else {
            return;
        };
        if self.binaries.contains_key(&key) {
            return;
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.as_deref().unwrap_or_default();
        let is_libpython = parse_libpython_name(name).is_some();
        let name_version = version_in_name(name, is_libpython);
        // Only a success is kept: a failure is found again, with its own message, when
        // the process maps the binary.
        if let Ok(py) = analyze(path, &path.to_string_lossy(), is_libpython, name_version) {
            self.binaries.insert(key, Ok(Arc::new(py)));
        }
    }
}

/// Locates the interpreter of `process` and reads its version and symbols, here and without
/// a deadline (tests).
#[cfg(test)]
pub fn detect(process: &Process) -> Result<PythonRuntime, PythonError> {
    detect_reading(process, &mut |_, job| Some(job()))
}

/// The interpreter's mapping in `process`: `libpython3.X.so`, else the executable.
fn interpreter_mapping(process: &Process) -> Result<(&Mapping, bool), PythonError> {
    let not_python = || PythonError::NotPython {
        pid: process.pid,
        comm: process.comm.clone(),
    };
    let mappings = process.mappings();
    if let Some(m) = mappings
        .iter()
        .find(|m| parse_libpython_name(m.basename()).is_some())
    {
        return Ok((m, true));
    }
    let exe = process.exe.as_deref().ok_or_else(not_python)?;
    let exe = exe.to_string_lossy();
    let exe = exe.strip_suffix(" (deleted)").unwrap_or(&exe);
    let m = mappings
        .iter()
        .find(|m| m.path.strip_suffix(" (deleted)").unwrap_or(&m.path) == exe)
        .ok_or_else(not_python)?;
    Ok((m, false))
}

/// Locates the interpreter of `process` and reads its version and symbols, the binary read
/// by `read` (on a worker, within a deadline: None when it did not answer,
/// [`PythonError::Pending`] then).
pub fn detect_reading(
    process: &Process,
    read: &mut dyn FnMut(&crate::os::procs::BinaryKey, ReadJob) -> Option<Analyzed>,
) -> Result<PythonRuntime, PythonError> {
    detect_with(process, &mut BinaryCache::default(), true, read)
}

/// Like [`detect_reading`] with a cache. Unless `read_unnamed` (a process the user named by
/// pid or name), an executable is only read when its name says Python (`python3.11`) or a
/// `libpython` is mapped: for a node-wide capture, where every process's executable would
/// otherwise be read in full to look for `_PyRuntime`. A binary not in the cache is read by
/// `read`, which may run it elsewhere (a worker) and answer None until it is done
/// ([`PythonError::Pending`] then).
pub fn detect_cached(
    process: &Process,
    cache: &mut BinaryCache,
    read_unnamed: bool,
    read: &mut dyn FnMut(&crate::os::procs::BinaryKey, ReadJob) -> Option<Analyzed>,
) -> Result<PythonRuntime, PythonError> {
    detect_with(process, cache, read_unnamed, read)
}

fn detect_with(
    process: &Process,
    cache: &mut BinaryCache,
    read_unnamed: bool,
    read: &mut dyn FnMut(&crate::os::procs::BinaryKey, ReadJob) -> Option<Analyzed>,
) -> Result<PythonRuntime, PythonError> {
    let not_python = || PythonError::NotPython {
        pid: process.pid,
        comm: process.comm.clone(),
    };
    let (mapping, is_libpython) = interpreter_mapping(process)?;
    let name_version = version_in_name(mapping.basename(), is_libpython);
    if !read_unnamed && !is_libpython && name_version.is_none() {
        return Err(not_python());
    }
    let binary = mapping.binary().ok_or_else(not_python)?;
    let analyzed = match cache.binaries.get(binary.key()) {
        Some(r) => r.clone(),
        None => {
            // The binary is moved into the job: it holds the file that its path names
            // (`/proc/self/fd/N`) open until the read is done.
            let held = Arc::clone(binary);
            let shown = mapping.path.clone();
            let name = mapping.basename().to_string();
            let job: ReadJob = Box::new(move || {
                let name_version = version_in_name(&name, is_libpython);
                analyze(held.path(), &shown, is_libpython, name_version)
                    .map(Arc::new)
                    .map_err(Failure::from)
            });
            let r = read(binary.key(), job).ok_or(PythonError::Pending)?;
            cache.binaries.insert(binary.key().clone(), r.clone());
            r
        }
    };
    let py = match analyzed {
        Ok(py) => py,
        Err(Failure::NotPython) => return Err(not_python()),
        Err(Failure::Unsupported { version, reason }) => {
            return Err(PythonError::Unsupported { version, reason });
        }
        Err(Failure::Other(e)) => return Err(PythonError::Message(e)),
    };
    let bias =
        load_bias(&py.segments, mapping.start, mapping.offset).ok_or_else(|| PythonError::Elf {
            path: mapping.path.clone(),
            reason: "no loadable segment covers the mapping".into(),
        })?;
    let required = |addr: Option<u64>, name: &str| {
        addr.map(|a| a.wrapping_add(bias))
            .ok_or_else(|| PythonError::MissingSymbol {
                symbol: name.to_string(),
                path: mapping.path.clone(),
            })
    };
    Ok(PythonRuntime {
        version: py.version,
        path: mapping.path.clone(),
        runtime: required(py.runtime, "_PyRuntime")?,
        code_type: required(py.code_type, "PyCode_Type")?,
        unicode_type: required(py.unicode_type, "PyUnicode_Type")?,
        bytes_type: required(py.bytes_type, "PyBytes_Type")?,
        dict_type: required(py.dict_type, "PyDict_Type")?,
        long_type: required(py.long_type, "PyLong_Type")?,
        module_type: required(py.module_type, "PyModule_Type")?,
        type_type: required(py.type_type, "PyType_Type")?,
        cfunction_type: py.cfunction_type.map_or(0, |a| a.wrapping_add(bias)),
        method_type: py.method_type.map_or(0, |a| a.wrapping_add(bias)),
        function_type: py.function_type.map_or(0, |a| a.wrapping_add(bias)),
    })
}

/// The version an interpreter binary's file name gives (`libpython3.11.so.1.0`, `python3.11`).
fn version_in_name(name: &str, is_libpython: bool) -> Option<(u32, u32, &str)> {
    if is_libpython {
        parse_libpython_name(name)
    } else {
        parse_executable_name(name)
    }
}

/// The symbols `analyze` looks up.
const WANTED: [&str; 12] = [
    "_PyRuntime",
    "Py_Version",
    "PyCode_Type",
    "PyUnicode_Type",
    "PyBytes_Type",
    "PyDict_Type",
    "PyLong_Type",
    "PyModule_Type",
    "PyType_Type",
    "PyCFunction_Type",
    "PyMethod_Type",
    "PyFunction_Type",
];

/// The sections of an interpreter binary read for its version and symbols.
const INTERPRETER_SECTIONS: [&str; 5] = [".dynsym", ".dynstr", ".symtab", ".strtab", ".rodata"];

/// Reads an interpreter binary's version and symbols. `shown` is the path for messages.
fn analyze(
    path: &Path,
    shown: &str,
    is_libpython: bool,
    name_version: Option<(u32, u32, &str)>,
) -> Result<PyBinary, PythonError> {
    if path.as_os_str().is_empty() {
        return Err(PythonError::Elf {
            path: shown.to_string(),
            reason: "refused: not the regular file mapped, or over the size cap".to_string(),
        });
    }
    // Only the symbol tables and the read-only data (where `Py_Version` and the version
    // literal are), read with `pread` into a sparse copy: the rest costs no memory.
    let data = UntrustedFile::open_resolved(path, Kind::Elf)
        .and_then(|f| f.copy_elf_sections(&INTERPRETER_SECTIONS))
        .map_err(|e| PythonError::Elf {
            path: shown.to_string(),
            reason: e.to_string(),
        })?;
    let elf = object::File::parse(&*data).map_err(|e| PythonError::Elf {
        path: shown.to_string(),
        reason: e.to_string(),
    })?;
    // One pass over the symbol tables for every name wanted (a shared build with symbols has
    // tens of thousands; a scan per name made registering a process take ~20 ms, during which
    // its samples had no Python frames). The dynamic table wins, as it did for a scan each.
    let mut found: [Option<u64>; WANTED.len()] = [None; WANTED.len()];
    for s in elf.dynamic_symbols().chain(elf.symbols()) {
        let Ok(name) = s.name() else { continue };
        if let Some(i) = WANTED.iter().position(|&w| w == name)
            && found[i].is_none()
        {
            found[i] = Some(s.address());
        }
    }
    let symbol = |name: &str| -> Option<u64> {
        WANTED
            .iter()
            .position(|&w| w == name)
            .and_then(|i| found[i])
    };
    let runtime_sym = symbol("_PyRuntime");
    // An executable without the runtime is not Python, whatever its name: a shared build's
    // launcher before the loader mapped libpython looks like that too.
    if !is_libpython && runtime_sym.is_none() {
        return Err(PythonError::NotPython {
            pid: 0,
            comm: String::new(),
        });
    }

    let mut version = symbol("Py_Version")
        .and_then(|addr| read_at_vaddr(&elf, addr, 8))
        .map(|b| from_hexversion(u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))))
        .filter(|v| v.major == 3);
    if version.is_none() {
        let (major, minor) = match name_version {
            Some((major, minor, _)) => (major, minor),
            None => {
                return Err(PythonError::Unsupported {
                    version: "unknown".into(),
                    reason: format!("cannot tell the Python version of {shown}"),
                });
            }
        };
        let micro = elf
            .section_by_name(".rodata")
            .and_then(|s| s.data().ok())
            .and_then(|d| find_version_string(d, major, minor));
        version = Some(PythonVersion {
            major,
            minor,
            micro,
        });
    }
    let version = version.unwrap_or(PythonVersion {
        major: 0,
        minor: 0,
        micro: None,
    });
    if let Some((_, _, flags)) = name_version {
        // 'm' (pymalloc) is only a name tag; 'd' (debug) and 't' (free-threaded) change the
        // object header, so a table's offsets would be wrong. 3.13+ describe their own header.
        let described = version.major == 3 && version.minor >= super::offsets::FIRST_MINOR;
        if !described && (flags.contains('d') || flags.contains('t')) {
            let kind = if flags.contains('t') {
                "free-threaded"
            } else {
                "debug"
            };
            return Err(PythonError::Unsupported {
                version: format!("{version}{flags}"),
                reason: format!("{kind} builds have a different object layout"),
            });
        }
    }
    if !super::offsets::is_supported(version.major, version.minor) {
        return Err(PythonError::Unsupported {
            version: version.to_string(),
            reason: String::new(),
        });
    }
    let segments = elf
        .segments()
        .map(|seg| {
            let (off, size) = seg.file_range();
            (off, seg.address(), size)
        })
        .collect();
    Ok(PyBinary {
        version,
        runtime: runtime_sym,
        code_type: symbol("PyCode_Type"),
        unicode_type: symbol("PyUnicode_Type"),
        bytes_type: symbol("PyBytes_Type"),
        dict_type: symbol("PyDict_Type"),
        long_type: symbol("PyLong_Type"),
        module_type: symbol("PyModule_Type"),
        type_type: symbol("PyType_Type"),
        cfunction_type: symbol("PyCFunction_Type"),
        method_type: symbol("PyMethod_Type"),
        function_type: symbol("PyFunction_Type"),
        segments,
    })
}

fn read_at_vaddr(elf: &object::File<'_>, addr: u64, len: u64) -> Option<Vec<u8>> {
    elf.sections().find_map(|s| {
        let start = s.address();
        if start <= addr && addr + len <= start + s.size() {
            let data = s.data().ok()?;
            let from = usize::try_from(addr - start).ok()?;
            data.get(from..from + len as usize).map(<[u8]>::to_vec)
        } else {
            None
        }
    })
}

/// The interpreter binary a Python executable will run: the `libpython3.X.so` it links
/// against, else the executable itself when it holds the runtime (a static build); `None` for
/// anything else. For preparing probes before a command starts.
pub fn interpreter_binary(exe: &Path) -> Option<std::path::PathBuf> {
    let exe = fs::canonicalize(exe).ok()?;
    if let Some(lib) = crate::os::elfsyms::needed_libraries(&exe)
        .into_iter()
        .find(|l| {
            l.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libpython"))
        })
    {
        return Some(lib);
    }
    let data = UntrustedFile::open(&exe, Kind::Elf)
        .and_then(|f| f.copy_elf_sections(&INTERPRETER_SECTIONS))
        .ok()?;
    let obj = object::File::parse(&*data).ok()?;
    let has_runtime = obj
        .dynamic_symbols()
        .chain(obj.symbols())
        .any(|s| s.name() == Ok("_PyRuntime"));
    has_runtime.then_some(exe)
}

/// The process's command line, NUL-separated arguments joined by spaces, bounded.
pub fn command_line(proc_root: &Path, pid: u32) -> Option<String> {
    let raw = UntrustedFile::open(
        &proc_root.join(pid.to_string()).join("cmdline"),
        Kind::ProcText,
    )
    .and_then(|f| f.read_bytes())
    .ok()?;
    let raw = &raw[..raw.len().min(4096)];
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (!args.is_empty()).then(|| args.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names() {
        assert_eq!(
            parse_libpython_name("libpython3.11.so.1.0"),
            Some((3, 11, ""))
        );
        assert_eq!(
            parse_libpython_name("libpython3.7m.so.1.0"),
            Some((3, 7, "m"))
        );
        assert_eq!(
            parse_libpython_name("libpython3.13t.so"),
            Some((3, 13, "t"))
        );
        assert_eq!(parse_libpython_name("libpython3.so"), None);
        assert_eq!(parse_libpython_name("libc.so.6"), None);
        assert_eq!(parse_executable_name("python3.11"), Some((3, 11, "")));
        assert_eq!(parse_executable_name("python3"), None);
        assert_eq!(parse_executable_name("bash"), None);
    }

    #[test]
    fn hexversion() {
        assert_eq!(from_hexversion(0x030b07f0).to_string(), "3.11.7");
        assert_eq!(from_hexversion(0x030d00f0).to_string(), "3.13.0");
    }

    #[test]
    fn version_strings() {
        let data = b"xx3.8.17\0\x003.8.18\0more";
        assert_eq!(find_version_string(data, 3, 8), Some(18));
        let data = b"\x00/root/.pyenv/versions/3.8.18\0 13.8.1\0";
        assert_eq!(find_version_string(data, 3, 8), Some(18));
        assert_eq!(find_version_string(b"\x003.13.0rc1\0", 3, 13), Some(0));
        assert_eq!(find_version_string(b"3.8.\0", 3, 8), None);
        assert_eq!(find_version_string(b"", 3, 8), None);
    }
}
