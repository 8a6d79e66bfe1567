//! speedscope's JSON file format (<https://www.speedscope.app/file-format-schema.json>): one
//! sampled profile per thread, frames shared between them.
//!
//! A profile read from folded stacks has no thread labels; it becomes one profile for all.
//! Frames are keyed by display name and file, not by address: speedscope treats distinct
//! frame indices as distinct functions, so two addresses in one function must share one.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use serde_json::{Value, json};

use crate::model::{LabelValue, Profile, SampleType};
use crate::output::folded::{frame_name, process_root};
use crate::output::{OutputError, check_type};

/// The schema speedscope files declare.
pub const SCHEMA: &str = "https://www.speedscope.app/file-format-schema.json";

/// speedscope's value unit for a sample type; counts have no unit ("none").
fn unit(sample_type: &SampleType) -> &'static str {
    match sample_type.unit.as_str() {
        "nanoseconds" => "nanoseconds",
        "microseconds" => "microseconds",
        "milliseconds" => "milliseconds",
        "seconds" => "seconds",
        "bytes" => "bytes",
        _ => "none",
    }
}

/// Which thread a sample belongs to, ordered by pid then tid, so output is deterministic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ThreadKey {
    pid: Option<i64>,
    tid: Option<i64>,
}

fn num(v: Option<&LabelValue>) -> Option<i64> {
    match v {
        Some(LabelValue::Num(n)) => Some(*n),
        Some(LabelValue::Str(s)) => s.parse().ok(),
        None => None,
    }
}

/// The profile name speedscope shows in its thread picker.
fn thread_title(key: &ThreadKey, comm: Option<&str>, thread: Option<&str>) -> String {
    match (key.pid, key.tid) {
        (Some(pid), Some(tid)) => {
            let comm = comm.unwrap_or("?");
            let thread = thread.unwrap_or(comm);
            format!("{comm} (pid {pid}) / {thread} (tid {tid})")
        }
        (Some(pid), None) => format!("{} (pid {pid})", comm.unwrap_or("?")),
        _ => comm.map_or_else(|| "all samples".to_string(), str::to_string),
    }
}

/// The name with the most samples, ties broken by name so output is deterministic.
fn most_common(names: &HashMap<String, i64>) -> Option<&str> {
    names
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
        .map(|(n, _)| n.as_str())
}

#[derive(Default)]
struct ThreadProfile {
    /// Names by samples carrying them: a thread sampled before and after an exec (or a
    /// rename) is titled by the name it ran under the longest.
    comms: HashMap<String, i64>,
    threads: HashMap<String, i64>,
    /// Stack (frame indices, root first) -> total, merged so equal stacks are one entry.
    stacks: BTreeMap<Vec<usize>, i64>,
}

