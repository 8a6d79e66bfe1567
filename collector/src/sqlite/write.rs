//! A batch into the SQLite store: one transaction on the writer connection that records its
//! (agent id, sequence), interns what it names and writes its chunks. Names and stacks the
//! bounded cache does not hold are looked up in their tables (unique indexes) before they
//! are added; label sets are all in the cache, so a label set missing there is new, and is
//! refused once its tenant holds `max_label_sets`.

use std::collections::HashMap;
use std::sync::Arc;

use rusqlite::{OptionalExtension, params};

use super::cache::{Cache, Fresh, labels_hash, stack_hash};
use super::chunk::IdMap;
use super::{SqliteStore, Sums, bucket_of, encode_stack, write_chunks};
use crate::store::{Batch, Frame, Ingested, LabelSet, Stack, StoreError, add, tenant_of};

/// Interns within the open transaction; new entries go to `fresh` and reach the cache only
/// after the commit, so a failed batch leaves the cache matching the database.
struct Interner<'a> {
    tx: &'a rusqlite::Transaction<'a>,
    cache: &'a Cache,
    fresh: Fresh,
    frames: HashMap<Frame, i64>,
    stacks: IdMap<u64, Vec<(i64, Stack)>>,
    labelsets: IdMap<u64, Vec<(i64, Arc<LabelSet>)>>,
    /// New label sets of this batch per tenant.
    new_labelsets: HashMap<String, usize>,
    /// Frames of the stacks this batch added (retention must keep them).
    new_stack_frames: Vec<i64>,
}

impl Interner<'_> {
    fn frame(&mut self, name: &Frame) -> Result<i64, StoreError> {
        if let Some(&id) = self.cache.frames.get(name).or(self.frames.get(name)) {
            return Ok(id);
        }
        let found: Option<i64> = self
            .tx
            .prepare_cached("SELECT id FROM frames WHERE name = ?1")?
            .query_row([&**name], |r| r.get(0))
            .optional()?;
        let id = match found {
            Some(id) => id,
            None => {
                self.tx
                    .prepare_cached("INSERT INTO frames (name) VALUES (?1)")?
                    .execute([&**name])?;
                self.tx.last_insert_rowid()
            }
        };
        self.frames.insert(name.clone(), id);
        self.fresh.frames.push((name.clone(), id));
        Ok(id)
    }

    fn stack(&mut self, frames: &Stack) -> Result<i64, StoreError> {
        let address = Arc::as_ptr(frames).addr();
        if let Some(&id) = self.cache.stack_by_address.get(&address) {
            return Ok(id);
        }
        let hash = stack_hash(frames);
        if let Some(id) = self.cache.find_stack(hash, frames).or_else(|| {
            self.stacks
                .get(&hash)?
                .iter()
                .find(|(_, s)| s == frames)
                .map(|(id, _)| *id)
        }) {
            return Ok(id);
        }
        let ids = frames
            .iter()
            .map(|f| self.frame(f))
            .collect::<Result<Vec<_>, _>>()?;
        let blob = encode_stack(&ids);
        let found: Option<i64> = self
            .tx
            .prepare_cached("SELECT id FROM stacks WHERE frames = ?1")?
            .query_row([&blob], |r| r.get(0))
            .optional()?;
        let id = match found {
            Some(id) => id,
            None => {
                self.tx
                    .prepare_cached("INSERT INTO stacks (frames) VALUES (?1)")?
                    .execute([&blob])?;
                self.new_stack_frames.extend(&ids);
                self.tx.last_insert_rowid()
            }
        };
        self.stacks
            .entry(hash)
            .or_default()
            .push((id, frames.clone()));
        self.fresh.stacks.push((hash, id, frames.clone()));
        Ok(id)
    }

    /// The label set's id; `None` when it is new and its tenant holds `max` already.
    fn labelset(
        &mut self,
        labels: &Arc<LabelSet>,
        max: Option<usize>,
    ) -> Result<Option<i64>, StoreError> {
        let hash = labels_hash(labels);
        if let Some(id) = self.cache.find_labelset(hash, labels).or_else(|| {
            self.labelsets
                .get(&hash)?
                .iter()
                .find(|(_, l)| l == labels)
                .map(|(id, _)| *id)
        }) {
            return Ok(Some(id));
        }
        let tenant = tenant_of(labels);
        let new = self.new_labelsets.get(tenant).copied().unwrap_or(0);
        if max.is_some_and(|max| self.cache.labelsets_of(tenant) + new >= max) {
            return Ok(None);
        }
        let json = serde_json::to_string(labels.as_ref()).expect("string maps serialize");
        let inserted = self
            .tx
            .prepare_cached("INSERT OR IGNORE INTO labelsets (labels) VALUES (?1)")?
            .execute([&json])?;
        let id = if inserted == 1 {
            *self.new_labelsets.entry(tenant.to_string()).or_default() += 1;
            self.tx.last_insert_rowid()
        } else {
            self.tx
                .prepare_cached("SELECT id FROM labelsets WHERE labels = ?1")?
                .query_row([&json], |r| r.get(0))?
        };
        self.labelsets
            .entry(hash)
            .or_default()
            .push((id, labels.clone()));
        self.fresh.labelsets.push((hash, id, labels.clone()));
        Ok(Some(id))
    }

    fn sample_type(&mut self, name: &str, unit: &str) -> Result<i64, StoreError> {
        let key = (name.to_string(), unit.to_string());
        if let Some(&id) = self.cache.types.get(&key) {
            return Ok(id);
        }
        if let Some((_, id)) = self.fresh.types.iter().find(|(k, _)| *k == key) {
            return Ok(*id);
        }
        self.tx
            .prepare_cached("INSERT INTO types (name, unit) VALUES (?1, ?2)")?
            .execute(params![name, unit])?;
        let id = self.tx.last_insert_rowid();
        self.fresh.types.push((key, id));
        Ok(id)
    }
}

