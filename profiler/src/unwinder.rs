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
//! Building is paid from a [`Budget`] of CPU time (node-wide in the agent, see `budget`).

mod arrays;
pub mod budget;
pub mod replay;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, MapData};
use pyrometer_ebpf::{ExecMapping, MAX_MAPPINGS, ProcessUnwind, bucket_index};

use crate::os::cpu_budget::thread_cpu;
use crate::os::elfsyms::load_bias;
use crate::os::procs::{Binary, BinaryKey, MappingKind, Process};
use crate::os::workers::{OffLoop, ProcessReads};
use arrays::{MmapArray, Ranges};
pub use budget::Budget;

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
    /// Table builds put off for want of budget (a waiting process counts at each sync).
    pub builds_deferred: u64,
    /// Processes waiting for a table now.
    pub processes_waiting: u64,
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
    /// Processes with a mapping whose table is being read or built (EXEC_MAPPING_PENDING).
    pending: HashSet<u32>,
    free: Ranges,
    index_free: Ranges,
    process_tables: HashMap<u32, Vec<TableKey>>,
    /// The table key of each file whose build id was read (see [`Unwinder::has_table`]).
    file_keys: HashMap<BinaryKey, TableKey>,
    clock: u64,
    stats: UnwinderStats,
    /// Where binaries are read and their tables built: a file that never answers (FUSE)
    /// holds a worker, not the sampling loop.
    reads: ProcessReads,
    /// Build-ids and tables being read on a worker; the loop takes them on a later turn.
    ids: OffLoop<BinaryKey, Option<String>>,
    /// Build-ids of the files tables were built for before any process mapped them.
    prewarmed: HashMap<BinaryKey, String>,
    builds: OffLoop<TableKey, Option<ReadTable>>,
    /// The CPU time tables may take to build, and the processes waiting for it.
    budget: Budget,
}

/// What a worker reads of a binary for its table.
struct ReadTable {
    /// Its PT_LOAD segments.
    loads: Vec<(u64, u64, u64)>,
    /// The table built from its CFI (None: no usable CFI).
    table: Option<pyrometer_unwind::UnwindTable>,
    /// How long reading and building took, and the worker's CPU time for it (what the
    /// table-building budget pays).
    took: Duration,
    cpu: Duration,
}

/// Files remembered for [`Unwinder::has_table`]; past it, the memory starts again.
const MAX_FILE_KEYS: usize = 16_384;
/// Threads reading binaries and building tables; each read stuck past its deadline holds one.
const READ_WORKERS: usize = 2;
/// How long reading a binary's CFI and building its table may take (a large library's
/// `.eh_frame` on a busy machine).
const READ_DEADLINE: Duration = Duration::from_secs(5);
/// How long a process whose read overran is left alone, at least.
const READ_BACKOFF: Duration = Duration::from_secs(60);

/// Where a table is built from.
enum Source {
    /// A file no process maps yet, waited for up to the deadline (before sampling starts).
    Wait(std::path::PathBuf),
    /// A mapped binary, read on a worker and taken on a later sync.
    Later(Arc<Binary>),
}

