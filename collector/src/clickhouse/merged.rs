//! [`Store::select_merged`](crate::store::Store::select_merged) on ClickHouse: the server
//! sums per (group, stack), where a group is named by its smallest label set id and every
//! other label set of the group is mapped onto it with `transform` in the query. An hour of
//! a cluster then answers with a few rows per stack rather than one per label set and
//! stack, which the server would have to hash, send and the collector sort.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::rowbinary::Reader;
use super::{ClickHouseStore, Selected, list};
use crate::store::{LabelSet, Selection, Stacked, StoreError, add, project};

/// The groups of a selection: each kept label set and the label set id that stands for it.
#[derive(Default)]
struct Groups {
    labels: Vec<Arc<LabelSet>>,
    by_labels: BTreeMap<LabelSet, u32>,
    /// Group of each label set id the query can answer with.
    by_id: HashMap<u64, u32>,
}

impl Groups {
    fn group(&mut self, labels: LabelSet) -> u32 {
        if let Some(&g) = self.by_labels.get(&labels) {
            return g;
        }
        let g = self.labels.len() as u32;
        self.labels.push(Arc::new(labels.clone()));
        self.by_labels.insert(labels, g);
        g
    }
}

impl ClickHouseStore {
    pub(super) fn merged(
        &self,
        selection: &Selection<'_>,
        keep: &[&str],
    ) -> Result<Vec<Stacked>, StoreError> {
        let Some(Selected {
            present,
            rows,
            filtered,
        }) = self.selected(selection)?
        else {
            return Ok(Vec::new());
        };
        let mut members: BTreeMap<LabelSet, Vec<u64>> = BTreeMap::new();
        for (&id, labels) in &present {
            if (selection.labels)(labels) {
                members.entry(project(labels, keep)).or_default().push(id);
            }
        }
        let mut groups = Groups::default();
        // Label sets mapped onto another (the group's smallest id) in the query.
        let (mut from, mut onto) = (Vec::new(), Vec::new());
        for (labels, mut ids) in members {
            ids.sort_unstable();
            let g = groups.group(labels);
            groups.by_id.insert(ids[0], g);
            for &id in &ids[1..] {
                from.push(id);
                onto.push(ids[0]);
            }
        }
        let only = groups.by_id.keys().next().copied();
        let query = if let (true, 1, Some(id)) = (filtered, groups.labels.len(), only) {
            // One group and only its label sets read (no label set stored since can slip
            // in): summed by stack alone, which costs ClickHouse about half of grouping by
            // two keys.
            format!("SELECT toUInt64({id}) AS g, stack, sum(value) {rows} GROUP BY stack")
        } else if from.is_empty() {
            format!("SELECT labelset AS g, stack, sum(value) {rows} GROUP BY g, stack")
        } else {
            // A label set stored after `selected` read the range maps onto itself, so it
            // is told apart below.
            format!(
                "SELECT transform(labelset, CAST([{}] AS Array(UInt64)), CAST([{}] AS Array(UInt64)), labelset) AS g,
                        stack, sum(value) {rows} GROUP BY g, stack",
                list(&from),
                list(&onto)
            )
        };
        let raw = self.select_raw(&query)?;
        let mut r = Reader::new(&raw);
        let mut rows = Vec::with_capacity(raw.len() / 24);
        while !r.is_empty() {
            rows.push((r.u64()?, r.u64()?, r.i64()?));
        }
        // Label sets stored since `selected` (possible only without a label filter): those
        // the selection matches join their group.
        let mut late: Vec<u64> = rows
            .iter()
            .map(|row| row.0)
            .filter(|id| !groups.by_id.contains_key(id))
            .collect();
        late.sort_unstable();
        late.dedup();
        for (id, labels) in self.labelsets(&late)? {
            if (selection.labels)(&labels) {
                let g = groups.group(project(&labels, keep));
                groups.by_id.insert(id, g);
            }
        }
        let mut sums: HashMap<(u32, u64), i64> = HashMap::with_capacity(rows.len());
        for (id, stack, value) in rows {
            if let Some(&g) = groups.by_id.get(&id) {
                add(sums.entry((g, stack)).or_default(), value);
            }
        }
        // Sorted by label set, then stack id, so answers are deterministic.
        let rank: HashMap<u32, usize> = groups
            .by_labels
            .values()
            .enumerate()
            .map(|(rank, &g)| (g, rank))
            .collect();
        let mut sums: Vec<(usize, u64, u32, i64)> = sums
            .into_iter()
            .filter(|&(_, v)| v != 0)
            .map(|((g, stack), v)| (rank[&g], stack, g, v))
            .collect();
        sums.sort_unstable();
        let mut stack_ids: Vec<u64> = sums.iter().map(|s| s.1).collect();
        stack_ids.sort_unstable();
        stack_ids.dedup();
        let stacks = self.stacks(&stack_ids)?;
        sums.into_iter()
            .map(|(_, sid, g, value)| match stacks.get(&sid) {
                Some(stack) => Ok(Stacked {
                    labels: groups.labels[g as usize].clone(),
                    stack: stack.clone(),
                    value,
                }),
                None => Err(StoreError::Corrupt(format!(
                    "sample rows of stack {sid} without it"
                ))),
            })
            .collect()
    }
}
