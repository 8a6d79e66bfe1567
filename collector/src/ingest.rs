//! Turns pushed bytes into a [`Batch`], checking every index and limit on the way: whatever
//! arrives, the answer is a batch or an error, never a panic.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use prost::Message;
use pyrometer_proto::ingest::PushRequest;
use pyrometer_proto::{FrameKind, naming};

use crate::idmap::IdMap;
use crate::store::{Batch, LabelSet, Row};
use crate::wire::{self, LabelView, ProfileView, PushView};

/// Limits on one batch; beyond them it is refused as a whole.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_samples: usize,
    pub max_depth: usize,
    pub max_labels: usize,
    pub max_string: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_samples: 1_000_000,
            max_depth: 4096,
            max_labels: 64,
            max_string: 4096,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IngestError {
    #[error("not a PushRequest: {0}")]
    Decode(String),
    #[error("invalid batch: {0}")]
    Invalid(String),
}

fn invalid(what: impl Into<String>) -> IngestError {
    IngestError::Invalid(what.into())
}

/// Decodes a pushed `PushRequest` (borrowing its strings, see [`crate::wire`]) into a batch.
pub fn decode(bytes: &[u8], limits: &Limits, now_s: i64) -> Result<Batch, IngestError> {
    let req = wire::decode(bytes).map_err(|e| IngestError::Decode(e.to_string()))?;
    from_view(&req, limits, now_s)
}

/// A push made from another format (e.g. OTLP) as a batch, every index and limit checked.
/// Encoded and decoded again so there is one path from a push to a batch; these pushes are
/// rare next to the agents'.
pub fn from_request(req: PushRequest, limits: &Limits, now_s: i64) -> Result<Batch, IngestError> {
    decode(&req.encode_to_vec(), limits, now_s)
}

fn from_view(req: &PushView<'_>, limits: &Limits, now_s: i64) -> Result<Batch, IngestError> {
    if req.agent_id.is_empty() || req.agent_id.len() > 256 {
        return Err(invalid("agent_id must have 1 to 256 bytes"));
    }
    if req.node.is_empty() || req.node.len() > 256 {
        return Err(invalid("node must have 1 to 256 bytes"));
    }
    let profile = req.profile.as_ref().ok_or_else(|| invalid("no profile"))?;
    if profile.sample.len() > limits.max_samples {
        return Err(invalid(format!(
            "{} samples, more than the limit of {}",
            profile.sample.len(),
            limits.max_samples
        )));
    }
    let s = |i: i64| -> Result<&str, IngestError> {
        let s = usize::try_from(i)
            .ok()
            .and_then(|i| profile.string_table.get(i))
            .copied()
            .ok_or_else(|| invalid(format!("string index {i} out of range")))?;
        if s.len() > limits.max_string {
            return Err(invalid("string longer than the limit"));
        }
        Ok(s)
    };
    if profile.string_table.first().is_some_and(|s| !s.is_empty()) {
        return Err(invalid("string_table[0] must be empty"));
    }
    let sample_types = profile
        .sample_type
        .iter()
        .map(|&(ty, unit)| Ok((s(ty)?.to_string(), s(unit)?.to_string())))
        .collect::<Result<Vec<_>, IngestError>>()?;
    if sample_types.is_empty() {
        return Err(invalid("no sample types"));
    }
    let frames = location_names(profile, &s)?;
    let time_s = if profile.time_nanos > 0 {
        profile.time_nanos / 1_000_000_000
    } else {
        now_s
    };

    let mut label_cache: IdMap<&[LabelView], Arc<LabelSet>> = IdMap::default();
    let mut stack_cache: IdMap<&[u64], Arc<Vec<String>>> = IdMap::default();
    let mut names: Vec<&str> = Vec::new();
    let mut rows = Vec::with_capacity(profile.sample.len() * sample_types.len());
    for sample in &profile.sample {
        let values = profile.values(sample);
        let location_ids = profile.location_ids(sample);
        let sample_labels = profile.labels(sample);
        if values.len() != sample_types.len() {
            return Err(invalid(
                "a sample's value count differs from the sample types",
            ));
        }
        if location_ids.len() > limits.max_depth {
            return Err(invalid("a stack deeper than the limit"));
        }
        if sample_labels.len() > limits.max_labels {
            return Err(invalid("a sample with more labels than the limit"));
        }
        let labels = match label_cache.get(sample_labels) {
            Some(set) => set.clone(),
            None => {
                let set = labels(sample_labels, req.node, &s)?;
                label_cache.insert(sample_labels, set.clone());
                set
            }
        };
        let stack = match stack_cache.get(location_ids) {
            Some(st) => st.clone(),
            None => {
                names.clear();
                // location_id is leaf first; inlined lines within a location innermost first.
                for id in location_ids.iter().rev() {
                    let lines = frames
                        .get(*id)
                        .ok_or_else(|| invalid(format!("location id {id} not in the profile")))?;
                    names.extend(lines.iter().rev().map(|n| n.as_ref()));
                }
                let st = shared_stack(&names);
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
        agent_id: req.agent_id.to_string(),
        sequence: req.sequence,
        time_s,
        sample_types,
        rows,
    })
}

/// Stacks decoded before, by a hash of their frame names: the same code runs on every node
/// and in every push, so most stacks of a batch were seen before, and sharing them saves
/// building (and the store hashing and dropping) dozens of strings per stack. Process-wide,
/// since every push is decoded alike; bounded by [`SHARED_STACKS`].
static STACKS: OnceLock<Mutex<SharedStacks>> = OnceLock::new();

/// Stacks by content hash; a hash names several only when they collide.
type SharedStacks = HashMap<u64, Vec<Arc<Vec<String>>>>;

/// Stacks [`STACKS`] holds before it starts over.
const SHARED_STACKS: usize = 1 << 16;

/// The shared stack of these frame names (root first), made and remembered if new.
fn shared_stack(names: &[&str]) -> Arc<Vec<String>> {
    let hash = crate::store::content_hash(names.iter().copied());
    let cache = STACKS.get_or_init(Mutex::default);
    // Holds only immutable Arcs, so a poisoned lock is still consistent.
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(found) = cache.get(&hash).and_then(|same| {
        same.iter()
            .find(|s| s.len() == names.len() && s.iter().zip(names).all(|(a, b)| a == b))
    }) {
        return found.clone();
    }
    if cache.len() >= SHARED_STACKS {
        cache.clear();
    }
    let stack = Arc::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>());
    cache.entry(hash).or_default().push(stack.clone());
    stack
}

