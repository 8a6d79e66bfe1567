//! Turns raw stack addresses into [`Frame`]s: user addresses through the process registry's
//! mappings and blazesym's ELF/DWARF reader, JIT code through perf maps, kernel addresses
//! through kallsyms.
//!
//! Results are cached per (build-id, file offset) — falling back to the file's identity when
//! it has no build-id — so a libc address is symbolized once per run whichever process hit it.

pub mod debuginfod;
mod elf;
mod fetched;
mod jit;
mod kallsyms;
mod kernel;
mod perfmap;
mod reads;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{CodeInfo, Input};

use crate::model::{Frame, FrameKind};
use crate::os::procs::{BinaryKey, Mapping, MappingKind, ProcessRegistry};
use crate::os::untrusted::{Kind, UntrustedError, UntrustedFile};
use crate::os::workers::{OffLoop, ProcessReads};
use elf::{ElfInfo, Vdso};
use kallsyms::Kallsyms;
use perfmap::PerfMap;
use reads::{Answer, ReadKey};
use std::os::fd::AsRawFd;

pub const KERNEL_MODULE: &str = "[kernel.kallsyms]";
pub const UNKNOWN: &str = "[unknown]";
/// The one frame standing for the user stack of a process over its budget.
pub const OVER_BUDGET: &str = "[budget]";

/// What the symbolizer may keep for one process unless configured otherwise
/// ([`Symbolizer::with_process_budget`]): 24 MiB.
pub const DEFAULT_PROCESS_BUDGET: u64 = 24 << 20;

/// Results kept at most (bounded memory); past it the cache starts over.
pub const MAX_RESULTS: usize = 1 << 18;

/// Directories searched for separate debug files unless configured otherwise.
pub const DEFAULT_DEBUG_DIRS: &[&str] = &["/usr/lib/debug", "/lib/debug"];

/// The separate debug file of a binary without debug information of its own (by build-id,
/// then `.gnu_debuglink`), as the symbolizer finds it; `None` when the binary has its own or
/// none is found. `dir` is the binary's directory as reachable from here, `seen` its path as
/// the process saw it.
pub fn separate_debug_file(
    path: &Path,
    dir: Option<&Path>,
    seen: &str,
    build_id: Option<&str>,
    debug_dirs: &[PathBuf],
) -> Option<crate::os::elfsyms::DebugFile> {
    let info = ElfInfo::load(path, dir, seen, build_id, debug_dirs)?;
    (info.debug_syms && info.source != path)
        .then(|| crate::os::elfsyms::DebugFile::checked(info.source, info.source_id))
}

/// Counts of input addresses (not output frames: inlining expands one address into several).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SymbolizerStats {
    /// Addresses that got a name (native, JIT, vDSO or kernel).
    pub symbolized: u64,
    /// Addresses left as `[unknown]` or `module+0xOFFSET`.
    pub unsymbolized: u64,
    /// User addresses answered from the result cache.
    pub cache_hits: u64,
    /// User addresses that needed a lookup in a binary.
    pub cache_misses: u64,
    /// Times a file with DWARF was opened for its symbol table only, its DWARF not fitting
    /// in [`Symbolizer::with_dwarf_budget`]: its frames have no lines or inlined functions.
    pub dwarf_skipped_files: u64,
    /// Files a process controls that were refused (a FIFO, a link, a device, over the cap):
    /// perf maps, and binaries or debug files found replaced between their check (build id,
    /// debuglink CRC) and their reading (their frames stay unnamed).
    pub refused_files: u64,
    /// Reads that did not finish by their deadline (a file on a mount that does not answer):
    /// the process is left alone for a while, the read keeps one worker.
    pub stalled_reads: u64,
    /// Reads still running when their caller stopped waiting (the push's share of waiting,
    /// [`Symbolizer::wait_for_reads_until`], ran out, or the read's deadline passed): what
    /// they would have named stayed module and offset then, and an answer that comes is
    /// used when next asked for.
    pub deferred_reads: u64,
    /// Processes found over their budget ([`Symbolizer::with_process_budget`]): their user
    /// stacks are one `[budget]` frame from then on.
    pub processes_over_budget: u64,
}

