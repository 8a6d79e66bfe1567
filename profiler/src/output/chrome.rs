//! Chrome trace event JSON (the format of chrome://tracing, Perfetto and `ray.timeline()`):
//! one track per sampled thread, on-CPU time as slices.
//!
//! Consecutive samples of a thread with the same call chain (by function names, so a loop
//! sampled at different addresses stays one slice) merge into one complete (`X`) event
//! named by the leaf function, with the whole stack in `args`. A sample stands for the
//! `period` before it (cpu-clock fires after the thread ran that long), so a slice starts
//! one period before its first sample. Samples more than 1.5 periods apart are not
//! consecutive: the thread was off the CPU, or ran something unsampled, in between, which
//! is what leaves visible gaps in the track. Off-CPU intervals (`record --off-cpu`) are slices
//! of their own, `off-CPU: <innermost user frame>` in category `off_cpu`, filling those gaps
//! where the thread blocked. GIL-wait and GPU sources, when they run, add their own slices and counter tracks beside these: each of the timeline's
//! [`CounterTrack`]s becomes counter (`C`) events under a process of its own (one per GPU),
//! whose pid is [`COUNTER_PID_BASE`] plus the track's index, above any real pid.
//!
//! GPU work (`record --gpu-kernels`) goes on the same GPU processes, one thread (track) per
//! device stream of each profiled process, a complete event per kernel, copy or set. A sampled
//! launch's event carries its launching stack in `args` and a flow arrow (`s` on the launching
//! thread when its stack was taken, `f` on the kernel) ties the two.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use serde_json::{Value, json};

use crate::capture::{CounterTrack, GpuSpan, IntervalKind, OffCpuInterval, Timeline};
use crate::model::{LabelValue, Profile};
use crate::output::OutputError;
use crate::output::folded::frame_name;

/// Trace pids of counter-track processes start here: above Linux's largest pid (2^22), so
/// they never collide with a sampled process.
pub const COUNTER_PID_BASE: i64 = 1 << 30;

