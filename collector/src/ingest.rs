//! Turns pushed bytes into a [`Batch`], checking every index and limit on the way: whatever
//! arrives, the answer is a batch or an error that names what was wrong, never a panic, and
//! nothing is allocated for a list before its count is checked against its limit. What one
//! push may decode into is bounded too: a stack deeper than the limit keeps its leaf-most
//! frames under a `[truncated]` root, and the new names, stacks and label sets of one push
//! may take at most `max_expansion` bytes per byte pushed.

use std::sync::Arc;

use pyrometer_proto::{FrameKind, naming};

use crate::frames;
use crate::idmap::{ById, IdMap};
pub use crate::limits::{LimitError, Limits};
use crate::store::{Batch, Frame, LabelSet, Row, Stack, TENANT_LABEL};
use crate::wire::{self, Counts, LabelView, ProfileView, PushView};

/// How far ahead of the collector's clock a batch may be stamped.
pub const MAX_AHEAD_S: i64 = 600;

/// The root frame of a stack cut at `max_stack_depth`.
pub const TRUNCATED: &str = "[truncated]";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IngestError {
    #[error("not a PushRequest: {0}")]
    Decode(String),
    #[error("invalid batch: {0}")]
    Invalid(String),
    #[error("refused: {0}")]
    Limit(#[from] LimitError),
    #[error("refused: {0}")]
    Time(String),
}

impl IngestError {
    /// Why, as `/metrics` counts refusals: the limit's key, `time_window` or `invalid`.
    pub fn reason(&self) -> &'static str {
        match self {
            IngestError::Decode(_) | IngestError::Invalid(_) => "invalid",
            IngestError::Limit(e) => e.key,
            IngestError::Time(_) => "time_window",
        }
    }
}

fn invalid(what: impl Into<String>) -> IngestError {
    IngestError::Invalid(what.into())
}

/// What decoding needs beside the bytes: the pushing tenant's limits, its name (empty for the
/// default tenant) and the accepted time window.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub limits: &'a Limits,
    pub tenant: &'a str,
    pub now_s: i64,
    /// Batches stamped before `now_s - retention_s` would be expired at once: refused.
    pub retention_s: i64,
}

impl<'a> Context<'a> {
    /// The default tenant at `now_s` with a week of retention.
    pub fn new(limits: &'a Limits, now_s: i64) -> Self {
        Self {
            limits,
            tenant: "",
            now_s,
            retention_s: 7 * 86_400,
        }
    }

    /// The id a batch's (agent, sequence) is deduplicated under: tenants cannot collide.
    fn agent_key(&self, agent_id: &str) -> String {
        if self.tenant.is_empty() {
            agent_id.to_string()
        } else {
            // Agent ids hold no control characters (checked), so this cannot be forged.
            format!("{}\u{1f}{agent_id}", self.tenant)
        }
    }

    fn check_time(&self, time_s: i64) -> Result<(), IngestError> {
        let (oldest, newest) = (
            self.now_s.saturating_sub(self.retention_s),
            self.now_s.saturating_add(MAX_AHEAD_S),
        );
        if time_s < oldest || time_s > newest {
            return Err(IngestError::Time(format!(
                "the batch is stamped {time_s} (Unix seconds), outside the accepted window \
                 [{oldest}, {newest}] (the retention back, {MAX_AHEAD_S} s ahead): check the \
                 sending node's clock"
            )));
        }
        Ok(())
    }
}

/// Checks the counted lists of a push against the limits, before any is allocated.
fn check_counts(c: &Counts, l: &Limits) -> Result<(), LimitError> {
    Limits::check("max_samples", "samples", c.samples, l.max_samples)?;
    Limits::check(
        "max_sample_types",
        "sample types",
        c.sample_types,
        l.max_sample_types,
    )?;
    Limits::check("max_locations", "locations", c.locations, l.max_locations)?;
    Limits::check("max_mappings", "mappings", c.mappings, l.max_mappings)?;
    Limits::check("max_functions", "functions", c.functions, l.max_functions)?;
    Limits::check("max_strings", "strings", c.strings, l.max_strings)?;
    // Every value belongs to a sample with one value per type.
    let values = c.samples.saturating_mul(c.sample_types.max(1));
    Limits::check("max_samples", "sample values", c.values, values)?;
    let labels = c.samples.saturating_mul(l.max_labels_per_sample);
    Limits::check("max_labels_per_sample", "labels", c.labels, labels)?;
    Ok(())
}

