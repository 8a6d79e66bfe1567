//! What the SQLite store keeps in memory. Label sets and sample types entirely (a query
//! matches every label set; a tenant's are bounded by its `max_label_sets`), with a count
//! per tenant; frame names and stacks only as a bounded cache, filled as pushes and queries
//! use them, so start-up reads none and memory does not grow with the store.

use std::collections::HashMap;
use std::sync::Arc;

use rusqlite::Connection;

use super::chunk::{IdMap, IdSet};
use crate::store::{Frame, LabelSet, Selection, Stack, StoreError, content_hash, tenant_of};

/// Frames the cached stacks may hold in all before the stack cache starts over (16 bytes
/// each: 64 MiB).
const STACK_CACHE_FRAMES: usize = 4 << 20;
/// Frame names cached before the name cache starts over.
const NAME_CACHE: usize = 1 << 20;

pub fn stack_hash(frames: &[Frame]) -> u64 {
    content_hash(frames.iter().map(|f| &**f))
}

pub fn labels_hash(labels: &LabelSet) -> u64 {
    content_hash(labels.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]))
}

#[derive(Default)]
pub struct Cache {
    pub labelset_index: IdMap<u64, Vec<i64>>,
    pub labelset_by_id: IdMap<i64, Arc<LabelSet>>,
    /// Label sets per tenant (internal name).
    pub tenant_labelsets: HashMap<String, usize>,
    pub types: HashMap<(String, String), i64>,
    /// Frame name to id, and back; a bounded cache.
    pub frames: HashMap<Frame, i64>,
    pub frame_names: IdMap<i64, Frame>,
    /// Stacks by content hash and by id; a bounded cache.
    pub stack_index: IdMap<u64, Vec<i64>>,
    pub stack_by_id: IdMap<i64, Stack>,
    /// Ids by the address of the stack held in `stack_by_id`: decoded stacks are shared
    /// across pushes (see `crate::frames`), so most of a batch's are the very allocation
    /// stored here and are found without hashing their names. Sound because `stack_by_id`
    /// keeps each such allocation alive (its address cannot be reused) and the two are
    /// only ever emptied together.
    pub stack_by_address: IdMap<usize, i64>,
    stack_frames: usize,
    /// The largest stack id stored (dense query sums are sized by it).
    pub max_stack_id: i64,
}

impl Cache {
    /// Label sets and types from the database; no stack or frame name.
    pub fn load(conn: &Connection) -> Result<Self, StoreError> {
        let mut cache = Cache::default();
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
        cache.max_stack_id =
            conn.query_row("SELECT coalesce(max(id), 0) FROM stacks", [], |r| r.get(0))?;
        Ok(cache)
    }

    pub fn find_stack(&self, hash: u64, frames: &[Frame]) -> Option<i64> {
        let ids = self.stack_index.get(&hash)?;
        ids.iter().copied().find(|id| {
            self.stack_by_id
                .get(id)
                .is_some_and(|s| s.as_slice() == frames)
        })
    }

    pub fn add_stack(&mut self, hash: u64, id: i64, frames: Stack) {
        if self.stack_frames >= STACK_CACHE_FRAMES {
            self.stack_index.clear();
            self.stack_by_id.clear();
            self.stack_by_address.clear();
            self.stack_frames = 0;
        }
        self.max_stack_id = self.max_stack_id.max(id);
        if self.stack_by_id.contains_key(&id) {
            return;
        }
        self.stack_frames += frames.len() + 1;
        self.stack_index.entry(hash).or_default().push(id);
        self.stack_by_address
            .insert(Arc::as_ptr(&frames).addr(), id);
        self.stack_by_id.insert(id, frames);
    }

    pub fn add_frame(&mut self, id: i64, name: Frame) {
        if self.frames.len() >= NAME_CACHE {
            self.frames.clear();
            self.frame_names.clear();
        }
        self.frames.insert(name.clone(), id);
        self.frame_names.insert(id, name);
    }

    pub fn find_labelset(&self, hash: u64, labels: &LabelSet) -> Option<i64> {
        let ids = self.labelset_index.get(&hash)?;
        ids.iter()
            .copied()
            .find(|id| self.labelset_by_id.get(id).is_some_and(|l| **l == *labels))
    }

    pub fn add_labelset(&mut self, hash: u64, id: i64, labels: Arc<LabelSet>) {
        *self
            .tenant_labelsets
            .entry(tenant_of(&labels).to_string())
            .or_default() += 1;
        self.labelset_index.entry(hash).or_default().push(id);
        self.labelset_by_id.insert(id, labels);
    }

    /// Label sets a tenant holds.
    pub fn labelsets_of(&self, tenant: &str) -> usize {
        self.tenant_labelsets.get(tenant).copied().unwrap_or(0)
    }

    /// Forgets label sets, stacks and frame names retention removed.
    pub fn remove(&mut self, labelsets: &IdSet<i64>, stacks: &IdSet<i64>, frames: &IdSet<i64>) {
        for id in labelsets {
            if let Some(labels) = self.labelset_by_id.remove(id) {
                if let Some(n) = self.tenant_labelsets.get_mut(tenant_of(&labels)) {
                    *n = n.saturating_sub(1);
                }
                let hash = labels_hash(&labels);
                if let Some(ids) = self.labelset_index.get_mut(&hash) {
                    ids.retain(|i| i != id);
                }
            }
        }
        if stacks.iter().any(|id| self.stack_by_id.contains_key(id)) {
            self.stack_by_address.retain(|_, id| !stacks.contains(id));
            for id in stacks {
                if let Some(frames) = self.stack_by_id.remove(id) {
                    self.stack_frames = self.stack_frames.saturating_sub(frames.len() + 1);
                    if let Some(ids) = self.stack_index.get_mut(&stack_hash(&frames)) {
                        ids.retain(|i| i != id);
                    }
                }
            }
        }
        for id in frames {
            if let Some(name) = self.frame_names.remove(id) {
                self.frames.remove(&name);
            }
        }
    }

    /// Takes in what a committed batch interned.
    pub fn extend(&mut self, fresh: Fresh) {
        for (name, id) in fresh.frames {
            self.add_frame(id, name);
        }
        for (hash, id, frames) in fresh.stacks {
            self.add_stack(hash, id, frames);
        }
        for (hash, id, labels) in fresh.labelsets {
            self.add_labelset(hash, id, labels);
        }
        self.types.extend(fresh.types);
    }

    /// The id of the selection's sample type and the ids of the label sets it matches; `None`
    /// when nothing can match. `all` is whether every label set matches.
    pub fn selected(&self, selection: &Selection<'_>) -> Option<(i64, IdSet<i64>, bool)> {
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
        let all = wanted.len() == self.labelset_by_id.len();
        (!wanted.is_empty()).then_some((ty, wanted, all))
    }
}

/// What one batch interned, taken into the cache after its commit.
#[derive(Default)]
pub struct Fresh {
    pub frames: Vec<(Frame, i64)>,
    pub stacks: Vec<(u64, i64, Stack)>,
    pub labelsets: Vec<(u64, i64, Arc<LabelSet>)>,
    pub types: Vec<((String, String), i64)>,
}
