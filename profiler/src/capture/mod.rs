//! Turns ring-buffer records into counted raw stacks while the capture runs, and into a
//! symbolized [`Profile`] at the end.
//!
//! Symbolization is deferred: a raw stack is a few addresses, so the capture loop stays cheap
//! and each distinct stack is symbolized once. What cannot wait is the process's memory map,
//! which is read the first time a process is seen (and again when an address falls outside
//! it, e.g. after `dlopen`) so that processes exiting mid-capture are still symbolized.
//!
//! Outputs that show time (the Chrome trace) also need each sample's timestamp: with
//! [`Capture::with_timeline`] the capture keeps a bounded [`Timeline`] of
//! (timestamp, raw stack) per sample beside the counts.

use std::collections::{HashMap, HashSet};

use pyrometer_ebpf::{RawSample, RawSpan};

use std::sync::Arc;

use crate::bpf::Sampler;
use crate::model::{Frame, FrameKind, Interner, LabelValue, Labels, Profile, Sources};
use crate::procs::ProcessRegistry;
use crate::python::merge::{self, FrameView};
use crate::python::tracker::{PyFrameName, PyTracker};
use crate::symbolize::Symbolizer;

mod alloc;
mod timeline;
pub use alloc::{AllocState, LiveBlock};
pub use timeline::{
    Activity, CounterPoint, CounterTrack, DEFAULT_ACTIVITY_BUCKET_NS, DEFAULT_ACTIVITY_BUCKETS,
    DEFAULT_TIMELINE_EVENTS, OffCpuInterval, Timeline, TimelineEvent,
};

/// One distinct stack of one thread, as the kernel reported it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RawStack {
    pub pid: u32,
    pub tid: u32,
    /// The thread's `threading` name, else its comm, at sample time.
    pub thread: String,
    /// `thread` is the `threading` name (false: the comm, for a Python thread whose name was
    /// not readable yet, see [`Capture::name_late_threads`]).
    pub thread_named: bool,
    /// User return addresses, leaf first.
    pub user: Vec<u64>,
    /// Kernel addresses, leaf first.
    pub kernel: Vec<u64>,
    /// The Ray task the process ran when sampled (its title), for Ray workers.
    pub ray: Option<std::sync::Arc<crate::ray::RayLabels>>,
    /// The OpenTelemetry span the thread was in (pyrometer-otel): an id into the capture's
    /// spans.
    pub span: Option<u32>,
    /// Python frames, innermost first: ids into the capture's Python frame names, with
    /// [`PY_ENTRY`] set on the outermost frame of each eval call.
    pub python: Vec<u32>,
    /// The native walk reached the outermost frame (the DWARF unwinder said so).
    pub complete: bool,
}

/// Marks the outermost Python frame of one `_PyEval_EvalFrameDefault` call in
/// [`RawStack::python`].
pub const PY_ENTRY: u32 = 1 << 31;

/// A distinct raw stack's dense id (its timeline events refer to it), on-CPU sample count
/// and off-CPU (blocked) nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackCount {
    pub id: u32,
    pub count: u64,
    pub off_cpu_ns: u64,
    /// Contended GIL wait (ns) that began in this stack.
    pub gil_wait_ns: u64,
    /// On-CPU samples taken while the thread held the GIL.
    pub gil_held: u64,
}

