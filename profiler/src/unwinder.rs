//! Feeds the in-kernel DWARF unwinder: builds unwind tables for the executables that target
//! processes map (pyrometer-unwind), places them in the `unwind_rows` BPF array, and writes
//! each process's executable mappings (address range, load bias, row range) to
//! `unwind_procs`.
//!
//! Tables are shared: one table per executable (keyed by build-id, else device and inode), so
//! the same libc is processed and stored once per node however many processes map it. The
//! row array is the memory budget (`--unwind-rows`, 12 bytes a row); when a new table does not
//! fit, tables that no live process maps any more are evicted, oldest first. Each table also
//! gets a bucket index in `unwind_index` (one u64 per KiB of text, see
//! `pyrometer_ebpf::bucket_index`), so the kernel searches a few rows a frame, not the table.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, MapData};
use pyrometer_ebpf::{ExecMapping, MAX_MAPPINGS, ProcessUnwind, bucket_index};

use crate::os::elfsyms::load_bias;
use crate::os::procs::{Binary, BinaryKey, MappingKind, Process};
use crate::os::workers::ProcessReads;

/// Bytes per element of a BPF array: the kernel rounds each value up to 8 bytes, so a
/// 12-byte row occupies 16 (1 Mi rows = 16 MiB of kernel memory).
pub const ROW_SLOT: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum UnwinderError {
    #[error("cannot map the unwind row array: {0}")]
    Mmap(std::io::Error),
    #[error("BPF map unwind_procs: {0}")]
    Map(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum TableKey {
    BuildId(String),
    File(BinaryKey),
}

struct LoadedTable {
    first: u32,
    count: u32,
    /// Its bucket index in `unwind_index`: (first entry, entries, pc of bucket 0). Every
    /// loaded table has one: the kernel's row search is bounded by a bucket's rows (at most
    /// one per byte of its 1 KiB of text), which keeps its loop short for the verifier.
    index: (u32, u32, u32),
    /// PT_LOAD segments (file offset, vaddr, file size), to turn a mapping into a load bias.
    loads: Vec<(u64, u64, u64)>,
    /// Processes whose mapping table points at these rows.
    users: u32,
    last_used: u64,
}

impl LoadedTable {
    /// Whether `allocate` may evict it at sync `now`: no process maps it, and the current sync
    /// has not touched it (it may be for the process being written, whose users are counted
    /// only once its entry is).
    fn evictable(&self, now: u64) -> bool {
        self.users == 0 && self.last_used < now
    }
}

/// Counters for the record summary, `--stats` and the benchmark.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnwinderStats {
    /// Tables built.
    pub tables_built: u64,
    /// Tables that could not be built.
    pub tables_failed: u64,
    /// Tables evicted for room.
    pub tables_evicted: u64,
    /// Rows of the row array in use.
    pub rows_used: u64,
    /// Rows it holds.
    pub rows_capacity: u64,
    /// Tables that did not fit even after eviction (each counted once until it fits): those
    /// mappings unwind by frame pointer until rows free up.
    pub tables_too_big: u64,
    /// Processes registered.
    pub processes: u64,
    /// Executable mappings beyond MAX_MAPPINGS in one process (left out of its table).
    pub mappings_dropped: u64,
    /// Nanoseconds spent building tables.
    pub build_ns: u64,
    /// Reads of a binary (its build-id, its CFI) that did not finish by their deadline: the
    /// process is left alone for a while and unwinds by frame pointer meanwhile.
    pub stalled_reads: u64,
}

/// A BPF_F_MMAPABLE array, mapped only while something is written into it: a mapping kept
/// open holds all its pages in the agent's resident set, though the data lives in the map's
/// kernel memory either way.
struct MmapArray {
    fd: OwnedFd,
    /// Bytes per element (the kernel rounds values up to 8 bytes).
    slot: usize,
}

impl MmapArray {
    fn new(map: MapData, slot: usize) -> Result<Self, UnwinderError> {
        // The duplicate keeps the map alive after `map` closes its own descriptor.
        let fd = map
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(UnwinderError::Mmap)?;
        drop(map);
        let array = Self { fd, slot };
        // Fails here, at load, if the array cannot be mapped at all.
        array.window(0, 1)?;
        Ok(array)
    }

    /// Elements `first..first + count`, mapped read-write until the window is dropped.
    fn window(&self, first: u32, count: u32) -> Result<Window, UnwinderError> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let start = first as usize * self.slot;
        let end = start + count as usize * self.slot;
        let offset = start / page * page;
        let len = end.div_ceil(page) * page - offset;
        // SAFETY: maps pages of a BPF array created with BPF_F_MMAPABLE, within its size
        // (the allocators only hand out elements below capacity); unmapped on drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(UnwinderError::Mmap(std::io::Error::last_os_error()));
        }
        Ok(Window {
            base: base.cast(),
            len,
            skip: start - offset,
            count: count as usize,
            slot: self.slot,
        })
    }
}

