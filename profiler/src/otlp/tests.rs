use super::*;
use crate::model::{Frame, Labels};

fn name_of(d: &pb::ProfilesDictionary, location: i32) -> &str {
    let f = d.location_table[location as usize].lines[0].function_index;
    &d.string_table[d.function_table[f as usize].name_strindex as usize]
}

#[test]
fn processes_become_resources_and_spans_links() {
    let mut p = Profile::cpu(10);
    let stack = |p: &mut Profile, names: &[&str]| {
        let ids: Vec<u32> = names
            .iter()
            .rev()
            .map(|n| p.intern_frame(Frame::named(*n, FrameKind::Python)))
            .collect();
        p.intern_stack(ids)
    };
    let heavy = stack(&mut p, &["main", "heavy"]);
    let base = Labels::new()
        .with("pid", LabelValue::Num(42))
        .with("comm", LabelValue::Str("python3".into()))
        .with("thread", LabelValue::Str("worker".into()));
    let spanned = base
        .clone()
        .with("trace_id", LabelValue::Str("ab".repeat(16)))
        .with("span_id", LabelValue::Str("01".repeat(8)))
        .with("span_name", LabelValue::Str("work".into()));
    p.add(heavy, spanned, &[2, 20]);
    p.add(heavy, base, &[1, 10]);
    let req = to_request(&p, "node-1", &|pid| (pid == 42).then(|| "c0ffee".into()));
    let d = req.dictionary.as_ref().unwrap();
    assert_eq!(req.resource_profiles.len(), 1);
    let rp = &req.resource_profiles[0];
    let attrs: Vec<(String, String)> = rp
        .resource
        .as_ref()
        .unwrap()
        .attributes
        .iter()
        .map(|kv| (kv.key.clone(), kv.value.as_ref().unwrap().text().unwrap()))
        .collect();
    for want in [
        ("host.name", "node-1"),
        ("process.pid", "42"),
        ("container.id", "c0ffee"),
        ("process.executable.name", "python3"),
    ] {
        assert!(
            attrs.contains(&(want.0.into(), want.1.into())),
            "{want:?} in {attrs:?}"
        );
    }
    let profiles = &rp.scope_profiles[0].profiles;
    assert_eq!(profiles.len(), 2, "one profile per sample type");
    let samples = &profiles[0].samples;
    assert_eq!(samples.len(), 2);
    let linked = samples.iter().find(|s| s.link_index != 0).unwrap();
    let link = &d.link_table[linked.link_index as usize];
    assert_eq!(link.trace_id, vec![0xab; 16]);
    assert_eq!(link.span_id, vec![0x01; 8]);
    assert_eq!(linked.values, [2]);
    assert!(samples.iter().any(|s| s.link_index == 0 && s.values == [1]));
    let stack = &d.stack_table[linked.stack_index as usize];
    let names: Vec<&str> = stack
        .location_indices
        .iter()
        .map(|&l| name_of(d, l))
        .collect();
    assert_eq!(names, ["heavy", "main"], "leaf first");
    let keys: Vec<&str> = linked
        .attribute_indices
        .iter()
        .map(|&a| d.string_table[d.attribute_table[a as usize].key_strindex as usize].as_str())
        .collect();
    assert!(
        keys.contains(&"thread.name") && keys.contains(&"span_name"),
        "{keys:?}"
    );
    assert!(
        !keys.contains(&"pid") && !keys.contains(&"trace_id"),
        "{keys:?}"
    );
    assert_eq!(d.string_table[0], "", "string 0 is empty");
}