/// The current CLOCK_MONOTONIC time in ns, the clock BPF timestamps use.
pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// What the capture loop accumulates.
#[derive(Default)]
pub struct Capture {
    pub stacks: crate::FastMap<RawStack, StackCount>,
    /// Per-sample times, when an output needs them.
    pub timeline: Option<Timeline>,
    /// Samples per time bucket, when something asks when the targets were on the CPU.
    pub activity: Option<Activity>,
    /// On-CPU samples read from the ring buffer.
    pub samples: u64,
    /// The profile gets the `off_cpu/nanoseconds` type (`record --off-cpu`).
    pub off_cpu: bool,
    /// The profile gets the `gil_wait` and `gil_held` types (`record --gil`).
    pub gil: bool,
    /// Contended GIL waits read, and their total.
    pub gil_wait_events: u64,
    pub gil_wait_ns: u64,
    /// On-CPU samples per thread: (pid, thread label, samples), for the GIL table.
    pub thread_samples: HashMap<u32, (u32, String, u64)>,
    /// Allocation sampling (`--alloc`): the profile gets the allocation types.
    pub alloc: Option<AllocState>,
    /// The agent: allocation sampling starts, with this mean, at the first report of a
    /// process that preloads the sampler library (when `alloc` is None).
    pub alloc_on_preload: Option<u64>,
    /// Times the live-block table was full and its older half dropped.
    pub alloc_live_dropped: u64,
    /// Off-CPU intervals read from the ring buffer, and their total blocked time.
    pub off_cpu_events: u64,
    pub off_cpu_ns: u64,
    /// Threads still blocked whose interval was partly reported by
    /// [`Capture::ingest_pending`]: tid -> (when it blocked, reported up to). A daemon hands
    /// this to the next interval's capture, so a long block is counted once, across pushes.
    /// The flag marks an entry whose thread was not blocked at the last flush: its wake-up
    /// record may still be in the ring buffer, so it is kept for one more flush.
    pub off_cpu_reported: HashMap<u32, (u64, u64, bool)>,
    /// Records that failed to parse (never expected; counted, not hidden).
    pub bad_records: u64,
    /// Kernel stack ids that were gone from the stack map when read.
    pub missing_kernel_stacks: u64,
    pub pids: HashSet<u32>,
    /// An exec only makes the registry forget the process; its new image is read at its
    /// next sample. For the node agent: at 19 Hz most processes that exec on a busy node
    /// are never sampled, and reading each new image (maps, unwind tables, Python version)
    /// at its exec was most of the agent's work. `record` reads at once, so that a target's
    /// first samples after its exec already unwind and carry Python frames.
    pub exec_lazily: bool,
    /// With `exec_lazily`: the pids that exec'd, for the caller to take.
    pub execs: Vec<u32>,
    /// Pids whose maps the caller read after their exec, and when (CLOCK_MONOTONIC ns):
    /// `record`'s start-up handshake with the sampler library. Their exec events from before
    /// that read are not read again: by the time the event is taken a short command may have
    /// exited, and re-reading its maps then would lose the ones that were read.
    pub maps_read_after_exec: HashMap<u32, u64>,
    /// Pids whose memory map was (re)read since the caller last took this list: the DWARF
    /// unwinder's tables for them need an update.
    pub maps_changed: Vec<u32>,
    /// Which frames the profile's stacks keep (`--frames`).
    pub frames: FrameView,
    /// Python frames named as they arrived (while their process was alive).
    py_names: Interner<PyFrameName>,
    /// The interpreter module of each process that had Python frames.
    py_modules: HashMap<u32, Arc<str>>,
    /// Python frames whose process was no longer registered when their record was read.
    pub py_unresolved: u64,
    /// Python frames read from records.
    pub py_frames_seen: u64,
    /// The OpenTelemetry spans samples were taken in.
    spans: Interner<RawSpan>,
    kernel_stack_cache: HashMap<i32, Vec<u64>>,
    titles: crate::ray::TitleCache,
    /// Threads of registered Python processes sampled before their `threading` name could be
    /// read (bounded by `MAX_LATE_THREADS`), and the names found for them later.
    unnamed_threads: HashSet<(u32, u32)>,
    late_names: HashMap<(u32, u32), String>,
    /// Those of `unnamed_threads` that may still get a name ([`PyTracker::awaits_name`]):
    /// what [`Capture::read_awaited_names`] looks at, so a loop that calls it often does not
    /// go through every unnamed native thread each time.
    awaited_names: HashSet<(u32, u32)>,
}

