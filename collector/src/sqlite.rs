//! The embedded store: one SQLite file in WAL mode. Frame names, stacks, label sets and sample
//! types are interned once in their own tables (and cached in memory). A batch's values are
//! stored as one chunk per sample type ([`chunk`]: (stack, value) pairs grouped by label
//! set, indexed by (type, bucket)), so a query reads a few rows per batch instead of one per
//! stack, skips unwanted label sets' groups without decoding them, and sums in memory. A
//! batch is one transaction that also records its (agent id, sequence): a replayed batch is
//! recognized and adds nothing, and a crash mid-batch leaves nothing half-stored.

mod chunk;
mod merged;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use chunk::{IdMap, IdSet};
use rusqlite::{Connection, OptionalExtension, params};

use crate::store::{
    BUCKET_SECONDS, Batch, Frame, Ingested, LabelSet, Point, Selection, Stack, Stacked, Store,
    StoreError, add, content_hash,
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
    inner: Mutex<Inner>,
}

/// The interning tables, mirrored in memory so ingest does not look names up in SQL.
/// Stacks and label sets are found by a hash of their content (then compared), so a known
/// stack costs one pass over its names, not a lookup per frame and an encoded key.
#[derive(Default)]
struct Cache {
    frames: HashMap<Frame, i64>,
    stack_index: IdMap<u64, Vec<i64>>,
    stack_by_id: IdMap<i64, Stack>,
    /// Ids by the address of the stack held in `stack_by_id`: decoded stacks are shared
    /// across pushes (see `ingest`), so most of a batch's are the very allocation stored
    /// here and are found without hashing their names. Sound because `stack_by_id` keeps
    /// each such allocation alive (its address cannot be reused) and never replaces one.
    stack_by_address: IdMap<usize, i64>,
    labelset_index: IdMap<u64, Vec<i64>>,
    labelset_by_id: IdMap<i64, Arc<LabelSet>>,
    types: HashMap<(String, String), i64>,
}

fn stack_hash(frames: &[Frame]) -> u64 {
    content_hash(frames.iter().map(|f| &**f))
}

fn labels_hash(labels: &LabelSet) -> u64 {
    content_hash(labels.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]))
}

impl Cache {
    fn find_stack(&self, hash: u64, frames: &[Frame]) -> Option<i64> {
        let ids = self.stack_index.get(&hash)?;
        ids.iter().copied().find(|id| {
            self.stack_by_id
                .get(id)
                .is_some_and(|s| s.as_slice() == frames)
        })
    }

    fn add_stack(&mut self, hash: u64, id: i64, frames: Stack) {
        self.stack_index.entry(hash).or_default().push(id);
        self.stack_by_address
            .insert(Arc::as_ptr(&frames).addr(), id);
        self.stack_by_id.insert(id, frames);
    }

    fn find_labelset(&self, hash: u64, labels: &LabelSet) -> Option<i64> {
        let ids = self.labelset_index.get(&hash)?;
        ids.iter()
            .copied()
            .find(|id| self.labelset_by_id.get(id).is_some_and(|l| **l == *labels))
    }

    fn add_labelset(&mut self, hash: u64, id: i64, labels: Arc<LabelSet>) {
        self.labelset_index.entry(hash).or_default().push(id);
        self.labelset_by_id.insert(id, labels);
    }

    /// Takes in what a committed batch interned.
    fn extend(&mut self, fresh: Cache) {
        self.frames.extend(fresh.frames);
        for (hash, ids) in fresh.stack_index {
            self.stack_index.entry(hash).or_default().extend(ids);
        }
        self.stack_by_address.extend(fresh.stack_by_address);
        self.stack_by_id.extend(fresh.stack_by_id);
        for (hash, ids) in fresh.labelset_index {
            self.labelset_index.entry(hash).or_default().extend(ids);
        }
        self.labelset_by_id.extend(fresh.labelset_by_id);
        self.types.extend(fresh.types);
    }
}

