//! What the collector keeps, independent of where: the [`Store`] trait the HTTP and gRPC layers
//! use, implemented by the embedded SQLite store ([`crate::sqlite`]) and the shared ClickHouse
//! one ([`crate::clickhouse`]). Every method may fail with [`StoreError::Unavailable`] when
//! the store is remote: callers answer it with a retryable status, never as "no data".

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// A sample's labels, sorted by name so equal sets compare and serialize equally.
pub use crate::labelset::LabelSet;

/// One frame's name, shared by every stack that holds it: a decoded stack costs a pointer a
/// frame, not a copy of each name.
pub type Frame = Arc<str>;

/// Frame names, root first; one shared allocation per distinct stack.
pub type Stack = Arc<Vec<Frame>>;

/// The label that holds a sample's tenant, set by the collector from the credentials that
/// pushed it (a pushed label of that name, as any starting with `__`, is dropped). The
/// default tenant's samples have none, so data stored before tenants existed is its.
pub const TENANT_LABEL: &str = "__tenant__";

/// Seconds covered by one ingest bucket: the agent's default push interval.
pub const BUCKET_SECONDS: i64 = 10;

/// One stack's value in one batch: the unit of ingest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub labels: Arc<LabelSet>,
    pub stack: Stack,
    /// Index into [`Batch::sample_types`].
    pub sample_type: usize,
    pub value: i64,
}

/// A validated push: everything the store needs, nothing wire-specific.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Batch {
    pub agent_id: String,
    pub sequence: u64,
    /// When the batch's samples were taken, seconds since the Unix epoch.
    pub time_s: i64,
    /// `(name, unit)` pairs, e.g. `("cpu", "nanoseconds")`.
    pub sample_types: Vec<(String, String)>,
    pub rows: Vec<Row>,
    /// Label sets the batch's tenant may keep (its `max_label_sets`): rows of label sets
    /// the store does not hold yet are refused once it holds this many. `None`: no limit.
    pub max_label_sets: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ingested {
    /// The (agent id, sequence) pair had been stored before; nothing was added.
    pub duplicate: bool,
    pub rows: u64,
    /// Rows left out because their label set was new and the tenant holds its
    /// `max_label_sets` already.
    pub rows_refused: u64,
}

/// What a query selects: a time range, a sample type and a predicate on label sets.
pub struct Selection<'a> {
    /// Buckets starting in `[from_s, to_s)` are included.
    pub from_s: i64,
    pub to_s: i64,
    pub sample_type: &'a str,
    pub labels: &'a (dyn Fn(&LabelSet) -> bool + Sync),
}

/// One stack's total under one label set, summed over the selected time range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stacked {
    pub labels: Arc<LabelSet>,
    pub stack: Stack,
    pub value: i64,
}

/// One label set's total over all stacks in one time step: a point of a time series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Point {
    pub labels: Arc<LabelSet>,
    /// Start of the step, a multiple of the step width in seconds since the Unix epoch.
    pub time_s: i64,
    pub value: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("store: cannot create {path}: {source}")]
    Create {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("store: corrupt {0}")]
    Corrupt(String),
    /// The store cannot be reached or is overloaded right now; the same request may succeed
    /// later (agents keep the batch and retry; queries answer 503).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The shared store refused a request.
    #[error("store: {0}")]
    ClickHouse(String),
    #[error("store schema: {0}")]
    Schema(String),
    /// The query ran past its deadline (see [`with_deadline`]) and was stopped.
    #[error("the query ran past its deadline")]
    Timeout,
}

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Unavailable(_) | StoreError::Timeout => true,
            // Another process holds the write lock past the busy timeout.
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            ),
            _ => false,
        }
    }
}

/// The tenant of a label set (internal name: empty for the default tenant).
pub fn tenant_of(labels: &LabelSet) -> &str {
    labels.get(TENANT_LABEL).map_or("", String::as_str)
}

