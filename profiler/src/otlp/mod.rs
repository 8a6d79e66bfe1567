//! The agent's OTLP profiles export: a [`Profile`] as an `ExportProfilesServiceRequest` in the
//! OpenTelemetry profiles data model (`profiles/v1development`), so an OpenTelemetry Collector
//! can forward it to any backend that takes profiles.
//!
//! One `ResourceProfiles` per process, with the resource attributes of the semantic
//! conventions (`host.name`, `process.pid`, `process.executable.name`, `container.id` when the
//! process runs in a container), one `Profile` per sample type with samples in it. A sample's
//! other labels become attributes (`thread.name` for the thread, the rest under their own
//! names), and the OpenTelemetry span it was taken in (pyrometer-otel) its link. Tables are
//! shared by the whole request, entry 0 of each the zero value, as the data model asks.

mod container;

use std::collections::HashMap;

use pyrometer_proto::otlp as pb;

use crate::model::{FrameKind, LabelValue, Profile};

pub use container::container_id;

/// The instrumentation scope every exported profile names.
pub const SCOPE: &str = "pyrometer";

/// Labels that go to the resource or the link, not to the sample's attributes.
const NOT_ATTRIBUTES: [&str; 6] = ["pid", "comm", "node", "tid", "trace_id", "span_id"];

/// Builds the request tables, each entry once.
#[derive(Default)]
struct Dictionary {
    d: pb::ProfilesDictionary,
    strings: HashMap<String, i32>,
    attributes: HashMap<(String, String), i32>,
    functions: HashMap<(i32, i32, i64), i32>,
    mappings: HashMap<i32, i32>,
    locations: HashMap<u32, i32>,
    stacks: HashMap<u32, i32>,
    links: HashMap<(Vec<u8>, Vec<u8>), i32>,
}

impl Dictionary {
    fn new() -> Self {
        let mut d = Self::default();
        d.string("");
        d.d.mapping_table.push(pb::Mapping::default());
        d.d.location_table.push(pb::Location::default());
        d.d.function_table.push(pb::Function::default());
        d.d.link_table.push(pb::Link::default());
        d.d.attribute_table.push(pb::KeyValueAndUnit::default());
        d.d.stack_table.push(pb::Stack::default());
        d
    }

    fn string(&mut self, s: &str) -> i32 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.d.string_table.len() as i32;
        self.d.string_table.push(s.to_string());
        self.strings.insert(s.to_string(), i);
        i
    }

    fn attribute(&mut self, key: &str, value: &str) -> i32 {
        let k = (key.to_string(), value.to_string());
        if let Some(&i) = self.attributes.get(&k) {
            return i;
        }
        let key_strindex = self.string(key);
        let i = self.d.attribute_table.len() as i32;
        self.d.attribute_table.push(pb::KeyValueAndUnit {
            key_strindex,
            value: Some(pb::AnyValue::string(value)),
            unit_strindex: 0,
        });
        self.attributes.insert(k, i);
        i
    }

    fn link(&mut self, trace: Vec<u8>, span: Vec<u8>) -> i32 {
        let next = self.d.link_table.len() as i32;
        *self
            .links
            .entry((trace.clone(), span.clone()))
            .or_insert_with(|| {
                self.d.link_table.push(pb::Link {
                    trace_id: trace,
                    span_id: span,
                });
                next
            })
    }

    fn location(&mut self, profile: &Profile, frame_id: u32) -> i32 {
        if let Some(&i) = self.locations.get(&frame_id) {
            return i;
        }
        let f = profile.frames.get(frame_id);
        let name = self.string(&f.function);
        let file = self.string(f.file.as_deref().unwrap_or(""));
        let fkey = (name, file, 0);
        let next_fn = self.d.function_table.len() as i32;
        let function_index = *self.functions.entry(fkey).or_insert_with(|| {
            self.d.function_table.push(pb::Function {
                name_strindex: name,
                system_name_strindex: name,
                filename_strindex: file,
                start_line: 0,
            });
            next_fn
        });
        let mapping_index = match &f.module {
            Some(module) => {
                let file = self.string(module);
                let next = self.d.mapping_table.len() as i32;
                *self.mappings.entry(file).or_insert_with(|| {
                    self.d.mapping_table.push(pb::Mapping {
                        filename_strindex: file,
                        ..Default::default()
                    });
                    next
                })
            }
            None => 0,
        };
        let kind = self.attribute("profile.frame.type", frame_type(f.kind));
        let i = self.d.location_table.len() as i32;
        self.d.location_table.push(pb::Location {
            mapping_index,
            address: f.address,
            lines: vec![pb::Line {
                function_index,
                line: i64::from(f.line.unwrap_or(0)),
                column: 0,
            }],
            attribute_indices: vec![kind],
        });
        self.locations.insert(frame_id, i);
        i
    }

    fn stack(&mut self, profile: &Profile, stack: u32) -> i32 {
        if let Some(&i) = self.stacks.get(&stack) {
            return i;
        }
        let frames = profile.stacks.get(stack).clone();
        let location_indices = frames
            .into_iter()
            .map(|f| self.location(profile, f))
            .collect();
        let i = self.d.stack_table.len() as i32;
        self.d.stack_table.push(pb::Stack { location_indices });
        self.stacks.insert(stack, i);
        i
    }
}

