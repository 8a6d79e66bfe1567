//! The preloaded sampler library (`libpyrometer_alloc.so`, the `alloc-preload` crate): which
//! copy processes are handed (an explicit or installed one, else the one this binary carries,
//! see [`embedded`]), which processes load it and which cannot, the mean its countdown uses
//! in each, and the probes on it (`alloc_preload`, `alloc_preload_free`, `alloc_preload_move`
//! in `ebpf/src/bpf/alloc.h`). A probe is attached once per copy of the library, for every
//! process: its functions run only in processes that load it and only for sampled
//! allocations, so nobody else pays for it.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use object::Object;

use super::embedded::{self, EmbeddedError};
use crate::bpf::{ALLOC_PRELOAD, ALLOC_PRELOAD_FREE, ALLOC_PRELOAD_MOVE, ProbedCopies, Uprobes};
use crate::os::procs::{BinaryKey, MappingKind, Process};

/// The library's file name.
pub const LIBRARY: &str = embedded::LIBRARY;
/// The environment variable the library reads its mean from (bytes).
pub const MEAN_ENV: &str = "PYROMETER_ALLOC_SAMPLE_BYTES";
/// Overrides where `pyrometer` looks for the library.
pub const LIBRARY_ENV: &str = "PYROMETER_ALLOC_LIB";
/// The library's mean when the environment does not set one.
pub const DEFAULT_MEAN: u64 = 512 * 1024;

const SAMPLED_FN: &str = "pyrometer_alloc_sampled";
const FREE_FN: &str = "pyrometer_free_sampled";
const MOVE_FN: &str = "pyrometer_realloc_sampled";

/// Why the library cannot be handed to a process.
#[derive(Debug, thiserror::Error)]
pub enum PreloadError {
    #[error("${LIBRARY_ENV} names {}, which is not a file", .0.display())]
    EnvMissing(PathBuf),
    #[error(transparent)]
    Carried(#[from] EmbeddedError),
    #[error("{} is statically linked: LD_PRELOAD cannot load {LIBRARY} into it", .0.display())]
    Static(PathBuf),
    #[error("cannot probe {}: {why}", path.display())]
    Probe { path: PathBuf, why: String },
}

/// A copy installed with this `pyrometer`: next to the executable (a cargo build, a
/// tarball), else in `../lib/pyrometer/` from it (a package, an image made with
/// `pyrometer install-preload`).
pub fn installed_library() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join(LIBRARY),
        dir.join("../lib/pyrometer").join(LIBRARY),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// The library this `pyrometer` hands to processes: `$PYROMETER_ALLOC_LIB` when set (a copy
/// a process in a container or chroot sees at that path), else an installed copy (the one
/// the processes of a node preload, so the agent probes it from the start), else the copy
/// it carries, written to its cache directory ([`embedded::cached_library`]).
pub fn library() -> Result<PathBuf, PreloadError> {
    if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(PreloadError::EnvMissing(p))
        };
    }
    match installed_library() {
        Some(p) => Ok(p),
        None => Ok(embedded::cached_library()?),
    }
}

/// The library a command started from `exe` is to preload: an error when it cannot load
/// one (statically linked) or none can be had.
pub fn for_command(exe: &Path) -> Result<PathBuf, PreloadError> {
    if is_static_executable(exe) {
        return Err(PreloadError::Static(exe.to_path_buf()));
    }
    library()
}

/// What `record` says when it samples a target's allocations with uprobes because the
/// library cannot be used (`why`), as `--alloc-uprobes` allowed.
pub fn uprobes_note(why: &dyn std::fmt::Display) -> String {
    format!(
        "{why}; its allocations are sampled with uprobes on the allocator (--alloc-uprobes), a trap into the kernel per call"
    )
}

/// `record`'s refusal when the library cannot be used (`why`) and `--alloc-uprobes` was
/// not given: uprobes are never chosen silently, they cost an allocation-heavy program
/// hundreds of times its run time.
pub fn uprobes_refusal(why: &dyn std::fmt::Display) -> String {
    format!(
        "{why}; add --alloc-uprobes to sample its allocator with uprobes instead (a trap into the kernel per allocator call, a few microseconds each)"
    )
}

/// Why `pid`, running, samples nothing in process, and how to start it so that it does.
pub fn not_loaded(pid: u32) -> String {
    let lib = library().map_or_else(|_| LIBRARY.to_string(), |p| p.display().to_string());
    format!(
        "pid {pid} does not load {LIBRARY} (start it with LD_PRELOAD={lib} to sample in process)"
    )
}

/// `LD_PRELOAD` for a command that gets the library: it first, then what the environment
/// already preloads (an allocator preloaded after it is the one it forwards to).
pub fn ld_preload(library: &Path, existing: Option<OsString>) -> OsString {
    let mut value = library.as_os_str().to_os_string();
    if let Some(old) = existing.filter(|o| !o.is_empty()) {
        value.push(":");
        value.push(old);
    }
    value
}

/// The file offsets of the library's probe functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOffsets {
    pub sampled: u64,
    pub free: u64,
    /// None in a copy from before resizes moved their blocks' entries: its resizes of
    /// sampled blocks report a free and, when sampled, a new allocation.
    pub moved: Option<u64>,
}