/// What building a table came to.
enum Built {
    Loaded(LoadedTable),
    /// It needs this many rows, more than could be had now.
    TooBig(u32),
    /// The file could not be read or has no usable unwind information.
    Failed,
    /// The read runs on a worker (or found none free, or its process is left alone for a
    /// read that overran): frame pointers until it comes back.
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
            pending: HashSet::new(),
            free: Ranges(vec![(0, capacity)]),
            index_free: Ranges(vec![(0, index_capacity)]),
            process_tables: HashMap::new(),
            file_keys: HashMap::new(),
            clock: 0,
            reads: ProcessReads::new(READ_WORKERS, READ_DEADLINE, READ_BACKOFF),
            ids: OffLoop::default(),
            prewarmed: HashMap::new(),
            builds: OffLoop::default(),
            budget: Budget::unlimited(),
            stats: UnwinderStats {
                rows_capacity: u64::from(capacity),
                ..UnwinderStats::default()
            },
        })
    }

    pub fn stats(&self) -> UnwinderStats {
        UnwinderStats {
            processes_waiting: self.budget.waiting() as u64,
            ..self.stats
        }
    }

    /// Bounds the CPU time spent building tables (unlimited by default).
    pub fn set_budget(&mut self, budget: Budget) {
        self.budget = budget;
    }

    /// The oldest process waiting for a table, when the budget allows building it now: the
    /// caller syncs it again ([`Unwinder::sync_process`]), which may make it wait again.
    pub fn next_due(&mut self) -> Option<u32> {
        self.budget.next_due()
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
        let mut pending = false;
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
                // Its build-id is being read: frame pointers for now, and samples through
                // it keep a copy of their stack for when the table is in.
                let flags = self.pending_flag(process.pid);
                pending |= flags != 0;
                entry.maps[n] = ExecMapping {
                    start: m.start,
                    end: m.end,
                    flags,
                    ..ExecMapping::default()
                };
                n += 1;
                continue;
            };
            let clock = self.clock;
            let estimate = (m.end - m.start).saturating_mul(budget::NS_PER_TEXT_BYTE);
            let found = self.table_for(
                process.pid,
                &key,
                Source::Later(Arc::clone(binary)),
                estimate,
            );
            let mut flags = 0;
            let (first, count, index, bias) = match found {
                Some(t) => {
                    t.last_used = clock;
                    let bias = load_bias(&t.loads, m.start, m.offset);
                    (t.first, t.count, t.index, bias)
                }
                None => {
                    if self.too_big.contains_key(&key) {
                        if !missing.contains(&key) {
                            missing.push(key.clone());
                        }
                    } else if !self.tables.contains_key(&key) {
                        // Neither built nor failed: on a worker, or waiting for the budget.
                        flags = self.pending_flag(process.pid);
                        pending |= flags != 0;
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
                flags,
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
        if pending {
            self.pending.insert(process.pid);
        } else {
            self.pending.remove(&process.pid);
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
        // The process that maps it finds its build-id here rather than reading it again on a
        // worker, and its table at once: its first samples unwind fully.
        if let Ok(file) = BinaryKey::of_file(path) {
            self.prewarmed.insert(file, id.clone());
        }
        let key = TableKey::BuildId(id);
        self.clock += 1;
        let _ = self.table_for(0, &key, Source::Wait(path.to_path_buf()), 0);
    }

    /// The key of a binary's table: its build-id, read on a worker the first time (None
    /// until that read comes back), or its file's identity.
    fn table_key(&mut self, pid: u32, binary: &Arc<Binary>) -> Option<TableKey> {
        let id = match binary.known_build_id() {
            Some(id) => id,
            None if self.prewarmed.contains_key(binary.key()) => {
                binary.set_build_id(self.prewarmed.get(binary.key()).cloned())
            }
            None => {
                // Moved into the job: the binary holds the file its path names open.
                let held = Arc::clone(binary);
                let id = self.ids.poll(&mut self.reads, pid, binary.key(), move || {
                    crate::os::procs::read_build_id(held.path())
                });
                self.stats.stalled_reads = self.reads.overran();
                binary.set_build_id(id?)
            }
        };
        let key = match id {
            Some(id) => TableKey::BuildId(id.to_string()),
            None => TableKey::File(binary.key().clone()),
        };
        if !self.file_keys.contains_key(binary.key()) {
            if self.file_keys.len() >= MAX_FILE_KEYS {
                self.file_keys.clear();
            }
            self.file_keys.insert(binary.key().clone(), key.clone());
        }
        Some(key)
    }

    /// Whether `path` was prewarmed ([`Unwinder::prewarm`]).
    #[cfg(test)]
    pub(crate) fn is_prewarmed(&self, path: &Path) -> bool {
        BinaryKey::of_file(path).is_ok_and(|k| self.prewarmed.contains_key(&k))
    }

    /// Whether the table of the file `key` is loaded: a process that exec'd it can be
    /// registered before its first sample. A hint only (a file rewritten in place keeps its
    /// inode): the registration itself reads the build id of what is mapped.
    pub fn has_table(&self, key: &BinaryKey) -> bool {
        self.file_keys
            .get(key)
            .is_some_and(|k| matches!(self.tables.get(k), Some(Some(_))))
    }

    /// EXEC_MAPPING_PENDING for a mapping of `pid` whose table is on its way, unless the
    /// process's reads are left alone for one that overran (no table comes for a while).
    fn pending_flag(&self, pid: u32) -> u32 {
        if self.reads.is_stalled(pid) {
            0
        } else {
            pyrometer_ebpf::EXEC_MAPPING_PENDING
        }
    }

    /// Whether a table `pid` maps may still come: a mapping of its last sync was waiting for
    /// one, or it was never synced. A sample's stack copy waits for this to turn false.
    pub fn pending(&self, pid: u32) -> bool {
        self.pending.contains(&pid) || !self.process_tables.contains_key(&pid)
    }

    /// Forgets a process that exited; its tables become evictable when nobody else maps them.
    pub fn remove_process(&mut self, pid: u32) {
        self.missing.remove(&pid);
        self.pending.remove(&pid);
        self.budget.forget(pid);
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

    /// Where its reads run: the loop's turn, waiting and the CPU budget are set there.
    pub fn reads(&mut self) -> &mut crate::os::workers::ProcessReads {
        &mut self.reads
    }

    /// Processes whose build-id or table read came back since the last call: syncing them
    /// again takes it (every turn of the capture loop).
    pub fn ready_pids(&mut self) -> Vec<u32> {
        let mut pids = self.ids.ready(&mut self.reads);
        pids.extend(self.builds.ready(&mut self.reads));
        self.stats.stalled_reads = self.reads.overran();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Whether a read handed to a worker may come back soon (one past its deadline is not
    /// waited for): the capture loop then looks again sooner.
    pub fn reads_due(&self) -> bool {
        self.ids.due_soon() || self.builds.due_soon()
    }

    /// The table for `key`, built the first time from `source` unless the budget says to
    /// wait (`estimate_ns`: what building it would cost, roughly).
    fn table_for(
        &mut self,
        pid: u32,
        key: &TableKey,
        source: Source,
        estimate_ns: u64,
    ) -> Option<&mut LoadedTable> {
        if !self.tables.contains_key(key) {
            let available = self.available_rows();
            if !self.worth_retrying(key, available) {
                return None;
            }
            // A build handed to a worker already was allowed when it started: its answer is
            // taken whatever the bucket holds now (and paid for then).
            if !self.builds.started(key) && !self.budget.allows(estimate_ns) {
                self.stats.builds_deferred += 1;
                self.budget.wait(pid);
                return None;
            }
            match self.build(pid, key, source) {
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

    fn build(&mut self, pid: u32, key: &TableKey, source: Source) -> Built {
        let (path, held, wait) = match source {
            Source::Wait(path) => (path, None, true),
            Source::Later(b) => (b.path().to_path_buf(), Some(b), false),
        };
        // On a worker: a binary on a mount that never answers holds it, not the caller.
        let job = move || {
            // The binary holds the file its path names open until the read is done.
            let _held = held;
            let started = std::time::Instant::now();
            let cpu = thread_cpu();
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
            let table = pyrometer_unwind::build_table(&bytes).ok();
            Some(ReadTable {
                loads,
                table,
                took: started.elapsed(),
                cpu: thread_cpu().saturating_sub(cpu),
            })
        };
        let read = if wait {
            self.reads.run(pid, job)
        } else {
            self.builds.poll(&mut self.reads, pid, key, job)
        };
        self.stats.stalled_reads = self.reads.overran();
        let Some(read) = read else {
            return Built::Deferred;
        };
        let Some(ReadTable {
            loads,
            table,
            took,
            cpu,
        }) = read
        else {
            return Built::Failed;
        };
        // Paid once, by whichever process's sync took the answer: the node's bucket bounds
        // all table building; the worker's CPU was charged to the process that started the
        // read by its own budget (see `ProcessReads`), which bounds one process's share.
        self.budget
            .spend(cpu.as_nanos().min(u128::from(u64::MAX)) as u64);
        self.stats.build_ns += took.as_nanos() as u64;
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
