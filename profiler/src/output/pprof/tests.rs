use super::*;
use crate::output::{fixture, folded};

fn frames_of(p: &Profile) -> Vec<Vec<Frame>> {
    let mut stacks: Vec<Vec<Frame>> = p
        .samples
        .iter()
        .map(|s| p.stack_frames(s.stack).cloned().collect())
        .collect();
    stacks.sort_by_key(|s| format!("{s:?}"));
    stacks
}

#[test]
fn round_trip_keeps_stacks_labels_and_metadata() {
    let orig = fixture::profile();
    let mut bytes = Vec::new();
    write_pprof(&orig, &mut bytes).unwrap();
    let back = read_pprof(&bytes).unwrap();
    for t in 0..orig.sample_types.len() {
        assert_eq!(
            folded::to_folded(&back, t).unwrap(),
            folded::to_folded(&orig, t).unwrap()
        );
        assert_eq!(back.total(t), orig.total(t));
    }
    assert_eq!(back.sample_types, orig.sample_types);
    assert_eq!(back.default_type, orig.default_type);
    assert_eq!(back.period_type, orig.period_type);
    assert_eq!(back.period, orig.period);
    assert_eq!(back.time_nanos, orig.time_nanos);
    assert_eq!(back.duration_nanos, orig.duration_nanos);
    assert_eq!(back.comments, orig.comments);
    // Every frame field survives: kind, module, build id, address, file, line, inlining.
    assert_eq!(frames_of(&back), frames_of(&orig));
    let labels = |p: &Profile| {
        let mut l: Vec<String> = p
            .samples
            .iter()
            .map(|s| format!("{:?}", s.labels))
            .collect();
        l.sort();
        l
    };
    assert_eq!(labels(&back), labels(&orig));
}

