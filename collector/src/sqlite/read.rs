//! Queries of the SQLite store, on read-only connections of their own: in WAL mode a reader
//! sees the last commit and never blocks the writer, so a push does not wait for a query. A
//! query's connection interrupts it at the thread's deadline (see
//! [`crate::store::with_deadline`]). The cache is locked only to look things up, never while
//! SQLite reads; stacks the cache lacks are read from their tables.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use rusqlite::{Connection, OpenFlags, params};

use super::cache::Cache;
use super::chunk::{self, IdMap, IdSet};
use super::{SqliteStore, decode_stack};
use crate::store::{
    Frame, LabelSet, Point, Selection, Stack, Stacked, StoreError, add, check_deadline,
};

/// Idle read connections kept; more concurrent queries open (and then close) their own.
const IDLE_READERS: usize = 8;
/// SQLite virtual-machine steps between deadline checks.
const STEPS_PER_CHECK: i32 = 20_000;
/// How much of the database file a read connection maps.
const READER_MMAP: u64 = 256 << 20;
/// Ids per `IN (...)` list.
const IN_CHUNK: usize = 10_000;

/// A read connection, back to the pool when dropped.
pub(super) struct Reader<'a> {
    store: &'a SqliteStore,
    conn: Option<Connection>,
}

impl Deref for Reader<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn.as_ref().expect("taken only on drop")
    }
}

impl DerefMut for Reader<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        self.conn.as_mut().expect("taken only on drop")
    }
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        self.store
            .reading
            .fetch_sub(1, std::sync::atomic::Ordering::Release);
        if let Some(conn) = self.conn.take() {
            let mut idle = self.store.readers.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < IDLE_READERS && conn.is_autocommit() {
                idle.push(conn);
            }
        }
    }
}

/// A SQLite error of a query: an interruption is the deadline.
pub(super) struct QueryError(pub(super) rusqlite::Error);

impl From<QueryError> for StoreError {
    fn from(QueryError(e): QueryError) -> Self {
        match &e {
            rusqlite::Error::SqliteFailure(f, _)
                if f.code == rusqlite::ErrorCode::OperationInterrupted =>
            {
                StoreError::Timeout
            }
            _ => StoreError::Sqlite(e),
        }
    }
}

/// Calls `f(bucket, data)` for every chunk of type `ty` whose bucket starts in
/// `[from_s, to_s)`; an interruption at the deadline is [`StoreError::Timeout`].
pub(super) fn each_chunk(
    conn: &Connection,
    ty: i64,
    from_s: i64,
    to_s: i64,
    mut f: impl FnMut(i64, &[u8]) -> Result<(), chunk::Corrupt>,
) -> Result<(), StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT bucket, data FROM chunks WHERE type = ?1 AND bucket >= ?2 AND bucket < ?3",
    )?;
    let mut rows = stmt.query(params![ty, from_s, to_s]).map_err(QueryError)?;
    while let Some(r) = rows.next().map_err(QueryError)? {
        f(r.get(0)?, r.get_ref(1)?.as_blob()?)?;
    }
    check_deadline()
}

impl SqliteStore {
    /// A read-only connection of the pool.
    pub(super) fn reader(&self) -> Result<Reader<'_>, StoreError> {
        let pooled = self.readers.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match pooled {
            Some(c) => c,
            None => {
                let conn = Connection::open_with_flags(
                    &self.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                conn.busy_timeout(std::time::Duration::from_secs(5))?;
                // Pages read in place from the kernel's cache of the file instead of copied
                // into this connection's own cache (2 MiB, cold for a connection new to the
                // pool and too small for an hour of a cluster): 1–15 % less CPU a query in
                // the store bench. Address space only; the writer keeps reading by copy.
                conn.execute_batch(&format!("PRAGMA mmap_size = {READER_MMAP}"))?;
                // Runs on the thread executing the query, whose deadline it reads.
                conn.progress_handler(STEPS_PER_CHECK, Some(|| check_deadline().is_err()));
                conn
            }
        };
        self.reading
            .fetch_add(1, std::sync::atomic::Ordering::Acquire);
        Ok(Reader {
            store: self,
            conn: Some(conn),
        })
    }

