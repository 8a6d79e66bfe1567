//! OTLP profiles pushes (`ProfilesService/Export`, the `profiles/v1development` data model):
//! each (resource, profile) pair of a request becomes one batch of the store, as if an agent
//! had pushed it. Resource attributes become the `node` (`host.name`), `pid`
//! (`process.pid`), `comm` (`process.executable.name`) and `container` (`container.id`)
//! labels; a sample's attributes become labels (`thread.name` as `thread`), and its span link
//! the `trace_id` and `span_id` labels, so pyrometer's own exports and other profilers' alike
//! answer the same queries. Every index is checked: bad input is refused with one reason.

use prost::Message;
use pyrometer_proto as pp;
use pyrometer_proto::FrameKind;
use pyrometer_proto::ingest::PushRequest;
use pyrometer_proto::otlp as pb;

use crate::ingest::{IngestError, Limits, from_request};
use crate::store::Batch;

/// The synthetic mappings that mark kernel and Python frames for the ingest's naming.
const KERNEL_MAPPING: u64 = 1;
const PYTHON_MAPPING: u64 = 2;

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

/// The batches of one encoded `ExportProfilesServiceRequest`.
pub fn decode(bytes: &[u8], limits: &Limits, now_s: i64) -> Result<Vec<Batch>, IngestError> {
    let req = pb::ExportProfilesServiceRequest::decode(bytes)
        .map_err(|e| IngestError::Decode(format!("not an ExportProfilesServiceRequest: {e}")))?;
    let dict = req.dictionary.unwrap_or_default();
    let mut batches = Vec::new();
    for rp in &req.resource_profiles {
        let resource: Vec<(String, String)> = rp
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .filter_map(|kv| Some((kv.key.clone(), kv.value.as_ref()?.text()?)))
            .collect();
        let get = |k: &str| resource.iter().find(|(key, _)| key == k).map(|(_, v)| v);
        let node = get("host.name")
            .cloned()
            .unwrap_or_else(|| "unknown".into());
        for sp in &rp.scope_profiles {
            for profile in &sp.profiles {
                let pprof = to_pprof(&dict, profile, &resource)?;
                let id = &profile.profile_id;
                let sequence = if id.len() >= 8 && id.iter().any(|&b| b != 0) {
                    u64::from_be_bytes(id[..8].try_into().expect("8 bytes")) ^ fnv(id)
                } else {
                    fnv(&profile.encode_to_vec())
                };
                let pid = get("process.pid").map_or("", |p| p.as_str());
                let request = PushRequest {
                    agent_id: format!("otlp/{node}/{pid}"),
                    sequence,
                    node: node.clone(),
                    profile: Some(pprof),
                };
                batches.push(from_request(request, limits, now_s)?);
            }
        }
    }
    Ok(batches)
}

/// One OTLP profile as a pprof profile whose tables are the dictionary's (string indices are
/// the same; function and location ids are table indices + 1).
fn to_pprof(
    dict: &pb::ProfilesDictionary,
    profile: &pb::Profile,
    resource: &[(String, String)],
) -> Result<pp::Profile, IngestError> {
    let mut strings = dict.string_table.clone();
    if strings.is_empty() {
        strings.push(String::new());
    }
    let mut intern = |s: &str| -> i64 {
        match strings.iter().position(|x| x == s) {
            Some(i) => i as i64,
            None => {
                strings.push(s.to_string());
                strings.len() as i64 - 1
            }
        }
    };
    let check = table_index;
    let string = |i: i32| -> Result<i64, IngestError> {
        check("string", i, dict.string_table.len().max(1)).map(|i| i as i64)
    };
    let st = profile
        .sample_type
        .as_ref()
        .ok_or_else(|| invalid("a profile without a sample type"))?;
    let sample_type = vec![pp::ValueType {
        r#type: string(st.type_strindex)?,
        unit: string(st.unit_strindex)?,
    }];
    let function = dict
        .function_table
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, f)| {
            Ok(pp::Function {
                id: i as u64,
                name: string(f.name_strindex)?,
                system_name: string(f.system_name_strindex)?,
                filename: string(f.filename_strindex)?,
                start_line: f.start_line,
            })
        })
        .collect::<Result<Vec<_>, IngestError>>()?;
    // Frames are named as the agent's own pushes name them: Python frames `function
    // (file:line)`, kernel ones with `_[k]`: each line carries the kind its
    // `profile.frame.type` says, under the pseudo mapping the agent's pushes use too.
    let kernel = intern(pyrometer_proto::naming::KERNEL_MAPPING);
    let python = intern(pyrometer_proto::naming::PYTHON_MAPPING);
    let mapping = vec![
        pp::Mapping {
            id: KERNEL_MAPPING,
            filename: kernel,
            ..Default::default()
        },
        pp::Mapping {
            id: PYTHON_MAPPING,
            filename: python,
            ..Default::default()
        },
    ];
    let location = locations(dict)?;
    let mut resource_labels = Vec::new();
    for (key, label) in [
        ("process.pid", "pid"),
        ("process.executable.name", "comm"),
        ("container.id", "container"),
    ] {
        if let Some((_, v)) = resource.iter().find(|(k, _)| k == key) {
            resource_labels.push((intern(label), intern(v)));
        }
    }
    let mut sample = Vec::with_capacity(profile.samples.len());
    for s in &profile.samples {
        let stack = &dict.stack_table[check("stack", s.stack_index, dict.stack_table.len())?];
        let location_id = stack
            .location_indices
            .iter()
            .map(|&l| {
                let l = check("location", l, dict.location_table.len())?;
                if l == 0 {
                    return Err(invalid("a stack holds location 0"));
                }
                Ok(l as u64)
            })
            .collect::<Result<Vec<_>, IngestError>>()?;
        let mut label: Vec<pp::Label> = resource_labels
            .iter()
            .map(|&(key, str)| pp::Label {
                key,
                str,
                ..Default::default()
            })
            .collect();
        for &a in &s.attribute_indices {
            let kv = &dict.attribute_table[check("attribute", a, dict.attribute_table.len())?];
            let key =
                &dict.string_table[check("string", kv.key_strindex, dict.string_table.len())?];
            let Some(value) = kv.value.as_ref().and_then(resolve_value(dict)) else {
                continue;
            };
            let key = if key == "thread.name" { "thread" } else { key };
            label.push(pp::Label {
                key: intern(key),
                str: intern(&value),
                ..Default::default()
            });
        }
        if s.link_index != 0 {
            let link = &dict.link_table[check("link", s.link_index, dict.link_table.len())?];
            if link.trace_id.len() == 16 && link.span_id.len() == 8 {
                for (key, v) in [("trace_id", &link.trace_id), ("span_id", &link.span_id)] {
                    label.push(pp::Label {
                        key: intern(key),
                        str: intern(&hex(v)),
                        ..Default::default()
                    });
                }
            }
        }
        sample.push(pp::Sample {
            location_id,
            value: vec![s.values.iter().sum()],
            label,
        });
    }
    Ok(pp::Profile {
        sample_type,
        sample,
        mapping,
        location,
        function,
        string_table: strings,
        time_nanos: i64::try_from(profile.time_unix_nano).unwrap_or(0),
        duration_nanos: i64::try_from(profile.duration_nano).unwrap_or(0),
        period: profile.period,
        ..Default::default()
    })
}

