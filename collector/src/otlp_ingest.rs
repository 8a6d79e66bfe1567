//! OTLP profiles pushes (`ProfilesService/Export`, the `profiles/v1development` data model):
//! each (resource, profile) pair of a request becomes one batch of the store, as if an agent
//! had pushed it. Resource attributes become the `node` (`host.name`), `pid`
//! (`process.pid`), `comm` (`process.executable.name`) and `container` (`container.id`)
//! labels; a sample's attributes become labels (`thread.name` as `thread`), and its span link
//! the `trace_id` and `span_id` labels, so pyrometer's own exports and other profilers' alike
//! answer the same queries. Every table of the request is counted and checked against the
//! limits before it is decoded, every index is checked, the dictionary's locations are named
//! once for all its profiles, and a stack shared by many samples is read once: bad or
//! oversized input is refused with one reason.

use std::collections::HashMap;

use prost::Message;
use pyrometer_proto::FrameKind;
use pyrometer_proto::otlp as pb;

use crate::ingest::{Budget, Context, Frames, IngestError, Limits, from_view};
use crate::store::Batch;
use crate::wire::{self, LocationView, ProfileView, PushView, Reader, SampleView, WireError};

/// The synthetic mappings that mark kernel and Python frames for the ingest's naming.
const KERNEL_MAPPING: u64 = 1;
const PYTHON_MAPPING: u64 = 2;

/// Profiles one request may carry (each is stored as a batch of its own).
pub const MAX_PROFILES: usize = 1024;

