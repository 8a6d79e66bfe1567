//! What a batch interns in ClickHouse, and what this collector remembers of it. Ids are
//! content hashes, so collectors agree without talking; the caches only save round trips.
//! A label set or stack is written again when this collector has not written it within
//! [`REWRITE`], so retention (which removes entries no sample uses once older than
//! [`GRACE_S`]) never removes one a collector is about to use. New label sets beyond a
//! tenant's `max_label_sets` are refused: the tenant's count is read from the store at most
//! every [`COUNT_EVERY`] and kept up to date in between.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::rowbinary::{Reader, Writer};
use super::{ClickHouseStore, IN_CHUNK, ids, list};
use crate::idmap::IdMap;
use crate::store::{Batch, LabelSet, Stack, StoreError, TENANT_LABEL, tenant_of};

/// Ids remembered per cache before it is emptied (they are only round-trip savers).
const CACHE_ENTRIES: usize = 1 << 20;
/// Frames the stack cache may hold before it is emptied.
const STACK_FRAMES: usize = 4 << 20;
/// A label set or stack this collector wrote within this long is not written again; older
/// ones are (a row each, an hour, a collector).
pub(super) const REWRITE: Duration = Duration::from_secs(3600);
/// Entries written this long ago or more, and used by no sample row, are removed by
/// retention: twice [`REWRITE`], so one written within it is safe.
pub(super) const GRACE_S: u64 = 2 * 3600;
/// How often a tenant's label sets are counted in the store.
const COUNT_EVERY: Duration = Duration::from_secs(60);

#[derive(Default)]
pub(super) struct Caches {
    /// Interned entries known to be in ClickHouse (written by us or read back).
    pub stored_types: HashSet<u64>,
    pub labelsets: HashMap<u64, Arc<LabelSet>>,
    /// When this collector last wrote each label set: only these are skipped when interning
    /// (label sets read back may be about to be removed by retention).
    pub written_labelsets: HashMap<u64, Instant>,
    pub stacks: HashMap<u64, Stack>,
    stack_frames: usize,
    pub written_stacks: HashMap<u64, Instant>,
    /// Stack ids by the address of the decoded stack: a push's stacks are the shared
    /// allocations of [`crate::frames`], so a stack seen in an earlier push is found here
    /// without hashing its names again (most of a push's storing time otherwise). Each entry
    /// holds its stack, so no address is reused for another stack while it is here.
    ids_by_address: IdMap<usize, (Stack, u64)>,
    address_frames: usize,
    /// Label sets per tenant as last counted (with those written since), and when.
    tenant_counts: Option<(Instant, HashMap<String, usize>)>,
}

impl Caches {
    pub fn bound(&mut self) {
        if self.labelsets.len() > CACHE_ENTRIES {
            self.labelsets.clear();
        }
        if self.written_labelsets.len() > CACHE_ENTRIES {
            self.written_labelsets.clear();
        }
        if self.written_stacks.len() > CACHE_ENTRIES {
            self.written_stacks.clear();
        }
        if self.stacks.len() > CACHE_ENTRIES || self.stack_frames > STACK_FRAMES {
            self.stacks.clear();
            self.stack_frames = 0;
        }
        if self.ids_by_address.len() > CACHE_ENTRIES || self.address_frames > STACK_FRAMES {
            self.ids_by_address.clear();
            self.address_frames = 0;
        }
    }

    /// The id of `stack`, remembered by its address.
    pub fn stack_id(&mut self, stack: &Stack) -> u64 {
        let address = Arc::as_ptr(stack) as usize;
        if let Some(&(_, id)) = self.ids_by_address.get(&address) {
            return id;
        }
        let id = ids::stack(stack);
        self.address_frames += stack.len() + 1;
        self.ids_by_address.insert(address, (stack.clone(), id));
        id
    }

    pub fn add_stack(&mut self, id: u64, stack: Stack) {
        self.stack_frames += stack.len() + 1;
        self.stacks.insert(id, stack);
    }
}

fn stale(written: Option<&Instant>) -> bool {
    written.is_none_or(|at| at.elapsed() >= REWRITE)
}

impl ClickHouseStore {
    /// The label sets of `labelsets` that are new to the store and over their tenant's
    /// `max`: their rows are refused.
    pub(super) fn refused_labelsets(
        &self,
        labelsets: &HashMap<u64, &Arc<LabelSet>>,
        max: Option<usize>,
    ) -> Result<HashSet<u64>, StoreError> {
        let Some(max) = max else {
            return Ok(HashSet::new());
        };
        let mut unknown: Vec<u64> = {
            let caches = self.caches();
            labelsets
                .keys()
                .copied()
                .filter(|id| !caches.labelsets.contains_key(id))
                .collect()
        };
        if unknown.is_empty() {
            return Ok(HashSet::new());
        }
        unknown.sort_unstable();
        let mut stored = HashSet::new();
        for part in unknown.chunks(IN_CHUNK) {
            stored.extend(self.select_ids(&format!(
                "SELECT DISTINCT id FROM {}.labelsets WHERE id IN ({})",
                self.db,
                list(part)
            ))?);
        }
        let fresh = self.tenant_counts()?;
        let mut caches = self.caches();
        let (_, counts) = caches.tenant_counts.get_or_insert((Instant::now(), fresh));
        let mut refused = HashSet::new();
        for id in unknown {
            let labels = labelsets[&id];
            if stored.contains(&id) {
                continue;
            }
            let n = counts.entry(tenant_of(labels).to_string()).or_default();
            if *n >= max {
                refused.insert(id);
            } else {
                *n += 1;
            }
        }
        for id in stored {
            caches.labelsets.insert(id, labelsets[&id].clone());
        }
        Ok(refused)
    }