/// The locations of the dictionary, each line with the kind its `profile.frame.type` says
/// (and the pseudo mapping pyrometer's own pushes give kernel and Python frames).
fn locations(dict: &pb::ProfilesDictionary) -> Result<Vec<pp::Location>, IngestError> {
    dict.location_table
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, l)| {
            let (mut mapping_id, mut kind) = (0, FrameKind::Unspecified);
            for &a in &l.attribute_indices {
                let kv =
                    &dict.attribute_table[table_index("attribute", a, dict.attribute_table.len())?];
                let key = table_index("string", kv.key_strindex, dict.string_table.len())?;
                if dict.string_table[key] != "profile.frame.type" {
                    continue;
                }
                (mapping_id, kind) =
                    match kv.value.as_ref().and_then(resolve_value(dict)).as_deref() {
                        Some("kernel") => (KERNEL_MAPPING, FrameKind::Kernel),
                        Some("cpython") => (PYTHON_MAPPING, FrameKind::Python),
                        Some("jit") => (0, FrameKind::Jit),
                        _ => (0, FrameKind::Native),
                    };
            }
            let line = l
                .lines
                .iter()
                .map(|line| {
                    let f =
                        table_index("function", line.function_index, dict.function_table.len())?;
                    Ok(pp::Line {
                        function_id: f as u64,
                        line: line.line,
                        kind: kind as i32,
                        ..Default::default()
                    })
                })
                .collect::<Result<Vec<_>, IngestError>>()?;
            Ok(pp::Location {
                id: i as u64,
                mapping_id,
                address: l.address,
                line,
                ..Default::default()
            })
        })
        .collect::<Result<Vec<_>, IngestError>>()
}

/// `i` as an index into a table of `len` entries.
fn table_index(what: &str, i: i32, len: usize) -> Result<usize, IngestError> {
    usize::try_from(i)
        .ok()
        .filter(|&i| i < len)
        .ok_or_else(|| invalid(format!("{what} index {i} out of range")))
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
        let batches = decode(&request(vec![2, 1]), &Limits::default(), 0).unwrap();
        assert_eq!(batches.len(), 1);
        let b = &batches[0];
        assert_eq!(b.agent_id, "otlp/n1/7");
        assert_eq!(b.time_s, 1_700_000_000);
        assert_eq!(b.sample_types, [("samples".into(), "count".into())]);
        assert_eq!(b.rows.len(), 1);
        let row = &b.rows[0];
        assert_eq!(*row.stack, ["main", "work"], "root first");
        assert_eq!(row.value, 5);
        let label = |k: &str| row.labels.get(k).cloned();
        assert_eq!(label("node").as_deref(), Some("n1"));
        assert_eq!(label("pid").as_deref(), Some("7"));
        assert_eq!(label("thread").as_deref(), Some("t1"));
        assert_eq!(label("trace_id"), Some("ab".repeat(16)));
        assert_eq!(label("span_id"), Some("01".repeat(8)));
        // The same profile again: the same sequence number, so the store keeps it once.
        let again = decode(&request(vec![2, 1]), &Limits::default(), 0).unwrap();
        assert_eq!(again[0].sequence, b.sequence);
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let err = |bytes: &[u8]| {
            decode(bytes, &Limits::default(), 0)
                .unwrap_err()
                .to_string()
        };
        assert!(err(b"\xff\xff\xff").contains("not an ExportProfilesServiceRequest"));
        assert!(err(&request(vec![9])).contains("location index 9 out of range"));
        assert!(err(&request(vec![0])).contains("location 0"));
    }
}