/// Python threads remembered per capture for naming late.
const MAX_LATE_THREADS: usize = 4096;

impl Capture {
    /// A capture that also keeps per-sample times, up to `timeline.capacity` of them.
    pub fn with_timeline(timeline: Timeline) -> Self {
        Self {
            timeline: Some(timeline),
            ..Self::default()
        }
    }

    /// Counts one ring-buffer record.
    pub fn ingest(
        &mut self,
        bytes: &[u8],
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
    ) {
        self.ingest_record(bytes, sampler, registry, python, false);
    }

    /// Names the record's Python frames now, while the process can still be read.
    fn python_frames(&mut self, sample: &RawSample, python: &mut PyTracker) -> Vec<u32> {
        let pid = sample.header.pid;
        let frames = sample.python_frames();
        let mut out = Vec::with_capacity(frames.len());
        for f in frames {
            self.py_frames_seen += 1;
            let Some(name) = python.resolve(pid, f) else {
                self.py_unresolved += 1;
                continue;
            };
            let id = self.py_names.intern(name) & !PY_ENTRY;
            out.push(if f.entry { id | PY_ENTRY } else { id });
        }
        if !out.is_empty()
            && !self.py_modules.contains_key(&pid)
            && let Some(m) = python.module(pid)
        {
            self.py_modules.insert(pid, m);
        }
        out
    }