/// Frame names of every location: one list for all, so a batch's hundreds of locations do
/// not each allocate their own.
struct Locations<'p> {
    /// Location id to its `[start, end)` in `names`.
    by_id: IdMap<u64, (u32, u32)>,
    names: Vec<Cow<'p, str>>,
}

impl<'p> Locations<'p> {
    /// The location's frame names, innermost inlined function first.
    fn get(&self, id: u64) -> Option<&[Cow<'p, str>]> {
        let &(start, end) = self.by_id.get(&id)?;
        self.names.get(start as usize..end as usize)
    }
}

/// Frame names per location id, innermost inlined function first.
fn location_names<'p>(
    profile: &ProfileView<'p>,
    s: &dyn Fn(i64) -> Result<&'p str, IngestError>,
) -> Result<Locations<'p>, IngestError> {
    let functions: IdMap<u64, (&str, &str)> = profile
        .function
        .iter()
        .map(|f| Ok((f.id, (s(f.name)?, s(f.filename)?))))
        .collect::<Result<_, IngestError>>()?;
    // A line says what it is; one that does not (an older agent's, another tool's) is told
    // by its mapping's name.
    let mapping_kinds: Vec<(u64, FrameKind)> = profile
        .mapping
        .iter()
        .filter_map(|&(id, filename)| Some((id, naming::mapping_kind(s(filename).ok()?))))
        .collect();
    let mut out = Locations {
        by_id: IdMap::default(),
        names: Vec::with_capacity(profile.location.len()),
    };
    out.by_id.reserve(profile.location.len());
    for loc in &profile.location {
        let by_mapping = mapping_kinds
            .iter()
            .find(|&&(id, _)| id == loc.mapping_id && id != 0)
            .map_or(FrameKind::Native, |&(_, k)| k);
        let start = out.names.len();
        let names = &mut out.names;
        for &(function_id, line, kind) in profile.lines(loc) {
            let &(name, file) = functions
                .get(&function_id)
                .ok_or_else(|| invalid(format!("function id {function_id} not in the profile")))?;
            let kind = match FrameKind::try_from(kind) {
                Ok(FrameKind::Unspecified) | Err(_) => by_mapping,
                Ok(k) => k,
            };
            let line = u32::try_from(line).ok().filter(|&l| l > 0);
            // As the node's own outputs name them (`function (file:line)` for Python).
            names.push(naming::frame_name(kind, name, Some(file), line));
        }
        if names.len() == start {
            names.push(Cow::Owned(format!("0x{:x}", loc.address)));
        }
        let range = u32::try_from(start)
            .ok()
            .zip(u32::try_from(names.len()).ok())
            .ok_or_else(|| invalid("too many frames"))?;
        out.by_id.insert(loc.id, range);
    }
    Ok(out)
}

