//! Merged query results as folded stacks, an inferno flame graph, pprof, a top-functions table
//! and per-group totals.

use std::collections::{BTreeMap, HashMap, HashSet};

use pyrometer_proto as pb;

use crate::store::{Frame, Stacked, add};

/// `root;...;leaf` with the sample's process (`comm` label) as the root frame, as `pyrometer
/// record` writes folded files, merged and sorted.
pub fn folded(stacks: &[Stacked]) -> Vec<(String, i64)> {
    fold(stacks, true)
}

/// [`folded`] without the process root: code only, as `pyrometer diff` compares, so a
/// baseline and a candidate under different process names line up frame by frame.
pub fn folded_code_text(stacks: &[Stacked]) -> String {
    fold(stacks, false)
        .into_iter()
        .map(|(s, v)| format!("{s} {v}\n"))
        .collect()
}

fn fold(stacks: &[Stacked], comm_root: bool) -> Vec<(String, i64)> {
    // Summed per (process, stack) first: a cluster-wide answer has one entry per label set
    // and stack, many times more than distinct lines, and the stores hand out one shared
    // `Arc` per stack, so its address is the key and each line is built once.
    type Key<'a> = (Option<&'a str>, *const Vec<Frame>);
    let mut by_stack: HashMap<Key<'_>, (&[Frame], i64)> = HashMap::new();
    for s in stacks {
        let comm = if comm_root {
            s.labels.get("comm").map(String::as_str)
        } else {
            None
        };
        add(
            &mut by_stack
                .entry((comm, std::sync::Arc::as_ptr(&s.stack)))
                .or_insert((s.stack.as_slice(), 0))
                .1,
            s.value,
        );
    }
    let mut merged: BTreeMap<String, i64> = BTreeMap::new();
    for ((comm, _), (frames, value)) in by_stack {
        let mut line = String::new();
        if let Some(comm) = comm {
            line.push_str(&comm.replace(';', ":"));
        }
        for f in frames {
            if !line.is_empty() {
                line.push(';');
            }
            line.push_str(f);
        }
        if line.is_empty() {
            line.push_str("[unknown]");
        }
        add(merged.entry(line).or_insert(0), value);
    }
    merged.into_iter().filter(|&(_, v)| v > 0).collect()
}

pub fn folded_text(stacks: &[Stacked]) -> String {
    folded(stacks)
        .into_iter()
        .map(|(s, v)| format!("{s} {v}\n"))
        .collect()
}

/// The merged stacks as the web UI's flame graph reads them, as JSON text: frame names
/// interned once in `names`, and each distinct (process, stack) as `[value, process, frame,
/// ...]` with frames root first and `process` the index of the sample's `comm` label (-1 when
/// it has none). The process is kept apart from the frames so a view can root stacks at it or
/// compare code only. Written directly rather than through `serde_json::Value`: a cluster's
/// hour holds tens of thousands of stacks of dozens of frames.
pub fn flame_json(stacks: &[Stacked], sample_type: (&str, &str)) -> String {
    use std::fmt::Write;
    let mut index: HashMap<&str, i64> = HashMap::new();
    let mut names: Vec<&str> = Vec::new();
    let mut merged: HashMap<Vec<i64>, i64> = HashMap::new();
    let mut key = Vec::new();
    for s in stacks {
        key.clear();
        let comm = s.labels.get("comm").map(String::as_str);
        if comm.is_none() {
            key.push(-1);
        }
        for name in comm.into_iter().chain(s.stack.iter().map(|f| &**f)) {
            let next = names.len() as i64;
            key.push(*index.entry(name).or_insert_with(|| {
                names.push(name);
                next
            }));
        }
        match merged.get_mut(key.as_slice()) {
            Some(v) => add(v, s.value),
            None => {
                merged.insert(key.clone(), s.value);
            }
        }
    }
    // Sorted, so answers are deterministic.
    let mut rows: Vec<(Vec<i64>, i64)> = merged.into_iter().filter(|&(_, v)| v > 0).collect();
    rows.sort_unstable();
    let total = rows.iter().fold(0i64, |t, (_, v)| t.saturating_add(*v));
    let quoted = |s: &str| serde_json::to_string(s).expect("strings serialize");
    let mut out = String::with_capacity(64 + rows.len() * 64);
    let _ = write!(
        out,
        r#"{{"type":{},"unit":{},"total":{total},"names":{},"stacks":["#,
        quoted(sample_type.0),
        quoted(sample_type.1),
        serde_json::to_string(&names).expect("strings serialize")
    );
    for (i, (frames, value)) in rows.iter().enumerate() {
        out.push_str(if i == 0 { "[" } else { ",[" });
        let _ = write!(out, "{value}");
        for f in frames {
            let _ = write!(out, ",{f}");
        }
        out.push(']');
    }
    out.push_str("]}");
    out
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("nothing matched the query in this time range")]
    Empty,
    #[error("cannot render the flame graph: {0}")]
    Svg(String),
}