/// One function at an address, before it is dressed up as a [`Frame`] for a given mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Resolved {
    function: String,
    file: Option<String>,
    line: Option<u32>,
    inlined: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ModKey {
    BuildId(String),
    File(BinaryKey),
}

/// What files may cost ([`elf::FileCost::open`]: their DWARF as read, inflated, and the rest at
/// its size on disk) to stay open, with their parsed symbol and DWARF tables, across
/// [`Symbolizer::release_files`]: the C library's debug file (10 MB of DWARF inflated) and
/// an interpreter named from its symbol table fit, a debug build of a large program does not.
pub const KEEP_OPEN_BYTES: u64 = 24 << 20;

/// How many [`Symbolizer::release_files`] periods (pushes: 10 s each in the agent) a file
/// stays open without being used, budget permitting. A binary that keeps running does not
/// meet a new address every push: released after one push without one, the C library's debug
/// file was decompressed again (~30 ms) at the next, every minute or so on a quiet node.
pub const KEEP_OPEN_PERIODS: u64 = 30;

/// One file's blazesym reader, and how it was used.
struct OpenFile {
    blaze: blazesym::symbolize::Symbolizer,
    /// The copy blazesym reads (a memory file of ours, as `/proc/self/fd/N`), never the
    /// process's file itself: truncating that cannot fault a mapping of blazesym's.
    copy: std::fs::File,
    /// The [`Symbolizer::release_files`] period it was last used in.
    used: u64,
    /// Lookups in that period.
    lookups: u64,
    /// What keeping it open costs ([`elf::FileCost::open`]).
    bytes: u64,
    /// Bytes of DWARF read from it (inflated); None when it is read for its symbol table only.
    dwarf: Option<u64>,
}

/// The sections blazesym reads from an ELF object: symbol tables and their names, and (when
/// asked) DWARF. The copy handed to it holds these only; its code and data read as zeros.
fn blaze_section(name: &[u8], dwarf: bool) -> bool {
    const SYMBOLS: &[&[u8]] = &[
        b".symtab",
        b".strtab",
        b".dynsym",
        b".dynstr",
        b".gnu_debuglink",
        b".gnu.version",
        b".gnu.version_d",
        b".gnu.version_r",
        b".note.gnu.build-id",
    ];
    SYMBOLS.contains(&name)
        || (dwarf && (name.starts_with(b".debug_") || name.starts_with(b".zdebug_")))
}

/// A read of a process's files did not answer in time, or found no free worker: nothing is
/// cached, it is tried again later.
struct Deferred;

