//! Retention and compaction of the SQLite store. Expiry deletes old chunks, then removes the
//! label sets, stacks and frame names no remaining chunk uses: it finds them in a snapshot
//! read on a read connection (pushes go on meanwhile), and deletes them in slices on the
//! writer, each slice leaving out what pushes used since the snapshot began. Compaction merges
//! one coarse bucket per transaction, so a push waits for one bucket at most.

use std::sync::atomic::Ordering::Relaxed;

use rusqlite::params;

use super::chunk::{self, IdSet};
use super::read::list;
use super::{SqliteStore, Sums, decode_stack, write_chunks};
use crate::store::{StoreError, add};

/// Ids removed per statement and writer lock.
const SLICE: usize = 10_000;

/// What pushes used while retention looked for unused entries.
#[derive(Default)]
pub(super) struct Touched {
    pub(super) labelsets: IdSet<i64>,
    pub(super) stacks: IdSet<i64>,
    pub(super) frames: IdSet<i64>,
}

/// Label set, stack and frame name ids no chunk uses.
type Unused = (Vec<i64>, Vec<i64>, Vec<i64>);

/// Entries retention removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    pub labelsets: u64,
    pub stacks: u64,
    pub frames: u64,
}

impl SqliteStore {
    /// Called by a push, holding the writer, with what its batch used.
    pub(super) fn touch(
        &self,
        labelsets: impl Iterator<Item = i64>,
        stacks: impl Iterator<Item = i64>,
        frames: Vec<i64>,
    ) {
        let mut t = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = t.as_mut() {
            t.labelsets.extend(labelsets);
            t.stacks.extend(stacks);
            t.frames.extend(frames);
        }
    }

    pub(super) fn expire_and_prune(&self, before_s: i64) -> Result<u64, StoreError> {
        let removed = {
            let conn = self.writer();
            let removed = conn.execute("DELETE FROM chunks WHERE bucket < ?1", [before_s])?;
            // Replays older than the retention would be stored again, but their samples
            // would be expired at once, so the dedup keys can go with them.
            conn.execute("DELETE FROM batches WHERE bucket < ?1", [before_s])?;
            removed
        };
        // Also once after start: a store of an older collector kept every label set.
        if removed > 0 || !self.pruned_once.swap(true, Relaxed) {
            self.prune()?;
        }
        Ok(removed as u64)
    }

    /// Removes the label sets, stacks and frame names no chunk uses.
    pub fn prune(&self) -> Result<Pruned, StoreError> {
        let result = self.prune_inner();
        *self.touched.lock().unwrap_or_else(|e| e.into_inner()) = None;
        result
    }

    fn prune_inner(&self) -> Result<Pruned, StoreError> {
        let reader = self.reader()?;
        {
            // Tracking starts with the snapshot, both under the writer: every push is
            // either in the snapshot or tracked.
            let _writer = self.writer();
            *self.touched.lock().unwrap_or_else(|e| e.into_inner()) = Some(Touched::default());
            reader.execute_batch("BEGIN")?;
            reader.query_row("SELECT count(*) FROM types", [], |_| Ok(()))?;
        }
        let snapshot = self.unused(&reader);
        reader.execute_batch("COMMIT")?;
        let (labelsets, stacks, frames) = snapshot?;
        let mut pruned = Pruned::default();
        for part in labelsets.chunks(SLICE) {
            pruned.labelsets += self.delete_slice("labelsets", part, |t| &t.labelsets)?;
        }
        for part in stacks.chunks(SLICE) {
            pruned.stacks += self.delete_slice("stacks", part, |t| &t.stacks)?;
        }
        // Frames of stacks that were unused in the snapshot but used since are kept.
        let mut kept: IdSet<i64> = IdSet::default();
        let mut checked: IdSet<i64> = IdSet::default();
        for part in frames.chunks(SLICE) {
            let conn = self.writer();
            let revived: Vec<i64> = {
                let t = self.touched.lock().unwrap_or_else(|e| e.into_inner());
                let t = t.as_ref().expect("tracking until the end");
                kept.extend(&t.frames);
                t.stacks
                    .iter()
                    .copied()
                    .filter(|id| !checked.contains(id))
                    .collect()
            };
            for ids in revived.chunks(SLICE) {
                let mut stmt = conn.prepare(&format!(
                    "SELECT frames FROM stacks WHERE id IN ({})",
                    list(ids)
                ))?;
                let mut rows = stmt.query([])?;
                while let Some(r) = rows.next()? {
                    kept.extend(decode_stack(r.get_ref(0)?.as_blob()?));
                }
            }
            checked.extend(revived);
            let gone: Vec<i64> = part.iter().copied().filter(|f| !kept.contains(f)).collect();
            if gone.is_empty() {
                continue;
            }
            pruned.frames += conn.execute(
                &format!("DELETE FROM frames WHERE id IN ({})", list(&gone)),
                [],
            )? as u64;
            let gone: IdSet<i64> = gone.into_iter().collect();
            self.cache_mut()
                .remove(&IdSet::default(), &IdSet::default(), &gone);
        }
        Ok(pruned)
    }