/// An interactive SVG (click a frame to zoom, Ctrl-F to search).
pub fn svg(stacks: &[Stacked], title: &str, count_name: &str) -> Result<Vec<u8>, RenderError> {
    let lines: Vec<String> = folded(stacks)
        .into_iter()
        .map(|(s, v)| format!("{s} {v}"))
        .collect();
    if lines.is_empty() {
        return Err(RenderError::Empty);
    }
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = title.to_string();
    opts.count_name = count_name.to_string();
    opts.hash = true;
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut out)
        .map_err(|e| RenderError::Svg(e.to_string()))?;
    Ok(out)
}

/// A pprof profile of one sample type, one sample per (label set, stack).
pub fn pprof(stacks: &[Stacked], sample_type: (&str, &str)) -> pb::Profile {
    let mut strings: HashMap<String, i64> = HashMap::new();
    let mut table: Vec<String> = Vec::new();
    let mut id = |s: &str| -> i64 {
        if let Some(&i) = strings.get(s) {
            return i;
        }
        let i = table.len() as i64;
        table.push(s.to_string());
        strings.insert(s.to_string(), i);
        i
    };
    id("");
    let ty = pb::ValueType {
        r#type: id(sample_type.0),
        unit: id(sample_type.1),
    };
    let mut functions: HashMap<Frame, u64> = HashMap::new();
    let mut function = Vec::new();
    let mut location = Vec::new();
    let mut sample = Vec::with_capacity(stacks.len());
    for s in stacks {
        let mut location_id = Vec::with_capacity(s.stack.len());
        for name in s.stack.iter().rev() {
            let fid = match functions.get(name) {
                Some(&f) => f,
                None => {
                    let f = function.len() as u64 + 1;
                    let name_index = id(name);
                    function.push(pb::Function {
                        id: f,
                        name: name_index,
                        system_name: pb::Function::system_name_index(name, name_index),
                        ..Default::default()
                    });
                    // One location per function: the collector keeps names, not addresses.
                    location.push(pb::Location {
                        id: f,
                        line: vec![pb::Line {
                            function_id: f,
                            line: 0,
                            ..Default::default()
                        }],
                        ..Default::default()
                    });
                    functions.insert(name.clone(), f);
                    f
                }
            };
            location_id.push(fid);
        }
        let label = s
            .labels
            .iter()
            .map(|(k, v)| pb::Label {
                key: id(k),
                str: id(v),
                ..Default::default()
            })
            .collect();
        sample.push(pb::Sample {
            location_id,
            value: vec![s.value],
            label,
        });
    }
    pb::Profile {
        sample_type: vec![ty],
        sample,
        location,
        function,
        string_table: table,
        ..Default::default()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TopRow {
    pub function: String,
    /// Value of stacks whose leaf is this function.
    #[serde(rename = "self")]
    pub self_value: i64,
    /// Value of stacks containing the function anywhere (counted once per stack).
    pub total: i64,
}

/// Functions by self value, largest first.
pub fn top(stacks: &[Stacked], limit: usize) -> Vec<TopRow> {
    let mut rows: HashMap<&str, (i64, i64)> = HashMap::new();
    let mut seen: HashSet<&str> = HashSet::new();
    for s in stacks {
        seen.clear();
        for f in s.stack.iter() {
            if seen.insert(f) {
                add(&mut rows.entry(f).or_default().1, s.value);
            }
        }
        if let Some(leaf) = s.stack.last() {
            add(&mut rows.entry(leaf).or_default().0, s.value);
        }
    }
    let mut out: Vec<TopRow> = rows
        .into_iter()
        .map(|(f, (self_value, total))| TopRow {
            function: f.to_string(),
            self_value,
            total,
        })
        .collect();
    out.sort_by(|a, b| {
        (b.self_value, b.total, &a.function).cmp(&(a.self_value, a.total, &b.function))
    });
    out.truncate(limit);
    out
}

/// Totals per distinct value of the `by` labels (a missing label groups as "").
pub fn group_totals(stacks: &[Stacked], by: &[String]) -> Vec<(BTreeMap<String, String>, i64)> {
    let mut groups: BTreeMap<Vec<String>, i64> = BTreeMap::new();
    for s in stacks {
        let key: Vec<String> = by
            .iter()
            .map(|b| s.labels.get(b).cloned().unwrap_or_default())
            .collect();
        add(groups.entry(key).or_insert(0), s.value);
    }
    groups
        .into_iter()
        .map(|(key, total)| (by.iter().cloned().zip(key).collect(), total))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn st(comm: &str, node: &str, frames: &[&str], value: i64) -> Stacked {
        Stacked {
            labels: Arc::new(
                [("comm", comm), ("node", node)]
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            stack: Arc::new(frames.iter().map(|&s| Frame::from(s)).collect()),
            value,
        }
    }

    #[test]
    fn folded_merges_and_roots_at_comm() {
        let s = [
            st("app", "n1", &["main", "a"], 2),
            st("app", "n2", &["main", "a"], 3),
            st("app", "n1", &["main", "b"], 1),
        ];
        assert_eq!(folded_text(&s), "app;main;a 5\napp;main;b 1\n");
        let g = group_totals(&s, &["node".to_string()]);
        assert_eq!(g.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![3, 3]);
        let t = top(&s, 10);
        assert_eq!((t[0].function.as_str(), t[0].self_value), ("a", 5));
        assert_eq!(t.iter().find(|r| r.function == "main").unwrap().total, 6);
        let p = pprof(&s, ("samples", "count"));
        assert_eq!(p.sample.iter().map(|x| x.value[0]).sum::<i64>(), 6);
        assert!(svg(&s, "t", "samples").unwrap().starts_with(b"<?xml"));
        assert!(matches!(svg(&[], "t", "samples"), Err(RenderError::Empty)));
    }

    /// `go tool pprof` empties a name in angle brackets whose system name is the same, as a
    /// C++ template (tests/tests/pyframes.rs shows it on the profiler's output).
    #[test]
    fn bracketed_names_have_no_system_name() {
        let s = [st(
            "app",
            "n1",
            &["main", "<module> (x.py:3)", "<lambda> (x.py:5)"],
            1,
        )];
        let p = pprof(&s, ("samples", "count"));
        let str_of = |i: i64| p.string_table[i as usize].as_str();
        let by_name: HashMap<&str, i64> = p
            .function
            .iter()
            .map(|f| (str_of(f.name), f.system_name))
            .collect();
        assert_eq!(by_name["<module> (x.py:3)"], 0);
        assert_eq!(by_name["<lambda> (x.py:5)"], 0);
        assert_eq!(str_of(by_name["main"]), "main");
    }

    #[test]
    fn flame_interns_names_and_keeps_the_process_apart() {
        let mut no_comm = st("x", "n1", &["main", "b"], 4);
        no_comm.labels = Arc::new([("node".to_string(), "n1".to_string())].into());
        let s = [
            st("app", "n1", &["main", "a"], 2),
            st("app", "n2", &["main", "a"], 3),
            no_comm,
        ];
        let f: serde_json::Value =
            serde_json::from_str(&flame_json(&s, ("samples", "count"))).unwrap();
        assert_eq!(
            (f["type"].as_str(), f["unit"].as_str()),
            (Some("samples"), Some("count"))
        );
        assert_eq!(f["total"], 9);
        assert_eq!(f["names"], serde_json::json!(["app", "main", "a", "b"]));
        assert_eq!(
            f["stacks"],
            serde_json::json!([[4, -1, 1, 3], [5, 0, 1, 2]])
        );
        let empty: serde_json::Value =
            serde_json::from_str(&flame_json(&[], ("cpu", "nanoseconds"))).unwrap();
        assert_eq!(
            empty,
            serde_json::json!({"type": "cpu", "unit": "nanoseconds", "total": 0, "names": [], "stacks": []})
        );
    }
}