    /// The stacks of `ids`, from the cache or their tables (then cached).
    pub(super) fn stacks(
        &self,
        conn: &Connection,
        ids: impl Iterator<Item = i64>,
    ) -> Result<IdMap<i64, Stack>, StoreError> {
        let mut out: IdMap<i64, Stack> = IdMap::default();
        let mut missing = Vec::new();
        {
            let cache = self.cache();
            // A select names each stack once per label set it was sampled under: each is
            // looked up in the cache (and its `Arc` cloned) once, not once per label set.
            for id in ids {
                if let std::collections::hash_map::Entry::Vacant(slot) = out.entry(id) {
                    match cache.stack_by_id.get(&id) {
                        Some(s) => {
                            slot.insert(s.clone());
                        }
                        None => missing.push(id),
                    }
                }
            }
        }
        if missing.is_empty() {
            return Ok(out);
        }
        missing.sort_unstable();
        missing.dedup();
        let mut blobs: Vec<(i64, Vec<u8>)> = Vec::with_capacity(missing.len());
        for part in missing.chunks(IN_CHUNK) {
            let mut stmt = conn.prepare(&format!(
                "SELECT id, frames FROM stacks WHERE id IN ({})",
                list(part)
            ))?;
            let mut rows = stmt.query([]).map_err(QueryError)?;
            while let Some(r) = rows.next().map_err(QueryError)? {
                blobs.push((r.get(0)?, r.get(1)?));
            }
        }
        let mut names: IdMap<i64, Frame> = IdMap::default();
        let mut unknown: IdSet<i64> = IdSet::default();
        {
            let cache = self.cache();
            for (_, blob) in &blobs {
                for f in decode_stack(blob) {
                    match cache.frame_names.get(&f) {
                        Some(n) => {
                            names.insert(f, n.clone());
                        }
                        None => {
                            unknown.insert(f);
                        }
                    }
                }
            }
        }
        let unknown: Vec<i64> = unknown.into_iter().collect();
        let mut read_names = Vec::new();
        for part in unknown.chunks(IN_CHUNK) {
            let mut stmt = conn.prepare(&format!(
                "SELECT id, name FROM frames WHERE id IN ({})",
                list(part)
            ))?;
            let mut rows = stmt.query([]).map_err(QueryError)?;
            while let Some(r) = rows.next().map_err(QueryError)? {
                let (id, name): (i64, String) = (r.get(0)?, r.get(1)?);
                let name = crate::frames::name(&name).0;
                names.insert(id, name.clone());
                read_names.push((id, name));
            }
        }
        let mut fresh = Vec::with_capacity(blobs.len());
        for (id, blob) in blobs {
            let frames = decode_stack(&blob)
                .map(|f| {
                    names
                        .get(&f)
                        .cloned()
                        .ok_or_else(|| StoreError::Corrupt(format!("stack {id} names frame {f}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let frames = Arc::new(frames);
            fresh.push((id, frames.clone()));
            out.insert(id, frames);
        }
        let mut cache = self.cache_mut();
        for (id, name) in read_names {
            cache.add_frame(id, name);
        }
        for (id, frames) in fresh {
            cache.add_stack(super::cache::stack_hash(&frames), id, frames);
        }
        Ok(out)
    }

    pub(super) fn read_select(
        &self,
        selection: &Selection<'_>,
    ) -> Result<Vec<Stacked>, StoreError> {
        let Some((ty, wanted, all)) = self.cache().selected(selection) else {
            return Ok(Vec::new());
        };
        let conn = self.reader()?;
        // Summed here rather than by GROUP BY: SQLite groups through a sorter, which costs
        // several times a hash map over the same rows, and groups of unwanted label sets are
        // skipped undecoded. Keyed by label set and stack packed into one integer (row ids
        // stay far below 2^32: one is used per distinct label set or stack ever stored).
        let pack = |labelset: i64, stack: i64| -> Result<u64, chunk::Corrupt> {
            match (u32::try_from(labelset), u32::try_from(stack)) {
                (Ok(l), Ok(s)) => Ok((u64::from(l) << 32) | u64::from(s)),
                _ => Err(chunk::Corrupt("an id beyond 2^32")),
            }
        };
        let mut sums: IdMap<u64, i64> = IdMap::default();
        each_chunk(&conn, ty, selection.from_s, selection.to_s, |_, data| {
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
            })
        })?;
        // Sorted by (label set, stack), so answers stay deterministic.
        let mut sums: Vec<(u64, i64)> = sums.into_iter().filter(|&(_, v)| v != 0).collect();
        sums.sort_unstable_by_key(|&(k, _)| k);
        // Most often the cache holds every stack: each entry then costs one lookup. Otherwise
        // the stacks are gathered (read where the cache lacks them) and the answer built again.
        if let Some(out) = assemble(&self.cache(), &sums, |cache, id| {
            cache.stack_by_id.get(&id).cloned().map(Some)
        }) {
            return Ok(out);
        }
        let stacks = self.stacks(&conn, sums.iter().map(|&(k, _)| (k & 0xffff_ffff) as i64))?;
        Ok(
            assemble(&self.cache(), &sums, |_, id| Some(stacks.get(&id).cloned()))
                .unwrap_or_default(),
        )
    }

    pub(super) fn read_series(
        &self,
        selection: &Selection<'_>,
        step_s: i64,
    ) -> Result<Vec<Point>, StoreError> {
        // The API validates steps; a non-positive one here is read as the finest.
        let step_s = step_s.max(1);
        let Some((ty, wanted, all)) = self.cache().selected(selection) else {
            return Ok(Vec::new());
        };
        let conn = self.reader()?;
        // Summed here, as in `select`: groups of unwanted label sets are skipped undecoded and
        // only values are added (a chunk's stacks do not matter to a series).
        let mut sums: IdMap<(i64, i64), i64> = IdMap::default();
        each_chunk(
            &conn,
            ty,
            selection.from_s,
            selection.to_s,
            |bucket, data| {
                let step = bucket - bucket.rem_euclid(step_s);
                chunk::each_group(data, |labelset, entries| {
                    if all || wanted.contains(&labelset) {
                        // Exact in 128 bits (a group holds far fewer than 2^64 entries),
                        // saturated once: no saturating add per entry.
                        let mut total = 0i128;
                        chunk::each_entry(entries, |_, value| total += i128::from(value))?;
                        let total = total.clamp(i64::MIN.into(), i64::MAX.into()) as i64;
                        add(sums.entry((step, labelset)).or_default(), total);
                    }
                    Ok(())
                })
            },
        )?;
        let cache = self.cache();
        let mut out = Vec::with_capacity(sums.len());
        for ((time_s, labelset), value) in sums {
            // Gone since the chunks were read: removed by retention with them.
            let Some(labels) = cache.labelset_by_id.get(&labelset).cloned() else {
                continue;
            };
            out.push(Point {
                labels,
                time_s,
                value,
            });
        }
        Ok(out)
    }

    pub(super) fn labelsets_in(
        &self,
        from_s: i64,
        to_s: i64,
    ) -> Result<Vec<Arc<LabelSet>>, StoreError> {
        let conn = self.reader()?;
        let mut ids: IdSet<i64> = IdSet::default();
        {
            let mut stmt =
                conn.prepare_cached("SELECT data FROM chunks WHERE bucket >= ?1 AND bucket < ?2")?;
            let mut rows = stmt.query(params![from_s, to_s]).map_err(QueryError)?;
            while let Some(r) = rows.next().map_err(QueryError)? {
                chunk::each_group(r.get_ref(0)?.as_blob()?, |labelset, _| {
                    ids.insert(labelset);
                    Ok(())
                })?;
            }
        }
        let cache = self.cache();
        Ok(ids
            .into_iter()
            .filter_map(|id| cache.labelset_by_id.get(&id).cloned())
            .collect())
    }
}

/// The answer of a select from its sums sorted by (label set, stack); `None` as soon as
/// `stack_of` answers `None` for a stack. A label set, or a stack `stack_of` answers
/// `Some(None)` for, gone since the chunks were read was removed by retention with the
/// chunks that used it: its entries are left out.
fn assemble(
    cache: &Cache,
    sums: &[(u64, i64)],
    stack_of: impl Fn(&Cache, i64) -> Option<Option<Stack>>,
) -> Option<Vec<Stacked>> {
    let mut out = Vec::with_capacity(sums.len());
    let mut labels: Option<(i64, Arc<LabelSet>)> = None;
    for &(key, value) in sums {
        let (labelset, stack) = ((key >> 32) as i64, (key & 0xffff_ffff) as i64);
        // Entries of one label set are adjacent: one lookup per label set.
        let set = match &labels {
            Some((id, set)) if *id == labelset => set.clone(),
            _ => {
                let Some(set) = cache.labelset_by_id.get(&labelset).cloned() else {
                    continue;
                };
                labels = Some((labelset, set.clone()));
                set
            }
        };
        let Some(stack) = stack_of(cache, stack)? else {
            continue;
        };
        out.push(Stacked {
            labels: set,
            stack,
            value,
        });
    }
    Some(out)
}

/// `a,b,c` of integers, for `IN (...)`.
pub(super) fn list(ids: &[i64]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(ids.len() * 8);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{id}");
    }
    s
}