/// Refuses a push larger than the tenant's `max_push_bytes`.
pub fn check_size(bytes: &[u8], limits: &Limits) -> Result<(), IngestError> {
    Ok(Limits::check(
        "max_push_bytes",
        "bytes pushed",
        bytes.len(),
        limits.max_push_bytes,
    )?)
}

/// Decodes a pushed `PushRequest` (borrowing its strings, see [`crate::wire`]) into a batch.
pub fn decode(bytes: &[u8], ctx: &Context<'_>) -> Result<Batch, IngestError> {
    check_size(bytes, ctx.limits)?;
    let counts = wire::count(bytes).map_err(|e| IngestError::Decode(e.to_string()))?;
    check_counts(&counts, ctx.limits)?;
    let req =
        wire::decode_counted(bytes, &counts).map_err(|e| IngestError::Decode(e.to_string()))?;
    let profile = req.profile.as_ref().ok_or_else(|| invalid("no profile"))?;
    let mut budget = Budget::new(ctx.limits, bytes.len());
    let frames = Frames::new(profile, ctx.limits, &mut budget)?;
    from_view(&req, &frames, ctx, &mut budget)
}

/// Memory a push may still decode into (see [`Limits::max_expansion`]).
pub struct Budget {
    left: usize,
    limit: usize,
}

impl Budget {
    pub fn new(limits: &Limits, bytes: usize) -> Self {
        let limit = limits.max_expansion.saturating_mul(bytes.max(1024));
        Self { left: limit, limit }
    }

    fn take(&mut self, cost: usize) -> bool {
        match self.left.checked_sub(cost) {
            Some(left) => {
                self.left = left;
                true
            }
            None => false,
        }
    }

    fn exceeded(&self, cost: usize) -> IngestError {
        IngestError::Limit(LimitError {
            key: "max_expansion",
            what: "bytes of new names, stacks and label sets",
            value: (self.limit - self.left).saturating_add(cost) as u64,
            limit: self.limit as u64,
        })
    }

    fn charge(&mut self, cost: usize) -> Result<(), IngestError> {
        if self.take(cost) {
            Ok(())
        } else {
            Err(self.exceeded(cost))
        }
    }
}

/// The string at index `i`, checked against the table.
fn string<'p>(profile: &ProfileView<'p>, i: i64) -> Result<&'p str, IngestError> {
    usize::try_from(i)
        .ok()
        .and_then(|i| profile.string_table.get(i))
        .copied()
        .ok_or_else(|| invalid(format!("string index {i} out of range")))
}

