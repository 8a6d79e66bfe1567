//! One result from the captures of several nodes (a label query that matched processes on
//! more than one): their profiles summed with a `node` label on every sample, and their
//! Chrome timelines as one trace with a process per node and pid, each node's times moved
//! onto one wall clock by the origin its agent reported.

use serde_json::{Value, json};

use crate::model::{LabelValue, Profile};
use pyrometer_proto::capture::UploadRequest;

/// Why the results do not make one.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A node's profile does not decode.
    #[error("the profile of node '{node}' is unreadable: {why}")]
    Profile {
        /// The node whose result it is.
        node: String,
        /// What is wrong with it.
        why: String,
    },
    /// A node's timeline does not decode.
    #[error("the timeline of node '{node}' is unreadable: {why}")]
    Timeline {
        /// The node whose result it is.
        node: String,
        /// What is wrong with it.
        why: String,
    },
    /// The nodes' profiles hold different sample types.
    #[error(
        "the nodes' captures hold different sample types ({0}): capture them with the same options"
    )]
    Types(String),
    /// There was no result.
    #[error("no result to merge")]
    Empty,
}

/// The profiles of `results` as one, each sample labelled with its node.
pub fn profiles(results: &[UploadRequest]) -> Result<Profile, MergeError> {
    let mut merged: Option<Profile> = None;
    for r in results {
        let mut p = crate::input::parse_profile(&r.pprof, "the capture").map_err(|e| {
            MergeError::Profile {
                node: r.node.clone(),
                why: e.to_string(),
            }
        })?;
        p.map_labels(|l| {
            if l.get("node").is_none() {
                l.set("node", LabelValue::Str(r.node.clone()));
            }
        });
        if merged.is_none() {
            merged = Some(p);
            continue;
        }
        let into = merged.as_mut().expect("set above");
        if into.sample_types != p.sample_types {
            let names = |p: &Profile| {
                p.sample_types
                    .iter()
                    .map(|t| t.name.clone())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            return Err(MergeError::Types(format!(
                "{} and {}",
                names(into),
                names(&p)
            )));
        }
        for s in &p.samples {
            let frames: Vec<u32> = p
                .stacks
                .get(s.stack)
                .iter()
                .map(|&f| into.intern_frame(p.frames.get(f).clone()))
                .collect();
            let stack = into.intern_stack(frames);
            into.add(stack, s.labels.clone(), &s.values);
        }
        into.duration_nanos = into.duration_nanos.max(p.duration_nanos);
        into.time_nanos = into.time_nanos.min(p.time_nanos);
    }
    merged.ok_or(MergeError::Empty)
}

/// Trace pids of a node's processes after the first node that had the same pid: moved up
/// by this per node, below the counter tracks' pids (2^30).
const PID_STRIDE: i64 = 1 << 22;

/// The wall-clock time of a result's timeline zero: what its agent reported, or its start
/// where an older agent reported none.
fn origin(r: &UploadRequest) -> u64 {
    if r.origin_unix_ns != 0 {
        r.origin_unix_ns
    } else {
        r.started_unix_ns
    }
}

/// The timelines of `results` (gzipped Chrome traces) as one trace whose zero is the
/// earliest origin (`otherData.origin_unix_ns`): a process track per node and pid named
/// `node: name`, its thread tracks under it.
pub fn timelines(results: &[UploadRequest]) -> Result<Value, MergeError> {
    let base = results.iter().map(origin).min().ok_or(MergeError::Empty)?;
    let mut events: Vec<Value> = Vec::new();
    let mut seen_pids = std::collections::HashSet::new();
    let mut nodes = Vec::new();
    let mut other = serde_json::Map::new();
    for (k, r) in results.iter().enumerate() {
        let doc = unzip(r)?;
        if k == 0
            && let Some(Value::Object(o)) = doc.get("otherData")
        {
            other = o.clone();
        }
        let shift_us = (origin(r) - base) as f64 / 1000.0;
        let Some(Value::Array(list)) = doc.get("traceEvents").cloned() else {
            return Err(MergeError::Timeline {
                node: r.node.clone(),
                why: "no traceEvents".into(),
            });
        };
        // This node's pids that an earlier node used too move up by a stride per node.
        let mut own = std::collections::HashSet::new();
        for e in &list {
            if let Some(pid) = e.get("pid").and_then(Value::as_i64) {
                own.insert(pid);
            }
        }
        let clash = own.iter().any(|p| seen_pids.contains(p));
        let moved = |pid: i64| {
            if clash && pid < PID_STRIDE {
                pid + PID_STRIDE * k as i64
            } else {
                pid
            }
        };
        for mut e in list {
            if let Some(ts) = e.get("ts").and_then(Value::as_f64) {
                e["ts"] = json!(ts + shift_us);
            }
            if let Some(pid) = e.get("pid").and_then(Value::as_i64) {
                e["pid"] = json!(moved(pid));
                seen_pids.insert(moved(pid));
            }
            if e.get("ph") == Some(&json!("M")) && e.get("name") == Some(&json!("process_name")) {
                let name = e["args"]["name"].as_str().unwrap_or("").to_string();
                e["args"]["name"] = json!(format!("{}: {name}", r.node));
            }
            events.push(e);
        }
        nodes.push(json!({
            "node": r.node,
            "capture": r.id,
            "origin_unix_ns": origin(r),
            "samples": r.samples,
        }));
    }
    other.insert("origin_unix_ns".into(), json!(base));
    other.insert("nodes".into(), Value::Array(nodes));
    Ok(json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": other,
    }))
}

fn unzip(r: &UploadRequest) -> Result<Value, MergeError> {
    let bad = |why: String| MergeError::Timeline {
        node: r.node.clone(),
        why,
    };
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&r.chrome[..]), &mut json)
        .map_err(|e| bad(format!("not gzip: {e}")))?;
    serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn result(node: &str, origin: u64, events: Value) -> UploadRequest {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(json!({ "traceEvents": events }).to_string().as_bytes())
            .unwrap();
        UploadRequest {
            node: node.into(),
            origin_unix_ns: origin,
            chrome: gz.finish().unwrap(),
            ..Default::default()
        }
    }

    /// Two nodes' timelines on one clock: the later origin's events move by the origins'
    /// difference, a pid both nodes have becomes two processes, each named with its node.
    #[test]
    fn timelines_of_two_nodes_share_one_clock_and_keep_their_processes_apart() {
        let a = result(
            "node-a",
            1_000_000_000,
            json!([
                {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "python"}},
                {"ph": "X", "name": "f", "pid": 7, "tid": 7, "ts": 10.0, "dur": 5.0},
            ]),
        );
        let b = result(
            "node-b",
            1_002_000_000,
            json!([
                {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "python"}},
                {"ph": "X", "name": "g", "pid": 7, "tid": 8, "ts": 10.0, "dur": 5.0},
            ]),
        );
        let doc = timelines(&[a, b]).unwrap();
        assert_eq!(doc["otherData"]["origin_unix_ns"], json!(1_000_000_000u64));
        let events = doc["traceEvents"].as_array().unwrap();
        let x: Vec<(&str, i64, f64)> = events
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| {
                (
                    e["name"].as_str().unwrap(),
                    e["pid"].as_i64().unwrap(),
                    e["ts"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(x, vec![("f", 7, 10.0), ("g", 7 + PID_STRIDE, 2010.0)]);
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, vec!["node-a: python", "node-b: python"]);
    }
}