/// Microseconds (Chrome trace `ts`/`dur`) from nanoseconds, keeping sub-µs precision.
fn micros(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

fn num(v: Option<&LabelValue>) -> i64 {
    match v {
        Some(LabelValue::Num(n)) => *n,
        Some(LabelValue::Str(s)) => s.parse().unwrap_or(0),
        None => 0,
    }
}

/// What a profile sample contributes to a track.
struct SampleInfo {
    pid: i64,
    tid: i64,
    /// Function names, leaf first, interned so equal chains compare as one id.
    chain: usize,
    /// A garbage collection's generation (its `gc_generation` label).
    gc_generation: Option<String>,
}

/// A run of consecutive samples with one call chain.
struct Slice {
    first_ns: u64,
    last_ns: u64,
    chain: usize,
    samples: u64,
}

/// The trace document of `timeline`, whose events index `profile.samples`.
pub fn to_chrome_trace(profile: &Profile, timeline: &Timeline) -> Result<Value, OutputError> {
    let mut chains: Vec<Vec<String>> = Vec::new();
    let mut chain_ids: HashMap<Vec<String>, usize> = HashMap::new();
    let names: Vec<String> = profile.frames.iter().map(frame_name).collect();
    // Names by how many samples carry them: a process that exec'd, or renamed a thread,
    // shows under the name it ran under the longest.
    let mut processes: BTreeMap<i64, HashMap<String, i64>> = BTreeMap::new();
    let mut threads: BTreeMap<(i64, i64), HashMap<String, i64>> = BTreeMap::new();
    let infos: Vec<SampleInfo> = profile
        .samples
        .iter()
        .map(|s| {
            let pid = num(s.labels.get("pid"));
            let tid = num(s.labels.get("tid"));
            let comm = s.labels.get("comm").map(ToString::to_string);
            let thread = s
                .labels
                .get("thread")
                .or_else(|| s.labels.get("thread_name"))
                .map(ToString::to_string);
            let n = s.values.first().copied().unwrap_or(0);
            if let Some(c) = &comm {
                *processes
                    .entry(pid)
                    .or_default()
                    .entry(c.clone())
                    .or_default() += n;
            }
            if let Some(t) = thread.or(comm) {
                *threads.entry((pid, tid)).or_default().entry(t).or_default() += n;
            }
            let mut chain: Vec<String> = profile
                .stacks
                .get(s.stack)
                .iter()
                .map(|&f| names[f as usize].clone())
                .collect();
            if chain.is_empty() {
                chain.push("[unknown]".to_string());
            }
            let next = chains.len();
            let id = *chain_ids.entry(chain.clone()).or_insert(next);
            if id == next {
                chains.push(chain);
            }
            SampleInfo {
                pid,
                tid,
                chain: id,
                gc_generation: s.labels.get("gc_generation").map(ToString::to_string),
            }
        })
        .collect();

    let mut by_thread: BTreeMap<(i64, i64), Vec<(u64, usize)>> = BTreeMap::new();
    for e in &timeline.events {
        let Some(info) = infos.get(e.sample as usize) else {
            continue;
        };
        by_thread
            .entry((info.pid, info.tid))
            .or_default()
            .push((e.timestamp_ns, info.chain));
    }
    if by_thread.is_empty() && timeline.off_cpu.is_empty() && timeline.gpu.is_empty() {
        return Err(OutputError::Empty("timeline".to_string()));
    }

    let mut events: Vec<Value> = Vec::new();
    for (pid, names) in &processes {
        events.push(json!({
            "ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": { "name": most_common(names) },
        }));
    }
    for ((pid, tid), names) in &threads {
        events.push(json!({
            "ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
            "args": { "name": most_common(names) },
        }));
    }
    thread_slices(&mut by_thread, &chains, timeline, &mut events);
    for e in &timeline.off_cpu {
        let Some(info) = infos.get(e.sample as usize) else {
            continue;
        };
        events.push(off_cpu_event(
            e,
            &chains[info.chain],
            info,
            timeline.origin_ns,
        ));
    }
    let named = counter_events(&timeline.counters, timeline.origin_ns, &mut events);
    gpu_events(
        &timeline.gpu,
        &chains,
        &infos,
        named,
        timeline.origin_ns,
        &mut events,
    );
    let mut doc = json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "exporter": concat!("pyrometer ", env!("CARGO_PKG_VERSION")),
            "period_ns": timeline.period_ns,
            "samples": timeline.events.len(),
            "timeline_capacity": timeline.capacity,
            "samples_not_in_timeline": timeline.dropped,
        },
    });
    if !timeline.gpu.is_empty() {
        doc["otherData"]["gpu_slices"] = json!(timeline.gpu.len());
    }
    Ok(doc)
}

/// Each thread's samples as slices: consecutive samples of one stack, a period or so apart,
/// make one slice.
fn thread_slices(
    by_thread: &mut BTreeMap<(i64, i64), Vec<(u64, usize)>>,
    chains: &[Vec<String>],
    timeline: &Timeline,
    events: &mut Vec<Value>,
) {
    let period = timeline.period_ns.max(1);
    for (&(pid, tid), samples) in by_thread.iter_mut() {
        // Records of different CPUs reach the ring buffer slightly out of order.
        samples.sort_unstable();
        let mut current: Option<Slice> = None;
        for &(ts, chain) in samples.iter() {
            if let Some(s) = current.as_mut()
                && s.chain == chain
                && ts.saturating_sub(s.last_ns) <= period + period / 2
            {
                s.last_ns = ts;
                s.samples += 1;
                continue;
            }
            if let Some(s) = current.take() {
                events.push(slice_event(
                    &s,
                    chains,
                    pid,
                    tid,
                    timeline.origin_ns,
                    period,
                ));
            }
            current = Some(Slice {
                first_ns: ts,
                last_ns: ts,
                chain,
                samples: 1,
            });
        }
        if let Some(s) = current {
            events.push(slice_event(
                &s,
                chains,
                pid,
                tid,
                timeline.origin_ns,
                period,
            ));
        }
    }
}