/// A batch of the samples of `req`, whose locations `frames` names.
pub fn from_view(
    req: &PushView<'_>,
    frames: &Frames,
    ctx: &Context<'_>,
    budget: &mut Budget,
) -> Result<Batch, IngestError> {
    let printable = |s: &str| !s.is_empty() && s.len() <= 256 && !s.chars().any(char::is_control);
    if !printable(req.agent_id) {
        return Err(invalid("agent_id must be 1 to 256 bytes of printable text"));
    }
    if !printable(req.node) {
        return Err(invalid("node must be 1 to 256 bytes of printable text"));
    }
    let profile = req.profile.as_ref().ok_or_else(|| invalid("no profile"))?;
    let s = |i: i64| string(profile, i);
    let sample_types = profile
        .sample_type
        .iter()
        .map(|&(ty, unit)| Ok((s(ty)?.to_string(), s(unit)?.to_string())))
        .collect::<Result<Vec<_>, IngestError>>()?;
    if sample_types.is_empty() {
        return Err(invalid("no sample types"));
    }
    let time_s = if profile.time_nanos > 0 {
        profile.time_nanos / 1_000_000_000
    } else {
        ctx.now_s
    };
    ctx.check_time(time_s)?;
    let labels = Labels {
        profile,
        node: req.node,
        tenant: ctx.tenant,
        limits: ctx.limits,
    };
    let mut label_cache: IdMap<&[LabelView], Arc<LabelSet>> = IdMap::default();
    let mut stack_cache: IdMap<&[u64], Stack> = IdMap::default();
    let mut names: Vec<&Frame> = Vec::new();
    let rows = profile.values.iter().filter(|&&v| v != 0).count();
    budget.charge(rows.saturating_mul(std::mem::size_of::<Row>()))?;
    let mut rows = Vec::with_capacity(rows);
    for sample in &profile.sample {
        let values = profile.values(sample);
        let location_ids = profile.location_ids(sample);
        let sample_labels = profile.labels(sample);
        if values.len() != sample_types.len() {
            return Err(invalid(format!(
                "a sample has {} values for {} sample types",
                values.len(),
                sample_types.len()
            )));
        }
        Limits::check(
            "max_labels_per_sample",
            "labels of a sample",
            sample_labels.len(),
            ctx.limits.max_labels_per_sample,
        )?;
        let labels = match label_cache.get(sample_labels) {
            Some(set) => set.clone(),
            None => {
                let set = labels.set(sample_labels, budget)?;
                label_cache.insert(sample_labels, set.clone());
                set
            }
        };
        let stack = match stack_cache.get(location_ids) {
            Some(st) => st.clone(),
            None => {
                let st =
                    frames.stack(location_ids, ctx.limits.max_stack_depth, &mut names, budget)?;
                stack_cache.insert(location_ids, st.clone());
                st
            }
        };
        for (i, &value) in values.iter().enumerate() {
            if value != 0 {
                rows.push(Row {
                    labels: labels.clone(),
                    stack: stack.clone(),
                    sample_type: i,
                    value,
                });
            }
        }
    }
    Ok(Batch {
        agent_id: ctx.agent_key(req.agent_id),
        sequence: req.sequence,
        time_s,
        sample_types,
        rows,
        max_label_sets: Some(ctx.limits.max_label_sets),
    })
}

/// Frame names of every location: one list for all, so a push's hundreds of locations do
/// not each allocate their own, and each name one shared allocation (see [`frames`]).
pub struct Frames {
    /// Location id to its `[start, end)` in `names`.
    by_id: ById<(u32, u32)>,
    /// Innermost inlined function first within a location.
    names: Vec<Frame>,
    /// The root of a truncated stack.
    truncated: Frame,
}

impl Frames {
    /// Names the locations of `profile`, checking every string and index they use.
    pub fn new(
        profile: &ProfileView<'_>,
        limits: &Limits,
        budget: &mut Budget,
    ) -> Result<Self, IngestError> {
        if profile.string_table.first().is_some_and(|s| !s.is_empty()) {
            return Err(invalid("string_table[0] must be empty"));
        }
        if let Some(long) = profile
            .string_table
            .iter()
            .find(|s| s.len() > limits.max_string_bytes)
        {
            Limits::check(
                "max_string_bytes",
                "bytes of a string",
                long.len(),
                limits.max_string_bytes,
            )?;
        }
        let s = |i: i64| string(profile, i);
        let max_function = profile.function.iter().map(|f| f.id).max().unwrap_or(0);
        let mut functions = ById::for_ids(max_function, profile.function.len());
        for f in &profile.function {
            functions.insert(f.id, (s(f.name)?, s(f.filename)?));
        }
        // A line says what it is; one that does not (an older agent's, another tool's) is
        // told by its mapping's name.
        let mut kinds: IdMap<u64, FrameKind> = IdMap::default();
        kinds.reserve(profile.mapping.len());
        for &(id, filename) in &profile.mapping {
            if id == 0 {
                continue;
            }
            kinds.insert(
                id,
                s(filename).map_or(FrameKind::Native, naming::mapping_kind),
            );
        }
        let max_location = profile.location.iter().map(|l| l.id).max().unwrap_or(0);
        let mut out = Frames {
            by_id: ById::for_ids(max_location, profile.location.len()),
            names: Vec::with_capacity(profile.lines.len().max(profile.location.len())),
            truncated: frames::name(TRUNCATED).0,
        };
        let mut intern = |name: &str| -> Result<Frame, IngestError> {
            let (frame, new) = frames::name(name);
            if new {
                budget.charge(frames::name_cost(name))?;
            }
            Ok(frame)
        };
        for loc in &profile.location {
            let by_mapping = kinds
                .get(&loc.mapping_id)
                .copied()
                .unwrap_or(FrameKind::Native);
            let start = out.names.len();
            for &(function_id, line, kind) in profile.lines(loc) {
                let (name, file) = functions.get(function_id).ok_or_else(|| {
                    invalid(format!("function id {function_id} not in the profile"))
                })?;
                let kind = match FrameKind::try_from(kind) {
                    Ok(FrameKind::Unspecified) | Err(_) => by_mapping,
                    Ok(k) => k,
                };
                let line = u32::try_from(line).ok().filter(|&l| l > 0);
                // As the node's own outputs name them (`function (file:line)` for Python).
                out.names
                    .push(intern(&naming::frame_name(kind, name, Some(file), line))?);
            }
            if out.names.len() == start {
                out.names.push(intern(&format!("0x{:x}", loc.address))?);
            }
            let range = u32::try_from(start)
                .ok()
                .zip(u32::try_from(out.names.len()).ok())
                .ok_or_else(|| invalid("too many frames"))?;
            out.by_id.insert(loc.id, range);
        }
        Ok(out)
    }