/// Not `Send`: blazesym's resolvers use `Rc`. Create it on the thread that symbolizes.
pub struct Symbolizer {
    /// A blazesym symbolizer per file (each caches the one file it read), so that files
    /// can be let go of one by one.
    open: HashMap<PathBuf, OpenFile>,
    /// The current [`Symbolizer::release_files`] period.
    period: u64,
    debug_dirs: Vec<PathBuf>,
    kallsyms_path: PathBuf,
    /// Where the kernel's symbols are kept between runs.
    kallsyms_cache: kallsyms::KeptFile,
    perf_map_interval: Duration,
    elves: crate::FastMap<BinaryKey, Option<Rc<ElfInfo>>>,
    /// Innermost-first functions at (module, lookup file offset); `None`: nothing found.
    results: crate::FastMap<(ModKey, u64), Option<Rc<[Resolved]>>>,
    perf_maps: HashMap<u32, PerfMap>,
    /// Where files a process controls are read, with deadlines.
    reads: ProcessReads,
    /// Reads started and not yet answered (or answered after their caller stopped waiting).
    pending: OffLoop<ReadKey, Answer>,
    /// What may be kept for one process, and the processes found over it.
    process_budget: u64,
    over_budget: std::collections::HashSet<u32>,
    /// CPU time spent on each process, bounded per interval (the agent's).
    cpu: Option<crate::os::cpu_budget::CpuBudget>,
    kallsyms: Option<Kallsyms>,
    vdso: Option<Option<Vdso>>,
    stats: SymbolizerStats,
    /// At most this much DWARF (inflated) is read from the files open at once; a file
    /// whose DWARF does not fit is read for its symbol table only (None: no limit).
    dwarf_budget: Option<u64>,
    /// Where debug files missing from the machine are fetched from (None: nowhere).
    debuginfod: Option<debuginfod::Debuginfod>,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Symbolizer {
    fn blaze() -> blazesym::symbolize::Symbolizer {
        blazesym::symbolize::Symbolizer::builder()
            // Files do not change under a capture, and reload checks cost a stat per lookup.
            .enable_auto_reload(false)
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            // We find debug files ourselves (by build-id too, which blazesym does not).
            .set_debug_dirs(Some(Vec::<PathBuf>::new()))
            .build()
    }

    pub fn new() -> Self {
        Self {
            open: HashMap::new(),
            period: 0,
            debug_dirs: DEFAULT_DEBUG_DIRS.iter().map(PathBuf::from).collect(),
            kallsyms_path: PathBuf::from("/proc/kallsyms"),
            kallsyms_cache: kallsyms::KeptFile::Default,
            perf_map_interval: crate::os::procs::DEFAULT_REFRESH_INTERVAL,
            elves: Default::default(),
            results: Default::default(),
            perf_maps: HashMap::new(),
            reads: reads::pool(),
            pending: OffLoop::default(),
            process_budget: DEFAULT_PROCESS_BUDGET,
            over_budget: Default::default(),
            cpu: None,
            kallsyms: None,
            vdso: None,
            stats: SymbolizerStats::default(),
            dwarf_budget: None,
            debuginfod: None,
        }
    }

    /// Reads at most `bytes` of DWARF, counted inflated, from the files open at once; a file
    /// whose DWARF does not fit in what is left is opened for its symbol table only (names,
    /// no lines or inlined functions) until it is let go. For the always-on agent, whose
    /// memory this bounds: the reader holds a compressed debug file's DWARF inflated, and with
    /// what it parses from it the agent grew by ~1.7 times the inflated size (41 MB for the
    /// 22 MB of Debian's python3.11 debug file); a debug build of a large program has hundreds
    /// of MB. Which files get their DWARF depends on the order they are first met in.
    pub fn with_dwarf_budget(mut self, bytes: u64) -> Self {
        self.dwarf_budget = Some(bytes);
        self
    }

    /// What the symbolizer and the registry may keep for one process: its perf map as parsed
    /// and its mappings as held. A process found over it (after a read of its perf map or
    /// its maps) is degraded: what was kept for it is let go, and each of its user stacks is
    /// one `[budget]` frame ([`FrameKind::Budget`]); its samples, kernel frames and labels
    /// stay. The caches shared by every process (results, open files, ELF layouts) have
    /// bounds of their own.
    pub fn with_process_budget(mut self, bytes: u64) -> Self {
        self.process_budget = bytes;
        self
    }

    /// Charges the CPU time spent symbolizing each process (its reads on workers, its
    /// lookups) to `budget`; a process over it has each of its user stacks as one `[budget]`
    /// frame until it is within the budget again (see [`crate::os::cpu_budget`]).
    pub fn with_cpu_budget(mut self, budget: crate::os::cpu_budget::CpuBudget) -> Self {
        self.reads.set_budget(budget.clone());
        self.cpu = Some(budget);
        self
    }

    /// Directories holding separate debug files (`<dir>/.build-id/xx/yyyy.debug`,
    /// `<dir>/<binary's dir>/<debuglink>`).
    pub fn with_debug_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        self.debug_dirs = dirs;
        self
    }

    #[cfg(test)]
    pub fn with_kallsyms(mut self, path: impl Into<PathBuf>) -> Self {
        self.kallsyms_path = path.into();
        self.kallsyms = None;
        self.kallsyms_cache = kallsyms::KeptFile::None;
        self
    }

