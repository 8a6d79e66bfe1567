//! Finding functions to probe in ELF files: symbols (with the copies compilers make of
//! static functions) turned into the file offsets uprobes take.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSegment};

use super::untrusted::{Copy, Kind, UntrustedError, UntrustedFile};

/// A binary and, when it has one, its separate debug file, copied whole into the profiler's
/// own memory (probe sites are found in their code), so a file truncated meanwhile is a parse
/// error, not a SIGBUS. Errors are (the file, why).
pub fn copy_with_debug(
    binary: &Path,
    debug_file: Option<&DebugFile>,
) -> Result<(Copy, Option<Copy>), (String, String)> {
    let failed = |p: &Path, e: UntrustedError| (p.display().to_string(), e.to_string());
    let binary = UntrustedFile::open_resolved(binary, Kind::ElfWhole)
        .and_then(|f| f.copy())
        .map_err(|e| failed(binary, e))?;
    let debug = debug_file
        .map(|d| {
            d.open(Kind::ElfWhole)
                .and_then(|f| f.copy())
                .map_err(|e| failed(&d.path, e))
        })
        .transpose()?;
    Ok((binary, debug))
}

/// A separate debug file as it was found (by build id or `.gnu_debuglink`, its contents
/// checked): read only while the file at its path is still the one checked, not one renamed
/// over it since.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebugFile {
    pub path: PathBuf,
    /// Device and inode when checked; None for a file named outright, with no check to hold
    /// it to.
    id: Option<(u64, u64)>,
}

impl DebugFile {
    pub fn checked(path: PathBuf, id: (u64, u64)) -> Self {
        Self { path, id: Some(id) }
    }

    #[cfg(test)]
    pub fn named(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            id: None,
        }
    }

    /// Opens it as `kind`: an error when the file now at its path is not the one checked.
    pub fn open(&self, kind: Kind) -> Result<UntrustedFile, UntrustedError> {
        match self.id {
            Some(id) => UntrustedFile::open_identified(&self.path, kind, id),
            None => UntrustedFile::open_resolved(&self.path, kind),
        }
    }
}

/// The DWARF sections of `obj`, decompressed; a missing one is empty.
pub fn dwarf_sections<'a>(
    obj: &'a object::File<'_>,
) -> Result<gimli::DwarfSections<Cow<'a, [u8]>>, gimli::Error> {
    gimli::DwarfSections::load(
        |id: gimli::SectionId| -> Result<Cow<'a, [u8]>, gimli::Error> {
            Ok(obj
                .section_by_name(id.name())
                .and_then(|s| s.uncompressed_data().ok())
                .unwrap_or(Cow::Borrowed(&[])))
        },
    )
}

/// Is `name` a copy of `function` to probe: `take_gil`, `take_gil.constprop.0`,
/// `take_gil.lto_priv.0`, but not `take_gil.cold` (a cold half is jumped into, not called).
pub fn is_copy_of(name: &str, function: &str) -> bool {
    match name.strip_prefix(function) {
        Some("") => true,
        Some(rest) => rest.starts_with('.') && !rest.split('.').any(|p| p == "cold"),
        None => false,
    }
}

/// PT_LOAD segments of an ELF image: (virtual address, file offset, file size).
pub fn loads(obj: &object::File<'_>) -> Vec<(u64, u64, u64)> {
    obj.segments()
        .map(|s| {
            let (off, size) = s.file_range();
            (s.address(), off, size)
        })
        .filter(|&(_, _, size)| size > 0)
        .collect()
}

/// The file offset of a virtual address, through the segment that loads it.
pub fn file_offset(loads: &[(u64, u64, u64)], vaddr: u64) -> Option<u64> {
    loads
        .iter()
        .find(|&&(addr, _, size)| addr <= vaddr && vaddr < addr + size)
        .map(|&(addr, off, _)| vaddr - addr + off)
}

/// The file offsets of the exported functions `names` in the ELF file at `path` (None for one it
/// does not define): the probe points of pyrometer's in-process libraries.
pub fn exported_offsets(path: &Path, names: &[&str]) -> Result<Vec<Option<u64>>, String> {
    use object::ObjectSymbol;
    let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let obj = object::File::parse(&*data).map_err(|e| format!("{}: {e}", path.display()))?;
    let loads = loads(&obj);
    Ok(names
        .iter()
        .map(|&name| {
            obj.dynamic_symbols()
                .find(|s| s.name() == Ok(name) && s.is_definition())
                .and_then(|s| file_offset(&loads, s.address()))
        })
        .collect())
}

