//! Time-resolved views a capture can keep beside its counts: per-sample times for the Chrome
//! trace ([`Timeline`]), and samples per time bucket ([`Activity`]) for questions such as
//! "were the targets on the CPU during this GPU poll?".

/// Default bound of a [`Timeline`]: 2^21 events of 16 bytes each, 32 MiB; at `record`'s 99 Hz
/// that is 5 hours of one busy thread, or 5 minutes of 64 busy CPUs.
pub const DEFAULT_TIMELINE_EVENTS: usize = 1 << 21;

/// One sample in time: CLOCK_MONOTONIC nanoseconds (the BPF program's `bpf_ktime_get_ns`)
/// and what it sampled. During the capture `sample` is a raw stack id ([`StackCount::id`]);
/// after [`Capture::into_profile_and_timeline`] it indexes `Profile::samples`, whose labels
/// name the process and thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimelineEvent {
    pub timestamp_ns: u64,
    pub sample: u32,
}

/// One off-CPU interval in time: the thread blocked at `timestamp_ns` for `duration_ns`, in
/// the stack `sample` names (a raw stack id, then a profile sample, as in [`TimelineEvent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffCpuInterval {
    pub timestamp_ns: u64,
    pub duration_ns: u64,
    pub sample: u32,
    pub kind: IntervalKind,
}

/// What an interval of [`Timeline::off_cpu`] was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntervalKind {
    /// The thread blocked (`--off-cpu`).
    OffCpu,
    /// A contended wait for the GIL (`--gil`).
    GilWait,
    /// A garbage collection of CPython (`--gc`).
    Gc,
}

/// Per-sample times, bounded: once `capacity` events are held, later samples are counted in
/// `dropped` but not kept, so a trace covers the start of a long capture rather than growing
/// without limit (the counts in the profile still cover all of it).
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    pub events: Vec<TimelineEvent>,
    pub capacity: usize,
    pub dropped: u64,
    /// CLOCK_MONOTONIC time the capture started; trace times are relative to it.
    pub origin_ns: u64,
    /// Sampling period: a sample stands for this much time on the CPU.
    pub period_ns: u64,
    /// Series recorded beside the samples (GPU telemetry), drawn as counter tracks.
    pub counters: Vec<CounterTrack>,
    /// Off-CPU intervals (`record --off-cpu`), bounded by `capacity` with `events`.
    pub off_cpu: Vec<OffCpuInterval>,
    /// Device work (`record --gpu-kernels`), bounded by the GPU account.
    pub gpu: Vec<GpuSpan>,
}

/// One kernel, copy or set a GPU ran, for its device stream's track.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpan {
    /// The `gpu` label of its device (NVML's index, else its UUID).
    pub device: String,
    pub pid: u32,
    pub stream: u32,
    /// CLOCK_MONOTONIC ns.
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: String,
    pub correlation: u32,
    /// The profile sample (launching stack with this work as leaf) of a sampled launch.
    pub sample: Option<u32>,
    /// The launching thread and when its stack was taken, for a sampled launch.
    pub launch: Option<(u32, u64)>,
}

/// A counter track of the Chrome trace: values over time, shown under a process of their
/// own (e.g. one per GPU) rather than under a sampled one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CounterTrack {
    /// The name of the track's process, e.g. `GPU 0 NVIDIA A100 (GPU-…)`.
    pub process: String,
    /// Distinguishes track processes (the GPU index); not a real pid.
    pub process_index: u32,
    /// The counter's name, e.g. `GPU utilization`.
    pub name: String,
    pub points: Vec<CounterPoint>,
}

/// One point of a [`CounterTrack`]: CLOCK_MONOTONIC ns and named values (a counter with
/// several values draws them stacked).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CounterPoint {
    pub timestamp_ns: u64,
    pub values: Vec<(String, f64)>,
}

/// Samples per time bucket, for questions such as "were the targets on the CPU during this
/// GPU poll interval?" without keeping every sample's time. Bounded: times past the last
/// bucket are counted in `dropped`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Activity {
    /// CLOCK_MONOTONIC ns of bucket 0's start.
    pub origin_ns: u64,
    pub bucket_ns: u64,
    pub counts: Vec<u32>,
    pub capacity: usize,
    pub dropped: u64,
}

/// Default [`Activity`] bucket: fine against the 1 s GPU poll interval, and 20 hours of
/// buckets fit in the default capacity (4 bytes each, 5.8 MB).
pub const DEFAULT_ACTIVITY_BUCKET_NS: u64 = 50_000_000;
pub const DEFAULT_ACTIVITY_BUCKETS: usize = 1_440_000;

impl Activity {
    pub fn new(origin_ns: u64, bucket_ns: u64, capacity: usize) -> Self {
        Self {
            origin_ns,
            bucket_ns: bucket_ns.max(1),
            counts: Vec::new(),
            capacity,
            dropped: 0,
        }
    }

    pub fn add(&mut self, timestamp_ns: u64) {
        let Some(i) = timestamp_ns
            .checked_sub(self.origin_ns)
            .map(|d| (d / self.bucket_ns) as usize)
        else {
            // Before the capture started: a record still in flight from before; ignore.
            return;
        };
        if i >= self.capacity {
            self.dropped += 1;
            return;
        }
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] = self.counts[i].saturating_add(1);
    }

    /// Samples in the buckets that start in `[from_ns, to_ns)`.
    pub fn samples_between(&self, from_ns: u64, to_ns: u64) -> u64 {
        let bucket = |t: u64| (t.saturating_sub(self.origin_ns)).div_ceil(self.bucket_ns) as usize;
        let (a, b) = (bucket(from_ns), bucket(to_ns).min(self.counts.len()));
        if a >= b {
            return 0;
        }
        self.counts[a..b].iter().map(|&c| u64::from(c)).sum()
    }
}

impl Timeline {
    pub fn new(capacity: usize, origin_ns: u64, period_ns: u64) -> Self {
        Self {
            // Grown as samples come: most captures are far below the bound.
            events: Vec::new(),
            capacity,
            dropped: 0,
            origin_ns,
            period_ns,
            counters: Vec::new(),
            off_cpu: Vec::new(),
            gpu: Vec::new(),
        }
    }

    fn full(&self) -> bool {
        self.events.len() + self.off_cpu.len() >= self.capacity
    }

    pub(crate) fn push(&mut self, event: TimelineEvent) {
        if self.full() {
            self.dropped += 1;
        } else {
            self.events.push(event);
        }
    }

    pub(crate) fn push_off_cpu(&mut self, interval: OffCpuInterval) {
        if self.full() {
            self.dropped += 1;
        } else {
            self.off_cpu.push(interval);
        }
    }
}