    /// The location's frame names, innermost inlined function first.
    fn get(&self, id: u64) -> Result<&[Frame], IngestError> {
        self.by_id
            .get(id)
            .and_then(|(start, end)| self.names.get(start as usize..end as usize))
            .ok_or_else(|| invalid(format!("location id {id} not in the profile")))
    }

    /// The stack of `location_ids` (leaf first), root first, its inlined frames expanded;
    /// deeper than `max_depth` frames it keeps the leaf-most ones under a [`TRUNCATED`] root.
    /// `names` is scratch space.
    fn stack<'f>(
        &'f self,
        location_ids: &[u64],
        max_depth: usize,
        names: &mut Vec<&'f Frame>,
        budget: &mut Budget,
    ) -> Result<Stack, IngestError> {
        let mut depth = 0usize;
        for &id in location_ids {
            depth = depth.saturating_add(self.get(id)?.len());
        }
        // Frames (root first) to leave out, to keep `max_depth - 1` under the marker.
        let mut skip = if depth > max_depth {
            depth - max_depth.saturating_sub(1)
        } else {
            0
        };
        names.clear();
        if skip > 0 {
            names.push(&self.truncated);
        }
        for &id in location_ids.iter().rev() {
            let lines = self.get(id)?;
            if skip >= lines.len() {
                skip -= lines.len();
                continue;
            }
            names.extend(lines.iter().rev().skip(skip));
            skip = 0;
        }
        let mut needed = 0;
        let found = frames::stack(names, |cost| {
            needed = cost;
            budget.take(cost)
        });
        let stack = found
            .map(|(stack, _)| stack)
            .ok_or_else(|| budget.exceeded(needed));
        names.clear();
        stack
    }
}

/// Builds the label set of a sample: every label checked against the limits, reserved names
/// (`__` first) left out, the pushing node's name and the tenant set by the collector.
struct Labels<'p, 'v> {
    profile: &'v ProfileView<'p>,
    node: &'v str,
    tenant: &'v str,
    limits: &'v Limits,
}

impl Labels<'_, '_> {
    fn set(&self, labels: &[LabelView], budget: &mut Budget) -> Result<Arc<LabelSet>, IngestError> {
        let mut set = LabelSet::new();
        for &(key, str, num) in labels {
            let name = string(self.profile, key)?;
            if name.is_empty() || name == "node" || name.starts_with("__") {
                continue;
            }
            Limits::check(
                "max_label_name_bytes",
                "bytes of a label name",
                name.len(),
                self.limits.max_label_name_bytes,
            )?;
            let value = if str != 0 {
                string(self.profile, str)?.to_string()
            } else {
                num.to_string()
            };
            Limits::check(
                "max_label_value_bytes",
                "bytes of a label value",
                value.len(),
                self.limits.max_label_value_bytes,
            )?;
            set.insert(name.to_string(), value);
        }
        // The pushing agent's node wins over any sample label of that name.
        set.insert("node".into(), self.node.to_string());
        if !self.tenant.is_empty() {
            set.insert(TENANT_LABEL.into(), self.tenant.to_string());
        }
        set.shrink();
        budget.charge(LABEL_SET_COST + set.heap_bytes())?;
        Ok(Arc::new(set))
    }
}

/// Bytes a label set costs beyond its heap: the `Arc` and the set itself.
const LABEL_SET_COST: usize = 16 + std::mem::size_of::<LabelSet>();

#[cfg(test)]
mod tests;