fn invalid(what: impl Into<String>) -> IngestError {
    IngestError::Invalid(what.into())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a: a stable sequence number for a profile that brings no id of its own, so a retried
/// export is stored once.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Entries of the lists of a request, read without decoding them.
#[derive(Debug, Default)]
struct Counts {
    profiles: usize,
    samples: usize,
    sample_values: usize,
    mappings: usize,
    locations: usize,
    lines: usize,
    functions: usize,
    links: usize,
    strings: usize,
    attributes: usize,
    stacks: usize,
    stack_locations: usize,
}

/// Counts the entries of the repeated message field `field` of `r`'s message, calling `each`
/// with each entry.
fn each_entry<'a>(
    r: &mut Reader<'a>,
    field: u32,
    mut each: impl FnMut(Reader<'a>) -> Result<(), WireError>,
) -> Result<(), WireError> {
    while !r.done() {
        match r.key()? {
            (f, w) if f == field => each(r.message(w)?)?,
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    Ok(())
}

fn count(bytes: &[u8]) -> Result<Counts, WireError> {
    let mut c = Counts::default();
    let mut r = Reader::new(bytes);
    while !r.done() {
        match r.key()? {
            (1, w) => each_entry(&mut r.message(w)?, 2, |mut scope| {
                each_entry(&mut scope, 2, |mut profile| {
                    c.profiles += 1;
                    each_entry(&mut profile, 2, |mut sample| {
                        c.samples += 1;
                        while !sample.done() {
                            match sample.key()? {
                                (4, w) => c.sample_values += wire::count_repeated(&mut sample, w)?,
                                (f, w) => sample.skip(f, w, 0)?,
                            }
                        }
                        Ok(())
                    })
                })
            })?,
            (2, w) => {
                let mut d = r.message(w)?;
                while !d.done() {
                    match d.key()? {
                        (1, w) => {
                            d.message(w)?;
                            c.mappings += 1;
                        }
                        (2, w) => {
                            c.locations += 1;
                            each_entry(&mut d.message(w)?, 3, |_| {
                                c.lines += 1;
                                Ok(())
                            })?;
                        }
                        (3, w) => {
                            d.message(w)?;
                            c.functions += 1;
                        }
                        (4, w) => {
                            d.message(w)?;
                            c.links += 1;
                        }
                        (5, w) => {
                            d.message(w)?;
                            c.strings += 1;
                        }
                        (6, w) => {
                            d.message(w)?;
                            c.attributes += 1;
                        }
                        (7, w) => {
                            c.stacks += 1;
                            let mut stack = d.message(w)?;
                            while !stack.done() {
                                match stack.key()? {
                                    (1, w) => {
                                        c.stack_locations += wire::count_repeated(&mut stack, w)?
                                    }
                                    (f, w) => stack.skip(f, w, 0)?,
                                }
                            }
                        }
                        (f, w) => d.skip(f, w, 0)?,
                    }
                }
            }
            (f, w) => r.skip(f, w, 0)?,
        }
    }
    Ok(c)
}

fn check_counts(c: &Counts, l: &Limits) -> Result<(), IngestError> {
    let dict = l.max_dictionary_entries;
    Limits::check("max_samples", "samples", c.samples, l.max_samples)?;
    Limits::check(
        "max_samples",
        "sample values",
        c.sample_values,
        l.max_samples,
    )?;
    Limits::check("max_mappings", "mappings", c.mappings, l.max_mappings)?;
    Limits::check("max_locations", "locations", c.locations, l.max_locations)?;
    Limits::check("max_functions", "functions", c.functions, l.max_functions)?;
    Limits::check("max_strings", "strings", c.strings, l.max_strings)?;
    Limits::check(
        "max_dictionary_entries",
        "lines of locations",
        c.lines,
        dict,
    )?;
    Limits::check("max_dictionary_entries", "links", c.links, dict)?;
    Limits::check("max_dictionary_entries", "attributes", c.attributes, dict)?;
    Limits::check("max_dictionary_entries", "stacks", c.stacks, dict)?;
    Limits::check(
        "max_dictionary_entries",
        "locations of stacks",
        c.stack_locations,
        dict,
    )?;
    if c.profiles > MAX_PROFILES {
        return Err(invalid(format!(
            "{} profiles in one request, more than {MAX_PROFILES}",
            c.profiles
        )));
    }
    Ok(())
}

/// The batches of one encoded `ExportProfilesServiceRequest`.
pub fn decode(bytes: &[u8], ctx: &Context<'_>) -> Result<Vec<Batch>, IngestError> {
    crate::ingest::check_size(bytes, ctx.limits)?;
    let bad = |e: String| IngestError::Decode(format!("not an ExportProfilesServiceRequest: {e}"));
    check_counts(&count(bytes).map_err(|e| bad(e.to_string()))?, ctx.limits)?;
    let req = pb::ExportProfilesServiceRequest::decode(bytes).map_err(|e| bad(e.to_string()))?;
    let dict = req.dictionary.unwrap_or_default();
    let mut budget = Budget::new(ctx.limits, bytes.len());
    let frames = {
        let mut view = tables(&dict)?;
        view.string_table = strings(&dict, &[]);
        Frames::new(&view, ctx.limits, &mut budget)?
    };
    // Every profile's samples first, their label strings interned into one list, so the
    // string table is built once for all.
    let mut extras = Extras::default();
    let (mut pushers, mut profiles) = (Vec::new(), Vec::new());
    for rp in &req.resource_profiles {
        let resource: Vec<(String, String)> = rp
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .filter_map(|kv| Some((kv.key.clone(), kv.value.as_ref()?.text()?)))
            .collect();
        let get = |k: &str| resource.iter().find(|(key, _)| key == k).map(|(_, v)| v);
        let node = get("host.name")
            .map_or("unknown", |n| n.as_str())
            .to_string();
        let pid = get("process.pid").map_or("", |p| p.as_str());
        let agent_id = format!("otlp/{node}/{pid}");
        for sp in &rp.scope_profiles {
            for profile in &sp.profiles {
                let id = &profile.profile_id;
                let sequence = if id.len() >= 8 && id.iter().any(|&b| b != 0) {
                    u64::from_be_bytes(id[..8].try_into().expect("8 bytes")) ^ fnv(id)
                } else {
                    fnv(&profile.encode_to_vec())
                };
                let samples = samples(&dict, profile, &resource, ctx.limits, &mut extras)?;
                pushers.push((agent_id.clone(), node.clone(), sequence));
                profiles.push(samples);
            }
        }
    }
    let mut view = Some(ProfileView {
        string_table: strings(&dict, &extras.strings),
        ..Default::default()
    });
    let mut batches = Vec::with_capacity(profiles.len());
    for ((agent_id, node, sequence), samples) in pushers.iter().zip(profiles) {
        let mut profile = view.take().expect("put back below");
        samples.fill(&mut profile);
        let push = PushView {
            agent_id,
            sequence: *sequence,
            node,
            profile: Some(profile),
        };
        let batch = from_view(&push, &frames, ctx, &mut budget);
        view = push.profile;
        batches.push(batch?);
    }
    Ok(batches)
}

/// The string table of the request's profiles: the dictionary's strings, the mapping names
/// and the strings labels add.
fn strings<'a>(dict: &'a pb::ProfilesDictionary, extras: &'a [String]) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::with_capacity(dict.string_table.len() + 3 + extras.len());
    out.extend(dict.string_table.iter().map(String::as_str));
    if out.is_empty() {
        // An empty dictionary still has the empty string at index 0.
        out.push("");
    }
    out.extend(MAPPING_NAMES);
    out.extend(extras.iter().map(String::as_str));
    out
}

/// Strings labels add, after the dictionary's and the mapping names, each once.
#[derive(Default)]
struct Extras {
    strings: Vec<String>,
    index: HashMap<String, i64>,
}

impl Extras {
    fn intern(&mut self, base: i64, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = base + self.strings.len() as i64;
        self.strings.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }
}

fn check(what: &str, i: i32, len: usize) -> Result<usize, IngestError> {
    usize::try_from(i)
        .ok()
        .filter(|&i| i < len)
        .ok_or_else(|| invalid(format!("{what} index {i} out of range")))
}

/// The mapping names, as extra strings after the dictionary's.
const MAPPING_NAMES: [&str; 2] = [
    pyrometer_proto::naming::KERNEL_MAPPING,
    pyrometer_proto::naming::PYTHON_MAPPING,
];

/// The dictionary's functions and locations as a pprof profile's: function and location
/// ids are table indices (0, the empty entry, is left out), string indices are the same,
/// and each line carries the kind its location's `profile.frame.type` says, under the pseudo
/// mappings pyrometer's own pushes give kernel and Python frames.
fn tables<'a>(dict: &pb::ProfilesDictionary) -> Result<ProfileView<'a>, IngestError> {
    let strings = dict.string_table.len().max(1);
    let string =
        |i: i32| -> Result<i64, IngestError> { check("string", i, strings).map(|i| i as i64) };
    let mut out = ProfileView {
        mapping: vec![
            (KERNEL_MAPPING, strings as i64),
            (PYTHON_MAPPING, strings as i64 + 1),
        ],
        location: Vec::with_capacity(dict.location_table.len()),
        function: Vec::with_capacity(dict.function_table.len()),
        ..Default::default()
    };
    for (i, f) in dict.function_table.iter().enumerate().skip(1) {
        out.function.push(wire::FunctionView {
            id: i as u64,
            name: string(f.name_strindex)?,
            filename: string(f.filename_strindex)?,
        });
    }
    for (i, l) in dict.location_table.iter().enumerate().skip(1) {
        let (mut mapping_id, mut kind) = (0, FrameKind::Unspecified);
        for &a in &l.attribute_indices {
            let kv = &dict.attribute_table[check("attribute", a, dict.attribute_table.len())?];
            let key = check("string", kv.key_strindex, dict.string_table.len())?;
            if dict.string_table[key] != "profile.frame.type" {
                continue;
            }
            (mapping_id, kind) = match kv.value.as_ref().and_then(resolve_value(dict)).as_deref() {
                Some("kernel") => (KERNEL_MAPPING, FrameKind::Kernel),
                Some("cpython") => (PYTHON_MAPPING, FrameKind::Python),
                Some("jit") => (0, FrameKind::Jit),
                _ => (0, FrameKind::Native),
            };
        }
        let start = out.lines.len();
        for line in &l.lines {
            let f = check("function", line.function_index, dict.function_table.len())?;
            out.lines.push((f as u64, line.line, kind as i32));
        }
        out.location.push(LocationView {
            id: i as u64,
            mapping_id,
            address: l.address,
            lines: (start as u32, out.lines.len() as u32),
        });
    }
    Ok(out)
}

/// One profile's samples as a pprof profile's.
struct Samples {
    sample_type: (i64, i64),
    time_nanos: i64,
    sample: Vec<SampleView>,
    location_ids: Vec<u64>,
    values: Vec<i64>,
    labels: Vec<wire::LabelView>,
}

impl Samples {
    /// Moves the samples into `view`.
    fn fill(self, view: &mut ProfileView<'_>) {
        view.sample_type = vec![self.sample_type];
        view.time_nanos = self.time_nanos;
        view.sample = self.sample;
        view.location_ids = self.location_ids;
        view.values = self.values;
        view.labels = self.labels;
    }
}

/// The samples of `profile`, their label strings added to `extras`.
fn samples(
    dict: &pb::ProfilesDictionary,
    profile: &pb::Profile,
    resource: &[(String, String)],
    limits: &Limits,
    extras: &mut Extras,
) -> Result<Samples, IngestError> {
    let strings = dict.string_table.len().max(1);
    let base = (strings + MAPPING_NAMES.len()) as i64;
    let mut intern = |s: &str| extras.intern(base, s);
    let st = profile
        .sample_type
        .as_ref()
        .ok_or_else(|| invalid("a profile without a sample type"))?;
    let sample_type = (
        check("string", st.type_strindex, strings)? as i64,
        check("string", st.unit_strindex, strings)? as i64,
    );
    let mut resource_labels = Vec::new();
    for (key, label) in [
        ("process.pid", "pid"),
        ("process.executable.name", "comm"),
        ("container.id", "container"),
    ] {
        if let Some((_, v)) = resource.iter().find(|(k, _)| k == key) {
            resource_labels.push((intern(label), intern(v), 0));
        }
    }
    let mut out = Samples {
        sample_type,
        time_nanos: i64::try_from(profile.time_unix_nano).unwrap_or(0),
        sample: Vec::with_capacity(profile.samples.len()),
        location_ids: Vec::new(),
        values: Vec::with_capacity(profile.samples.len()),
        labels: Vec::new(),
    };
    // Each stack's locations are listed once; its samples share the span.
    let mut stacks: HashMap<usize, (u32, u32)> = HashMap::new();
    for s in &profile.samples {
        let stack = check("stack", s.stack_index, dict.stack_table.len())?;
        let location_ids = match stacks.get(&stack) {
            Some(&span) => span,
            None => {
                let start = out.location_ids.len();
                for &l in &dict.stack_table[stack].location_indices {
                    let l = check("location", l, dict.location_table.len())?;
                    if l == 0 {
                        return Err(invalid("a stack holds location 0"));
                    }
                    out.location_ids.push(l as u64);
                }
                let span = (start as u32, out.location_ids.len() as u32);
                stacks.insert(stack, span);
                span
            }
        };
        Limits::check(
            "max_labels_per_sample",
            "labels of a sample",
            s.attribute_indices.len() + resource_labels.len() + 2,
            limits.max_labels_per_sample,
        )?;
        let label_start = out.labels.len();
        out.labels.extend(&resource_labels);
        for &a in &s.attribute_indices {
            let kv = &dict.attribute_table[check("attribute", a, dict.attribute_table.len())?];
            let key =
                &dict.string_table[check("string", kv.key_strindex, dict.string_table.len())?];
            let Some(value) = kv.value.as_ref().and_then(resolve_value(dict)) else {
                continue;
            };
            let key = if key == "thread.name" { "thread" } else { key };
            out.labels.push((intern(key), intern(&value), 0));
        }
        if s.link_index != 0 {
            let link = &dict.link_table[check("link", s.link_index, dict.link_table.len())?];
            if link.trace_id.len() == 16 && link.span_id.len() == 8 {
                for (key, v) in [("trace_id", &link.trace_id), ("span_id", &link.span_id)] {
                    out.labels.push((intern(key), intern(&hex(v)), 0));
                }
            }
        }
        out.values
            .push(s.values.iter().fold(0i64, |sum, &v| sum.saturating_add(v)));
        let value = out.values.len() as u32;
        out.sample.push(SampleView {
            location_ids,
            values: (value - 1, value),
            labels: (label_start as u32, out.labels.len() as u32),
        });
    }
    Ok(out)
}

/// An attribute's value as text: inline, or through the string table.
fn resolve_value(dict: &pb::ProfilesDictionary) -> impl Fn(&pb::AnyValue) -> Option<String> + '_ {
    move |v| match &v.value {
        Some(pb::any_value::Value::StringValueStrindex(i)) => {
            dict.string_table.get(usize::try_from(*i).ok()?).cloned()
        }
        _ => v.text(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The collector's clock in these tests: the profiles' time.
    const NOW: i64 = 1_700_000_000;

    /// A request of one process (host n1, pid 7) with one sample of `stack` (location
    /// indices, leaf first) over a table of two functions, linked to a span.
    fn request(stack: Vec<i32>) -> Vec<u8> {
        let strings = ["", "main", "work", "samples", "count", "thread.name", "t1"];
        let function = |name| pb::Function {
            name_strindex: name,
            ..Default::default()
        };
        let location = |f| pb::Location {
            lines: vec![pb::Line {
                function_index: f,
                ..Default::default()
            }],
            ..Default::default()
        };
        let dict = pb::ProfilesDictionary {
            string_table: strings.iter().map(|s| s.to_string()).collect(),
            function_table: vec![pb::Function::default(), function(1), function(2)],
            location_table: vec![pb::Location::default(), location(1), location(2)],
            stack_table: vec![
                pb::Stack::default(),
                pb::Stack {
                    location_indices: stack,
                },
            ],
            link_table: vec![
                pb::Link::default(),
                pb::Link {
                    trace_id: vec![0xab; 16],
                    span_id: vec![0x01; 8],
                },
            ],
            attribute_table: vec![
                pb::KeyValueAndUnit::default(),
                pb::KeyValueAndUnit {
                    key_strindex: 5,
                    value: Some(pb::AnyValue::string("t1")),
                    unit_strindex: 0,
                },
            ],
            ..Default::default()
        };
        let profile = pb::Profile {
            sample_type: Some(pb::ValueType {
                type_strindex: 3,
                unit_strindex: 4,
            }),
            samples: vec![pb::Sample {
                stack_index: 1,
                attribute_indices: vec![1],
                link_index: 1,
                values: vec![5],
                ..Default::default()
            }],
            time_unix_nano: 1_700_000_000_000_000_000,
            ..Default::default()
        };
        pb::ExportProfilesServiceRequest {
            resource_profiles: vec![pb::ResourceProfiles {
                resource: Some(pb::Resource {
                    attributes: vec![
                        pb::KeyValue::new("host.name", pb::AnyValue::string("n1")),
                        pb::KeyValue::new("process.pid", pb::AnyValue::int(7)),
                    ],
                    dropped_attributes_count: 0,
                }),
                scope_profiles: vec![pb::ScopeProfiles {
                    profiles: vec![profile],
                    ..Default::default()
                }],
                schema_url: String::new(),
            }],
            dictionary: Some(dict),
        }
        .encode_to_vec()
    }

    #[test]
    fn a_profile_becomes_a_labelled_batch() {
        let batches = decode(&request(vec![2, 1]), &Context::new(&Limits::default(), NOW)).unwrap();
        assert_eq!(batches.len(), 1);
        let b = &batches[0];
        assert_eq!(b.agent_id, "otlp/n1/7");
        assert_eq!(b.time_s, 1_700_000_000);
        assert_eq!(b.sample_types, [("samples".into(), "count".into())]);
        assert_eq!(b.rows.len(), 1);
        let row = &b.rows[0];
        let names: Vec<&str> = row.stack.iter().map(|f| &**f).collect();
        assert_eq!(names, ["main", "work"], "root first");
        assert_eq!(row.value, 5);
        let label = |k: &str| row.labels.get(k).cloned();
        assert_eq!(label("node").as_deref(), Some("n1"));
        assert_eq!(label("pid").as_deref(), Some("7"));
        assert_eq!(label("thread").as_deref(), Some("t1"));
        assert_eq!(label("trace_id"), Some("ab".repeat(16)));
        assert_eq!(label("span_id"), Some("01".repeat(8)));
        // The same profile again: the same sequence number, so the store keeps it once.
        let again = decode(&request(vec![2, 1]), &Context::new(&Limits::default(), NOW)).unwrap();
        assert_eq!(again[0].sequence, b.sequence);
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let err = |bytes: &[u8]| {
            decode(bytes, &Context::new(&Limits::default(), NOW))
                .unwrap_err()
                .to_string()
        };
        assert!(err(b"\xff\xff\xff").contains("not an ExportProfilesServiceRequest"));
        assert!(err(&request(vec![9])).contains("location index 9 out of range"));
        assert!(err(&request(vec![0])).contains("location 0"));
    }
}
