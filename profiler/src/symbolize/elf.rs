//! What the symbolizer needs to know about one ELF object before handing it to blazesym:
//! how file offsets map to virtual addresses, and which file actually carries its symbols
//! (the object itself, or a separate debug file found by build-id or `.gnu_debuglink`).

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, SymbolKind};

use crate::os::procs::build_id_of;
use crate::os::untrusted::{Kind, UntrustedFile};

/// A PT_LOAD segment: `filesz` bytes at file `offset` are mapped at `vaddr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Load {
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

pub(crate) fn offset_to_vaddr(loads: &[Load], offset: u64) -> Option<u64> {
    loads
        .iter()
        .find(|l| l.offset <= offset && offset < l.offset + l.filesz)
        .map(|l| offset - l.offset + l.vaddr)
}

fn loads_of<'d, O: Object<'d>>(obj: &O) -> Vec<Load> {
    obj.segments()
        .map(|s| {
            let (offset, filesz) = s.file_range();
            Load {
                offset,
                vaddr: s.address(),
                filesz,
            }
        })
        .collect()
}

/// How to symbolize one binary.
#[derive(Debug)]
pub(crate) struct ElfInfo {
    loads: Vec<Load>,
    /// The file blazesym reads symbols (and DWARF) from.
    pub source: PathBuf,
    /// Its device and inode when it was checked (its build id, its debuglink CRC): the file
    /// opened later to be read must be that one, not one put at its path since.
    pub source_id: (u64, u64),
    /// Whether blazesym should look at DWARF in `source`. Off for a stripped object without a
    /// debug file, so blazesym does not go searching (and fail) on its own.
    pub debug_syms: bool,
    pub build_id: Option<String>,
    /// Whether the object has a symbol table of its own (`.symtab`): without one, its static
    /// functions have no name unless a debug file is found.
    pub symtab: bool,
    /// What reading `source` costs: read once per binary, not at each opening of the file.
    pub cost: FileCost,
}

impl ElfInfo {
    /// `dir` is the binary's directory as reachable from here; `seen_path` the path as the
    /// process saw it (for `/usr/lib/debug/<dir>/<debuglink>`).
    pub fn load(
        path: &Path,
        dir: Option<&Path>,
        seen_path: &str,
        build_id: Option<&str>,
        debug_dirs: &[PathBuf],
    ) -> Option<ElfInfo> {
        // Through the untrusted-file layer (inside the process's root, regular files only)
        // and pread, not a mapping: a file truncated meanwhile costs an error, not a SIGBUS.
        let file = UntrustedFile::open_resolved(path, Kind::Elf).ok()?;
        let size = file.size();
        let cache = object::read::ReadCache::new(file.reader());
        let obj = object::File::parse(&cache).ok()?;
        let loads = loads_of(&obj);
        let build_id = build_id
            .map(str::to_string)
            .or_else(|| obj.build_id().ok().flatten().map(hex));
        let symtab = obj.symbol_table().is_some();
        if obj.has_debug_symbols() {
            return Some(ElfInfo {
                symtab,
                loads,
                source: path.to_path_buf(),
                source_id: file.identity(),
                debug_syms: true,
                build_id,
                cost: FileCost::of_object(&obj, size),
            });
        }
        let link = obj.gnu_debuglink().ok().flatten().and_then(|(name, crc)| {
            let name = std::str::from_utf8(name).ok()?;
            // A link must be a plain file name; anything else could escape the search dirs.
            (!name.is_empty() && !name.contains('/')).then(|| (name.to_string(), crc))
        });
        let seen_dir = Path::new(seen_path).parent();
        let debug = find_debug_file(
            path,
            build_id.as_deref(),
            link.as_ref().map(|(n, c)| (n.as_str(), *c)),
            dir,
            seen_dir,
            debug_dirs,
        );
        let debug_syms = debug.is_some();
        let (source, source_id, cost) = match debug {
            Some((d, f)) => (d, f.identity(), FileCost::of_file(&f)),
            None => (
                path.to_path_buf(),
                file.identity(),
                FileCost::of_object(&obj, size),
            ),
        };
        Some(ElfInfo {
            symtab,
            loads,
            debug_syms,
            source,
            source_id,
            build_id,
            cost,
        })
    }

    /// The same binary named from `debug`, a debug file found elsewhere (fetched by build id);
    /// unchanged when that cannot be opened.
    pub fn with_debug_file(self, debug: PathBuf) -> ElfInfo {
        let Ok(file) = UntrustedFile::open_resolved(&debug, Kind::Elf) else {
            return self;
        };
        ElfInfo {
            cost: FileCost::of_file(&file),
            source_id: file.identity(),
            source: debug,
            debug_syms: true,
            ..self
        }
    }