    /// Minimum time between re-reads of one process's perf map after a miss.
    #[cfg(test)]
    pub fn with_perf_map_interval(mut self, interval: Duration) -> Self {
        self.perf_map_interval = interval;
        self
    }

    pub fn stats(&self) -> SymbolizerStats {
        self.stats
    }

    /// Lets go of the files blazesym holds (mapped, with the symbol and DWARF tables parsed
    /// from them), keeping the results and what is known of each binary. A long-running agent
    /// calls it after each push: otherwise every binary a profile ever touched stays in its
    /// resident set, on a busy node hundreds of MB. The files used most since the previous
    /// calls stay open, up to [`KEEP_OPEN_BYTES`]: a binary that keeps running keeps meeting
    /// addresses not seen before (libc's, the interpreter's), and parsing it again for each
    /// (decompressing a debug file's DWARF) was most of an always-on agent's CPU time. The
    /// most recently used first, then the most used; none unused for [`KEEP_OPEN_PERIODS`].
    /// A later miss opens a released file again.
    pub fn release_files(&mut self) {
        self.ask_again_for_debug_files();
        // Answers nobody came back for are let go after a while; reads past their deadline
        // leave their process alone.
        self.pending.ready(&mut self.reads);
        let period = self.period;
        let mut used: Vec<(u64, u64, u64, PathBuf)> = self
            .open
            .iter()
            .filter(|(_, f)| period - f.used < KEEP_OPEN_PERIODS)
            .map(|(p, f)| (f.used, f.lookups, f.bytes, p.clone()))
            .collect();
        used.sort_by_key(|u| std::cmp::Reverse((u.0, u.1)));
        let mut budget = KEEP_OPEN_BYTES;
        let mut keep = std::collections::HashSet::new();
        for (_, _, bytes, path) in used {
            if bytes <= budget {
                budget -= bytes;
                keep.insert(path);
            }
        }
        self.open.retain(|p, _| keep.contains(p));
        for f in self.open.values_mut() {
            f.lookups = 0;
        }
        self.period += 1;
    }

    /// Forgets what it read for processes and binaries `registry` no longer holds: each
    /// process's perf map, and each binary's ELF layout and debug file location. A
    /// long-running agent calls it after [`ProcessRegistry::forget_exited`]; these were kept
    /// for every process and binary a node ever ran, a perf map as large as its JIT wrote it.
    /// Results stay (bounded by [`MAX_RESULTS`]); a binary met again is read again.
    pub fn forget_exited(&mut self, registry: &ProcessRegistry) {
        self.perf_maps.retain(|&pid, _| registry.get(pid).is_some());
        self.over_budget.retain(|&pid| registry.get(pid).is_some());
        self.reads.retain(|pid| registry.get(pid).is_some());
        self.elves.retain(|key, _| registry.maps_binary(key));
    }