    /// `still_blocked`: an off-CPU record made up for a thread that has not woken yet
    /// ([`Capture::ingest_pending`]), whose interval goes on.
    fn ingest_record(
        &mut self,
        bytes: &[u8],
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
        still_blocked: bool,
    ) {
        let Ok(sample) = RawSample::parse(bytes) else {
            self.bad_records += 1;
            return;
        };
        let h = sample.header;
        if h.flags & pyrometer_ebpf::SAMPLE_FREE != 0 {
            match sample.moved_to() {
                Some(to) => self.count_move(h.pid, h.aux, to, h.value),
                None => self.count_free(h.pid, h.aux),
            }
            return;
        }
        if h.flags & pyrometer_ebpf::SAMPLE_EVENT_EXEC != 0 {
            self.forget_allocations(h.pid);
            self.titles.forget(h.pid);
            if self.exec_lazily {
                self.pids.remove(&h.pid);
                registry.forget(h.pid);
                self.execs.push(h.pid);
                return;
            }
            self.pids.insert(h.pid);
            if self
                .maps_read_after_exec
                .get(&h.pid)
                .is_some_and(|&read| h.timestamp_ns <= read)
            {
                return;
            }
            if registry.exec(h.pid).is_ok() {
                self.maps_changed.push(h.pid);
            }
            return;
        }
        if self.pids.insert(h.pid) {
            // Best effort: a process that is already gone keeps its samples, unsymbolized.
            if registry.observe(h.pid).is_ok() {
                self.maps_changed.push(h.pid);
            }
        }
        let mut user: Vec<u64> = sample.user_frames().collect();
        // An allocation's stack is taken at the allocator's return: its innermost address is
        // a return address too, and one byte back names the call (as for the other frames).
        if h.flags & pyrometer_ebpf::SAMPLE_ALLOC != 0
            && let Some(leaf) = user.first_mut()
        {
            *leaf = leaf.saturating_sub(1);
        }
        // Any frame outside the known mappings means the map changed since it was read (the
        // loader mapped libraries after exec, or a dlopen); refresh is rate-limited.
        if user.iter().any(|&a| registry.find(h.pid, a).is_none())
            && let Ok(true) = registry.refresh(h.pid)
        {
            self.maps_changed.push(h.pid);
        }
        let kernel = if h.kernel_stack_id >= 0 {
            match self.kernel_stack_cache.get(&h.kernel_stack_id) {
                Some(frames) => frames.clone(),
                None => match sampler.kernel_stack(h.kernel_stack_id) {
                    Some(frames) => {
                        self.kernel_stack_cache
                            .insert(h.kernel_stack_id, frames.clone());
                        frames
                    }
                    None => {
                        self.missing_kernel_stacks += 1;
                        Vec::new()
                    }
                },
            }
        } else {
            sample.inline_kernel_frames().collect()
        };
        let comm = sample.comm();
        let is_python = python.module(h.pid).is_some();
        let ray = self.titles.labels(h.pid, h.tid, &comm, is_python);
        // Python threads are labelled with their `threading` name where it can be read.
        let (thread, thread_named) = match python.thread_name(h.pid, h.tid) {
            Some(name) => (name.to_string(), true),
            None => {
                if self.unnamed_threads.len() < MAX_LATE_THREADS && is_python {
                    self.unnamed_threads.insert((h.pid, h.tid));
                    self.awaited_names.insert((h.pid, h.tid));
                }
                (comm, false)
            }
        };
        let py = if h.py_frames > 0 {
            self.python_frames(&sample, python)
        } else {
            Vec::new()
        };
        python.refresh_spans(h.pid);
        let span = sample.span().map(|s| self.spans.intern(s));
        let key = RawStack {
            pid: h.pid,
            tid: h.tid,
            thread,
            thread_named,
            user,
            kernel,
            ray,
            span,
            python: py,
            complete: h.flags & pyrometer_ebpf::SAMPLE_COMPLETE != 0,
        };
        if h.flags & pyrometer_ebpf::SAMPLE_ALLOC != 0 {
            if h.flags & pyrometer_ebpf::SAMPLE_ALLOC_PRELOAD != 0 {
                if self.alloc.is_none()
                    && let Some(mean) = self.alloc_on_preload
                {
                    self.alloc = Some(AllocState::new(mean));
                }
                self.note_preload_mean(h.pid, registry.proc_root());
            }
            let tracked = h.flags & pyrometer_ebpf::SAMPLE_ALLOC_UNTRACKED == 0;
            self.count_sampled(key, h.value, tracked.then_some(h.aux), h.timestamp_ns);
        } else if h.flags & pyrometer_ebpf::SAMPLE_GIL_WAIT != 0 {
            self.count_gil_wait(key, h.timestamp_ns, h.value);
        } else if h.flags & pyrometer_ebpf::SAMPLE_OFFCPU != 0 {
            let (start, end) = (h.timestamp_ns, h.timestamp_ns.saturating_add(h.value));
            let from = match self.off_cpu_reported.get(&h.tid) {
                Some(&(blocked_at, until, _)) if blocked_at == start => until.max(start),
                _ => start,
            };
            if still_blocked {
                self.off_cpu_reported.insert(h.tid, (start, end, false));
            } else {
                self.off_cpu_reported.remove(&h.tid);
            }
            if end > from {
                self.count_off_cpu(key, from, end - from);
            }
        } else {
            if self.gil {
                let e = self
                    .thread_samples
                    .entry(h.tid)
                    .or_insert_with(|| (h.pid, key.thread.clone(), 0));
                e.2 += 1;
                // The latest name: a Python thread's `threading` name becomes readable
                // once the thread registered.
                if e.1 != key.thread {
                    e.1.clone_from(&key.thread);
                }
            }
            let held = h.flags & pyrometer_ebpf::SAMPLE_GIL_HELD != 0;
            self.count_sample(key, h.timestamp_ns, held);
        }
    }

    /// Counts the intervals of threads still blocked ([`Sampler::pending_off_cpu`]) up to
    /// now, minus what an earlier call reported of the same interval; when the thread wakes,
    /// its record then counts only the rest. Threads no longer blocked are forgotten, which
    /// bounds the map by the kernel's pending map.
    pub fn ingest_pending(
        &mut self,
        records: Vec<Vec<u8>>,
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
    ) {
        let blocked: HashSet<u32> = records
            .iter()
            .filter_map(|r| RawSample::parse(r).ok())
            .map(|r| r.header.tid)
            .collect();
        // Entries of threads that are not blocked now survive one flush, then go.
        self.off_cpu_reported
            .retain(|tid, (_, _, stale)| blocked.contains(tid) || !std::mem::replace(stale, true));
        for rec in records {
            self.ingest_record(&rec, sampler, registry, python, true);
        }
    }