/// Returns the trace pids it named.
fn counter_events(
    tracks: &[CounterTrack],
    origin: u64,
    events: &mut Vec<Value>,
) -> std::collections::BTreeSet<i64> {
    let mut named = std::collections::BTreeSet::new();
    for t in tracks {
        let pid = COUNTER_PID_BASE + i64::from(t.process_index);
        if named.insert(pid) {
            events.push(json!({
                "ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                "args": { "name": t.process },
            }));
        }
        for p in &t.points {
            let args: serde_json::Map<String, Value> = p
                .values
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            events.push(json!({
                "ph": "C",
                "name": t.name,
                "pid": pid,
                "tid": 0,
                "ts": micros(p.timestamp_ns.saturating_sub(origin)),
                "args": args,
            }));
        }
    }
    named
}

/// The GPU processes' pids: NVML's index above [`COUNTER_PID_BASE`], as the counter tracks
/// have it; a device known only by its UUID after the indexes.
fn gpu_pid(device: &str, others: &mut BTreeMap<String, i64>) -> i64 {
    match device.parse::<u32>() {
        Ok(index) => COUNTER_PID_BASE + i64::from(index),
        Err(_) => {
            let next = COUNTER_PID_BASE + 4096 + others.len() as i64;
            *others.entry(device.to_string()).or_insert(next)
        }
    }
}

fn gpu_events(
    spans: &[GpuSpan],
    chains: &[Vec<String>],
    infos: &[SampleInfo],
    mut named: std::collections::BTreeSet<i64>,
    origin: u64,
    events: &mut Vec<Value>,
) {
    let mut others = BTreeMap::new();
    // One track per (device, process, stream), numbered in order.
    let mut tracks: BTreeMap<(i64, u32, u32), i64> = BTreeMap::new();
    for s in spans {
        tracks.insert((gpu_pid(&s.device, &mut others), s.pid, s.stream), 0);
    }
    for (n, ((pid, process, stream), tid)) in tracks.iter_mut().enumerate() {
        *tid = n as i64 + 1;
        events.push(json!({
            "ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
            "args": { "name": format!("stream {stream} (pid {process})") },
        }));
    }
    for s in spans {
        let pid = gpu_pid(&s.device, &mut others);
        if named.insert(pid) {
            events.push(json!({
                "ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                "args": { "name": format!("GPU {}", s.device) },
            }));
        }
    }
    for (i, s) in spans.iter().enumerate() {
        let pid = gpu_pid(&s.device, &mut others);
        let tid = tracks[&(pid, s.pid, s.stream)];
        let ts = micros(s.start_ns.saturating_sub(origin));
        let mut args = json!({ "correlation": s.correlation, "pid": s.pid });
        let stack = s.sample.and_then(|i| infos.get(i as usize));
        if let Some(info) = stack {
            // The launching stack, without the leaf (this event is the leaf).
            args["stack"] = json!(chains[info.chain][1..]);
        }
        events.push(json!({
            "ph": "X",
            "cat": "gpu",
            "name": s.name,
            "pid": pid,
            "tid": tid,
            "ts": ts,
            "dur": micros(s.end_ns.saturating_sub(s.start_ns)),
            "args": args,
        }));
        if let (Some((launch_tid, launched)), Some(_)) = (s.launch, stack) {
            events.push(json!({
                "ph": "s", "cat": "gpu_launch", "name": "launch", "id": i,
                "pid": s.pid, "tid": launch_tid,
                "ts": micros(launched.saturating_sub(origin)),
            }));
            events.push(json!({
                "ph": "f", "bp": "e", "cat": "gpu_launch", "name": "launch", "id": i,
                "pid": pid, "tid": tid, "ts": ts,
            }));
        }
    }
}

/// The name with the most samples, ties broken by name so output is deterministic.
fn most_common(names: &HashMap<String, i64>) -> &str {
    names
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
        .map_or("", |(n, _)| n.as_str())
}

fn slice_event(
    s: &Slice,
    chains: &[Vec<String>],
    pid: i64,
    tid: i64,
    origin: u64,
    period: u64,
) -> Value {
    let start = s.first_ns.saturating_sub(period).max(origin);
    let chain = &chains[s.chain];
    json!({
        "ph": "X",
        "cat": "cpu",
        "name": chain[0],
        "pid": pid,
        "tid": tid,
        "ts": micros(start - origin),
        "dur": micros(s.last_ns.saturating_sub(start)),
        "args": { "stack": chain, "samples": s.samples },
    })
}