/// A library shipped with this `pyrometer`: `$ENV` when set, else next to the executable (a
/// cargo build, a tarball), else `../lib/pyrometer/` from it (a package).
pub fn shipped_library(name: &str, env: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(name), dir.join("../lib/pyrometer").join(name)]
        .into_iter()
        .find(|p| p.is_file())
}

/// The libraries `LD_PRELOAD` (as this process sees it, and a command it starts inherits)
/// names: paths as they are, bare names searched in the usual library directories.
pub fn preloaded_libraries() -> Vec<PathBuf> {
    let Some(value) = std::env::var_os("LD_PRELOAD") else {
        return Vec::new();
    };
    value
        .to_string_lossy()
        .split([' ', ':'])
        .filter(|s| !s.is_empty())
        .filter_map(|lib| {
            if lib.contains('/') {
                Some(PathBuf::from(lib)).filter(|p| p.is_file())
            } else {
                LIBRARY_DIRS
                    .iter()
                    .map(|d| Path::new(d).join(lib))
                    .find(|p| p.is_file())
            }
        })
        .collect()
}

/// Where the dynamic loader looks when nothing else says (x86-64 Debian).
const LIBRARY_DIRS: [&str; 5] = [
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
    "/lib",
    "/usr/lib",
];

/// The shared libraries an executable names (DT_NEEDED) that can be found: along its
/// RUNPATH/RPATH (`$ORIGIN` expanded), `LD_LIBRARY_PATH` and the usual library directories,
/// as the dynamic loader would. For probing a command's libraries before it starts.
pub fn needed_libraries(exe: &Path) -> Vec<PathBuf> {
    use object::elf;
    use object::read::elf::{Dyn, FileHeader};
    let data = super::untrusted::UntrustedFile::open(exe, super::untrusted::Kind::Elf)
        .and_then(|f| f.copy_elf_sections(&[".dynamic", ".dynstr"]));
    let Ok(data) = data else {
        return Vec::new();
    };
    let Ok(header) = elf::FileHeader64::<object::Endianness>::parse(&*data) else {
        return Vec::new();
    };
    let Ok(endian) = header.endian() else {
        return Vec::new();
    };
    let Ok(sections) = header.sections(endian, &*data) else {
        return Vec::new();
    };
    let mut needed = Vec::new();
    let mut dirs = Vec::new();
    if let Ok(Some((entries, link))) = sections.dynamic(endian, &*data)
        && let Ok(strings) = sections.strings(endian, &*data, link)
    {
        let origin = exe.parent().map(|p| p.to_string_lossy().into_owned());
        for d in entries {
            let Ok(value) = d.string(endian, strings) else {
                continue;
            };
            let value = String::from_utf8_lossy(value).into_owned();
            match d.tag32(endian) {
                Some(elf::DT_NEEDED) => needed.push(value),
                Some(elf::DT_RUNPATH | elf::DT_RPATH) => {
                    for dir in value.split(':').filter(|d| !d.is_empty()) {
                        let dir = match &origin {
                            Some(o) => dir.replace("$ORIGIN", o).replace("${ORIGIN}", o),
                            None => dir.to_string(),
                        };
                        dirs.push(PathBuf::from(dir));
                    }
                }
                _ => {}
            }
        }
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    dirs.extend(LIBRARY_DIRS.map(PathBuf::from));
    needed
        .iter()
        .filter_map(|lib| dirs.iter().map(|d| d.join(lib)).find(|p| p.is_file()))
        .collect()
}

/// runtime address - ELF virtual address for a mapping of file offset `offset` at `start`.
/// The loader maps each PT_LOAD from its offset rounded down to a page, so a mapping's offset
/// can lie before its segment's own and inside the previous segment's file range: lld leaves
/// text at offset 0x14ad8 after a read-only segment of 0x14ad8 bytes, and the text mapping
/// starts at 0x14000. The segment whose rounded-down offset is the greatest one at or below the
/// mapping's is the one mapped there.
pub fn load_bias(loads: &[(u64, u64, u64)], start: u64, offset: u64) -> Option<u64> {
    const PAGE: u64 = 0xfff;
    let &(seg_off, vaddr, _) = loads
        .iter()
        .filter(|&&(o, _, size)| o & !PAGE <= offset && offset < o + size.max(1))
        .max_by_key(|&&(o, _, _)| o)?;
    let vaddr_at_start = vaddr.wrapping_add(offset).wrapping_sub(seg_off);
    Some(start.wrapping_sub(vaddr_at_start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_told_by_name() {
        assert!(is_copy_of("take_gil", "take_gil"));
        assert!(is_copy_of("take_gil.constprop.0", "take_gil"));
        assert!(is_copy_of("take_gil.lto_priv.0", "take_gil"));
        assert!(!is_copy_of("take_gil.cold", "take_gil"));
        assert!(!is_copy_of("take_gil.lto_priv.0.cold", "take_gil"));
        assert!(!is_copy_of("take_gil_x", "take_gil"));
        assert!(!is_copy_of("drop_gil", "take_gil"));
    }

    #[test]
    fn a_python_executable_needs_its_libpython_and_libc() {
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
        let exe = Path::new(&home).join(".pyenv/versions/3.11.7/bin/python3.11");
        if !exe.exists() {
            skip_ledger::skip("python:3.11", format!("{} is missing", exe.display()));
            return;
        }
        let libs = needed_libraries(&exe);
        let names: Vec<String> = libs
            .iter()
            .map(|l| l.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.contains(&"libpython3.11.so.1.0".to_string()),
            "{libs:?}"
        );
        assert!(names.contains(&"libc.so.6".to_string()), "{libs:?}");
    }

    /// The GIL's, the collector's and the allocator's site searches read a debug file only
    /// while it is the file that was checked: one renamed over it since is an error.
    #[test]
    fn a_debug_file_replaced_since_its_check_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let debug = dir.path().join("x.debug");
        std::fs::copy("/bin/true", &debug).unwrap();
        let id = UntrustedFile::open_resolved(&debug, Kind::ElfWhole)
            .unwrap()
            .identity();
        let checked = DebugFile::checked(debug.clone(), id);
        assert!(copy_with_debug(Path::new("/bin/true"), Some(&checked)).is_ok());
        let other = dir.path().join("other");
        std::fs::copy("/bin/false", &other).unwrap();
        std::fs::rename(&other, &debug).unwrap();
        let err = copy_with_debug(Path::new("/bin/true"), Some(&checked))
            .map(|_| ())
            .unwrap_err();
        assert!(err.1.contains("replaced"), "{err:?}");
        let named = DebugFile::named(&debug);
        assert!(copy_with_debug(Path::new("/bin/true"), Some(&named)).is_ok());
    }

    #[test]
    fn offsets_go_through_the_loading_segment() {
        let loads = [(0x400000, 0, 0x1000), (0x401000, 0x1000, 0x5000)];
        assert_eq!(file_offset(&loads, 0x402345), Some(0x2345));
        assert_eq!(file_offset(&loads, 0x500000), None);
    }

    #[test]
    fn bias_of_pie_text_mapping() {
        // A PIE's text: file offset 0x1000 at vaddr 0x1000, mapped at 0x5555_5555_5000.
        let loads = [(0, 0, 0x800), (0x1000, 0x1000, 0x500)];
        assert_eq!(
            load_bias(&loads, 0x5555_5555_5000, 0x1000),
            Some(0x5555_5555_4000)
        );
        // A non-PIE executable: vaddr 0x401000 at 0x401000.
        let loads = [(0x1000, 0x401000, 0x2000)];
        assert_eq!(load_bias(&loads, 0x401000, 0x1000), Some(0));
        assert_eq!(load_bias(&loads, 0x401000, 0x9000), None);
        // lld's layout (libpyrometer_alloc.so): a read-only segment of 0x14ad8 bytes, then
        // text at offset 0x14ad8, vaddr 0x15ad8; its mapping starts at offset 0x14000.
        let loads = [(0, 0, 0x14ad8), (0x14ad8, 0x15ad8, 0x40ec8)];
        assert_eq!(
            load_bias(&loads, 0x7f5e_9f2b_2000, 0x14000),
            Some(0x7f5e_9f2b_2000 - 0x15000)
        );
        assert_eq!(
            load_bias(&loads, 0x7f5e_9f29_d000, 0),
            Some(0x7f5e_9f29_d000)
        );
    }
}