struct Inner {
    conn: Connection,
    cache: Cache,
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
        // deleted it from its spool cannot lose it to a power cut either.
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000;",
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
        let cache = load_cache(&conn)?;
        Ok(Self {
            path,
            inner: Mutex::new(Inner { conn, cache }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave SQLite inconsistent (transactions roll
        // back), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
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

fn load_cache(conn: &Connection) -> Result<Cache, StoreError> {
    let mut cache = Cache::default();
    let mut names: HashMap<i64, Frame> = HashMap::new();
    let mut stmt = conn.prepare("SELECT id, name FROM frames")?;
    for row in stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))? {
        let (id, name) = row?;
        let name = Frame::from(name);
        cache.frames.insert(name.clone(), id);
        names.insert(id, name);
    }
    let mut stmt = conn.prepare("SELECT id, frames FROM stacks")?;
    for row in stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))? {
        let (id, blob) = row?;
        let frames = decode_stack(&blob)
            .iter()
            .map(|f| {
                names
                    .get(f)
                    .cloned()
                    .ok_or_else(|| StoreError::Corrupt(format!("stack {id} names frame {f}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        cache.add_stack(stack_hash(&frames), id, Arc::new(frames));
    }
    let mut stmt = conn.prepare("SELECT id, labels FROM labelsets")?;
    for row in stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))? {
        let (id, json) = row?;
        let labels: LabelSet = serde_json::from_str(&json)
            .map_err(|e| StoreError::Corrupt(format!("label set {id}: {e}")))?;
        cache.add_labelset(labels_hash(&labels), id, Arc::new(labels));
    }
    let mut stmt = conn.prepare("SELECT id, name, unit FROM types")?;
    for row in stmt.query_map([], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
        ))
    })? {
        let (id, name, unit) = row?;
        cache.types.insert((name, unit), id);
    }
    Ok(cache)
}

impl Cache {
    /// The id of the selection's sample type and the ids of the label sets it matches; `None`
    /// when nothing can match.
    fn selected(&self, selection: &Selection<'_>) -> Option<(i64, IdSet<i64>)> {
        let ty = self
            .types
            .iter()
            .find(|((name, _), _)| name == selection.sample_type)
            .map(|(_, &id)| id)?;
        let wanted: IdSet<i64> = self
            .labelset_by_id
            .iter()
            .filter(|(_, labels)| (selection.labels)(labels))
            .map(|(&id, _)| id)
            .collect();
        (!wanted.is_empty()).then_some((ty, wanted))
    }
}

fn encode_stack(ids: &[i64]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&id| (id as u32).to_le_bytes())
        .collect()
}

fn decode_stack(blob: &[u8]) -> Vec<i64> {
    blob.chunks_exact(4)
        .map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect()
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

/// Interns within the open transaction; new entries go to `fresh` and reach the cache only
/// after the commit, so a failed batch leaves the cache matching the database.
struct Interner<'a> {
    tx: &'a rusqlite::Transaction<'a>,
    cache: &'a Cache,
    fresh: Cache,
}

impl Interner<'_> {
    fn frame(&mut self, name: &Frame) -> Result<i64, StoreError> {
        if let Some(&id) = self.cache.frames.get(name).or(self.fresh.frames.get(name)) {
            return Ok(id);
        }
        self.tx
            .prepare_cached("INSERT INTO frames (name) VALUES (?1)")?
            .execute([&**name])?;
        let id = self.tx.last_insert_rowid();
        self.fresh.frames.insert(name.clone(), id);
        Ok(id)
    }

    fn stack(&mut self, frames: &Stack) -> Result<i64, StoreError> {
        let address = Arc::as_ptr(frames).addr();
        if let Some(&id) = self
            .cache
            .stack_by_address
            .get(&address)
            .or_else(|| self.fresh.stack_by_address.get(&address))
        {
            return Ok(id);
        }
        let hash = stack_hash(frames);
        if let Some(id) = self
            .cache
            .find_stack(hash, frames)
            .or_else(|| self.fresh.find_stack(hash, frames))
        {
            return Ok(id);
        }
        let ids = frames
            .iter()
            .map(|f| self.frame(f))
            .collect::<Result<Vec<_>, _>>()?;
        self.tx
            .prepare_cached("INSERT INTO stacks (frames) VALUES (?1)")?
            .execute([encode_stack(&ids)])?;
        let id = self.tx.last_insert_rowid();
        self.fresh.add_stack(hash, id, frames.clone());
        Ok(id)
    }

    fn labelset(&mut self, labels: &Arc<LabelSet>) -> Result<i64, StoreError> {
        let hash = labels_hash(labels);
        if let Some(id) = self
            .cache
            .find_labelset(hash, labels)
            .or_else(|| self.fresh.find_labelset(hash, labels))
        {
            return Ok(id);
        }
        let json = serde_json::to_string(labels.as_ref()).expect("string maps serialize");
        self.tx
            .prepare_cached("INSERT INTO labelsets (labels) VALUES (?1)")?
            .execute([&json])?;
        let id = self.tx.last_insert_rowid();
        self.fresh.add_labelset(hash, id, labels.clone());
        Ok(id)
    }

    fn sample_type(&mut self, name: &str, unit: &str) -> Result<i64, StoreError> {
        let key = (name.to_string(), unit.to_string());
        if let Some(&id) = self.cache.types.get(&key).or(self.fresh.types.get(&key)) {
            return Ok(id);
        }
        self.tx
            .prepare_cached("INSERT INTO types (name, unit) VALUES (?1, ?2)")?
            .execute(params![name, unit])?;
        let id = self.tx.last_insert_rowid();
        self.fresh.types.insert(key, id);
        Ok(id)
    }
}