/// The speedscope document of one sample type.
pub fn to_speedscope(
    profile: &Profile,
    type_index: usize,
    name: &str,
) -> Result<Value, OutputError> {
    check_type(profile, type_index)?;
    let sample_type = &profile.sample_types[type_index];
    let mut frames: Vec<Value> = Vec::new();
    let mut frame_ids: HashMap<(String, Option<String>), usize> = HashMap::new();
    let mut intern = |name: String, file: Option<String>, line: Option<u32>| -> usize {
        *frame_ids
            .entry((name.clone(), file.clone()))
            .or_insert_with(|| {
                let mut f = json!({ "name": name });
                if let Some(file) = file {
                    f["file"] = json!(file);
                    if let Some(line) = line {
                        f["line"] = json!(line);
                    }
                }
                frames.push(f);
                frames.len() - 1
            })
    };
    // Per model frame id, its speedscope index, filled on first use.
    let mut mapped: Vec<Option<usize>> = vec![None; profile.frames.len()];
    let mut threads: BTreeMap<ThreadKey, ThreadProfile> = BTreeMap::new();
    for sample in &profile.samples {
        let value = sample.values[type_index];
        if value <= 0 {
            continue;
        }
        let labels = &sample.labels;
        let key = ThreadKey {
            pid: num(labels.get("pid")),
            tid: num(labels.get("tid")),
        };
        let thread = threads.entry(key).or_default();
        if let Some(c) = labels.get("comm") {
            *thread.comms.entry(c.to_string()).or_default() += value;
        }
        if let Some(t) = labels.get("thread").or_else(|| labels.get("thread_name")) {
            *thread.threads.entry(t.to_string()).or_default() += value;
        }
        let mut stack = Vec::new();
        // As in folded output, the process is the root frame, so merged views stay apart.
        if let Some(root) = process_root(labels.get("comm")) {
            stack.push(intern(root, None, None));
        }
        for &f in profile.stacks.get(sample.stack).iter().rev() {
            let id = match mapped[f as usize] {
                Some(id) => id,
                None => {
                    let frame = profile.frames.get(f);
                    let file = frame.file.clone().or_else(|| frame.module.clone());
                    let id = intern(frame_name(frame), file, frame.line);
                    mapped[f as usize] = Some(id);
                    id
                }
            };
            stack.push(id);
        }
        if stack.is_empty() {
            stack.push(intern("[unknown]".to_string(), None, None));
        }
        *thread.stacks.entry(stack).or_insert(0) += value;
    }
    if threads.is_empty() {
        return Err(OutputError::Empty(sample_type.name.clone()));
    }
    let profiles: Vec<Value> = threads
        .iter()
        .map(|(key, t)| {
            let total: i64 = t.stacks.values().sum();
            json!({
                "type": "sampled",
                "name": thread_title(key, most_common(&t.comms), most_common(&t.threads)),
                "unit": unit(sample_type),
                "startValue": 0,
                "endValue": total,
                "samples": t.stacks.keys().collect::<Vec<_>>(),
                "weights": t.stacks.values().collect::<Vec<_>>(),
            })
        })
        .collect();
    // Open on the busiest thread, the one a user most likely wants first.
    let active = threads
        .values()
        .enumerate()
        .max_by_key(|(i, t)| (t.stacks.values().sum::<i64>(), std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    Ok(json!({
        "$schema": SCHEMA,
        "shared": { "frames": frames },
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": active,
        "exporter": concat!("pyrometer ", env!("CARGO_PKG_VERSION")),
    }))
}

/// Writes one sample type as a speedscope file.
pub fn write_speedscope(
    profile: &Profile,
    type_index: usize,
    name: &str,
    out: &mut dyn Write,
) -> Result<(), OutputError> {
    let doc = to_speedscope(profile, type_index, name)?;
    serde_json::to_writer(&mut *out, &doc).map_err(std::io::Error::from)?;
    out.write_all(b"\n")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::read_folded;
    use crate::output::fixture;

    fn names(doc: &Value, stack: &Value) -> Vec<String> {
        stack
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                doc["shared"]["frames"][i.as_u64().unwrap() as usize]["name"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn one_profile_per_thread_with_shared_frames() {
        let p = fixture::profile();
        let doc = to_speedscope(&p, 0, "fixture").unwrap();
        assert_eq!(doc["$schema"], SCHEMA);
        let profiles = doc["profiles"].as_array().unwrap();
        let titles: Vec<&str> = profiles
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            titles,
            [
                "python3 (pid 100) / MainThread (tid 101)",
                "python3 (pid 100) / worker (tid 102)",
                "ray::Train (pid 200) / train (tid 201)",
                "ray::Train (pid 200) / train (tid 202)",
            ]
        );
        // tid 201 has 7 + 4 + 2 samples, the most: it opens first.
        assert_eq!(doc["activeProfileIndex"], 2);
        let weights: i64 = profiles
            .iter()
            .flat_map(|p| p["weights"].as_array().unwrap())
            .map(|w| w.as_i64().unwrap())
            .sum();
        assert_eq!(weights, 24);
        for p in profiles {
            assert_eq!(p["unit"], "none");
            assert_eq!(
                p["samples"].as_array().unwrap().len(),
                p["weights"].as_array().unwrap().len()
            );
            let total: i64 = p["weights"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_i64().unwrap())
                .sum();
            assert_eq!(p["endValue"], total);
        }
        // Root first, process name at the root, kernel frames marked as in folded output.
        let main = &profiles[0];
        let stacks: Vec<Vec<String>> = main["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| names(&doc, s))
            .collect();
        assert!(stacks.contains(&vec![
            "python3".to_string(),
            "main".into(),
            "_PyEval_EvalFrameDefault".into(),
            "__libc_read".into(),
            "do_syscall_64_[k]".into(),
            "copy_user_generic_string_[k]".into(),
        ]));
        // fib recursion shares one frame; `main` of two binaries stays two frames (by file).
        let frames = doc["shared"]["frames"].as_array().unwrap();
        assert_eq!(frames.iter().filter(|f| f["name"] == "fib").count(), 1);
        assert_eq!(frames.iter().filter(|f| f["name"] == "main").count(), 2);
        let eval = frames
            .iter()
            .find(|f| f["name"] == "_PyEval_EvalFrameDefault")
            .unwrap();
        assert_eq!(eval["file"], "Python/ceval.c");
        assert_eq!(eval["line"], 4200);
    }

    #[test]
    fn units_follow_the_type_and_folded_input_is_one_profile() {
        let doc = to_speedscope(&fixture::profile(), 1, "f").unwrap();
        assert_eq!(doc["profiles"][0]["unit"], "nanoseconds");
        let p = read_folded("a;b 3\na;c 1\n").unwrap();
        let doc = to_speedscope(&p, 0, "f").unwrap();
        let profiles = doc["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 1);
        assert_eq!(profiles[0]["name"], "all samples");
        assert_eq!(names(&doc, &profiles[0]["samples"][0]), ["a", "b"]);
        assert_eq!(profiles[0]["weights"], json!([3, 1]));
    }

    #[test]
    fn empty_profile_is_an_error() {
        assert!(matches!(
            to_speedscope(&Profile::cpu(1), 0, "x"),
            Err(OutputError::Empty(_))
        ));
    }
}
