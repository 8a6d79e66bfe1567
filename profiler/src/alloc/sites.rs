//! Which allocator entry points a binary defines, as probe sites (file offset, kind). Any
//! object a process maps can be its allocator: libc, a preloaded or linked jemalloc or
//! tcmalloc (same public names), or a static executable; CPython's pymalloc functions are
//! static (`.symtab` or the debug file). Names at one address (glibc's `memalign` and
//! `aligned_alloc`, tcmalloc's `tc_*` aliases) make one site.

use std::collections::HashSet;
use std::path::Path;

use object::{Object, ObjectSymbol, SymbolKind};
use pyrometer_ebpf as shared;

use crate::os::elfsyms::{DebugFile, file_offset, is_copy_of, loads};
use crate::os::untrusted::{Copy as FileCopy, Kind, UntrustedError, UntrustedFile};

/// The C allocator's public entry points.
const LIBC: &[(&str, u32)] = &[
    ("malloc", shared::ALLOC_MALLOC),
    ("calloc", shared::ALLOC_CALLOC),
    ("realloc", shared::ALLOC_REALLOC),
    ("reallocarray", shared::ALLOC_REALLOCARRAY),
    ("free", shared::ALLOC_FREE),
    ("cfree", shared::ALLOC_FREE),
    ("posix_memalign", shared::ALLOC_POSIX_MEMALIGN),
    ("aligned_alloc", shared::ALLOC_ALIGNED),
    ("memalign", shared::ALLOC_ALIGNED),
    ("valloc", shared::ALLOC_VALLOC),
    ("pvalloc", shared::ALLOC_VALLOC),
];

/// pymalloc's functions, which `PyObject_Malloc` and `PyMem_Malloc` reach through the
/// allocator table (so the table's calls are never inlined).
const PYMALLOC: &[(&str, u32)] = &[
    ("_PyObject_Malloc", shared::ALLOC_PY_MALLOC),
    ("_PyObject_Calloc", shared::ALLOC_PY_CALLOC),
    ("_PyObject_Realloc", shared::ALLOC_PY_REALLOC),
    ("_PyObject_Free", shared::ALLOC_PY_FREE),
];

/// Probe sites of one binary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sites {
    /// (file offset, `alloc_kind`), sorted by offset.
    pub sites: Vec<(u64, u32)>,
    /// The binary defines `malloc` (it is a C allocator, not only pymalloc).
    pub has_malloc: bool,
}

/// Finds the allocator sites of the binary at `path`; `debug_file` is its separate debug
/// file (for pymalloc's static symbols in a stripped interpreter).
pub fn find(path: &Path, debug_file: Option<&DebugFile>) -> Result<Sites, String> {
    // A sparse copy of the symbol tables, not the whole file: a large library's debug file
    // is hundreds of MB, of which the symbol tables are a small part. Not a mapping of the
    // file either, which a process truncating it would turn into a SIGBUS here.
    let data = symbol_tables(path).map_err(|e| e.to_string())?;
    let obj = object::File::parse(&*data).map_err(|e| format!("{}: {e}", path.display()))?;
    let loads = loads(&obj);
    let debug_data = debug_file.and_then(|d| d.open(Kind::Elf).and_then(copy_symbol_tables).ok());
    let debug_obj = debug_data
        .as_deref()
        .and_then(|d| object::File::parse(d).ok());
    let mut out = Sites::default();
    let mut seen = HashSet::new();
    let objects = std::iter::once(&obj).chain(debug_obj.as_ref());
    for o in objects {
        for sym in o.dynamic_symbols().chain(o.symbols()) {
            if !sym.is_definition() || sym.kind() != SymbolKind::Text || sym.address() == 0 {
                continue;
            }
            let Ok(name) = sym.name() else { continue };
            let kind = LIBC
                .iter()
                .find(|(n, _)| *n == name)
                .or_else(|| PYMALLOC.iter().find(|(n, _)| is_copy_of(name, n)))
                .map(|&(_, k)| k);
            let Some(kind) = kind else { continue };
            out.has_malloc |= kind == shared::ALLOC_MALLOC;
            if seen.insert(sym.address())
                && let Some(off) = file_offset(&loads, sym.address())
            {
                out.sites.push((off, kind));
            }
        }
    }
    out.sites.sort_unstable();
    Ok(out)
}

fn symbol_tables(path: &Path) -> Result<FileCopy, UntrustedError> {
    copy_symbol_tables(UntrustedFile::open_resolved(path, Kind::Elf)?)
}

fn copy_symbol_tables(file: UntrustedFile) -> Result<FileCopy, UntrustedError> {
    file.copy_elf_sections(&[".symtab", ".strtab", ".dynsym", ".dynstr"])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_entry_points_one_site_per_address() {
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        if !libc.exists() {
            skip_ledger::skip("lib:libc.so.6", format!("{} is missing", libc.display()));
            return;
        }
        let s = find(libc, None).unwrap();
        assert!(s.has_malloc);
        let kinds: Vec<u32> = s.sites.iter().map(|&(_, k)| k).collect();
        for k in [
            shared::ALLOC_MALLOC,
            shared::ALLOC_CALLOC,
            shared::ALLOC_REALLOC,
            shared::ALLOC_FREE,
            shared::ALLOC_POSIX_MEMALIGN,
            shared::ALLOC_ALIGNED,
        ] {
            assert!(kinds.contains(&k), "kind {k} missing: {s:?}");
        }
        // memalign and aligned_alloc share an address in glibc: one site.
        assert_eq!(
            kinds
                .iter()
                .filter(|&&k| k == shared::ALLOC_ALIGNED)
                .count(),
            1
        );
        let offsets: HashSet<u64> = s.sites.iter().map(|&(o, _)| o).collect();
        assert_eq!(offsets.len(), s.sites.len());
    }

    #[test]
    fn pymalloc_in_a_pyenv_build() {
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
        let lib = Path::new(&home).join(".pyenv/versions/3.11.7/lib/libpython3.11.so.1.0");
        if !lib.exists() {
            skip_ledger::skip("python:3.11", format!("{} is missing", lib.display()));
            return;
        }
        let s = find(&lib, None).unwrap();
        assert!(!s.has_malloc, "libpython is not a C allocator");
        let kinds: Vec<u32> = s.sites.iter().map(|&(_, k)| k).collect();
        assert_eq!(
            kinds.len(),
            4,
            "the four pymalloc functions, nothing else: {s:?}"
        );
        for k in [
            shared::ALLOC_PY_MALLOC,
            shared::ALLOC_PY_CALLOC,
            shared::ALLOC_PY_REALLOC,
            shared::ALLOC_PY_FREE,
        ] {
            assert!(kinds.contains(&k));
        }
    }
}