    /// Processes with a perf map read, and binaries with their ELF layout read (for tests).
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        (self.perf_maps.len(), self.elves.len())
    }

    /// Files open now (for tests and statistics).
    #[cfg(test)]
    pub fn open_files(&self) -> usize {
        self.open.len()
    }

    /// Whether `path` is open now (for tests).
    #[cfg(test)]
    pub fn is_open(&self, path: &Path) -> bool {
        self.open.contains_key(path)
    }

    /// Symbolizes a user stack of `pid`: `addrs` are leaf first, the first the sampled IP, the
    /// rest return addresses. Frames come back leaf first, inlined functions expanded.
    pub fn user(&mut self, registry: &mut ProcessRegistry, pid: u32, addrs: &[u64]) -> Vec<Frame> {
        if registry.get(pid).is_none() {
            // An unknown pid just yields `[unknown]` frames.
            let _ = registry.observe(pid);
        }
        if self.over(registry, pid) || self.cpu.as_ref().is_some_and(|b| b.is_over(pid)) {
            self.stats.unsymbolized += addrs.len() as u64;
            return vec![Frame::named(OVER_BUDGET, FrameKind::Budget)];
        }
        let mut out = Vec::with_capacity(addrs.len());
        for (i, &addr) in addrs.iter().enumerate() {
            // A return address points after the call, possibly into the next function or
            // line; one byte back is inside the call instruction.
            let lookup = if i == 0 { addr } else { addr.saturating_sub(1) };
            let named = self.user_one(registry, pid, addr, lookup, &mut out);
            self.count(named);
        }
        out
    }

    fn count(&mut self, named: bool) {
        if named {
            self.stats.symbolized += 1;
        } else {
            self.stats.unsymbolized += 1;
        }
    }

    fn user_one(
        &mut self,
        registry: &mut ProcessRegistry,
        pid: u32,
        addr: u64,
        lookup: u64,
        out: &mut Vec<Frame>,
    ) -> bool {
        if registry.find(pid, lookup).is_none() {
            // Maybe something was dlopen'ed since we read the maps (rate-limited inside).
            let _ = registry.refresh(pid);
        }
        let registry = &*registry;
        let Some((m, _)) = registry.find(pid, lookup) else {
            if let Some(f) = self.jit(registry, pid, addr, lookup) {
                out.push(f);
                return true;
            }
            out.push(Frame {
                address: addr,
                ..Frame::named(UNKNOWN, FrameKind::Unknown)
            });
            return false;
        };
        match m.kind {
            MappingKind::File => {
                let before = out.len();
                if self.native(pid, m, addr, lookup, out) {
                    return true;
                }
                // Code in a file we cannot read as ELF (a memfd some JITs use) may be in
                // the perf map.
                if let Some(f) = self.jit(registry, pid, addr, lookup) {
                    out.truncate(before);
                    out.push(f);
                    return true;
                }
                false
            }
            MappingKind::Vdso => self.vdso(m, addr, lookup, out),
            MappingKind::Anon | MappingKind::Special => {
                if m.kind == MappingKind::Anon
                    && let Some(f) = self.jit(registry, pid, addr, lookup)
                {
                    out.push(f);
                    return true;
                }
                out.push(Frame {
                    module: Some(m.path.clone()),
                    address: addr,
                    ..Frame::named(UNKNOWN, FrameKind::Unknown)
                });
                false
            }
        }
    }

    /// Pushes the frames for an address in a file mapping; false when it stayed unnamed (a
    /// `name+0xOFFSET` frame was pushed then). What is read of the binary is read on a
    /// worker, with a deadline.
    fn native(
        &mut self,
        pid: u32,
        m: &Mapping,
        addr: u64,
        lookup: u64,
        out: &mut Vec<Frame>,
    ) -> bool {
        let id = m.binary().and_then(|b| self.build_id(pid, b));
        let build_id = id.as_ref().and_then(|id| id.as_deref());
        let resolved = m.binary().filter(|_| id.is_some()).and_then(|b| {
            let mkey = mod_key(build_id, b.key());
            self.cached(pid, mkey, m.file_offset(lookup), |s| {
                let dirs = b.debug_dirs(&s.debug_dirs);
                let seen = b.seen_path(&m.path);
                s.elf_info(pid, b.key(), b.path(), b.dir(), seen, build_id, Some(&dirs))
            })
        });
        let off = m.file_offset(addr);
        push_native(
            out,
            resolved.as_deref(),
            &m.path,
            m.basename(),
            build_id,
            off,
        )
    }

    /// Symbolizes one exact file offset of an ELF file on disk (no return-address
    /// adjustment): for offline symbolization by path. Frames innermost first.
    #[cfg(test)]
    pub fn symbolize_elf(&mut self, path: &Path, file_offset: u64) -> Vec<Frame> {
        let key = BinaryKey::Path(path.to_path_buf());
        let seen = path.to_string_lossy();
        let info = self
            .elf_info(0, &key, path, path.parent(), &seen, None, None)
            .ok()
            .flatten();
        let build_id = info.as_ref().and_then(|i| i.build_id.clone());
        let mkey = mod_key(build_id.as_deref(), &key);
        let resolved = self.cached(0, mkey, file_offset, |_| Ok(info));
        let basename = seen.rsplit('/').next().unwrap_or(&seen);
        let mut out = Vec::new();
        let named = push_native(
            &mut out,
            resolved.as_deref(),
            &seen,
            basename,
            build_id.as_deref(),
            file_offset,
        );
        self.count(named);
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn elf_info(
        &mut self,
        pid: u32,
        key: &BinaryKey,
        path: &Path,
        dir: Option<&Path>,
        seen: &str,
        build_id: Option<&str>,
        debug_dirs: Option<&[PathBuf]>,
    ) -> Result<Option<Rc<ElfInfo>>, Deferred> {
        if let Some(info) = self.elves.get(key) {
            let info = info.clone();
            self.want_debug_file(info.as_deref());
            return Ok(info);
        }
        let dirs = debug_dirs.unwrap_or(&self.debug_dirs).to_vec();
        let fetched = self.debuginfod.as_ref().map(|d| d.cache_lookup());
        let (path, dir, seen) = (
            path.to_path_buf(),
            dir.map(Path::to_path_buf),
            seen.to_string(),
        );
        let build_id = build_id.map(str::to_string);
        let info = self
            .off_loop(pid, ReadKey::Layout(key.clone()), move || {
                let info = ElfInfo::load(&path, dir.as_deref(), &seen, build_id.as_deref(), &dirs)?;
                // Without a debug file on the machine, one fetched earlier may be cached.
                let id = info.build_id.as_deref().filter(|_| !info.debug_syms);
                Some(match id.zip(fetched).and_then(|(id, find)| find(id)) {
                    Some(file) => info.with_debug_file(file),
                    None => info,
                })
            })
            .ok_or(Deferred)?
            .map(Rc::new);
        self.want_debug_file(info.as_deref());
        self.elves.insert(key.clone(), info.clone());
        Ok(info)
    }

    fn cached(
        &mut self,
        pid: u32,
        mkey: ModKey,
        lookup_offset: u64,
        info: impl FnOnce(&mut Self) -> Result<Option<Rc<ElfInfo>>, Deferred>,
    ) -> Option<Rc<[Resolved]>> {
        let key = (mkey, lookup_offset);
        if let Some(r) = self.results.get(&key) {
            self.stats.cache_hits += 1;
            return r.clone();
        }
        self.stats.cache_misses += 1;
        let budget = self.cpu.clone();
        let r =
            crate::os::cpu_budget::charged(budget.as_ref(), pid, || match info(self).ok()? {
                Some(i) => self.resolve(pid, &i, lookup_offset).ok(),
                None => Some(None),
            })?;
        if self.results.len() >= MAX_RESULTS {
            self.results.clear();
        }
        self.results.insert(key, r.clone());
        r
    }

    fn resolve(
        &mut self,
        pid: u32,
        info: &ElfInfo,
        file_offset: u64,
    ) -> Result<Option<Rc<[Resolved]>>, Deferred> {
        let Some(vaddr) = info.vaddr(file_offset) else {
            return Ok(None);
        };
        let period = self.period;
        if !self.open.contains_key(&info.source) {
            let cost = info.cost;
            let mut dwarf = info.debug_syms;
            if dwarf && let Some(budget) = self.dwarf_budget {
                let held: u64 = self.open.values().filter_map(|f| f.dwarf).sum();
                dwarf = held.saturating_add(cost.dwarf) <= budget;
                if !dwarf {
                    self.stats.dwarf_skipped_files += 1;
                }
            }
            let (source, id) = (info.source.clone(), info.source_id);
            let key = ReadKey::Copy(source.clone(), dwarf);
            let copy = self
                .off_loop(pid, key, move || {
                    UntrustedFile::open_identified(&source, Kind::Elf, id)
                        .and_then(|f| f.copy_elf_to_memfd(|name| blaze_section(name, dwarf)))
                })
                .ok_or(Deferred)?;
            let copy = match copy {
                Ok(copy) => copy,
                Err(UntrustedError::Replaced { .. }) => {
                    self.stats.refused_files += 1;
                    return Ok(None);
                }
                Err(_) => return Ok(None),
            };
            self.open.insert(
                info.source.clone(),
                OpenFile {
                    blaze: Self::blaze(),
                    copy,
                    used: period,
                    lookups: 0,
                    bytes: cost.open(dwarf),
                    dwarf: dwarf.then_some(cost.dwarf),
                },
            );
        }
        let Some(file) = self.open.get_mut(&info.source) else {
            return Ok(None);
        };
        let mut elf = Elf::new(format!("/proc/self/fd/{}", file.copy.as_raw_fd()));
        elf.debug_syms = file.dwarf.is_some();
        let src = Source::from(elf);
        if file.used != period {
            file.used = period;
            file.lookups = 0;
        }
        file.lookups += 1;
        let Ok(syms) = file.blaze.symbolize(&src, Input::VirtOffset(&[vaddr])) else {
            return Ok(None);
        };
        let Some(sym) = syms.into_iter().next().and_then(|s| s.into_sym()) else {
            return Ok(None);
        };
        let mut v = Vec::with_capacity(sym.inlined.len() + 1);
        // blazesym lists inlined callees outermost first; frames go innermost first.
        for f in sym.inlined.iter().rev() {
            let (file, line) = location(f.code_info.as_ref());
            v.push(Resolved {
                function: f.name.to_string(),
                file,
                line,
                inlined: true,
            });
        }
        let (file, line) = location(sym.code_info.as_deref());
        v.push(Resolved {
            function: sym.name.into_owned(),
            file,
            line,
            inlined: false,
        });
        Ok(Some(v.into()))
    }

    fn vdso(&mut self, m: &Mapping, addr: u64, lookup: u64, out: &mut Vec<Frame>) -> bool {
        let vdso = self.vdso.get_or_insert_with(Vdso::read_self).as_ref();
        let name = vdso.and_then(|v| v.lookup(m.file_offset(lookup)));
        out.push(Frame {
            function: name.unwrap_or("[vdso]").to_string(),
            file: None,
            line: None,
            module: Some("[vdso]".to_string()),
            build_id: vdso.and_then(|v| v.build_id.clone()),
            address: m.file_offset(addr),
            kind: if name.is_some() {
                FrameKind::Native
            } else {
                FrameKind::Unknown
            },
            inlined: false,
        });
        name.is_some()
    }
}

