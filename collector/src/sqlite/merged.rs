//! [`Store::select_merged`](crate::store::Store::select_merged) on SQLite: label sets are
//! cut down to the kept labels once per label set (not per entry), each wanted label set
//! maps to its group through a table indexed by its row id, and chunk entries are summed
//! per (group, stack). An hour of a cluster then sums into a table of a few thousand
//! entries that stays in the CPU's cache, instead of one entry per label set and stack.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::read::each_chunk;
use super::{SqliteStore, chunk};
use crate::store::{LabelSet, Selection, Stacked, StoreError, add, project};

/// Group tables up to this many entries are summed densely (an array indexed by group and
/// stack id) rather than through a hash map: 16 MiB of sums at most.
const DENSE_ENTRIES: usize = 1 << 21;

/// Sums per (group, stack), dense when small enough. Stacks stored since the query began
/// (beyond the dense table) are summed apart.
enum Sums {
    Dense {
        stacks: usize,
        sums: Vec<i64>,
        later: chunk::IdMap<(u32, i64), i64>,
    },
    Sparse(chunk::IdMap<(u32, i64), i64>),
}

impl Sums {
    fn new(groups: usize, max_stack: i64) -> Self {
        let stacks = usize::try_from(max_stack).unwrap_or(0) + 1;
        match groups.checked_mul(stacks) {
            Some(n) if n <= DENSE_ENTRIES => Sums::Dense {
                stacks,
                sums: vec![0; n],
                later: chunk::IdMap::default(),
            },
            _ => Sums::Sparse(chunk::IdMap::default()),
        }
    }

    #[inline]
    fn add(&mut self, group: u32, stack: i64, value: i64) {
        match self {
            Sums::Dense {
                stacks,
                sums,
                later,
            } => match usize::try_from(stack) {
                Ok(s) if s < *stacks => add(&mut sums[group as usize * *stacks + s], value),
                _ => add(later.entry((group, stack)).or_default(), value),
            },
            Sums::Sparse(map) => add(map.entry((group, stack)).or_default(), value),
        }
    }

    /// `(group, stack, sum)` of the non-zero sums, by group then stack.
    fn into_sorted(self) -> Vec<(u32, i64, i64)> {
        match self {
            Sums::Dense {
                stacks,
                sums,
                later,
            } => {
                let mut out: Vec<(u32, i64, i64)> = sums
                    .into_iter()
                    .enumerate()
                    .filter(|&(_, v)| v != 0)
                    .map(|(i, v)| ((i / stacks) as u32, (i % stacks) as i64, v))
                    .collect();
                if !later.is_empty() {
                    out.extend(
                        later
                            .into_iter()
                            .filter(|&(_, v)| v != 0)
                            .map(|((g, s), v)| (g, s, v)),
                    );
                    out.sort_unstable();
                }
                out
            }
            Sums::Sparse(map) => {
                let mut out: Vec<(u32, i64, i64)> = map
                    .into_iter()
                    .filter(|&(_, v)| v != 0)
                    .map(|((g, s), v)| (g, s, v))
                    .collect();
                out.sort_unstable();
                out
            }
        }
    }
}

impl SqliteStore {
    pub(super) fn merged(
        &self,
        selection: &Selection<'_>,
        keep: &[&str],
    ) -> Result<Vec<Stacked>, StoreError> {
        let (ty, groups, group_of, max_stack) = {
            let cache = self.cache();
            let Some((ty, wanted, _)) = cache.selected(selection) else {
                return Ok(Vec::new());
            };
            // Groups numbered in the order of their label sets, so answers are deterministic.
            let mut by_labels: BTreeMap<LabelSet, Vec<i64>> = BTreeMap::new();
            for &id in &wanted {
                if let Some(labels) = cache.labelset_by_id.get(&id) {
                    by_labels.entry(project(labels, keep)).or_default().push(id);
                }
            }
            let max_labelset = wanted.iter().copied().max().unwrap_or(0);
            let mut group_of = vec![u32::MAX; usize::try_from(max_labelset).unwrap_or(0) + 1];
            let mut groups: Vec<Arc<LabelSet>> = Vec::with_capacity(by_labels.len());
            for (labels, ids) in by_labels {
                for id in ids {
                    group_of[id as usize] = groups.len() as u32;
                }
                groups.push(Arc::new(labels));
            }
            (ty, groups, group_of, cache.max_stack_id)
        };
        let mut sums = Sums::new(groups.len(), max_stack);
        let conn = self.reader()?;
        each_chunk(&conn, ty, selection.from_s, selection.to_s, |_, data| {
            chunk::each_group(data, |labelset, entries| {
                let group = usize::try_from(labelset)
                    .ok()
                    .and_then(|l| group_of.get(l))
                    .copied()
                    .unwrap_or(u32::MAX);
                if group == u32::MAX {
                    return Ok(());
                }
                chunk::each_entry(entries, |stack, value| sums.add(group, stack, value))
            })
        })?;
        let sums = sums.into_sorted();
        let stacks = self.stacks(&conn, sums.iter().map(|s| s.1))?;
        // A stack gone since the chunks were read was removed by retention with them.
        Ok(sums
            .into_iter()
            .filter_map(|(group, stack, value)| {
                Some(Stacked {
                    labels: groups[group as usize].clone(),
                    stack: stacks.get(&stack)?.clone(),
                    value,
                })
            })
            .collect())
    }
}