pub trait Store: Send + Sync {
    /// Stores a batch atomically, once: a batch whose (agent id, sequence) was stored before
    /// changes nothing. Rows of new label sets beyond the batch's `max_label_sets` are left
    /// out (and counted in the answer).
    fn ingest(&self, batch: &Batch) -> Result<Ingested, StoreError>;
    /// Stacks with their summed values, one entry per (label set, stack).
    fn select(&self, selection: &Selection<'_>) -> Result<Vec<Stacked>, StoreError>;
    /// [`Store::select`] with each label set cut down to its `keep` labels and the entries of
    /// equal (cut label set, stack) summed; entries that sum to zero are left out. What a
    /// flame graph (which reads only `comm`) or a per-label total needs: over many nodes it
    /// is a few entries per stack where [`Store::select`] has one per label set and stack,
    /// and the stores sum it without building those. Equal to [`merge`] of `select`'s answer.
    fn select_merged(
        &self,
        selection: &Selection<'_>,
        keep: &[&str],
    ) -> Result<Vec<Stacked>, StoreError> {
        Ok(merge(self.select(selection)?, keep))
    }
    /// The selection's values over time, summed over stacks: one [`Point`] per (label set, step)
    /// that holds samples, in any order. A stored bucket counts in the step of width `step_s`
    /// (> 0) that contains the bucket's start, i.e. at `bucket - bucket.rem_euclid(step_s)`.
    /// Buckets are chosen as by [`Store::select`] (bucket start in `[from_s, to_s)`); a step
    /// without samples has no point. Memory: one entry per (matching label set, step).
    fn series(&self, selection: &Selection<'_>, step_s: i64) -> Result<Vec<Point>, StoreError>;
    /// Label names used by samples in the range whose label sets `labels` accepts, sorted.
    fn label_names(
        &self,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError>;
    /// Values of one label in the range among label sets `labels` accepts, sorted.
    fn label_values(
        &self,
        name: &str,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError>;
    /// `(name, unit)` of every sample type stored.
    fn sample_types(&self) -> Result<Vec<(String, String)>, StoreError>;
    /// Bytes the store occupies on disk.
    fn size_bytes(&self) -> Result<u64, StoreError>;
    /// Deletes buckets starting before `before_s`, then the label sets, stacks and frame
    /// names no remaining sample uses; returns the rows removed.
    fn expire(&self, before_s: i64) -> Result<u64, StoreError>;
    /// Merges buckets starting before `before_s` into buckets of `coarse_s` seconds (totals
    /// unchanged, time resolution lost); returns the rows removed.
    fn compact(&self, before_s: i64, coarse_s: i64) -> Result<u64, StoreError>;
}

/// Adds `value` to `sum`, stopping at `i64::MAX` or `i64::MIN` rather than wrapping: a sum of
/// values pushed by a peer must never turn two large ones into a small or negative one.
#[inline]
pub fn add(sum: &mut i64, value: i64) {
    *sum = sum.saturating_add(value);
}

/// The label names of the label sets `labels` accepts, sorted (for [`Store::label_names`]).
pub fn names_of<'a>(
    sets: impl Iterator<Item = &'a LabelSet>,
    labels: &(dyn Fn(&LabelSet) -> bool + Sync),
) -> Vec<String> {
    let names: std::collections::BTreeSet<&String> =
        sets.filter(|s| labels(s)).flat_map(|s| s.keys()).collect();
    names.into_iter().cloned().collect()
}

/// The values of label `name` among the label sets `labels` accepts, sorted (for
/// [`Store::label_values`]).
pub fn values_of<'a>(
    sets: impl Iterator<Item = &'a LabelSet>,
    name: &str,
    labels: &(dyn Fn(&LabelSet) -> bool + Sync),
) -> Vec<String> {
    let values: std::collections::BTreeSet<&String> = sets
        .filter(|s| labels(s))
        .filter_map(|s| s.get(name))
        .collect();
    values.into_iter().cloned().collect()
}

/// `labels` without the labels not named in `keep`.
pub fn project(labels: &LabelSet, keep: &[&str]) -> LabelSet {
    labels
        .iter()
        .filter(|(k, _)| keep.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// `stacks` with label sets cut to `keep` and equal (label set, stack) entries summed, zero
/// sums left out, sorted by label set and stack: the meaning of [`Store::select_merged`].
pub fn merge(stacks: Vec<Stacked>, keep: &[&str]) -> Vec<Stacked> {
    let mut sums: BTreeMap<(LabelSet, Stack), i64> = BTreeMap::new();
    for s in stacks {
        add(
            sums.entry((project(&s.labels, keep), s.stack)).or_default(),
            s.value,
        );
    }
    let mut out: Vec<Stacked> = Vec::with_capacity(sums.len());
    for ((labels, stack), value) in sums {
        if value == 0 {
            continue;
        }
        // One shared label set per group, as the stores hand out.
        let labels = match out.last() {
            Some(prev) if *prev.labels == labels => prev.labels.clone(),
            _ => Arc::new(labels),
        };
        out.push(Stacked {
            labels,
            stack,
            value,
        });
    }
    out
}

pub use crate::idmap::content_hash;

thread_local! {
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Runs `f` with a deadline the stores check while it queries (SQLite between steps of its
/// virtual machine, ClickHouse as the query's execution time): past it they stop with
/// [`StoreError::Timeout`].
pub fn with_deadline<T>(deadline: Instant, f: impl FnOnce() -> T) -> T {
    let before = DEADLINE.replace(Some(deadline));
    let out = f();
    DEADLINE.set(before);
    out
}

/// The deadline of the query running on this thread, if any.
pub fn deadline() -> Option<Instant> {
    DEADLINE.get()
}

/// `Err(Timeout)` once the deadline has passed.
pub fn check_deadline() -> Result<(), StoreError> {
    match deadline() {
        Some(d) if Instant::now() >= d => Err(StoreError::Timeout),
        _ => Ok(()),
    }
}