    pub fn vaddr(&self, file_offset: u64) -> Option<u64> {
        offset_to_vaddr(&self.loads, file_offset)
    }
}

/// What reading a file costs in memory, from its section headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FileCost {
    /// The file's size on disk.
    pub size: u64,
    /// Its DWARF sections (`.debug_*`, `.zdebug_*`) as stored, compressed or not.
    pub dwarf_stored: u64,
    /// The same sections as the DWARF reader holds them: a compressed section is inflated
    /// into the heap, whole, when the file's first address is looked up in it.
    pub dwarf: u64,
}

impl FileCost {
    /// Reads the section headers only (a few KB of a file of any size). A file that cannot
    /// be read as ELF costs its size and has no DWARF.
    #[cfg(test)]
    pub fn of(path: &Path) -> FileCost {
        let Ok(file) = UntrustedFile::open_resolved(path, Kind::Elf) else {
            return FileCost {
                size: u64::MAX,
                ..FileCost::default()
            };
        };
        FileCost::of_file(&file)
    }

    /// [`FileCost::of`] an opened file.
    pub fn of_file(file: &UntrustedFile) -> FileCost {
        let size = file.size();
        let cache = object::read::ReadCache::new(file.reader());
        match object::File::parse(&cache) {
            Ok(obj) => FileCost::of_object(&obj, size),
            Err(_) => FileCost {
                size,
                ..FileCost::default()
            },
        }
    }

    /// The cost of a file of `size` bytes already parsed as `obj`.
    pub fn of_object<'d, O: Object<'d>>(obj: &O, size: u64) -> FileCost {
        let mut cost = FileCost {
            size,
            ..FileCost::default()
        };
        for sec in obj.sections() {
            let name = sec.name().unwrap_or("");
            if !(name.starts_with(".debug_") || name.starts_with(".zdebug_")) {
                continue;
            }
            if let Ok(r) = sec.compressed_file_range() {
                cost.dwarf_stored += r.compressed_size;
                cost.dwarf += r.uncompressed_size;
            }
        }
        cost
    }

    /// What the file costs while open: its DWARF as the reader holds it when `with_dwarf`,
    /// the rest (symbol tables, code) at its size on disk, which bounds what is mapped.
    pub fn open(&self, with_dwarf: bool) -> u64 {
        let rest = self.size.saturating_sub(self.dwarf_stored);
        if with_dwarf {
            rest.saturating_add(self.dwarf)
        } else {
            rest
        }
    }
}

/// Finds a separate debug file: by build-id under each debug dir's `.build-id/`, then by
/// debuglink next to the binary, in its `.debug/` subdir, and under each debug dir plus the
/// binary's directory. Debuglink candidates must match the link's CRC32. Every candidate is
/// opened through the untrusted-file layer: a directory of a process's root is resolved
/// inside that root, and a link, a FIFO or a device planted there is refused. Returns the
/// file as it was checked, opened: what is read later must have its device and inode.
pub(crate) fn find_debug_file(
    binary: &Path,
    build_id: Option<&str>,
    link: Option<(&str, u32)>,
    dir: Option<&Path>,
    seen_dir: Option<&Path>,
    debug_dirs: &[PathBuf],
) -> Option<(PathBuf, UntrustedFile)> {
    if let Some(id) = build_id.filter(|id| id.len() > 2) {
        for d in debug_dirs {
            let cand = d
                .join(".build-id")
                .join(&id[..2])
                .join(format!("{}.debug", &id[2..]));
            let Ok(f) = UntrustedFile::open_resolved(&cand, Kind::Elf) else {
                continue;
            };
            if build_id_of(&f).as_deref() == Some(id) {
                return Some((cand, f));
            }
        }
    }
    let (name, crc) = link?;
    let mut cands = Vec::new();
    if let Some(dir) = dir {
        cands.push(dir.join(name));
        cands.push(dir.join(".debug").join(name));
    }
    if let Some(seen) = seen_dir {
        let rel = seen.strip_prefix("/").unwrap_or(seen);
        cands.extend(debug_dirs.iter().map(|d| d.join(rel).join(name)));
    }
    let binary_id = same_file_id(binary);
    cands.into_iter().find_map(|c| {
        let f = UntrustedFile::open_resolved(&c, Kind::Elf).ok()?;
        ((binary_id.is_none() || Some(f.identity()) != binary_id)
            && crc32(&mut f.reader()).is_ok_and(|v| v == crc))
        .then_some((c, f))
    })
}

