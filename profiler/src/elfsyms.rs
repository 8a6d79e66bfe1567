//! Finding functions to probe in ELF files: symbols (with the copies compilers make of
//! static functions) turned into the file offsets uprobes take.

use std::path::{Path, PathBuf};

use object::{Object, ObjectSegment};

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
    let Ok(data) = std::fs::read(exe) else {
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

    #[test]
    fn offsets_go_through_the_loading_segment() {
        let loads = [(0x400000, 0, 0x1000), (0x401000, 0x1000, 0x5000)];
        assert_eq!(file_offset(&loads, 0x402345), Some(0x2345));
        assert_eq!(file_offset(&loads, 0x500000), None);
    }
}