/// Finds the probe functions in the library at `path`.
pub fn probe_offsets(path: &Path) -> Result<ProbeOffsets, String> {
    let found = crate::os::elfsyms::exported_offsets(path, &[SAMPLED_FN, FREE_FN, MOVE_FN])?;
    let need = |i: usize, name: &str| {
        found[i].ok_or_else(|| format!("{}: no {name} (not pyrometer's library?)", path.display()))
    };
    Ok(ProbeOffsets {
        sampled: need(0, SAMPLED_FN)?,
        free: need(1, FREE_FN)?,
        moved: found[2],
    })
}

/// The copy of the library `process` maps, if any (the path as this process reaches it).
pub fn mapped_library(process: &Process) -> Option<(BinaryKey, PathBuf)> {
    process.mapped_file(LIBRARY)
}

/// Why `process`, which does not map the library, will not load it: it has no program
/// interpreter (statically linked), or the loader has mapped its C library (preloaded
/// objects come first) without it. None while the loader may still map it (just after
/// `exec`), and for a C library the loader itself is (musl).
pub fn without_library(process: &Process) -> Option<&'static str> {
    let names: Vec<&str> = process
        .mappings()
        .iter()
        .filter(|m| m.kind == MappingKind::File)
        .map(|m| m.basename())
        .collect();
    let loader = names.iter().any(|n| n.starts_with("ld-"));
    let libc = names
        .iter()
        .any(|n| n.starts_with("libc.so") || n.starts_with("libc-"));
    if names.is_empty() {
        None
    } else if !loader {
        Some("is statically linked (LD_PRELOAD cannot load libpyrometer_alloc.so into it)")
    } else if libc {
        Some("does not load libpyrometer_alloc.so (started without it in LD_PRELOAD)")
    } else {
        None
    }
}

/// The mean the library uses in process `pid`: its environment's, else the library's
/// default; None when the environment cannot be read (the process is gone).
pub fn mean_of(proc_root: &Path, pid: u32) -> Option<u64> {
    crate::os::proctext::read_bytes(
        &proc_root.join(pid.to_string()).join("environ"),
        crate::os::proctext::TEXT_CAP,
    )
    .ok()
    .map(|env| mean_in_environ(&env).unwrap_or(DEFAULT_MEAN))
}

/// Whether `path` is an ELF executable without a program interpreter (statically linked):
/// `LD_PRELOAD` does nothing to it.
pub fn is_static_executable(path: &Path) -> bool {
    let Ok(data) = std::fs::read(path) else {
        return false;
    };
    object::File::parse(&*data).is_ok_and(|obj| {
        use object::ObjectSection;
        obj.kind() == object::ObjectKind::Executable
            && obj.section_by_name(".interp").is_none_or(|s| s.size() == 0)
    })
}

/// `PYROMETER_ALLOC_SAMPLE_BYTES` in a NUL-separated environment, as the library parses it.
fn mean_in_environ(env: &[u8]) -> Option<u64> {
    let prefix = format!("{MEAN_ENV}=");
    env.split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(prefix.as_bytes()))
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
}

/// The probes on each copy of the library attached so far.
#[derive(Default)]
pub struct PreloadProbes {
    copies: ProbedCopies,
}

impl PreloadProbes {
    /// Attaches the probes to the library at `path` (identified by `key`) unless they are on
    /// it already.
    pub fn attach(
        &mut self,
        key: BinaryKey,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        self.copies.attach(key, path, probes, attach_probes)
    }

    /// Attaches to the library file at `path` (a command about to start with it).
    pub fn attach_file(
        &mut self,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        self.copies.attach_file(path, probes, attach_probes)
    }

    /// Copies of the library probed.
    pub fn len(&self) -> usize {
        self.copies.len()
    }
}

/// The sampled-allocation, free and (where the library has it) move probes on one copy.
fn attach_probes(path: &Path, probes: &mut (dyn Uprobes + '_)) -> Result<(), String> {
    let offsets = probe_offsets(path)?;
    probes
        .attach_uprobe(ALLOC_PRELOAD, path, offsets.sampled)
        .and_then(|()| probes.attach_uprobe(ALLOC_PRELOAD_FREE, path, offsets.free))
        .and_then(|()| match offsets.moved {
            Some(at) => probes.attach_uprobe(ALLOC_PRELOAD_MOVE, path, at),
            None => Ok(()),
        })
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_comes_from_the_environment() {
        let env = b"PATH=/bin\0PYROMETER_ALLOC_SAMPLE_BYTES=4096\0HOME=/\0";
        assert_eq!(mean_in_environ(env), Some(4096));
        assert_eq!(mean_in_environ(b"PATH=/bin\0"), None);
        assert_eq!(
            mean_in_environ(b"PYROMETER_ALLOC_SAMPLE_BYTES=12k\0"),
            None,
            "the library ignores what it cannot parse, so does this"
        );
    }

    #[test]
    fn the_library_goes_first_in_ld_preload() {
        let lib = Path::new("/opt/p/libpyrometer_alloc.so");
        assert_eq!(ld_preload(lib, None), "/opt/p/libpyrometer_alloc.so");
        assert_eq!(
            ld_preload(lib, Some("libjemalloc.so.2".into())),
            "/opt/p/libpyrometer_alloc.so:libjemalloc.so.2"
        );
    }
}