#[test]
fn output_is_byte_identical_for_equal_profiles() {
    let mut a = Vec::new();
    let mut b = Vec::new();
    write_pprof(&fixture::profile(), &mut a).unwrap();
    write_pprof(&fixture::profile(), &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn tables_follow_the_spec() {
    let pb = to_pprof(&fixture::profile());
    let s = |i: i64| pb.str(i).unwrap();
    assert_eq!(pb.string_table[0], "");
    let uniq: std::collections::HashSet<_> = pb.string_table.iter().collect();
    assert_eq!(
        uniq.len(),
        pb.string_table.len(),
        "strings are interned once"
    );
    assert_eq!(s(pb.default_sample_type), "cpu");
    // One function per distinct (name, file): `main` exists in two objects, without file
    // in one of them.
    let mains = pb.function.iter().filter(|f| s(f.name) == "main").count();
    assert_eq!(mains, 2);
    // The inlined run is one location with three lines, innermost first.
    let inl = pb.location.iter().find(|l| l.line.len() > 1).unwrap();
    let names: Vec<&str> = inl
        .line
        .iter()
        .map(|l| s(pb.function[l.function_id as usize - 1].name))
        .collect();
    assert_eq!(names, ["PyLong_FromLong", "_PyLong_Add", "long_add"]);
    assert_eq!(inl.address, 0x1a_2b3c);
    let kernel = pb
        .mapping
        .iter()
        .find(|m| s(m.filename) == KERNEL_MAPPING)
        .unwrap();
    assert!(kernel.has_functions && !kernel.has_filenames);
    let py = pb
        .mapping
        .iter()
        .find(|m| s(m.filename) == "/usr/bin/python3.11")
        .unwrap();
    assert_eq!(s(py.build_id), "0f3c6a2b9d11e4f5a6b7c8d9e0f1a2b3c4d5e6f7");
    assert!(py.has_inline_frames && py.has_line_numbers);
    assert_eq!(
        (py.memory_start, py.memory_limit, py.file_offset),
        (0, u64::MAX, 0)
    );
    let files: Vec<&str> = pb.mapping.iter().map(|m| s(m.filename)).collect();
    assert_eq!(
        files,
        [
            "/usr/bin/python3.11",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/opt/train/libtrain.so",
            KERNEL_MAPPING
        ],
        "main binary first, the kernel last"
    );
    for l in &pb.location {
        let m = &pb.mapping[l.mapping_id as usize - 1];
        assert_eq!(m.id, l.mapping_id);
        let kernel_addr = l.address >= 0xffff_0000_0000_0000;
        assert_eq!(
            s(m.filename) == KERNEL_MAPPING,
            kernel_addr,
            "location {}",
            l.id
        );
    }
    // pid and tid are numeric labels, comm a string label.
    let l = &pb.sample[0].label;
    let by_key = |k: &str| l.iter().find(|x| s(x.key) == k).unwrap();
    assert_eq!((by_key("pid").num, by_key("pid").str), (100, 0));
    assert_eq!(s(by_key("comm").str), "python3");
    // The unknown frame is an unsymbolized location: an address and no lines.
    assert!(
        pb.location
            .iter()
            .any(|l| l.address == 0xdead && l.line.is_empty())
    );
}

/// A profile from another tool: a folded-style `_[k]` name and no default type.
#[test]
fn reads_foreign_conventions() {
    let strings = [
        "",
        "samples",
        "count",
        "cpu",
        "nanoseconds",
        "sys_read_[k]",
        "main",
    ];
    let pb = pb::Profile {
        sample_type: vec![
            pb::ValueType { r#type: 1, unit: 2 },
            pb::ValueType { r#type: 3, unit: 4 },
        ],
        sample: vec![pb::Sample {
            location_id: vec![1, 2],
            value: vec![1, 10],
            label: vec![],
        }],
        location: vec![
            pb::Location {
                id: 1,
                line: vec![pb::Line {
                    function_id: 1,
                    ..Default::default()
                }],
                ..Default::default()
            },
            pb::Location {
                id: 2,
                line: vec![pb::Line {
                    function_id: 2,
                    ..Default::default()
                }],
                ..Default::default()
            },
        ],
        function: vec![
            pb::Function {
                id: 1,
                name: 5,
                ..Default::default()
            },
            pb::Function {
                id: 2,
                name: 6,
                ..Default::default()
            },
        ],
        string_table: strings.map(String::from).to_vec(),
        ..Default::default()
    };
    let p = from_pprof(&pb).unwrap();
    assert_eq!(p.default_type, 1, "pprof defaults to the last type");
    assert_eq!(folded::to_folded(&p, 0).unwrap(), "main;sys_read_[k] 1\n");
    let leaf = p.stack_frames(p.samples[0].stack).next().unwrap();
    assert_eq!(
        (leaf.function.as_str(), leaf.kind),
        ("sys_read", FrameKind::Kernel)
    );
}

#[test]
fn lines_carry_their_kind_and_readers_go_by_it() {
    let written = to_pprof(&fixture::profile());
    let kinds = |p: &pb::Profile| -> Vec<i32> {
        p.location
            .iter()
            .flat_map(|l| &l.line)
            .map(|l| l.kind)
            .collect()
    };
    assert!(
        kinds(&written).iter().all(|&k| k != 0),
        "every line says what it is"
    );
    let frame_kinds = |p: &pb::Profile| -> Vec<(String, FrameKind, bool)> {
        let profile = from_pprof(p).unwrap();
        profile
            .frames
            .iter()
            .map(|f| (f.function.clone(), f.kind, f.inlined))
            .collect()
    };
    let expected = frame_kinds(&written);
    assert!(expected.iter().any(|f| f.1 == FrameKind::Kernel));
    assert!(expected.iter().any(|f| f.1 == FrameKind::Native && f.2));
    // Mapping names mean nothing once the lines say their kind.
    let mut renamed = written.clone();
    renamed.string_table.push("/renamed".into());
    let index = renamed.string_table.len() as i64 - 1;
    for m in &mut renamed.mapping {
        m.filename = index;
    }
    let read = frame_kinds(&renamed);
    assert_eq!(
        read.iter().map(|f| f.1).collect::<Vec<_>>(),
        expected.iter().map(|f| f.1).collect::<Vec<_>>()
    );
    // A file without kinds (an older agent's, another tool's): the mapping names tell.
    let mut old = written.clone();
    for l in &mut old.location {
        for line in &mut l.line {
            line.kind = 0;
        }
    }
    assert_eq!(frame_kinds(&old), expected);
    // A Python line under a mapping not named `[python]` is still a Python frame.
    let mut p = written.clone();
    p.location[0].line[0].kind = pb::FrameKind::Python as i32;
    let profile = from_pprof(&p).unwrap();
    let f = profile
        .frames
        .iter()
        .find(|f| f.kind == FrameKind::Python)
        .unwrap();
    assert_eq!(f.module, None);
}

#[test]
fn corrupt_references_are_errors() {
    let good = to_pprof(&fixture::profile());
    let check = |f: &dyn Fn(&mut pb::Profile), msg: &str| {
        let mut p = good.clone();
        f(&mut p);
        assert_eq!(from_pprof(&p).unwrap_err().to_string(), msg);
    };
    check(
        &|p| p.sample[0].location_id[0] = 999,
        "sample refers to unknown location id 999",
    );
    check(
        &|p| p.location[0].line[0].function_id = 77,
        "location refers to unknown function id 77",
    );
    check(
        &|p| p.location[0].mapping_id = 55,
        "location refers to unknown mapping id 55",
    );
    check(
        &|p| p.function[0].name = 10_000,
        &format!(
            "string index 10000 out of range (the string table has {} entries)",
            good.string_table.len()
        ),
    );
    check(
        &|p| p.sample[0].value.pop().map(drop).unwrap_or(()),
        "sample 0 has 1 values but the profile has 2 sample types",
    );
    check(
        &|p| p.location[1].id = p.location[0].id,
        "location id 1 is used twice",
    );
    check(&|p| p.function[0].id = 0, "function id 0 is reserved");
    check(
        &|p| p.string_table[0] = "x".into(),
        "string table must start with \"\"",
    );
    assert!(matches!(
        read_pprof(b"\x1f\x8bjunk"),
        Err(PprofError::Decode(_))
    ));
}

#[test]
fn jit_and_kernel_mapping_names() {
    assert!(is_kernel_mapping("[kernel.kallsyms]"));
    assert!(is_kernel_mapping("[kernel.kallsyms]_text"));
    assert!(!is_kernel_mapping("/usr/lib/libc.so.6"));
    assert!(is_jit_mapping("/tmp/perf-1234.map"));
    assert!(!is_jit_mapping("/tmp/perf-.map"));
    assert!(!is_jit_mapping("/usr/lib/libperf-x.map.so"));
}
