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

use std::sync::Arc;

use pyrometer_ebpf::RawSpan;

use crate::model::Interner;
use crate::python::merge::FrameView;
use crate::python::tracker::{PyFrameName, PyTracker};

mod alloc;
pub mod gpu;
mod ingest;
mod profile;
mod timeline;
pub use alloc::{AllocState, LiveBlock};
pub use timeline::{
    Activity, CounterPoint, CounterTrack, DEFAULT_ACTIVITY_BUCKET_NS, DEFAULT_ACTIVITY_BUCKETS,
    DEFAULT_TIMELINE_EVENTS, GpuSpan, IntervalKind, OffCpuInterval, Timeline, TimelineEvent,
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
    /// A garbage collection's stack: the generation it collected
    /// ([`GC_GENERATION_UNKNOWN`] where the probe could not read it).
    pub gc_generation: Option<u8>,
}

/// [`RawStack::gc_generation`] of a collection whose generation is not known.
pub const GC_GENERATION_UNKNOWN: u8 = u8::MAX;

/// Processes whose pauses one capture keeps for the agent's metrics, and pauses per process.
const MAX_GC_PROCESSES: usize = 4096;
const MAX_GC_PAUSES: usize = 65_536;

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
    /// Garbage-collection pauses (ns) that began in this stack.
    pub gc_ns: u64,
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
    /// The profile gets the `gc` type (`record --gc`).
    pub gc: bool,
    /// Garbage collections read, and their total pause.
    pub gc_events: u64,
    pub gc_ns: u64,
    /// Pauses per process, for the agent's metrics.
    pub gc_pauses: HashMap<u32, Vec<u64>>,
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
    /// Samples of processes opted out of profiling, dropped unread.
    pub opted_out: u64,
    /// A sample of a Ray worker (comm `ray::…`) was read since the caller last cleared this.
    pub ray_seen: bool,
    /// Kernel stack ids that were gone from the stack map when read.
    pub missing_kernel_stacks: u64,
    pub pids: HashSet<u32>,
    /// An exec only makes the registry forget the process; its new image is read at its
    /// next sample. For the node agent: at 19 Hz most processes that exec on a busy node
    /// are never sampled, and reading each new image (maps, unwind tables, Python version)
    /// at its exec was most of the agent's work. `record` reads at once, so that a target's
    /// first samples after its exec already unwind and carry Python frames.
    pub exec_lazily: bool,
    /// With `exec_lazily`: the pids that exec'd, for the caller to take (and register at once
    /// when their program's table is loaded).
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
    /// GPU kernels by launching stack (`--gpu-kernels`): the profile gets the GPU types.
    pub gpu: Option<crate::capture::gpu::samples::GpuCapture>,
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

