//! The embedded store: one SQLite file in WAL mode. Frame names, stacks, label sets and sample
//! types are interned once in their own tables. A batch's values are stored as one chunk per
//! sample type ([`chunk`]: (stack, value) pairs grouped by label set, indexed by (type,
//! bucket)), so a query reads a few rows per batch instead of one per stack, skips unwanted
//! label sets' groups without decoding them, and sums in memory. A batch is one transaction
//! that also records its (agent id, sequence): a replayed batch is recognized and adds
//! nothing, and a crash mid-batch leaves nothing half-stored.
//!
//! Pushes write through one connection; queries read through their own ([`read`]), so in
//! WAL mode a push never waits for a query, and a query stops at its deadline. Label sets
//! are held in memory (queries match every one; a tenant's are bounded by its
//! `max_label_sets`); stacks and frame names are read when first needed and cached within a
//! bound, so start-up reads no stack. Retention removes the label sets, stacks and names no
//! remaining sample uses ([`retention`]).

mod cache;
mod chunk;
mod merged;
mod read;
mod retention;
mod write;

pub use retention::Pruned;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use cache::Cache;
use chunk::IdMap;
use rusqlite::{Connection, OptionalExtension, params};

use crate::store::{
    BUCKET_SECONDS, Batch, Ingested, LabelSet, Point, Selection, Stacked, Store, StoreError, add,
    names_of, values_of,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS batches (
    agent_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    bucket INTEGER NOT NULL,
    PRIMARY KEY (agent_id, sequence)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS frames (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS stacks (id INTEGER PRIMARY KEY, frames BLOB NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS labelsets (id INTEGER PRIMARY KEY, labels TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS types (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, unit TEXT NOT NULL, UNIQUE (name, unit)
);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    bucket INTEGER NOT NULL,
    type INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_time ON chunks (type, bucket);
";

/// `PRAGMA user_version` of this layout. 0 is a new file, or one of the first layout (a
/// `samples` table of one row per (bucket, label set, stack, type)), converted on open.
const LAYOUT_VERSION: i64 = 2;

/// Entries per chunk written by compaction and conversion, so no blob grows unbounded.
const CHUNK_ENTRIES: usize = 1 << 16;

pub struct SqliteStore {
    path: PathBuf,
    /// The one connection that writes: pushes, retention, compaction.
    writer: Mutex<Connection>,
    /// Idle read-only connections of queries.
    readers: Mutex<Vec<Connection>>,
    cache: RwLock<Cache>,
    /// While retention looks for unused entries, what pushes use meanwhile (see
    /// [`retention`]).
    touched: Mutex<Option<retention::Touched>>,
    /// Whether retention pruned since the store was opened.
    pruned_once: AtomicBool,
    checkpointer: Checkpointer,
    /// Read connections taken from the pool and not yet given back: queries running.
    reading: std::sync::atomic::AtomicUsize,
}

/// Copies the write-ahead log into the database on a connection and thread of its own, for
/// what no push checkpointed (see [`SqliteStore::after_push`]): after a push that found
/// queries reading (at most every `CHECKPOINT_SPACING`) and every second; stopped when the
/// store is dropped.
struct Checkpointer {
    stop: std::sync::Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Held through every checkpoint, the thread's and a push's: SQLite runs one checkpoint
    /// at a time and a passive one that finds another running gives up at once, so a push
    /// that found the thread's under way would leave the log to grow past its limit.
    running: std::sync::Arc<Mutex<()>>,
}

/// How often the checkpointer runs with no push asking for it.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// The least time between two checkpoints: each ends in an fsync of the database.
const CHECKPOINT_SPACING: std::time::Duration = std::time::Duration::from_millis(100);
/// The size the log is cut back to once a checkpoint has emptied it.
const JOURNAL_SIZE_LIMIT: u64 = 4 << 20;
/// Pages of log (4 KiB each) past which the push that wrote them checkpoints it, when no
/// query reads: half the size limit, so a log started again from its beginning is reused
/// in place rather than cut back and extended again.
const CHECKPOINT_PAGES: i32 = 512;

thread_local! {
    /// The pages in the log after this thread's last commit (SQLite's write-ahead log hook).
    static WAL_PAGES: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

fn note_wal_pages(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_PAGES.set(pages);
    Ok(())
}

impl Checkpointer {
    fn start(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path)?;
        conn.execute_batch("PRAGMA busy_timeout = 5000;")?;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let running = std::sync::Arc::new(Mutex::new(()));
        let held = running.clone();
        let thread = std::thread::Builder::new()
            .name("sqlite-checkpoint".into())
            .spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::park_timeout(CHECKPOINT_EVERY);
                    passive_checkpoint(&conn, &held);
                    std::thread::sleep(CHECKPOINT_SPACING);
                }
            })
            .map_err(|source| StoreError::Create {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
            running,
        })
    }
}

/// Copies what no reader still needs into the database and waits for no reader, only for a
/// checkpoint already running (bounded by its copy and fsync).
fn passive_checkpoint(conn: &Connection, running: &Mutex<()>) {
    let _one_at_a_time = running.lock().unwrap_or_else(|e| e.into_inner());
    let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
}

impl Checkpointer {
    /// Asks for a checkpoint soon: the log has grown by a push.
    fn nudge(&self) {
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl SqliteStore {
    /// Opens (or creates) `DIR/pyrometer.sqlite`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Create {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join("pyrometer.sqlite");
        let mut conn = Connection::open(&path)?;
        // FULL: a batch is acknowledged only after its commit is on disk, so an agent that
        // deleted it from its spool cannot lose it to a power cut either. SQLite's own
        // checkpoint at commit is off: it runs while queries hold snapshots too, where it
        // cannot finish (see `after_push` and `Checkpointer`).
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000;
             PRAGMA wal_autocheckpoint = 0;",
        )?;
        conn.query_row(
            &format!("PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}"),
            [],
            |_| Ok(()),
        )?;
        private(&path);
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > LAYOUT_VERSION {
            return Err(StoreError::Schema(format!(
                "{} has layout version {version}, newer than this collector's \
                 {LAYOUT_VERSION}: upgrade pyrometer-collector",
                path.display()
            )));
        }
        conn.execute_batch(SCHEMA)?;
        if version < LAYOUT_VERSION {
            convert_samples(&mut conn)?;
        }
        conn.wal_hook(Some(note_wal_pages));
        let cache = Cache::load(&conn)?;
        let checkpointer = Checkpointer::start(&path)?;
        Ok(Self {
            path,
            writer: Mutex::new(conn),
            readers: Mutex::new(Vec::new()),
            cache: RwLock::new(cache),
            touched: Mutex::new(None),
            pruned_once: AtomicBool::new(false),
            checkpointer,
            reading: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    fn writer(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent (transactions roll
        // back), so a poisoned lock is still usable.
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cache(&self) -> RwLockReadGuard<'_, Cache> {
        // The cache holds only what the database holds: a poisoned one is still right.
        self.cache.read().unwrap_or_else(|e| e.into_inner())
    }

    fn cache_mut(&self) -> RwLockWriteGuard<'_, Cache> {
        self.cache.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a batch was stored (for tests and diagnostics).
    pub fn has_batch(&self, agent_id: &str, sequence: u64) -> Result<bool, StoreError> {
        Ok(self
            .writer()
            .query_row(
                "SELECT 1 FROM batches WHERE agent_id = ?1 AND sequence = ?2",
                params![agent_id, sequence as i64],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }

    /// Label sets, stacks and frame names stored (for tests and diagnostics).
    pub fn interned(&self) -> Result<(u64, u64, u64), StoreError> {
        let conn = self.writer();
        let count = |table: &str| -> Result<u64, StoreError> {
            Ok(
                conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| {
                    r.get::<_, i64>(0)
                })? as u64,
            )
        };
        Ok((count("labelsets")?, count("stacks")?, count("frames")?))
    }
}

/// The store's files (and those of a store made by an older collector) readable by the
/// collector alone: profiles name hosts, processes, code and traces.
fn private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600));
    }
}

fn encode_stack(ids: &[i64]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&id| (id as u32).to_le_bytes())
        .collect()
}

fn decode_stack(blob: &[u8]) -> impl Iterator<Item = i64> + '_ {
    blob.chunks_exact(4)
        .map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
}

fn bucket_of(time_s: i64) -> i64 {
    time_s - time_s.rem_euclid(BUCKET_SECONDS)
}

impl From<rusqlite::types::FromSqlError> for StoreError {
    fn from(e: rusqlite::types::FromSqlError) -> Self {
        StoreError::Corrupt(format!("a chunk is not a blob: {e}"))
    }
}

impl From<chunk::Corrupt> for StoreError {
    fn from(e: chunk::Corrupt) -> Self {
        StoreError::Corrupt(e.to_string())
    }
}

/// `(type, label set, stack) -> value` of one bucket.
type Sums = IdMap<(i64, i64, i64), i64>;

/// Writes `sums` as chunks of at most [`CHUNK_ENTRIES`] entries (more only when one label
/// set has more), one type per chunk. Sorted flat rather than in nested maps: a batch's few
/// hundred entries then cost one allocation and one sort.
fn write_chunks(tx: &rusqlite::Transaction<'_>, bucket: i64, sums: Sums) -> Result<(), StoreError> {
    let mut sorted: Vec<(i64, i64, i64, i64)> = sums
        .into_iter()
        .filter(|&(_, value)| value != 0)
        .map(|((ty, labelset, stack), value)| (ty, labelset, stack, value))
        .collect();
    sorted.sort_unstable();
    let mut insert =
        tx.prepare_cached("INSERT INTO chunks (bucket, type, data) VALUES (?1, ?2, ?3)")?;
    let mut part: Vec<(i64, i64, i64)> = Vec::new();
    for of_type in sorted.chunk_by(|a, b| a.0 == b.0) {
        let ty = of_type[0].0;
        part.clear();
        for group in of_type.chunk_by(|a, b| a.1 == b.1) {
            part.extend(
                group
                    .iter()
                    .map(|&(_, labelset, stack, value)| (labelset, stack, value)),
            );
            if part.len() >= CHUNK_ENTRIES {
                insert.execute(params![bucket, ty, chunk::encode(&part)])?;
                part.clear();
            }
        }
        if !part.is_empty() {
            insert.execute(params![bucket, ty, chunk::encode(&part)])?;
        }
    }
    Ok(())
}

/// Converts a first-layout `samples` table into chunks, one bucket at a time.
fn convert_samples(conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn.transaction()?;
    let old: bool = tx
        .query_row(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'samples'",
            [],
            |_| Ok(()),
        )
        .optional()?
        .is_some();
    if old {
        let buckets: Vec<i64> = tx
            .prepare("SELECT DISTINCT bucket FROM samples")?
            .query_map([], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        for bucket in buckets {
            let mut sums = Sums::default();
            let mut stmt =
                tx.prepare("SELECT type, labelset, stack, value FROM samples WHERE bucket = ?1")?;
            let mut rows = stmt.query([bucket])?;
            while let Some(r) = rows.next()? {
                add(
                    sums.entry((r.get(0)?, r.get(1)?, r.get(2)?)).or_default(),
                    r.get::<_, i64>(3)?,
                );
            }
            drop(rows);
            drop(stmt);
            write_chunks(&tx, bucket, sums)?;
        }
        tx.execute_batch("DROP TABLE samples")?;
    }
    tx.execute_batch(&format!("PRAGMA user_version = {LAYOUT_VERSION}"))?;
    tx.commit()?;
    Ok(())
}

impl SqliteStore {
    /// Keeps the log small and in place. With no query reading, the push that filled it past
    /// [`CHECKPOINT_PAGES`] checkpoints it: nothing writes meanwhile (it holds the writer), so
    /// the checkpoint copies every frame and the next push starts the log again from its
    /// beginning, in the same file. A checkpoint running beside a writer (the checkpointer's
    /// thread, at full-speed ingest) never catches up, and the log grew to 227 MiB in the
    /// store bench. With queries reading, their snapshots hold frames back: the checkpointer
    /// copies them after the queries, off the push.
    fn after_push(&self) {
        if WAL_PAGES.get() < CHECKPOINT_PAGES {
            return;
        }
        if self.reading.load(std::sync::atomic::Ordering::Acquire) == 0 {
            passive_checkpoint(&self.writer(), &self.checkpointer.running);
        } else {
            self.checkpointer.nudge();
        }
    }
}

impl Store for SqliteStore {
    fn ingest(&self, batch: &Batch) -> Result<Ingested, StoreError> {
        let ingested = self.write_batch(batch);
        self.after_push();
        ingested
    }

    fn select(&self, selection: &Selection<'_>) -> Result<Vec<Stacked>, StoreError> {
        self.read_select(selection)
    }

    fn select_merged(
        &self,
        selection: &Selection<'_>,
        keep: &[&str],
    ) -> Result<Vec<Stacked>, StoreError> {
        self.merged(selection, keep)
    }

    fn series(&self, selection: &Selection<'_>, step_s: i64) -> Result<Vec<Point>, StoreError> {
        self.read_series(selection, step_s)
    }

    fn label_names(
        &self,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError> {
        let sets = self.labelsets_in(from_s, to_s)?;
        Ok(names_of(sets.iter().map(|s| &**s), labels))
    }

    fn label_values(
        &self,
        name: &str,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError> {
        let sets = self.labelsets_in(from_s, to_s)?;
        Ok(values_of(sets.iter().map(|s| &**s), name, labels))
    }

    fn sample_types(&self) -> Result<Vec<(String, String)>, StoreError> {
        let mut types: Vec<(String, String)> = self.cache().types.keys().cloned().collect();
        types.sort();
        Ok(types)
    }

    fn size_bytes(&self) -> Result<u64, StoreError> {
        let file = |suffix: &str| {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
        };
        Ok(file("") + file("-wal"))
    }

    fn expire(&self, before_s: i64) -> Result<u64, StoreError> {
        self.expire_and_prune(before_s)
    }

    fn compact(&self, before_s: i64, coarse_s: i64) -> Result<u64, StoreError> {
        self.compact_buckets(before_s, coarse_s)
    }
}

#[cfg(test)]
mod tests;
