//! The end of a capture: every distinct stack symbolized once into a [`Profile`], with the
//! timeline's events pointing at its samples.

use std::collections::{HashMap, HashSet};

use pyrometer_ebpf::RawSpan;

use super::gpu::samples::LaunchStack;

use super::{Capture, PY_ENTRY, RawStack, StackCount, Timeline};
use crate::model::{Frame, FrameKind, Interner, LabelValue, Labels, Profile, Sources};
use crate::os::procs::ProcessRegistry;
use crate::python::merge::{self, FrameView};
use crate::python::tracker::PyFrameName;
use crate::symbolize::Symbolizer;

impl Capture {
    /// Symbolizes each distinct user stack once, the frames thrown away: the symbolizer
    /// learns which binaries lack a debug file and starts fetching theirs.
    pub fn request_debug_files(&self, registry: &mut ProcessRegistry, symbolizer: &mut Symbolizer) {
        for raw in self.stacks.keys() {
            symbolizer.user(registry, raw.pid, &raw.user);
        }
    }

    /// Symbolizes every distinct stack into a CPU profile (`period_ns` per sample).
    pub fn into_profile(
        self,
        registry: &mut ProcessRegistry,
        symbolizer: &mut Symbolizer,
        period_ns: i64,
    ) -> Profile {
        self.into_profile_and_timeline(registry, symbolizer, period_ns)
            .0
    }

    /// Like [`Capture::into_profile`], and also returns the timeline (when kept) with its
    /// events pointing at the profile's samples.
    pub fn into_profile_and_timeline(
        mut self,
        registry: &mut ProcessRegistry,
        symbolizer: &mut Symbolizer,
        period_ns: i64,
    ) -> (Profile, Option<Timeline>) {
        let in_use = self.in_use_by_id();
        let mut profile = Profile::with_sources(
            period_ns,
            Sources {
                off_cpu: self.off_cpu,
                gil: self.gil,
                alloc: self.alloc.is_some(),
                gpu_kernels: self.gpu.is_some(),
                gc: self.gc,
            },
        );
        // Raw stack id -> the profile stack and labels its GPU work goes under.
        let mut launch_stacks: HashMap<u32, LaunchStack> = HashMap::new();
        let launching: HashSet<u32> = self
            .gpu
            .as_ref()
            .map(|g| g.account.sums.keys().filter_map(|k| k.stack).collect())
            .unwrap_or_default();
        // Raw stack id -> index into profile.samples.
        let mut sample_of = vec![0u32; self.stacks.len()];
        let mut stacks: Vec<(RawStack, StackCount)> = self.stacks.into_iter().collect();
        sort_stacks(&mut stacks, &self.spans);
        for (
            raw,
            StackCount {
                id,
                count,
                off_cpu_ns,
                gil_wait_ns,
                gil_held,
                gc_ns,
            },
        ) in stacks
        {
            // The Python view shows Python frames only, so not the kernel's either.
            let python_only = self.frames == FrameView::Python && !raw.python.is_empty();
            let mut frames: Vec<Frame> = if python_only {
                Vec::new()
            } else {
                symbolizer.kernel(&raw.kernel)
            };
            if off_cpu_ns > 0 {
                trim_tracepoint_frames(&mut frames);
            }
            let native = symbolizer.user(registry, raw.pid, &raw.user);
            if raw.python.is_empty() {
                frames.extend(native);
            } else {
                let python: Vec<(Frame, bool)> = raw
                    .python
                    .iter()
                    .map(|&id| {
                        let name = self.py_names.get(id & !PY_ENTRY);
                        (python_frame(name), id & PY_ENTRY != 0)
                    })
                    .collect();
                let module = self.py_modules.get(&raw.pid).map(|m| &**m);
                frames.extend(merge::merge(
                    native,
                    &python,
                    self.frames,
                    module,
                    raw.complete,
                ));
            }
            if frames.is_empty() {
                frames.push(Frame::named("[no stack]", FrameKind::Unknown));
            }
            let ids: Vec<u32> = frames
                .into_iter()
                .map(|f| profile.intern_frame(f))
                .collect();
            let stack = profile.intern_stack(ids);
            let process = registry
                .get(raw.pid)
                .map(|p| p.comm.clone())
                .unwrap_or_else(|| raw.thread.clone());
            let thread = match self.late_names.get(&(raw.pid, raw.tid)) {
                Some(name) if !raw.thread_named => name.clone(),
                _ => raw.thread.clone(),
            };
            let mut labels =
                stack_labels(&raw, process, thread, raw.span.map(|id| self.spans.get(id)));
            if let Some(task) = innermost_task(&self.py_names, &raw.python) {
                labels = labels.with(TASK_LABEL, LabelValue::Str(task));
            }
            let ns = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let n = ns(count);
            let mut values = vec![n, n.saturating_mul(period_ns)];
            if self.off_cpu {
                values.push(ns(off_cpu_ns));
            }
            if self.gil {
                values.push(ns(gil_wait_ns));
                values.push(ns(gil_held).saturating_mul(period_ns));
            }
            if let Some(a) = &self.alloc {
                let (objects, bytes) = a.sums(id);
                let (live_objects, live_bytes) = in_use.get(&id).copied().unwrap_or_default();
                values.extend([objects, bytes, live_objects, live_bytes].map(|v| v.round() as i64));
            }
            if self.gpu.is_some() {
                values.extend([0, 0]);
            }
            if self.gc {
                values.push(ns(gc_ns));
            }
            if launching.contains(&id) {
                launch_stacks.insert(
                    id,
                    LaunchStack {
                        stack,
                        labels: labels.clone(),
                    },
                );
            }
            // A stack that only launched GPU work (or waits for its records, handed over from
            // an earlier push) has no value of its own.
            if values.iter().all(|&v| v == 0) {
                continue;
            }
            let index = profile.add(stack, labels, &values);
            sample_of[id as usize] = u32::try_from(index).unwrap_or(u32::MAX);
        }
        let keep_spans = self.timeline.is_some();
        let gpu_spans = match self.gpu.as_mut() {
            Some(g) => g.add_to_profile(&mut profile, &launch_stacks, registry, keep_spans),
            None => Vec::new(),
        };
        let timeline = self.timeline.map(|mut t| {
            t.gpu = gpu_spans;
            for e in &mut t.events {
                e.sample = sample_of[e.sample as usize];
            }
            for e in &mut t.off_cpu {
                e.sample = sample_of[e.sample as usize];
            }
            t
        });
        (profile, timeline)
    }
}