impl SqliteStore {
    pub(super) fn write_batch(&self, batch: &Batch) -> Result<Ingested, StoreError> {
        let mut conn = self.writer();
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
                ..Ingested::default()
            });
        }
        let cache = self.cache();
        let mut interner = Interner {
            tx: &tx,
            cache: &cache,
            fresh: Fresh::default(),
            frames: HashMap::new(),
            stacks: IdMap::default(),
            labelsets: IdMap::default(),
            new_labelsets: HashMap::new(),
            new_stack_frames: Vec::new(),
        };
        let mut types = Vec::with_capacity(batch.sample_types.len());
        for (name, unit) in &batch.sample_types {
            types.push(interner.sample_type(name, unit)?);
        }
        let mut sums = Sums::default();
        let mut refused = 0u64;
        // Label sets and stacks arrive as shared Arcs: intern each once per batch.
        let mut labelsets: IdMap<*const LabelSet, Option<i64>> = IdMap::default();
        let mut stacks: IdMap<*const Vec<Frame>, i64> = IdMap::default();
        for row in &batch.rows {
            let labelset = match labelsets.get(&Arc::as_ptr(&row.labels)) {
                Some(&id) => id,
                None => {
                    let id = interner.labelset(&row.labels, batch.max_label_sets)?;
                    labelsets.insert(Arc::as_ptr(&row.labels), id);
                    id
                }
            };
            let Some(labelset) = labelset else {
                refused += 1;
                continue;
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
        let Interner {
            fresh,
            new_stack_frames,
            ..
        } = interner;
        drop(cache);
        tx.commit()?;
        self.touch(
            labelsets.values().flatten().copied(),
            stacks.values().copied(),
            new_stack_frames,
        );
        self.cache_mut().extend(fresh);
        Ok(Ingested {
            duplicate: false,
            rows: batch.rows.len() as u64 - refused,
            rows_refused: refused,
        })
    }
}