impl Capture {
    /// A capture that also keeps per-sample times, up to `timeline.capacity` of them.
    pub fn with_timeline(timeline: Timeline) -> Self {
        Self {
            timeline: Some(timeline),
            ..Self::default()
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
            gc_ns: 0,
        })
    }

    /// Adds one garbage collection of `key` that began at `timestamp_ns` and paused its
    /// thread for `pause_ns`.
    pub fn count_gc(&mut self, key: RawStack, timestamp_ns: u64, pause_ns: u64) {
        let pid = key.pid;
        let entry = self.entry(key);
        entry.gc_ns = entry.gc_ns.saturating_add(pause_ns);
        let sample = entry.id;
        if let Some(t) = self.timeline.as_mut() {
            t.push_off_cpu(OffCpuInterval {
                timestamp_ns,
                duration_ns: pause_ns,
                sample,
                kind: IntervalKind::Gc,
            });
        }
        self.gc_events += 1;
        self.gc_ns = self.gc_ns.saturating_add(pause_ns);
        // Bounded: the agent takes them at every push; a process keeps its latest pauses.
        if self.gc_pauses.len() < MAX_GC_PROCESSES || self.gc_pauses.contains_key(&pid) {
            let pauses = self.gc_pauses.entry(pid).or_default();
            if pauses.len() < MAX_GC_PAUSES {
                pauses.push(pause_ns);
            }
        }
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
                kind: IntervalKind::GilWait,
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
                kind: IntervalKind::OffCpu,
            });
        }
        self.off_cpu_events += 1;
        self.off_cpu_ns = self.off_cpu_ns.saturating_add(blocked_ns);
    }

    /// Counts one sample of `key` taken at `timestamp_ns`.
    #[cfg(test)]
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

    /// Gives `next` (the capture of the agent's next push interval) what the GPU join still
    /// waits for: the sampled launches whose records have not come yet, with their stacks
    /// re-entered under `next`'s ids, and the names and devices the processes sent. Device
    /// totals and sums stay with this capture's profile.
    pub fn hand_over_gpu(&mut self, next: &mut Capture) {
        let Some(g) = self.gpu.as_mut() else {
            return;
        };
        let wanted: HashSet<u32> = g.joiner.pending_stacks().copied().collect();
        // A raw stack's Python frames and span are ids into its capture's tables: they are
        // entered into `next`'s.
        let by_id: HashMap<u32, RawStack> = self
            .stacks
            .iter()
            .filter(|(_, c)| wanted.contains(&c.id))
            .map(|(k, c)| {
                let mut raw = k.clone();
                for f in &mut raw.python {
                    let name = self.py_names.get(*f & !PY_ENTRY).clone();
                    *f = next.py_names.intern(name) | (*f & PY_ENTRY);
                }
                raw.span = raw
                    .span
                    .map(|id| next.spans.intern(self.spans.get(id).clone()));
                if let Some(m) = self.py_modules.get(&raw.pid) {
                    next.py_modules.entry(raw.pid).or_insert_with(|| m.clone());
                }
                (c.id, raw)
            })
            .collect();
        let joiner = std::mem::take(&mut g.joiner);
        let joiner = joiner.remap_stacks(|id| by_id.get(id).map(|raw| next.entry(raw.clone()).id));
        let mut fresh = crate::capture::gpu::samples::GpuCapture::new(0);
        fresh.joiner = joiner;
        fresh.nvml_index = g.nvml_index.clone();
        next.gpu = Some(fresh);
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
}

#[cfg(test)]
mod tests {
    use super::profile::trim_tracepoint_frames;
    use super::*;
    use crate::model::{Frame, FrameKind, LabelValue};
    use crate::os::procs::ProcessRegistry;
    use crate::symbolize::Symbolizer;

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
            gc_generation: None,
        }
    }

    #[test]
    fn gpu_launches_handed_to_the_next_capture_keep_their_python_frames() {
        use crate::capture::gpu::channel::Status;
        use crate::capture::gpu::samples::GpuCapture;
        use crate::capture::gpu::testenc::{Enc, kernel, launch};
        let py = |f: &str| PyFrameName {
            function: Arc::from(f),
            file: Some(Arc::from("train.py")),
            line: Some(3),
            task: false,
        };
        let mut a = Capture {
            gpu: Some(GpuCapture::new(0)),
            ..Capture::default()
        };
        // The two captures' tables of Python names differ: `conv` has id 1 in one, 0 in the
        // other, where id 1 is another function.
        a.py_names.intern(py("setup"));
        let conv = a.py_names.intern(py("conv_phase"));
        let id = a
            .entry(RawStack {
                python: vec![conv | PY_ENTRY],
                ..raw(1, 1)
            })
            .id;
        a.gpu.as_mut().unwrap().launch(4_000_000, 1, 7, id, 10);
        let mut b = Capture {
            gpu: Some(GpuCapture::new(0)),
            ..Capture::default()
        };
        b.py_names.intern(py("matmul_phase"));
        b.py_names.intern(py("elementwise_phase"));
        a.hand_over_gpu(&mut b);
        let mut e = Enc::default();
        let status = Status {
            sample_every: 1,
            ..Status::default()
        };
        e.status(&status)
            .string(3, 1, "conv")
            .launch(&launch(7, 1, 1, 0))
            .kernel(&kernel(7, 3, 0, 100, 600));
        b.gpu.as_mut().unwrap().chunk(4_000_000, &e.chunk(0), 20);
        let p = b.into_profile(&mut ProcessRegistry::new(), &mut Symbolizer::new(), 10);
        let t = p.type_index("gpu_time").unwrap();
        let s = p
            .samples
            .iter()
            .find(|s| s.values[t] > 0)
            .expect("a GPU sample");
        let names: Vec<&str> = p.stack_frames(s.stack).map(|f| &*f.function).collect();
        assert!(names.contains(&"conv_phase"), "{names:?}");
        assert_eq!(s.values[t], 500);
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