/// The `profile.frame.type` of the semantic conventions.
fn frame_type(kind: FrameKind) -> &'static str {
    match kind {
        FrameKind::Kernel => "kernel",
        // A task is where its coroutines' CPython frames ran.
        FrameKind::Python | FrameKind::Task => "cpython",
        FrameKind::Jit => "jit",
        FrameKind::Native | FrameKind::Unknown => "native",
        // OpenTelemetry's frame types name no GPU or budget kind.
        FrameKind::Gpu | FrameKind::Budget => "native",
    }
}

/// `hex` as bytes, or None when it is not whole hex digits.
fn hex_bytes(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

fn text(v: &LabelValue) -> String {
    match v {
        LabelValue::Str(s) => s.clone(),
        LabelValue::Num(n) => n.to_string(),
    }
}

/// `profile` (one push interval of node `host`) as an OTLP export request; `container` names
/// the container of a pid (see [`container_id`]).
pub fn to_request(
    profile: &Profile,
    host: &str,
    container: &dyn Fn(u32) -> Option<String>,
) -> pb::ExportProfilesServiceRequest {
    let mut dict = Dictionary::new();
    // Samples by process, in the order processes first appear.
    let mut order: Vec<i64> = Vec::new();
    let mut by_pid: HashMap<i64, Vec<usize>> = HashMap::new();
    for (i, s) in profile.samples.iter().enumerate() {
        let pid = match s.labels.get("pid") {
            Some(LabelValue::Num(p)) => *p,
            _ => -1,
        };
        by_pid
            .entry(pid)
            .or_insert_with(|| {
                order.push(pid);
                Vec::new()
            })
            .push(i);
    }
    let id_seed = profile.time_nanos as u64;
    let mut resource_profiles = Vec::new();
    for pid in order {
        let samples = &by_pid[&pid];
        let first = &profile.samples[samples[0]];
        let mut attributes = vec![pb::KeyValue::new("host.name", pb::AnyValue::string(host))];
        if pid >= 0 {
            attributes.push(pb::KeyValue::new("process.pid", pb::AnyValue::int(pid)));
            if let Some(id) = container(pid as u32) {
                attributes.push(pb::KeyValue::new("container.id", pb::AnyValue::string(id)));
            }
        }
        if let Some(comm) = first.labels.get("comm") {
            attributes.push(pb::KeyValue::new(
                "process.executable.name",
                pb::AnyValue::string(text(comm)),
            ));
        }
        let mut profiles = Vec::new();
        for (t, ty) in profile.sample_types.iter().enumerate() {
            let mut out = Vec::new();
            for &i in samples {
                let s = &profile.samples[i];
                let value = s.values.get(t).copied().unwrap_or(0);
                if value == 0 {
                    continue;
                }
                let mut attribute_indices = Vec::new();
                for (k, v) in s.labels.iter() {
                    if NOT_ATTRIBUTES.contains(&k) {
                        continue;
                    }
                    let key = if k == "thread" { "thread.name" } else { k };
                    attribute_indices.push(dict.attribute(key, &text(v)));
                }
                let link_index = match (s.labels.get("trace_id"), s.labels.get("span_id")) {
                    (Some(LabelValue::Str(t)), Some(LabelValue::Str(sp))) => {
                        match (hex_bytes(t), hex_bytes(sp)) {
                            (Some(t), Some(sp)) => dict.link(t, sp),
                            _ => 0,
                        }
                    }
                    _ => 0,
                };
                out.push(pb::Sample {
                    stack_index: dict.stack(profile, s.stack),
                    attribute_indices,
                    link_index,
                    values: vec![value],
                    timestamps_unix_nano: Vec::new(),
                });
            }
            if out.is_empty() {
                continue;
            }
            let sample_type = pb::ValueType {
                type_strindex: dict.string(&ty.name),
                unit_strindex: dict.string(&ty.unit),
            };
            let period_type = profile.period_type.as_ref().map(|p| pb::ValueType {
                type_strindex: dict.string(&p.name),
                unit_strindex: dict.string(&p.unit),
            });
            let mut profile_id = [0u8; 16];
            profile_id[..8].copy_from_slice(&id_seed.to_be_bytes());
            profile_id[8..12].copy_from_slice(&(pid as u32).to_be_bytes());
            profile_id[12..].copy_from_slice(&(t as u32 + 1).to_be_bytes());
            profiles.push(pb::Profile {
                sample_type: Some(sample_type),
                samples: out,
                time_unix_nano: profile.time_nanos.max(0) as u64,
                duration_nano: profile.duration_nanos.max(0) as u64,
                period_type,
                period: profile.period,
                profile_id: profile_id.to_vec(),
                ..Default::default()
            });
        }
        if profiles.is_empty() {
            continue;
        }
        resource_profiles.push(pb::ResourceProfiles {
            resource: Some(pb::Resource {
                attributes,
                dropped_attributes_count: 0,
            }),
            scope_profiles: vec![pb::ScopeProfiles {
                scope: Some(pb::InstrumentationScope {
                    name: SCOPE.to_string(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    ..Default::default()
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        });
    }
    pb::ExportProfilesServiceRequest {
        resource_profiles,
        dictionary: Some(dict.d),
    }
}

#[cfg(test)]
mod tests;