fn mod_key(build_id: Option<&str>, key: &BinaryKey) -> ModKey {
    match build_id {
        Some(id) => ModKey::BuildId(id.to_string()),
        None => ModKey::File(key.clone()),
    }
}

fn location(ci: Option<&CodeInfo<'_>>) -> (Option<String>, Option<u32>) {
    match ci {
        Some(c) => (Some(c.to_path().display().to_string()), c.line),
        None => (None, None),
    }
}

/// Pushes the resolved functions, or one `basename+0xOFFSET` frame when there are none.
fn push_native(
    out: &mut Vec<Frame>,
    resolved: Option<&[Resolved]>,
    module: &str,
    basename: &str,
    build_id: Option<&str>,
    file_offset: u64,
) -> bool {
    let frame = |function: String, kind| Frame {
        function,
        file: None,
        line: None,
        module: Some(module.to_string()),
        build_id: build_id.map(str::to_string),
        address: file_offset,
        kind,
        inlined: false,
    };
    match resolved {
        Some(list) if !list.is_empty() => {
            out.extend(list.iter().map(|r| Frame {
                file: r.file.clone(),
                line: r.line,
                inlined: r.inlined,
                ..frame(r.function.clone(), FrameKind::Native)
            }));
            true
        }
        _ => {
            out.push(frame(
                format!("{basename}+0x{file_offset:x}"),
                FrameKind::Unknown,
            ));
            false
        }
    }
}