fn labels<'p>(
    labels: &[LabelView],
    node: &str,
    s: &dyn Fn(i64) -> Result<&'p str, IngestError>,
) -> Result<Arc<LabelSet>, IngestError> {
    let mut set = LabelSet::new();
    for &(key, str, num) in labels {
        let name = s(key)?;
        if name.is_empty() || name == "node" {
            continue;
        }
        let value = if str != 0 {
            s(str)?.to_string()
        } else {
            num.to_string()
        };
        set.insert(name.to_string(), value);
    }
    // The pushing agent's node wins over any sample label of that name.
    set.insert("node".into(), node.to_string());
    Ok(Arc::new(set))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyrometer_proto::{Function, Line, Location, Mapping, Profile, Sample, ValueType};

    /// A Python frame (under the `[python]` mapping) reads `function (file:line)`, as the
    /// node's own outputs write it; a native one its function name.
    #[test]
    fn python_frames_are_named_with_file_and_line() {
        let stack = |python_mapping: &str, kinds: [FrameKind; 2]| {
            let strings: Vec<String> = [
                "",
                "samples",
                "count",
                python_mapping,
                "grow",
                "/srv/app/lib/python3.11/site-packages/pkg/mod.py",
                "/usr/lib/libc.so.6",
                "malloc",
            ]
            .map(String::from)
            .to_vec();
            let profile = Profile {
                sample_type: vec![ValueType { r#type: 1, unit: 2 }],
                mapping: vec![
                    Mapping {
                        id: 1,
                        filename: 3,
                        ..Default::default()
                    },
                    Mapping {
                        id: 2,
                        filename: 6,
                        ..Default::default()
                    },
                ],
                function: vec![
                    Function {
                        id: 1,
                        name: 4,
                        filename: 5,
                        ..Default::default()
                    },
                    Function {
                        id: 2,
                        name: 7,
                        ..Default::default()
                    },
                ],
                location: vec![
                    Location {
                        id: 1,
                        mapping_id: 1,
                        line: vec![Line {
                            function_id: 1,
                            line: 12,
                            column: 0,
                            kind: kinds[0] as i32,
                        }],
                        ..Default::default()
                    },
                    Location {
                        id: 2,
                        mapping_id: 2,
                        address: 0x1234,
                        line: vec![Line {
                            function_id: 2,
                            line: 0,
                            column: 0,
                            kind: kinds[1] as i32,
                        }],
                        ..Default::default()
                    },
                ],
                sample: vec![Sample {
                    location_id: vec![2, 1],
                    value: vec![3],
                    label: vec![],
                }],
                string_table: strings,
                ..Default::default()
            };
            let bytes = PushRequest {
                agent_id: "a".into(),
                sequence: 1,
                node: "n".into(),
                profile: Some(profile),
            }
            .encode_to_vec();
            let batch = decode(&bytes, &Limits::default(), 100).unwrap();
            batch.rows[0].stack.as_slice().to_vec()
        };
        // Without kinds (an older agent): the `[python]` mapping tells.
        let unsaid = [FrameKind::Unspecified; 2];
        assert_eq!(
            stack("[python]", unsaid),
            ["grow (pkg/mod.py:12)", "malloc"]
        );
        // With them, the mapping's name does not matter.
        assert_eq!(
            stack("/opt/py", [FrameKind::Python, FrameKind::Native]),
            ["grow (pkg/mod.py:12)", "malloc"]
        );
        assert_eq!(
            stack("[python]", [FrameKind::Native, FrameKind::Kernel]),
            ["grow", "malloc_[k]"]
        );
        assert_eq!(stack("/opt/py", unsaid), ["grow", "malloc"]);
    }

    /// The same stack decoded from two pushes is one shared allocation; a different one is not.
    #[test]
    fn stacks_are_shared_across_batches() {
        let a = shared_stack(&["main", "ingest-test-shared", "leaf"]);
        let b = shared_stack(&["main", "ingest-test-shared", "leaf"]);
        let c = shared_stack(&["main", "ingest-test-shared"]);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.as_slice(), ["main", "ingest-test-shared"]);
    }
}