/// With `--async`, the name of the innermost task of a stack's Python frames (leaf first).
fn innermost_task(names: &Interner<PyFrameName>, python: &[u32]) -> Option<String> {
    python
        .iter()
        .map(|&id| names.get(id & !PY_ENTRY))
        .find(|name| name.task)
        .map(|task| task.function.to_string())
}

/// Orders the stacks by their content: the same capture gives the same profile, whatever the
/// hash map's order.
fn sort_stacks(stacks: &mut [(RawStack, StackCount)], spans: &Interner<RawSpan>) {
    stacks.sort_by(|a, b| {
        (
            a.0.pid,
            a.0.tid,
            &a.0.user,
            &a.0.kernel,
            &a.0.ray,
            a.0.span.map(|id| spans.get(id)),
            &a.0.python,
            a.0.complete,
            a.0.gc_generation,
        )
            .cmp(&(
                b.0.pid,
                b.0.tid,
                &b.0.user,
                &b.0.kernel,
                &b.0.ray,
                b.0.span.map(|id| spans.get(id)),
                &b.0.python,
                b.0.complete,
                b.0.gc_generation,
            ))
    });
}

/// A stack's labels: its process and thread, its Ray task and span where it has them.
fn stack_labels(raw: &RawStack, process: String, thread: String, span: Option<&RawSpan>) -> Labels {
    let labels = Labels::new()
        .with("pid", LabelValue::Num(i64::from(raw.pid)))
        .with("tid", LabelValue::Num(i64::from(raw.tid)))
        .with("comm", LabelValue::Str(process))
        .with("thread", LabelValue::Str(thread));
    let labels = match raw.ray.as_deref() {
        Some(ray) => {
            let mut l = labels.with("ray_task", LabelValue::Str(ray.task.clone()));
            if let Some(actor) = &ray.actor {
                l.set("ray_actor", LabelValue::Str(actor.clone()));
            }
            if let Some(job) = &ray.job {
                l.set("ray_job", LabelValue::Str(job.clone()));
            }
            l
        }
        None => labels,
    };
    // A collection's generation; "unknown" where its probe site could not say.
    let labels = match raw.gc_generation {
        Some(super::GC_GENERATION_UNKNOWN) => {
            labels.with("gc_generation", LabelValue::Str("unknown".into()))
        }
        Some(g) => labels.with("gc_generation", LabelValue::Num(i64::from(g))),
        None => labels,
    };
    match span {
        Some(span) => span_labels(labels, span),
        None => labels,
    }
}

/// The `trace_id`, `span_id` and (when the record held one) `span_name` labels of a span.
fn span_labels(labels: Labels, span: &RawSpan) -> Labels {
    let labels = labels
        .with("trace_id", LabelValue::Str(span.trace_hex()))
        .with("span_id", LabelValue::Str(span.span_hex()));
    if span.name.is_empty() {
        labels
    } else {
        labels.with("span_name", LabelValue::Str(span.name.clone()))
    }
}

/// The label with a sample's innermost asyncio task (`--async`).
pub const TASK_LABEL: &str = "asyncio_task";

/// A Python frame as a profile frame: no module or address, its file and line.
fn python_frame(name: &PyFrameName) -> Frame {
    if name.task {
        return Frame::named(&*name.function, FrameKind::Task);
    }
    Frame {
        file: name.file.as_deref().map(str::to_string),
        line: name.line,
        ..Frame::named(&*name.function, FrameKind::Python)
    }
}

/// Drops the tracepoint machinery from the leaf of an off-CPU kernel stack, which was taken
/// from inside the sched_switch program: the BPF program skips its own two frames, but whether
/// `__traceiter_sched_switch` shows up as a third depends on the call path, so the rest is
/// cut here by name, leaving the stack to end in the scheduler.
pub(super) fn trim_tracepoint_frames(frames: &mut Vec<Frame>) {
    let machinery = |f: &Frame| {
        f.function.starts_with("__traceiter_")
            || f.function.starts_with("bpf_trace_run")
            || f.function.starts_with("bpf_prog_")
    };
    if let Some(last) = frames.iter().take(4).rposition(machinery) {
        frames.drain(..=last);
    }
}