fn same_file_id(p: &Path) -> Option<(u64, u64)> {
    UntrustedFile::open_resolved(p, Kind::Elf)
        .ok()
        .map(|f| f.identity())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// CRC-32 (IEEE, reflected, as zlib and `.gnu_debuglink` use it), streamed so multi-GB debug
/// files need no memory.
#[cfg(test)]
pub(crate) fn crc32_file(path: &Path) -> io::Result<u32> {
    crc32(&mut File::open(path)?)
}

/// [`crc32_file`] of what `f` reads.
fn crc32(f: &mut impl Read) -> io::Result<u32> {
    let table = crc_table();
    let mut buf = vec![0u8; 1 << 16];
    let mut crc = !0u32;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(!crc);
        }
        for &b in &buf[..n] {
            crc = table[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
        }
    }
}

fn crc_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    for (i, slot) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *slot = c;
    }
    table
}

/// Function symbols of the vDSO. Every process on this kernel maps the same image, so ours
/// (read from our own memory) names theirs.
#[derive(Debug)]
pub(crate) struct Vdso {
    loads: Vec<Load>,
    /// (start vaddr, end vaddr, name), sorted by start.
    syms: Vec<(u64, u64, String)>,
    pub build_id: Option<String>,
}

impl Vdso {
    pub fn read_self() -> Option<Vdso> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let line = maps.lines().find(|l| l.ends_with("[vdso]"))?;
        let range = line.split_whitespace().next()?;
        let (s, e) = range.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
        );
        let mut image = vec![0u8; usize::try_from(end - start).ok()?];
        use std::os::unix::fs::FileExt;
        File::open("/proc/self/mem")
            .ok()?
            .read_exact_at(&mut image, start)
            .ok()?;
        Self::parse(&image)
    }

    pub fn parse(image: &[u8]) -> Option<Vdso> {
        let obj = object::File::parse(image).ok()?;
        let mut syms: Vec<(u64, u64, bool, String)> = obj
            .dynamic_symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.address() != 0)
            .filter_map(|s| {
                let name = s.name().ok()?.to_string();
                Some((
                    s.address(),
                    s.address() + s.size().max(1),
                    s.is_weak(),
                    name,
                ))
            })
            .collect();
        // At one address the global `__vdso_x` beats its weak alias `x`.
        syms.sort_by(|a, b| (a.0, a.2, &a.3).cmp(&(b.0, b.2, &b.3)));
        syms.dedup_by_key(|s| s.0);
        Some(Vdso {
            loads: loads_of(&obj),
            syms: syms.into_iter().map(|(a, e, _, n)| (a, e, n)).collect(),
            build_id: obj.build_id().ok().flatten().map(hex),
        })
    }

    /// The function at a file offset within the vDSO mapping.
    pub fn lookup(&self, file_offset: u64) -> Option<&str> {
        let va = offset_to_vaddr(&self.loads, file_offset)?;
        let i = self.syms.partition_point(|s| s.0 <= va).checked_sub(1)?;
        let (_, end, name) = &self.syms[i];
        (va < *end).then_some(name.as_str())
    }

    /// (name, file offset) of each symbol, for tests.
    #[cfg(test)]
    pub fn symbols(&self) -> impl Iterator<Item = (&str, u64)> {
        self.syms.iter().filter_map(|(va, _, n)| {
            let l = self
                .loads
                .iter()
                .find(|l| l.vaddr <= *va && *va < l.vaddr + l.filesz)?;
            Some((n.as_str(), va - l.vaddr + l.offset))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_known_vector() {
        let tmp = crate::symbolize::testutil::TempDir::new("crc");
        let p = tmp.path().join("f");
        std::fs::write(&p, b"123456789").unwrap();
        assert_eq!(crc32_file(&p).unwrap(), 0xCBF4_3926);
    }

    #[test]
    fn offsets_convert_through_load_segments() {
        let loads = [
            Load {
                offset: 0,
                vaddr: 0,
                filesz: 0x1000,
            },
            Load {
                offset: 0x1000,
                vaddr: 0x401000,
                filesz: 0x500,
            },
        ];
        assert_eq!(offset_to_vaddr(&loads, 0x1010), Some(0x401010));
        assert_eq!(offset_to_vaddr(&loads, 0x10), Some(0x10));
        assert_eq!(offset_to_vaddr(&loads, 0x1500), None);
    }
}
