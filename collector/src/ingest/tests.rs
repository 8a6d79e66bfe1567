//! Decoding real pushes: names, limits, truncation, tenants, time.
use super::*;
use prost::Message;
use pyrometer_proto::ingest::PushRequest;
use pyrometer_proto::{Function, Line, Location, Mapping, Profile, Sample, ValueType};

/// A Python frame reads `function (file:line)`, as the node's own outputs write it; a native
/// one its function name. A line's kind says which; without one (an older agent) the
/// `[python]` mapping does.
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
        let batch = decode(&bytes, &Context::new(&Limits::default(), 100)).unwrap();
        let names: Vec<String> = batch.rows[0].stack.iter().map(|f| f.to_string()).collect();
        names
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

/// One process's push of one sample per stack (root first), with labels.
fn push(stacks: &[&[&str]], labels: &[(&str, &str)], time_s: i64) -> Vec<u8> {
    let mut strings = vec![String::new(), "samples".into(), "count".into()];
    let mut id = |s: &str| -> i64 {
        if let Some(i) = strings.iter().position(|x| x == s) {
            return i as i64;
        }
        strings.push(s.to_string());
        strings.len() as i64 - 1
    };
    let (mut function, mut location, mut sample) = (Vec::new(), Vec::new(), Vec::new());
    for stack in stacks {
        let mut location_id = Vec::new();
        for name in stack.iter().rev() {
            let fid = function.len() as u64 + 1;
            function.push(Function {
                id: fid,
                name: id(name),
                ..Default::default()
            });
            location.push(Location {
                id: fid,
                line: vec![Line {
                    function_id: fid,
                    ..Default::default()
                }],
                ..Default::default()
            });
            location_id.push(fid);
        }
        let label = labels
            .iter()
            .map(|(k, v)| pyrometer_proto::Label {
                key: id(k),
                str: id(v),
                ..Default::default()
            })
            .collect();
        sample.push(Sample {
            location_id,
            value: vec![1],
            label,
        });
    }
    PushRequest {
        agent_id: "a".into(),
        sequence: 1,
        node: "n".into(),
        profile: Some(Profile {
            sample_type: vec![ValueType { r#type: 1, unit: 2 }],
            sample,
            location,
            function,
            string_table: strings,
            time_nanos: time_s * 1_000_000_000,
            ..Default::default()
        }),
    }
    .encode_to_vec()
}

fn names(stack: &Stack) -> Vec<&str> {
    stack.iter().map(|f| &**f).collect()
}

/// A stack deeper than the limit keeps its leaf-most frames under a marked root.
#[test]
fn deep_stacks_are_cut_at_the_root() {
    let deep: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    let deep: Vec<&str> = deep.iter().map(String::as_str).collect();
    let limits = Limits {
        max_stack_depth: 4,
        ..Limits::default()
    };
    let batch = decode(
        &push(&[&deep, &deep[..4]], &[], 100),
        &Context::new(&limits, 100),
    )
    .unwrap();
    assert_eq!(names(&batch.rows[0].stack), [TRUNCATED, "f7", "f8", "f9"]);
    assert_eq!(names(&batch.rows[1].stack), ["f0", "f1", "f2", "f3"]);
}

/// Each limit refuses with its key and the value; reserved labels are dropped and the
/// tenant's set; batches outside the time window are refused.
#[test]
fn limits_time_and_tenants() {
    let ok = push(
        &[&["main"]],
        &[("comm", "app"), ("__tenant__", "forged")],
        1000,
    );
    let l = Limits::default();
    let err = |limits: &Limits, bytes: &[u8], now: i64| {
        decode(bytes, &Context::new(limits, now)).unwrap_err()
    };
    for (limits, key) in [
        (
            Limits {
                max_push_bytes: 10,
                ..l
            },
            "max_push_bytes",
        ),
        (
            Limits {
                max_samples: 0,
                ..l
            },
            "max_samples",
        ),
        (
            Limits {
                max_strings: 3,
                ..l
            },
            "max_strings",
        ),
        (
            Limits {
                max_string_bytes: 3,
                ..l
            },
            "max_string_bytes",
        ),
        (
            Limits {
                max_locations: 0,
                ..l
            },
            "max_locations",
        ),
        (
            Limits {
                max_functions: 0,
                ..l
            },
            "max_functions",
        ),
        (
            Limits {
                max_labels_per_sample: 1,
                ..l
            },
            "max_labels_per_sample",
        ),
        (
            Limits {
                max_label_value_bytes: 2,
                ..l
            },
            "max_label_value_bytes",
        ),
        (
            Limits {
                max_label_name_bytes: 3,
                ..l
            },
            "max_label_name_bytes",
        ),
        (
            Limits {
                max_expansion: 0,
                ..l
            },
            "max_expansion",
        ),
    ] {
        let e = err(&limits, &ok, 1000);
        assert_eq!(e.reason(), key, "{e}");
        assert!(e.to_string().contains(key), "{e}");
    }
    let e = err(&l, &ok, 1000 + 8 * 86_400);
    assert_eq!(e.reason(), "time_window");
    assert!(e.to_string().contains("clock"), "{e}");
    assert_eq!(err(&l, &ok, 1000 - MAX_AHEAD_S - 1).reason(), "time_window");

    let mut ctx = Context::new(&l, 1000);
    let b = decode(&ok, &ctx).unwrap();
    assert!(
        !b.rows[0].labels.contains_key(TENANT_LABEL),
        "{:?}",
        b.rows[0].labels
    );
    assert_eq!(b.agent_id, "a");
    ctx.tenant = "ci";
    let b = decode(&ok, &ctx).unwrap();
    assert_eq!(b.rows[0].labels[TENANT_LABEL], "ci");
    assert_eq!(b.rows[0].labels["comm"], "app");
    assert_ne!(b.agent_id, "a", "tenants' agents cannot collide");
}