    fn entry(&mut self, key: RawStack) -> &mut StackCount {
        let next_id = u32::try_from(self.stacks.len()).unwrap_or(u32::MAX);
        self.stacks.entry(key).or_insert(StackCount {
            id: next_id,
            count: 0,
            off_cpu_ns: 0,
            gil_wait_ns: 0,
            gil_held: 0,
        })
    }

    /// Adds one contended GIL wait of `key` that began at `timestamp_ns` and lasted
    /// `waited_ns`.
    pub fn count_gil_wait(&mut self, key: RawStack, timestamp_ns: u64, waited_ns: u64) {
        let entry = self.entry(key);
        entry.gil_wait_ns = entry.gil_wait_ns.saturating_add(waited_ns);
        let sample = entry.id;
        if let Some(t) = self.timeline.as_mut() {
            t.push_off_cpu(OffCpuInterval {
                timestamp_ns,
                duration_ns: waited_ns,
                sample,
                gil: true,
            });
        }
        self.gil_wait_events += 1;
        self.gil_wait_ns = self.gil_wait_ns.saturating_add(waited_ns);
    }

    /// Adds one off-CPU interval of `key` that started at `timestamp_ns` and lasted
    /// `blocked_ns`. Intervals stay out of the activity buckets, which describe time on the CPU.
    pub fn count_off_cpu(&mut self, key: RawStack, timestamp_ns: u64, blocked_ns: u64) {
        let entry = self.entry(key);
        entry.off_cpu_ns = entry.off_cpu_ns.saturating_add(blocked_ns);
        let sample = entry.id;
        if let Some(t) = self.timeline.as_mut() {
            t.push_off_cpu(OffCpuInterval {
                timestamp_ns,
                duration_ns: blocked_ns,
                sample,
                gil: false,
            });
        }
        self.off_cpu_events += 1;
        self.off_cpu_ns = self.off_cpu_ns.saturating_add(blocked_ns);
    }

    /// Counts one sample of `key` taken at `timestamp_ns`.
    pub fn count(&mut self, key: RawStack, timestamp_ns: u64) {
        self.count_sample(key, timestamp_ns, false);
    }

    /// Counts one sample; `gil_held`: its thread held the GIL.
    fn count_sample(&mut self, key: RawStack, timestamp_ns: u64, gil_held: bool) {
        let entry = self.entry(key);
        entry.count += 1;
        entry.gil_held += u64::from(gil_held);
        let id = entry.id;
        if let Some(a) = self.activity.as_mut() {
            a.add(timestamp_ns);
        }
        if let Some(t) = self.timeline.as_mut() {
            t.push(TimelineEvent {
                timestamp_ns,
                sample: id,
            });
        }
        self.samples += 1;
    }

    /// Names the Python threads sampled before their `threading` name could be read, where it
    /// can be by now (the tracker keeps ended threads' names): a thread is often sampled as it
    /// starts, before `threading` registers it, and the names are read at most every few
    /// milliseconds, so its first samples went under its command name. Called before
    /// [`Capture::into_profile`].
    pub fn name_late_threads(&mut self, python: &mut PyTracker) {
        for &(pid, tid) in &self.unnamed_threads {
            if self.late_names.contains_key(&(pid, tid)) {
                continue;
            }
            if let Some(name) = python.thread_name(pid, tid) {
                self.late_names.insert((pid, tid), name.to_string());
            }
        }
    }