    /// Label sets per tenant: counted in the store when the last count is older than
    /// [`COUNT_EVERY`] (or there is none), else the count kept up to date since.
    fn tenant_counts(&self) -> Result<HashMap<String, usize>, StoreError> {
        {
            let mut caches = self.caches();
            match &caches.tenant_counts {
                Some((at, counts)) if at.elapsed() < COUNT_EVERY => return Ok(counts.clone()),
                _ => caches.tenant_counts = None,
            }
        }
        let raw = self.select_raw(&format!(
            "SELECT visitParamExtractString(labels, '{TENANT_LABEL}') AS t, uniqExact(id)
             FROM {}.labelsets GROUP BY t",
            self.db
        ))?;
        let mut r = Reader::new(&raw);
        let mut counts = HashMap::new();
        while !r.is_empty() {
            let tenant = r.str()?;
            counts.insert(tenant, r.u64()? as usize);
        }
        Ok(counts)
    }

    /// Writes interned entries the store may lack: before the samples that use them, so a
    /// reader never meets an id it cannot resolve.
    pub(super) fn intern(
        &self,
        batch: &Batch,
        types: &[u64],
        labelsets: &HashMap<u64, &Arc<LabelSet>>,
        stacks: &HashMap<u64, &Stack>,
    ) -> Result<(), StoreError> {
        let (new_types, new_labelsets, new_stacks) = {
            let caches = self.caches();
            let new_types: Vec<usize> = (0..types.len())
                .filter(|&i| !caches.stored_types.contains(&types[i]))
                .collect();
            let new_labelsets: Vec<(u64, Arc<LabelSet>)> = labelsets
                .iter()
                .filter(|(id, _)| stale(caches.written_labelsets.get(id)))
                .map(|(&id, &l)| (id, l.clone()))
                .collect();
            let new_stacks: Vec<(u64, Stack)> = stacks
                .iter()
                .filter(|(id, _)| stale(caches.written_stacks.get(id)))
                .map(|(&id, &s)| (id, s.clone()))
                .collect();
            (new_types, new_labelsets, new_stacks)
        };
        if !new_types.is_empty() {
            let mut w = Writer::default();
            for &i in &new_types {
                let (name, unit) = &batch.sample_types[i];
                w.u64(types[i]);
                w.str(name);
                w.str(unit);
            }
            self.insert("types (id, name, unit)", &w.0, new_types.len())?;
        }
        // Taken before writing: the row's `at` is no earlier than this.
        let written_at = Instant::now();
        if !new_labelsets.is_empty() {
            let mut w = Writer::default();
            for (id, labels) in &new_labelsets {
                w.u64(*id);
                w.str(&ids::labelset_json(labels));
            }
            self.insert("labelsets (id, labels)", &w.0, new_labelsets.len())?;
        }
        if !new_stacks.is_empty() {
            let mut w = Writer::default();
            for (id, frames) in &new_stacks {
                w.u64(*id);
                w.strs(frames);
            }
            self.insert("stacks (id, frames)", &w.0, new_stacks.len())?;
        }
        let mut caches = self.caches();
        caches.bound();
        for i in new_types {
            caches.stored_types.insert(types[i]);
        }
        for (id, labels) in new_labelsets {
            caches.written_labelsets.insert(id, written_at);
            caches.labelsets.insert(id, labels);
        }
        for (id, stack) in new_stacks {
            caches.written_stacks.insert(id, written_at);
            caches.add_stack(id, stack);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stack's id remembered by its address is its content's id, for every allocation of
    /// that content, and an address freed and reused by another stack cannot be met (each
    /// entry keeps its stack alive).
    #[test]
    fn stack_ids_by_address_are_content_ids() {
        let stack =
            |names: &[&str]| -> Stack { Arc::new(names.iter().map(|&n| n.into()).collect()) };
        let mut caches = Caches::default();
        let a = stack(&["main", "work"]);
        let again = stack(&["main", "work"]);
        assert_eq!(caches.stack_id(&a), ids::stack(&["main", "work"]));
        assert_eq!(caches.stack_id(&a), caches.stack_id(&again));
        let address = Arc::as_ptr(&a) as usize;
        drop(a);
        for _ in 0..1000 {
            let other = stack(&["main", "other"]);
            assert_ne!(
                Arc::as_ptr(&other) as usize,
                address,
                "address held by the cache"
            );
            assert_eq!(caches.stack_id(&other), ids::stack(&["main", "other"]));
        }
    }
}