/// Some elements of an [`MmapArray`], mapped.
struct Window {
    base: *mut u8,
    len: usize,
    /// Offset of the first element from `base` (the mapping starts on a page boundary).
    skip: usize,
    count: usize,
    slot: usize,
}

impl Window {
    /// Writes `values` into the window's elements, in order (at most its count).
    fn write<T: Copy>(&self, values: &[T]) {
        debug_assert!(size_of::<T>() <= self.slot);
        for (i, &v) in values.iter().take(self.count).enumerate() {
            // SAFETY: element i < count lies inside the window; elements are 8-byte aligned
            // (the window starts on a page and slots are multiples of 8) and `slot` bytes
            // long, at least size_of::<T>().
            unsafe {
                let at = self.base.add(self.skip + i * self.slot);
                std::ptr::write(at.cast::<T>(), v);
            }
        }
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: the region mapped in `MmapArray::window`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Free ranges of an array, (first, count) sorted by first; first fit.
struct Ranges(Vec<(u32, u32)>);

impl Ranges {
    fn take(&mut self, count: u32) -> Option<u32> {
        let i = self.0.iter().position(|&(_, len)| len >= count)?;
        let (first, len) = self.0[i];
        if len == count {
            self.0.remove(i);
        } else {
            self.0[i] = (first + count, len - count);
        }
        Some(first)
    }

    fn give_back(&mut self, first: u32, count: u32) {
        let i = self.0.partition_point(|&(f, _)| f < first);
        self.0.insert(i, (first, count));
        // Merge with neighbours so large tables can fit again.
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(self.0.len());
        for &(f, l) in &self.0 {
            if let Some(last) = merged.last_mut()
                && last.0 + last.1 == f
            {
                last.1 += l;
                continue;
            }
            merged.push((f, l));
        }
        self.0 = merged;
    }
}

pub struct Unwinder {
    /// The row array: one ROW_SLOT-byte slot per row.
    rows: MmapArray,
    /// The bucket indexes: one u64 per entry.
    index: MmapArray,
    procs: BpfHashMap<MapData, u32, ProcessUnwind>,
    tables: HashMap<TableKey, Option<LoadedTable>>,
    /// Tables that did not fit: (rows needed, rows that could be had when it failed). Built
    /// again once that many rows could be had and more than then (processes exited), not
    /// cached as failed for good, or an agent that once met more tables than rows would walk
    /// those executables by frame pointer until restart; nor every few seconds while nothing
    /// changed, since a build parses the whole `.eh_frame` and may fail again for want of a
    /// contiguous range.
    too_big: HashMap<TableKey, (u32, u32)>,
    /// Per process, the executables it maps that are in `too_big`.
    missing: HashMap<u32, Vec<TableKey>>,
    free: Ranges,
    index_free: Ranges,
    process_tables: HashMap<u32, Vec<TableKey>>,
    clock: u64,
    stats: UnwinderStats,
    /// Where binaries are read and their tables built: a file that never answers (FUSE)
    /// holds a worker, not the sampling loop.
    reads: ProcessReads,
}

/// Threads reading binaries and building tables; each read stuck past its deadline holds one.
const READ_WORKERS: usize = 2;
/// How long reading a binary's CFI and building its table may take (a large library's
/// `.eh_frame` on a busy machine).
const READ_DEADLINE: Duration = Duration::from_secs(5);
/// How long a process whose read overran is left alone, at least.
const READ_BACKOFF: Duration = Duration::from_secs(60);

/// What building a table came to.
enum Built {
    Loaded(LoadedTable),
    /// It needs this many rows, more than could be had now.
    TooBig(u32),
    /// The file could not be read or has no usable unwind information.
    Failed,
    /// The read did not finish in time or found no free worker: tried again later.
    Deferred,
}

impl Unwinder {
    /// `rows_map` is the BPF_F_MMAPABLE `unwind_rows` array of `capacity` rows, `index_map`
    /// the `unwind_index` array of `index_capacity` entries.
    pub fn new(maps: crate::bpf::UnwindMaps) -> Result<Self, UnwinderError> {
        let crate::bpf::UnwindMaps {
            rows: rows_map,
            rows_capacity: capacity,
            index: index_map,
            index_entries: index_capacity,
            procs,
        } = maps;
        Ok(Self {
            rows: MmapArray::new(rows_map, ROW_SLOT)?,
            index: MmapArray::new(index_map, 8)?,
            procs,
            tables: HashMap::new(),
            too_big: HashMap::new(),
            missing: HashMap::new(),
            free: Ranges(vec![(0, capacity)]),
            index_free: Ranges(vec![(0, index_capacity)]),
            process_tables: HashMap::new(),
            clock: 0,
            reads: ProcessReads::new(READ_WORKERS, READ_DEADLINE, READ_BACKOFF),
            stats: UnwinderStats {
                rows_capacity: u64::from(capacity),
                ..UnwinderStats::default()
            },
        })
    }

    pub fn stats(&self) -> UnwinderStats {
        self.stats
    }

    /// (Re)writes the unwind information of a process from its current mappings, building
    /// tables for executables not seen before.
    pub fn sync_process(&mut self, process: &Process) -> Result<(), UnwinderError> {
        self.clock += 1;
        let mut entry = ProcessUnwind {
            count: 0,
            reserved: 0,
            maps: [ExecMapping::default(); MAX_MAPPINGS],
        };
        let mut keys = Vec::new();
        let mut missing = Vec::new();
        let mut n = 0usize;
        for m in process.mappings() {
            if m.kind != MappingKind::File {
                continue;
            }
            let Some(binary) = m.binary() else { continue };
            if n == MAX_MAPPINGS {
                self.stats.mappings_dropped += 1;
                continue;
            }
            let Some(key) = self.table_key(process.pid, binary) else {
                // Its build-id could not be read in time: frame pointers for now.
                entry.maps[n] = ExecMapping {
                    start: m.start,
                    end: m.end,
                    ..ExecMapping::default()
                };
                n += 1;
                continue;
            };
            let path = binary.path().to_path_buf();
            let clock = self.clock;
            let (first, count, index, bias) = match self.table_for(process.pid, &key, &path) {
                Some(t) => {
                    t.last_used = clock;
                    let bias = load_bias(&t.loads, m.start, m.offset);
                    (t.first, t.count, t.index, bias)
                }
                None => {
                    if self.too_big.contains_key(&key) && !missing.contains(&key) {
                        missing.push(key.clone());
                    }
                    (0, 0, (0, 0, 0), None)
                }
            };
            let (first, count, index, bias) = match bias {
                Some(b) => (first, count, index, b),
                // Without a load bias the rows cannot be used: frame pointers for it.
                None => (0, 0, (0, 0, 0), 0),
            };
            let (index_first, index_count, pc_base) = index;
            if count > 0 && !keys.contains(&key) {
                keys.push(key);
            }
            entry.maps[n] = ExecMapping {
                start: m.start,
                end: m.end,
                bias,
                row_first: first,
                row_count: count,
                index_first,
                index_count,
                pc_base,
                reserved: 0,
            };
            n += 1;
        }
        entry.maps[..n].sort_by_key(|m| m.start);
        entry.count = n as u32;
        for k in &keys {
            if let Some(Some(t)) = self.tables.get_mut(k) {
                t.users += 1;
            }
        }
        if missing.is_empty() {
            self.missing.remove(&process.pid);
        } else {
            self.missing.insert(process.pid, missing);
        }
        if let Some(old) = self.process_tables.insert(process.pid, keys) {
            self.release(&old);
        } else {
            self.stats.processes += 1;
        }
        self.procs
            .insert(process.pid, entry, 0)
            .map_err(|e| UnwinderError::Map(e.to_string()))
    }

    /// Builds and loads the table of an executable before any process maps it (the command
    /// `record` is about to start, the C library), so a new process's first samples already
    /// unwind. Only objects with a build-id can be matched up later; others are skipped.
    pub fn prewarm(&mut self, path: &Path) {
        let Some(id) = crate::os::procs::read_build_id(path) else {
            return;
        };
        let key = TableKey::BuildId(id);
        self.clock += 1;
        let _ = self.table_for(0, &key, path);
    }

    /// The key of a binary's table: its build-id, read on a worker the first time (None
    /// while that read cannot be done in time), or its file's identity.
    fn table_key(&mut self, pid: u32, binary: &Arc<Binary>) -> Option<TableKey> {
        let id = match binary.known_build_id() {
            Some(id) => id,
            None => {
                let path = binary.path().to_path_buf();
                let id = self
                    .reads
                    .run(pid, move || crate::os::procs::read_build_id(&path));
                self.stats.stalled_reads = self.reads.overran();
                binary.set_build_id(id?)
            }
        };
        Some(match id {
            Some(id) => TableKey::BuildId(id.to_string()),
            None => TableKey::File(binary.key().clone()),
        })
    }

    /// Forgets a process that exited; its tables become evictable when nobody else maps them.
    pub fn remove_process(&mut self, pid: u32) {
        self.missing.remove(&pid);
        if let Some(keys) = self.process_tables.remove(&pid) {
            self.release(&keys);
            self.stats.processes = self.stats.processes.saturating_sub(1);
        }
        let _ = self.procs.remove(&pid);
    }

    /// Pids whose unwind information is loaded.
    pub fn pids(&self) -> Vec<u32> {
        self.process_tables.keys().copied().collect()
    }

    /// Forgets processes that are gone (every few seconds from the capture loop).
    pub fn gc(&mut self) {
        for pid in self.pids() {
            if !crate::os::pids::exists(pid) {
                self.remove_process(pid);
            }
        }
        self.reads.retain(crate::os::pids::exists);
    }

    fn release(&mut self, keys: &[TableKey]) {
        for k in keys {
            if let Some(Some(t)) = self.tables.get_mut(k) {
                t.users = t.users.saturating_sub(1);
            }
        }
    }

    /// Live processes that map an executable whose table did not fit, now that enough rows
    /// could be had for one of them (checked every few seconds): syncing them again builds it.
    pub fn retry_pids(&self) -> Vec<u32> {
        if self.missing.is_empty() {
            return Vec::new();
        }
        let available = self.available_rows();
        self.missing
            .iter()
            .filter(|(_, keys)| keys.iter().any(|k| self.worth_retrying(k, available)))
            .map(|(&pid, _)| pid)
            .collect()
    }

    /// A table that did not fit may now: enough rows could be had, and more than when it
    /// failed. True for a table that never failed.
    fn worth_retrying(&self, key: &TableKey, available: u32) -> bool {
        self.too_big
            .get(key)
            .is_none_or(|&(needed, then)| needed <= available && available > then)
    }

    /// Rows free or held by tables no process maps (which `allocate` may evict); contiguous
    /// or not, so a build tried on this can still not fit.
    fn available_rows(&self) -> u32 {
        let free: u32 = self.free.0.iter().map(|&(_, len)| len).sum();
        let evictable: u32 = self
            .tables
            .values()
            .flatten()
            .filter(|t| t.evictable(self.clock))
            .map(|t| t.count)
            .sum();
        free.saturating_add(evictable)
    }

    fn table_for(&mut self, pid: u32, key: &TableKey, path: &Path) -> Option<&mut LoadedTable> {
        if !self.tables.contains_key(key) {
            let available = self.available_rows();
            if !self.worth_retrying(key, available) {
                return None;
            }
            match self.build(pid, path) {
                Built::Loaded(t) => {
                    self.too_big.remove(key);
                    self.tables.insert(key.clone(), Some(t));
                }
                Built::TooBig(needed) => {
                    // What could be had once the failed allocation evicted all it could.
                    let then = self.available_rows();
                    if self.too_big.insert(key.clone(), (needed, then)).is_none() {
                        self.stats.tables_too_big += 1;
                    }
                    return None;
                }
                Built::Failed => {
                    self.tables.insert(key.clone(), None);
                }
                Built::Deferred => return None,
            }
        }
        self.tables.get_mut(key).and_then(Option::as_mut)
    }

    fn build(&mut self, pid: u32, path: &Path) -> Built {
        let started = std::time::Instant::now();
        let path = path.to_path_buf();
        // On a worker: a binary on a mount that never answers holds it, not the caller.
        let read = self.reads.run(pid, move || {
            // A sparse copy in an anonymous mapping, not the heap (a copy of a large binary
            // there would keep the allocator's high-water mark long after the table is built)
            // and not a mapping of the file (which a process truncating it would turn into a
            // SIGBUS here): only the headers and the CFI are read.
            let bytes = crate::os::untrusted::UntrustedFile::open_resolved(
                &path,
                crate::os::untrusted::Kind::Elf,
            )
            .and_then(|f| f.copy_elf_sections(&[".eh_frame", ".debug_frame"]))
            .ok()?;
            let loads = load_segments(&bytes);
            Some((loads, pyrometer_unwind::build_table(&bytes).ok()))
        });
        self.stats.stalled_reads = self.reads.overran();
        let Some(read) = read else {
            return Built::Deferred;
        };
        let Some((loads, table)) = read else {
            return Built::Failed;
        };
        self.stats.build_ns += started.elapsed().as_nanos() as u64;
        let table = match table {
            Some(t) if !t.rows.is_empty() && !loads.is_empty() => t,
            _ => {
                self.stats.tables_failed += 1;
                return Built::Failed;
            }
        };
        let Ok(count) = u32::try_from(table.rows.len()) else {
            return Built::TooBig(u32::MAX);
        };
        let Some(first) = self.allocate(count) else {
            return Built::TooBig(count);
        };
        match self.rows.window(first, count) {
            Ok(window) => window.write(&table.rows),
            Err(_) => {
                self.free.give_back(first, count);
                self.stats.tables_failed += 1;
                return Built::Failed;
            }
        }
        let buckets = bucket_index(&table.rows);
        let Ok(n) = u32::try_from(buckets.len()) else {
            self.free.give_back(first, count);
            return Built::TooBig(count);
        };
        let Some(at) = self.allocate_index(n) else {
            // Rows without an index cannot be searched by the kernel (see LoadedTable::index).
            self.free.give_back(first, count);
            return Built::TooBig(count);
        };
        match self.index.window(at, n) {
            Ok(window) => window.write(&buckets),
            Err(_) => {
                self.index_free.give_back(at, n);
                self.free.give_back(first, count);
                self.stats.tables_failed += 1;
                return Built::Failed;
            }
        }
        let index = (at, n, table.rows[0].pc);
        self.stats.tables_built += 1;
        self.stats.rows_used += u64::from(count);
        Built::Loaded(LoadedTable {
            first,
            count,
            index,
            loads,
            users: 0,
            last_used: self.clock,
        })
    }

    /// First fit in the free list; when nothing fits, evicts unused tables oldest first.
    /// A table built or looked up during the current sync is in use though nobody counts it
    /// yet (users are counted when the process's entry is written): evicting it handed its
    /// rows to the next table while the entry being built still pointed at them, so a
    /// process with more tables than fit (PyTorch's ~200 libraries against the default
    /// --unwind-rows) unwound some frames with another library's rows.
    fn allocate(&mut self, count: u32) -> Option<u32> {
        self.take_or_evict(|u| u.free.take(count))
    }

    /// The same for a table's bucket index.
    fn allocate_index(&mut self, entries: u32) -> Option<u32> {
        self.take_or_evict(|u| u.index_free.take(entries))
    }

    fn take_or_evict(&mut self, mut take: impl FnMut(&mut Self) -> Option<u32>) -> Option<u32> {
        let now = self.clock;
        loop {
            if let Some(at) = take(self) {
                return Some(at);
            }
            let victim = eviction_victim(&self.tables, now)?;
            self.evict(&victim);
        }
    }

    fn evict(&mut self, key: &TableKey) {
        if let Some(Some(t)) = self.tables.remove(key) {
            self.stats.tables_evicted += 1;
            self.stats.rows_used -= u64::from(t.count);
            self.free.give_back(t.first, t.count);
            let (at, n, _) = t.index;
            self.index_free.give_back(at, n);
        }
    }
}

/// The table to evict for room at sync `now`: the least recently used of those no process
/// maps and the current sync has not touched (see `Unwinder::allocate`).
fn eviction_victim(tables: &HashMap<TableKey, Option<LoadedTable>>, now: u64) -> Option<TableKey> {
    tables
        .iter()
        .filter_map(|(k, t)| t.as_ref().map(|t| (k, t)))
        .filter(|(_, t)| t.evictable(now))
        .min_by_key(|(_, t)| t.last_used)
        .map(|(k, _)| k.clone())
}

fn load_segments(bytes: &[u8]) -> Vec<(u64, u64, u64)> {
    use object::{Object, ObjectSegment};
    let Ok(obj) = object::File::parse(bytes) else {
        return Vec::new();
    };
    obj.segments()
        .map(|s| {
            let (off, size) = s.file_range();
            (off, s.address(), size)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(users: u32, last_used: u64) -> Option<LoadedTable> {
        Some(LoadedTable {
            first: 0,
            count: 1,
            index: (0, 1, 0),
            loads: Vec::new(),
            users,
            last_used,
        })
    }

    fn key(id: &str) -> TableKey {
        TableKey::BuildId(id.to_string())
    }

    #[test]
    fn eviction_spares_mapped_tables_and_the_current_sync() {
        let mut tables = HashMap::new();
        tables.insert(key("mapped"), table(1, 1));
        tables.insert(key("old"), table(0, 2));
        tables.insert(key("older"), table(0, 1));
        // Built earlier in sync 5 for the process being written: nobody counts it yet.
        tables.insert(key("this sync"), table(0, 5));
        tables.insert(key("failed"), None);
        assert_eq!(eviction_victim(&tables, 5), Some(key("older")));
        tables.remove(&key("older"));
        assert_eq!(eviction_victim(&tables, 5), Some(key("old")));
        tables.remove(&key("old"));
        assert_eq!(eviction_victim(&tables, 5), None);
        // At the next sync it is fair game unless that process mapped it.
        assert_eq!(eviction_victim(&tables, 6), Some(key("this sync")));
    }
}