    /// Reads the names of the threads sampled without one that `threading` may yet register
    /// (first asked about in the last second), for a caller that reads samples rarely (the
    /// agent) to call after each read: a short thread's name is gone once it ends. True
    /// while some are still waiting, for the caller to come back soon.
    pub fn read_awaited_names(&mut self, python: &mut PyTracker) -> bool {
        self.awaited_names.retain(|&(pid, tid)| {
            if !python.awaits_name(pid, tid) {
                return false;
            }
            match python.thread_name(pid, tid) {
                Some(name) => {
                    self.late_names.insert((pid, tid), name.to_string());
                    false
                }
                None => true,
            }
        });
        !self.awaited_names.is_empty()
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
            },
        );
        // Raw stack id -> index into profile.samples.
        let mut sample_of = vec![0u32; self.stacks.len()];
        let mut stacks: Vec<(RawStack, StackCount)> = self.stacks.into_iter().collect();
        // Deterministic output order regardless of hash iteration.
        stacks.sort_by(|a, b| {
            (
                a.0.pid,
                a.0.tid,
                &a.0.user,
                &a.0.kernel,
                &a.0.ray,
                a.0.span.map(|id| self.spans.get(id)),
                &a.0.python,
                a.0.complete,
            )
                .cmp(&(
                    b.0.pid,
                    b.0.tid,
                    &b.0.user,
                    &b.0.kernel,
                    &b.0.ray,
                    b.0.span.map(|id| self.spans.get(id)),
                    &b.0.python,
                    b.0.complete,
                ))
        });
        for (
            raw,
            StackCount {
                id,
                count,
                off_cpu_ns,
                gil_wait_ns,
                gil_held,
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
                _ => raw.thread,
            };
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
            let labels = match raw.span.map(|id| self.spans.get(id)) {
                Some(span) => span_labels(labels, span),
                None => labels,
            };
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
            let index = profile.add(stack, labels, &values);
            sample_of[id as usize] = u32::try_from(index).unwrap_or(u32::MAX);
        }
        let timeline = self.timeline.map(|mut t| {
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

/// A Python frame as a profile frame: no module or address, its file and line.
fn python_frame(name: &PyFrameName) -> Frame {
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
fn trim_tracepoint_frames(frames: &mut Vec<Frame>) {
    let machinery = |f: &Frame| {
        f.function.starts_with("__traceiter_")
            || f.function.starts_with("bpf_trace_run")
            || f.function.starts_with("bpf_prog_")
    };
    if let Some(last) = frames.iter().take(4).rposition(machinery) {
        frames.drain(..=last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(tid: u32, kernel: u64) -> RawStack {
        RawStack {
            pid: 4_000_000,
            tid,
            thread: format!("t{tid}"),
            thread_named: true,
            user: Vec::new(),
            kernel: vec![kernel],
            ray: None,
            span: None,
            python: Vec::new(),
            complete: false,
        }
    }

    #[test]
    fn span_labels_name_trace_and_span() {
        let mut c = Capture::default();
        let span = RawSpan {
            trace_id: [0xab; 16],
            span_id: [0x01; 8],
            name: "work".into(),
        };
        let id = c.spans.intern(span);
        c.count(
            RawStack {
                span: Some(id),
                ..raw(1, 1)
            },
            5,
        );
        c.count(raw(1, 1), 6);
        let p = c.into_profile(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        let with: Vec<_> = p
            .samples
            .iter()
            .filter(|s| s.labels.get("span_id").is_some())
            .collect();
        assert_eq!(with.len(), 1, "a sample outside any span has no span label");
        let l = &with[0].labels;
        assert_eq!(l.get("trace_id"), Some(&LabelValue::Str("ab".repeat(16))));
        assert_eq!(l.get("span_id"), Some(&LabelValue::Str("01".repeat(8))));
        assert_eq!(l.get("span_name"), Some(&LabelValue::Str("work".into())));
    }

    #[test]
    fn timeline_is_bounded_and_points_at_profile_samples() {
        let mut c = Capture::with_timeline(Timeline::new(3, 100, 10));
        c.count(raw(1, 0xffff_ffff_8100_0000), 110);
        c.count(raw(2, 0xffff_ffff_8100_0000), 120);
        c.count(raw(1, 0xffff_ffff_8100_0000), 130);
        c.count(raw(2, 0xffff_ffff_8100_0000), 140);
        assert_eq!(c.samples, 4);
        let (p, t) =
            c.into_profile_and_timeline(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        let t = t.unwrap();
        assert_eq!((t.events.len(), t.dropped), (3, 1));
        assert_eq!(p.total(0), 4, "the counts cover dropped samples too");
        let tid_of = |e: &TimelineEvent| p.samples[e.sample as usize].labels.get("tid").cloned();
        let tids: Vec<_> = t.events.iter().map(tid_of).collect();
        assert_eq!(
            tids,
            [1, 2, 1].map(|n| Some(LabelValue::Num(n))),
            "events keep their order and thread"
        );
        assert_eq!(t.events[2].timestamp_ns, 130);
    }

    #[test]
    fn activity_counts_samples_per_bucket() {
        let mut c = Capture {
            activity: Some(Activity::new(1_000, 100, 5)),
            ..Capture::default()
        };
        for t in [900, 1_050, 1_150, 1_160, 1_420, 1_600] {
            c.count(raw(1, 1), t);
        }
        let a = c.activity.unwrap();
        assert_eq!(a.counts, [1, 2, 0, 0, 1]);
        assert_eq!(a.dropped, 1);
        assert_eq!(a.samples_between(1_000, 1_200), 3);
        assert_eq!(a.samples_between(1_200, 1_400), 0);
        // A bucket counts for the interval its start falls in.
        assert_eq!(a.samples_between(1_050, 1_500), 3);
        assert_eq!(a.samples_between(1_300, 9_000), 1);
    }

    #[test]
    fn off_cpu_intervals_are_their_own_type() {
        let mut c = Capture {
            off_cpu: true,
            ..Capture::with_timeline(Timeline::new(10, 0, 10))
        };
        c.count(raw(1, 1), 5);
        c.count_off_cpu(raw(1, 1), 20, 3_000_000);
        c.count_off_cpu(raw(2, 2), 30, 7_000_000);
        assert_eq!(
            (c.samples, c.off_cpu_events, c.off_cpu_ns),
            (1, 2, 10_000_000)
        );
        let (p, t) =
            c.into_profile_and_timeline(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        let off = p.type_index("off_cpu").unwrap();
        assert_eq!(p.sample_types[off].unit, "nanoseconds");
        assert_eq!(p.total(off), 10_000_000);
        assert_eq!(p.total(0), 1, "intervals are not samples");
        assert_eq!(p.total(1), 10, "intervals are not CPU time");
        assert_eq!(
            t.unwrap().events.len(),
            1,
            "the timeline holds on-CPU samples"
        );
    }

    #[test]
    fn tracepoint_frames_are_trimmed() {
        let f = |n: &str| Frame::named(n, FrameKind::Kernel);
        let mut frames = vec![
            f("__traceiter_sched_switch"),
            f("__schedule"),
            f("schedule"),
        ];
        trim_tracepoint_frames(&mut frames);
        assert_eq!(frames, [f("__schedule"), f("schedule")]);
        let mut untouched = vec![f("__schedule"), f("schedule")];
        trim_tracepoint_frames(&mut untouched);
        assert_eq!(untouched.len(), 2);
    }

    #[test]
    fn without_off_cpu_the_types_are_unchanged() {
        let mut c = Capture::default();
        c.count(raw(1, 1), 5);
        let p = c.into_profile(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        assert!(p.type_index("off_cpu").is_err());
        assert_eq!(p.sample_types.len(), 2);
    }

    #[test]
    fn without_timeline_nothing_is_kept() {
        let mut c = Capture::default();
        c.count(raw(1, 1), 5);
        let (_, t) =
            c.into_profile_and_timeline(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        assert!(t.is_none());
    }
}