    /// The label sets, stacks and frame names of the snapshot `reader` is in that no chunk
    /// uses.
    fn unused(&self, reader: &rusqlite::Connection) -> Result<Unused, StoreError> {
        let (mut used_labelsets, mut used_stacks) = (IdSet::default(), IdSet::default());
        {
            let mut stmt = reader.prepare("SELECT data FROM chunks")?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                chunk::each_group(r.get_ref(0)?.as_blob()?, |labelset, entries| {
                    used_labelsets.insert(labelset);
                    chunk::each_entry(entries, |stack, _| {
                        used_stacks.insert(stack);
                    })
                })?;
            }
        }
        let mut labelsets = Vec::new();
        {
            let mut stmt = reader.prepare("SELECT id FROM labelsets")?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let id: i64 = r.get(0)?;
                if !used_labelsets.contains(&id) {
                    labelsets.push(id);
                }
            }
        }
        let (mut stacks, mut used_frames) = (Vec::new(), IdSet::default());
        {
            let mut stmt = reader.prepare("SELECT id, frames FROM stacks")?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let id: i64 = r.get(0)?;
                if used_stacks.contains(&id) {
                    used_frames.extend(decode_stack(r.get_ref(1)?.as_blob()?));
                } else {
                    stacks.push(id);
                }
            }
        }
        let mut frames = Vec::new();
        {
            let mut stmt = reader.prepare("SELECT id FROM frames")?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let id: i64 = r.get(0)?;
                if !used_frames.contains(&id) {
                    frames.push(id);
                }
            }
        }
        Ok((labelsets, stacks, frames))
    }

    /// Deletes the ids of `part` from `table` but those pushes used since the snapshot.
    pub(super) fn delete_slice(
        &self,
        table: &str,
        part: &[i64],
        touched: impl Fn(&Touched) -> &IdSet<i64>,
    ) -> Result<u64, StoreError> {
        let conn = self.writer();
        let gone: Vec<i64> = {
            let t = self.touched.lock().unwrap_or_else(|e| e.into_inner());
            let used = touched(t.as_ref().expect("tracking until the end"));
            part.iter()
                .copied()
                .filter(|id| !used.contains(id))
                .collect()
        };
        if gone.is_empty() {
            return Ok(0);
        }
        let n = conn.execute(
            &format!("DELETE FROM {table} WHERE id IN ({})", list(&gone)),
            [],
        )?;
        let gone: IdSet<i64> = gone.into_iter().collect();
        let none = IdSet::default();
        let mut cache = self.cache_mut();
        if table == "labelsets" {
            cache.remove(&gone, &none, &none);
        } else {
            cache.remove(&none, &gone, &none);
        }
        Ok(n as u64)
    }

    pub(super) fn compact_buckets(&self, before_s: i64, coarse_s: i64) -> Result<u64, StoreError> {
        // Only whole coarse buckets are merged, so a coarse bucket never overlaps fine ones.
        let before_s = before_s - before_s.rem_euclid(coarse_s);
        let coarse: Vec<i64> = self
            .writer()
            .prepare(
                "SELECT DISTINCT bucket - (bucket % ?2) FROM chunks
                 WHERE bucket < ?1 AND bucket % ?2 != 0",
            )?
            .query_map(params![before_s, coarse_s], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        let mut removed = 0;
        // One coarse bucket a transaction, so memory holds one bucket's stacks, not the
        // range's, and a push waits for one bucket at most.
        for start in coarse {
            let mut conn = self.writer();
            let tx = conn.transaction()?;
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
            tx.commit()?;
        }
        Ok(removed as u64)
    }
}