/// An off-CPU interval (or a GIL wait) as its own slice, named by the innermost user-space
/// frame (where the code chose to block: the kernel leaf is always the scheduler), on the
/// thread's track.
fn off_cpu_event(e: &OffCpuInterval, chain: &[String], info: &SampleInfo, origin: u64) -> Value {
    let leaf = chain
        .iter()
        .find(|f| !f.ends_with("_[k]"))
        .unwrap_or(&chain[0]);
    let (cat, what, key) = match e.kind {
        IntervalKind::GilWait => ("gil_wait", "GIL wait", "waited_ns"),
        IntervalKind::Gc => ("gc", "GC", "paused_ns"),
        IntervalKind::OffCpu => ("off_cpu", "off-CPU", "blocked_ns"),
    };
    let mut args = json!({ "stack": chain, key: e.duration_ns });
    if let Some(g) = &info.gc_generation {
        args["generation"] = json!(g);
    }
    json!({
        "ph": "X",
        "cat": cat,
        "name": format!("{what}: {leaf}"),
        "pid": info.pid,
        "tid": info.tid,
        "ts": micros(e.timestamp_ns.saturating_sub(origin)),
        "dur": micros(e.duration_ns),
        "args": args,
    })
}

/// Writes the profile and its timeline as a Chrome trace.
pub fn write_chrome_trace(
    profile: &Profile,
    timeline: &Timeline,
    out: &mut dyn Write,
) -> Result<(), OutputError> {
    let doc = to_chrome_trace(profile, timeline)?;
    serde_json::to_writer(&mut *out, &doc).map_err(std::io::Error::from)?;
    out.write_all(b"\n")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::TimelineEvent;
    use crate::model::{Frame, FrameKind, Labels};

    const MS: u64 = 1_000_000;

    /// Thread 11 of process 10: `spin` every ms for 10 ms, nothing for 100 ms, `spin`
    /// again; thread 12 alternates two functions each ms.
    fn fixture() -> (Profile, Timeline) {
        let mut p = Profile::cpu(MS as i64);
        let main = p.intern_frame(Frame::named("main", FrameKind::Native));
        let spin = p.intern_frame(Frame::named("spin", FrameKind::Native));
        let spin2 = p.intern_frame(Frame {
            address: 8,
            ..Frame::named("spin", FrameKind::Native)
        });
        let read = p.intern_frame(Frame::named("vfs_read", FrameKind::Kernel));
        let labels = |tid, thread: &str| {
            Labels::new()
                .with("pid", LabelValue::Num(10))
                .with("tid", LabelValue::Num(tid))
                .with("comm", LabelValue::Str("prog".into()))
                .with("thread", LabelValue::Str(thread.into()))
        };
        let s_spin = p.intern_stack(vec![spin, main]);
        let s_spin2 = p.intern_stack(vec![spin2, main]);
        let s_read = p.intern_stack(vec![read, main]);
        let a = p.add(s_spin, labels(11, "worker"), &[1, 1]) as u32;
        // Named "sh" for one sample before an exec: "worker" wins.
        p.add(s_read, labels(11, "sh"), &[1, 1]);
        let a2 = p.add(s_spin2, labels(11, "worker"), &[1, 1]) as u32;
        let b = p.add(s_read, labels(12, "io"), &[1, 1]) as u32;
        let c = p.add(s_spin, labels(12, "io"), &[1, 1]) as u32;
        let origin = 1_000 * MS;
        let mut t = Timeline::new(100, origin, MS);
        let mut at = |ms: u64, sample| {
            t.events.push(TimelineEvent {
                timestamp_ns: origin + ms * MS,
                sample,
            })
        };
        for ms in 1..=10 {
            // Two addresses in one function: still one slice.
            at(ms, if ms % 2 == 0 { a } else { a2 });
        }
        for ms in 111..=120 {
            at(ms, a);
        }
        for ms in 1..=4 {
            at(ms, if ms % 2 == 0 { b } else { c });
        }
        (p, t)
    }

    fn slices(doc: &Value, tid: i64) -> Vec<(String, f64, f64)> {
        doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == tid)
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["ts"].as_f64().unwrap(),
                    e["dur"].as_f64().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn consecutive_samples_merge_and_gaps_stay() {
        let (p, t) = fixture();
        let doc = to_chrome_trace(&p, &t).unwrap();
        // 1..10 ms of samples cover 0..10 ms; 111..120 cover 110..120 ms.
        assert_eq!(
            slices(&doc, 11),
            [
                ("spin".to_string(), 0.0, 10_000.0),
                ("spin".to_string(), 110_000.0, 10_000.0)
            ]
        );
        let io = slices(&doc, 12);
        let names: Vec<&str> = io.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(names, ["spin", "vfs_read_[k]", "spin", "vfs_read_[k]"]);
        let first = doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["ph"] == "X")
            .unwrap();
        assert_eq!(first["args"]["stack"], json!(["spin", "main"]));
        assert_eq!(first["args"]["samples"], 10);
    }

    #[test]
    fn off_cpu_intervals_are_slices_named_by_the_user_leaf() {
        let (p, mut t) = fixture();
        // Thread 11 blocked in vfs_read (under main) for the 100 ms gap; sample 1 is that stack.
        t.off_cpu.push(OffCpuInterval {
            timestamp_ns: t.origin_ns + 10 * MS,
            duration_ns: 100 * MS,
            sample: 1,
            kind: IntervalKind::OffCpu,
        });
        t.off_cpu.push(OffCpuInterval {
            timestamp_ns: t.origin_ns + 200 * MS,
            duration_ns: 5 * MS,
            sample: 1,
            kind: IntervalKind::GilWait,
        });
        let doc = to_chrome_trace(&p, &t).unwrap();
        let blocked: Vec<_> = slices(&doc, 11)
            .into_iter()
            .filter(|s| s.0.starts_with("off-CPU"))
            .collect();
        assert_eq!(
            blocked,
            [("off-CPU: main".to_string(), 10_000.0, 100_000.0)]
        );
        let gil: Vec<_> = slices(&doc, 11)
            .into_iter()
            .filter(|s| s.0.starts_with("GIL wait"))
            .collect();
        assert_eq!(gil, [("GIL wait: main".to_string(), 200_000.0, 5_000.0)]);
    }

    #[test]
    fn gc_pauses_are_slices_with_their_generation() {
        let (mut p, mut t) = fixture();
        let collect = p.intern_frame(Frame::named("full_collections", FrameKind::Python));
        let stack = p.intern_stack(vec![collect]);
        let labels = Labels::new()
            .with("pid", LabelValue::Num(10))
            .with("tid", LabelValue::Num(11))
            .with("gc_generation", LabelValue::Num(2));
        let values = vec![0; p.sample_types.len()];
        let sample = p.add(stack, labels, &values) as u32;
        t.off_cpu.push(OffCpuInterval {
            timestamp_ns: t.origin_ns + 300 * MS,
            duration_ns: 40 * MS,
            sample,
            kind: IntervalKind::Gc,
        });
        let doc = to_chrome_trace(&p, &t).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let gc: Vec<&Value> = events.iter().filter(|e| e["cat"] == "gc").collect();
        assert_eq!(gc.len(), 1, "{gc:?}");
        assert_eq!(gc[0]["name"], "GC: full_collections");
        assert_eq!(gc[0]["args"]["generation"], "2");
        assert_eq!(gc[0]["args"]["paused_ns"], 40 * MS);
        assert_eq!(gc[0]["dur"], 40_000.0);
        assert_eq!(gc[0]["tid"], 11);
    }

    #[test]
    fn gpu_work_gets_a_track_per_stream_linked_to_its_launch() {
        let (mut p, mut t) = fixture();
        let kernel = p.intern_frame(Frame::named("gemm", FrameKind::Gpu));
        let main = p.intern_frame(Frame::named("main", FrameKind::Native));
        let stack = p.intern_stack(vec![kernel, main]);
        let labels = Labels::new()
            .with("pid", LabelValue::Num(10))
            .with("tid", LabelValue::Num(11));
        let sample = p.add(stack, labels, &[0, 0]) as u32;
        let span = |stream, start_ms, sampled: bool| GpuSpan {
            device: "1".into(),
            pid: 10,
            stream,
            start_ns: t.origin_ns + start_ms * MS,
            end_ns: t.origin_ns + (start_ms + 2) * MS,
            name: "gemm".into(),
            correlation: 7,
            sample: sampled.then_some(sample),
            launch: sampled.then_some((11, t.origin_ns + start_ms * MS - MS)),
        };
        t.gpu = vec![span(3, 20, true), span(3, 30, false), span(5, 20, false)];
        let doc = to_chrome_trace(&p, &t).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let gpu_pid = COUNTER_PID_BASE + 1;
        let gpu: Vec<&Value> = events
            .iter()
            .filter(|e| e["cat"] == "gpu" && e["pid"] == gpu_pid)
            .collect();
        assert_eq!(gpu.len(), 3);
        // Two streams, two tracks, named.
        let tids: std::collections::BTreeSet<i64> =
            gpu.iter().map(|e| e["tid"].as_i64().unwrap()).collect();
        assert_eq!(tids.len(), 2);
        assert!(events.iter().any(|e| e["ph"] == "M"
            && e["pid"] == gpu_pid
            && e["args"]["name"] == "stream 3 (pid 10)"));
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "M" && e["pid"] == gpu_pid && e["args"]["name"] == "GPU 1")
        );
        // The sampled one names its launching stack and has its arrow from thread 11.
        assert_eq!(gpu[0]["args"]["stack"], json!(["main"]));
        assert!(gpu[1]["args"].get("stack").is_none());
        let flow: Vec<&Value> = events.iter().filter(|e| e["cat"] == "gpu_launch").collect();
        assert_eq!(flow.len(), 2);
        assert_eq!(
            (flow[0]["ph"].as_str(), flow[0]["tid"].as_i64()),
            (Some("s"), Some(11))
        );
        assert_eq!(flow[1]["ph"], "f");
        assert_eq!(flow[1]["ts"], gpu[0]["ts"]);
        assert_eq!(doc["otherData"]["gpu_slices"], 3);
    }

    #[test]
    fn metadata_names_processes_and_threads() {
        let (p, t) = fixture();
        let doc = to_chrome_trace(&p, &t).unwrap();
        let meta: Vec<(String, i64, String)> = doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["tid"].as_i64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            meta,
            [
                ("process_name".to_string(), 0, "prog".to_string()),
                ("thread_name".to_string(), 11, "worker".to_string()),
                ("thread_name".to_string(), 12, "io".to_string()),
            ]
        );
        assert_eq!(doc["otherData"]["samples"], 24);
    }

    #[test]
    fn counter_tracks_become_counter_events() {
        use crate::capture::CounterPoint;
        let (p, mut t) = fixture();
        let point = |ms: u64, v: f64| CounterPoint {
            timestamp_ns: t.origin_ns + ms * MS,
            values: vec![("gpu_%".to_string(), v)],
        };
        t.counters = vec![
            CounterTrack {
                process: "GPU 0".into(),
                process_index: 0,
                name: "GPU utilization".into(),
                points: vec![point(0, 0.0), point(100, 80.0)],
            },
            CounterTrack {
                process: "GPU 1".into(),
                process_index: 1,
                name: "GPU utilization".into(),
                points: vec![point(50, 25.0)],
            },
        ];
        let doc = to_chrome_trace(&p, &t).unwrap();
        let counters: Vec<(i64, f64, f64)> = doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "C")
            .map(|e| {
                (
                    e["pid"].as_i64().unwrap() - COUNTER_PID_BASE,
                    e["ts"].as_f64().unwrap(),
                    e["args"]["gpu_%"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            counters,
            [(0, 0.0, 0.0), (0, 100_000.0, 80.0), (1, 50_000.0, 25.0)]
        );
        let gpu_names = doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "M" && e["pid"].as_i64().unwrap() >= COUNTER_PID_BASE)
            .count();
        assert_eq!(gpu_names, 2);
    }

    #[test]
    fn out_of_order_events_are_sorted_and_empty_is_an_error() {
        let (p, mut t) = fixture();
        t.events.reverse();
        let doc = to_chrome_trace(&p, &t).unwrap();
        assert_eq!(slices(&doc, 11).len(), 2);
        t.events.clear();
        assert!(matches!(
            to_chrome_trace(&p, &t),
            Err(OutputError::Empty(_))
        ));
    }
}