impl Store for SqliteStore {
    fn ingest(&self, batch: &Batch) -> Result<Ingested, StoreError> {
        let mut inner = self.lock();
        let Inner { conn, cache } = &mut *inner;
        let tx = conn.transaction()?;
        let bucket = bucket_of(batch.time_s);
        let inserted = tx
            .prepare_cached(
                "INSERT OR IGNORE INTO batches (agent_id, sequence, bucket) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![batch.agent_id, batch.sequence as i64, bucket])?;
        if inserted == 0 {
            return Ok(Ingested {
                duplicate: true,
                rows: 0,
            });
        }
        let mut interner = Interner {
            tx: &tx,
            cache,
            fresh: Cache::default(),
        };
        let mut types = Vec::with_capacity(batch.sample_types.len());
        for (name, unit) in &batch.sample_types {
            types.push(interner.sample_type(name, unit)?);
        }
        let mut sums = Sums::default();
        // Label sets and stacks arrive as shared Arcs: intern each once per batch.
        let mut labelsets: IdMap<*const LabelSet, i64> = IdMap::default();
        let mut stacks: IdMap<*const Vec<Frame>, i64> = IdMap::default();
        for row in &batch.rows {
            let labelset = match labelsets.get(&Arc::as_ptr(&row.labels)) {
                Some(&id) => id,
                None => {
                    let id = interner.labelset(&row.labels)?;
                    labelsets.insert(Arc::as_ptr(&row.labels), id);
                    id
                }
            };
            let stack = match stacks.get(&Arc::as_ptr(&row.stack)) {
                Some(&id) => id,
                None => {
                    let id = interner.stack(&row.stack)?;
                    stacks.insert(Arc::as_ptr(&row.stack), id);
                    id
                }
            };
            let ty = *types
                .get(row.sample_type)
                .ok_or_else(|| StoreError::Corrupt("row names a missing sample type".into()))?;
            add(sums.entry((ty, labelset, stack)).or_default(), row.value);
        }
        write_chunks(&tx, bucket, sums)?;
        let fresh = interner.fresh;
        tx.commit()?;
        cache.extend(fresh);
        Ok(Ingested {
            duplicate: false,
            rows: batch.rows.len() as u64,
        })
    }

    fn select(&self, selection: &Selection<'_>) -> Result<Vec<Stacked>, StoreError> {
        let inner = self.lock();
        let Some((ty, wanted)) = inner.cache.selected(selection) else {
            return Ok(Vec::new());
        };
        // Summed here rather than by GROUP BY: SQLite groups through a sorter, which costs
        // several times a hash map over the same rows, and groups of unwanted label sets are
        // skipped undecoded.
        // Every label set wanted: no lookup per group.
        let all = wanted.len() == inner.cache.labelset_by_id.len();
        let mut stmt = inner.conn.prepare_cached(
            "SELECT data FROM chunks WHERE type = ?1 AND bucket >= ?2 AND bucket < ?3",
        )?;
        // Keyed by label set and stack packed into one integer (row ids stay far below 2^32:
        // one is used per distinct label set or stack ever stored).
        let pack = |labelset: i64, stack: i64| -> Result<u64, chunk::Corrupt> {
            match (u32::try_from(labelset), u32::try_from(stack)) {
                (Ok(l), Ok(s)) => Ok((u64::from(l) << 32) | u64::from(s)),
                _ => Err(chunk::Corrupt("an id beyond 2^32")),
            }
        };
        let mut sums: IdMap<u64, i64> = IdMap::default();
        let mut rows = stmt.query(params![ty, selection.from_s, selection.to_s])?;
        while let Some(r) = rows.next()? {
            let data = r.get_ref(0)?.as_blob()?;
            chunk::each_group(data, |labelset, entries| {
                if all || wanted.contains(&labelset) {
                    let mut bad = false;
                    chunk::each_entry(entries, |stack, value| match pack(labelset, stack) {
                        Ok(k) => add(sums.entry(k).or_default(), value),
                        Err(_) => bad = true,
                    })?;
                    if bad {
                        return Err(chunk::Corrupt("an id beyond 2^32"));
                    }
                }
                Ok(())
            })?;
        }
        // Sorted by (label set, stack), so answers stay deterministic.
        let mut sums: Vec<(u64, i64)> = sums.into_iter().filter(|&(_, v)| v != 0).collect();
        sums.sort_unstable_by_key(|&(k, _)| k);
        let mut out = Vec::with_capacity(sums.len());
        let mut labels: Option<(i64, Arc<LabelSet>)> = None;
        for (key, value) in sums {
            let (labelset, stack) = ((key >> 32) as i64, (key & 0xffff_ffff) as i64);
            let corrupt = || StoreError::Corrupt(format!("sample row {labelset}/{stack}"));
            // Entries of one label set are adjacent: one lookup per label set.
            let set = match &labels {
                Some((id, set)) if *id == labelset => set.clone(),
                _ => {
                    let set = inner
                        .cache
                        .labelset_by_id
                        .get(&labelset)
                        .cloned()
                        .ok_or_else(corrupt)?;
                    labels = Some((labelset, set.clone()));
                    set
                }
            };
            let stack = inner
                .cache
                .stack_by_id
                .get(&stack)
                .cloned()
                .ok_or_else(corrupt)?;
            out.push(Stacked {
                labels: set,
                stack,
                value,
            });
        }
        Ok(out)
    }

    fn select_merged(
        &self,
        selection: &Selection<'_>,
        keep: &[&str],
    ) -> Result<Vec<Stacked>, StoreError> {
        self.merged(selection, keep)
    }

    fn series(&self, selection: &Selection<'_>, step_s: i64) -> Result<Vec<Point>, StoreError> {
        // The API validates steps; a non-positive one here is read as the finest.
        let step_s = step_s.max(1);
        let inner = self.lock();
        let Some((ty, wanted)) = inner.cache.selected(selection) else {
            return Ok(Vec::new());
        };
        let all = wanted.len() == inner.cache.labelset_by_id.len();
        // Summed here, as in `select`: groups of unwanted label sets are skipped undecoded and
        // only values are added (a chunk's stacks do not matter to a series).
        let mut stmt = inner.conn.prepare_cached(
            "SELECT bucket, data FROM chunks WHERE type = ?1 AND bucket >= ?2 AND bucket < ?3",
        )?;
        let mut sums: IdMap<(i64, i64), i64> = IdMap::default();
        let mut rows = stmt.query(params![ty, selection.from_s, selection.to_s])?;
        while let Some(r) = rows.next()? {
            let bucket: i64 = r.get(0)?;
            let step = bucket - bucket.rem_euclid(step_s);
            let data = r.get_ref(1)?.as_blob()?;
            chunk::each_group(data, |labelset, entries| {
                if all || wanted.contains(&labelset) {
                    let mut total = 0i64;
                    chunk::each_entry(entries, |_, value| add(&mut total, value))?;
                    add(sums.entry((step, labelset)).or_default(), total);
                }
                Ok(())
            })?;
        }
        let mut out = Vec::with_capacity(sums.len());
        for ((time_s, labelset), value) in sums {
            let labels = inner
                .cache
                .labelset_by_id
                .get(&labelset)
                .cloned()
                .ok_or_else(|| {
                    StoreError::Corrupt(format!("sample row names label set {labelset}"))
                })?;
            out.push(Point {
                labels,
                time_s,
                value,
            });
        }
        Ok(out)
    }

    fn label_names(
        &self,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError> {
        let sets = self.labelsets_in(from_s, to_s)?;
        let names: BTreeSet<String> = sets
            .iter()
            .filter(|s| labels(s))
            .flat_map(|s| s.keys().cloned())
            .collect();
        Ok(names.into_iter().collect())
    }

    fn label_values(
        &self,
        name: &str,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError> {
        let sets = self.labelsets_in(from_s, to_s)?;
        let values: BTreeSet<String> = sets
            .iter()
            .filter(|s| labels(s))
            .filter_map(|s| s.get(name).cloned())
            .collect();
        Ok(values.into_iter().collect())
    }

    fn sample_types(&self) -> Result<Vec<(String, String)>, StoreError> {
        let inner = self.lock();
        let mut types: Vec<(String, String)> = inner.cache.types.keys().cloned().collect();
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
        let inner = self.lock();
        let removed = inner
            .conn
            .execute("DELETE FROM chunks WHERE bucket < ?1", [before_s])?;
        // Replays older than the retention would be stored again, but their samples would be
        // expired at once, so the dedup keys can go with them.
        inner
            .conn
            .execute("DELETE FROM batches WHERE bucket < ?1", [before_s])?;
        Ok(removed as u64)
    }

    fn compact(&self, before_s: i64, coarse_s: i64) -> Result<u64, StoreError> {
        // Only whole coarse buckets are merged, so a coarse bucket never overlaps fine ones.
        let before_s = before_s - before_s.rem_euclid(coarse_s);
        let mut inner = self.lock();
        let tx = inner.conn.transaction()?;
        let coarse: Vec<i64> = tx
            .prepare(
                "SELECT DISTINCT bucket - (bucket % ?2) FROM chunks
                 WHERE bucket < ?1 AND bucket % ?2 != 0",
            )?
            .query_map(params![before_s, coarse_s], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        let mut removed = 0;
        // One coarse bucket at a time, so memory holds one bucket's stacks, not the range's.
        for start in coarse {
            let mut sums = Sums::default();
            {
                let mut stmt = tx.prepare_cached(
                    "SELECT type, data FROM chunks WHERE bucket > ?1 AND bucket < ?2",
                )?;
                let mut rows = stmt.query(params![start, start + coarse_s])?;
                while let Some(r) = rows.next()? {
                    let ty: i64 = r.get(0)?;
                    chunk::each_group(r.get_ref(1)?.as_blob()?, |labelset, entries| {
                        chunk::each_entry(entries, |stack, value| {
                            add(sums.entry((ty, labelset, stack)).or_default(), value);
                        })
                    })?;
                }
            }
            removed += tx.execute(
                "DELETE FROM chunks WHERE bucket > ?1 AND bucket < ?2",
                params![start, start + coarse_s],
            )?;
            write_chunks(&tx, start, sums)?;
        }
        tx.commit()?;
        Ok(removed as u64)
    }
}

impl SqliteStore {
    fn labelsets_in(&self, from_s: i64, to_s: i64) -> Result<Vec<Arc<LabelSet>>, StoreError> {
        let inner = self.lock();
        let mut stmt = inner
            .conn
            .prepare_cached("SELECT data FROM chunks WHERE bucket >= ?1 AND bucket < ?2")?;
        let mut ids: IdSet<i64> = IdSet::default();
        let mut rows = stmt.query(params![from_s, to_s])?;
        while let Some(r) = rows.next()? {
            chunk::each_group(r.get_ref(0)?.as_blob()?, |labelset, _| {
                ids.insert(labelset);
                Ok(())
            })?;
        }
        Ok(ids
            .into_iter()
            .filter_map(|id| inner.cache.labelset_by_id.get(&id).cloned())
            .collect())
    }

    /// Whether a batch was stored (for tests and diagnostics).
    pub fn has_batch(&self, agent_id: &str, sequence: u64) -> Result<bool, StoreError> {
        let inner = self.lock();
        Ok(inner
            .conn
            .query_row(
                "SELECT 1 FROM batches WHERE agent_id = ?1 AND sequence = ?2",
                params![agent_id, sequence as i64],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }
}

#[cfg(test)]
mod tests;
