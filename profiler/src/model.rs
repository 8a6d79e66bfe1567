//! The in-memory profile every source writes into and every output reads: interned frames and
//! stacks, samples aggregated by (stack, labels), several value types per sample (pprof's
//! model, so writing pprof is a direct mapping).

use std::hash::Hash;

/// What kind of code a frame belongs to; outputs colour and suffix frames by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrameKind {
    /// Kernel code (folded suffix `_[k]`).
    Kernel,
    /// Native user-space code from an ELF object.
    Native,
    /// JIT code named by a `/tmp/perf-PID.map` file.
    Jit,
    /// A Python function (CPython frame): `function` is its (qualified) name, `file` and
    /// `line` where it was; no module or address.
    Python,
    /// An address nothing could name.
    Unknown,
    /// Work a GPU ran (a kernel, a copy): the leaf of a `gpu_time` sample, on the stack that
    /// launched it; a name, no module or address.
    Gpu,
    /// Stands for the user stack of a process over its budget (the memory the profiler may
    /// spend on one process's symbols and maps): `[budget]`, no module or address.
    Budget,
    /// An asyncio task (`--async`), above the frames of the coroutines it ran: its name, no
    /// module, file or address.
    Task,
}

/// One function-level frame. An address that inlining expanded into several functions yields
/// several frames with the same `address`, all but the outermost marked `inlined`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Demangled function name, or `[unknown]` / the module name when nothing better is known.
    pub function: String,
    /// Source file, when known.
    pub file: Option<String>,
    /// Source line, when known.
    pub line: Option<u32>,
    /// Path of the object (as the process saw it) or `[kernel.kallsyms]`.
    pub module: Option<String>,
    /// GNU build-id of the module, lowercase hex.
    pub build_id: Option<String>,
    /// Address relative to the module: an ELF file offset for user code, the absolute address
    /// for kernel code.
    pub address: u64,
    /// What code the frame is.
    pub kind: FrameKind,
    /// This frame was inlined into the next frame towards the root (same address).
    pub inlined: bool,
}

impl Frame {
    /// A frame that is only a name (from folded input, or synthetic roots).
    pub fn named(function: impl Into<String>, kind: FrameKind) -> Self {
        Self {
            function: function.into(),
            file: None,
            line: None,
            module: None,
            build_id: None,
            address: 0,
            kind,
            inlined: false,
        }
    }
}

/// A sample type, e.g. `cpu`/`nanoseconds` (pprof's ValueType).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SampleType {
    /// The type's name (`cpu`, `alloc_space`, ...).
    pub name: String,
    /// Its unit (`nanoseconds`, `bytes`, `count`).
    pub unit: String,
}

impl SampleType {
    /// A sample type of `name` in `unit`.
    pub fn new(name: &str, unit: &str) -> Self {
        Self {
            name: name.to_string(),
            unit: unit.to_string(),
        }
    }
}

/// A label value: pprof labels are either strings or numbers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelValue {
    /// A string.
    Str(String),
    /// A number.
    Num(i64),
}

impl std::fmt::Display for LabelValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LabelValue::Str(s) => f.write_str(s),
            LabelValue::Num(n) => write!(f, "{n}"),
        }
    }
}

/// Labels of a sample, kept sorted by key so equal sets compare equal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Labels(Vec<(String, LabelValue)>);

impl Labels {
    /// No labels.
    pub fn new() -> Self {
        Self::default()
    }

    /// These labels and `key` = `value` (replacing a value of `key`).
    pub fn with(mut self, key: &str, value: LabelValue) -> Self {
        self.set(key, value);
        self
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: LabelValue) {
        match self.0.binary_search_by(|(k, _)| k.as_str().cmp(key)) {
            Ok(i) => self.0[i].1 = value,
            Err(i) => self.0.insert(i, (key.to_string(), value)),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&LabelValue> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|i| &self.0[i].1)
    }

    /// The labels, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &LabelValue)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Interns values of type `T` into dense `u32` ids.
#[derive(Debug, Clone)]
pub struct Interner<T: Hash + Eq + Clone> {
    items: Vec<T>,
    ids: crate::FastMap<T, u32>,
}

impl<T: Hash + Eq + Clone> Default for Interner<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            ids: Default::default(),
        }
    }
}

impl<T: Hash + Eq + Clone> Interner<T> {
    /// The id of `value`, added when new.
    pub fn intern(&mut self, value: T) -> u32 {
        if let Some(&id) = self.ids.get(&value) {
            return id;
        }
        let id = u32::try_from(self.items.len()).expect("fewer than 2^32 interned values");
        self.items.push(value.clone());
        self.ids.insert(value, id);
        id
    }

    /// The value of id `id`.
    pub fn get(&self, id: u32) -> &T {
        &self.items[id as usize]
    }

    /// Values interned.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The values, by id.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter()
    }
}

/// One aggregated sample: a stack, its labels and one value per sample type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The stack (an id in [`Profile::stacks`]).
    pub stack: u32,
    /// The sample's labels.
    pub labels: Labels,
    /// One value per sample type.
    pub values: Vec<i64>,
}

/// A profile: what `record` produces, what `report` reads, what outputs write.
#[derive(Debug, Clone)]
pub struct Profile {
    /// The sample types every sample has a value of.
    pub sample_types: Vec<SampleType>,
    /// Index into `sample_types` of the type shown by default.
    pub default_type: usize,
    /// Every frame, interned.
    pub frames: Interner<Frame>,
    /// Stacks as frame ids, leaf first (as the kernel and pprof order them).
    pub stacks: Interner<Vec<u32>>,
    /// The samples, one per stack and label set.
    pub samples: Vec<Sample>,
    sample_index: crate::FastMap<(u32, Labels), usize>,
    /// Wall-clock start of the capture, ns since the Unix epoch (0 when unknown).
    pub time_nanos: i64,
    /// How long the capture was, ns.
    pub duration_nanos: i64,
    /// The sampling period: `period` of `period_type` per sample (e.g. 10101010 ns at 99 Hz).
    pub period_type: Option<SampleType>,
    /// See `period_type`.
    pub period: i64,
    /// Free-text comments (pprof's).
    pub comments: Vec<String>,
}

/// What a capture measured beyond CPU samples: each adds sample types.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sources {
    /// Off-CPU time (`off_cpu/nanoseconds`).
    pub off_cpu: bool,
    /// GIL wait and hold time.
    pub gil: bool,
    /// Allocations (the four allocation types).
    pub alloc: bool,
    /// GPU kernels by launching stack (`--gpu-kernels`).
    pub gpu_kernels: bool,
    /// CPython's garbage-collector pauses (`gc/nanoseconds`).
    pub gc: bool,
}

/// The GPU kernel types: device time by launching stack (estimated from sampled launches,
/// weighted) and the kernels, copies and sets it counts.
pub const GPU_TYPES: [(&str, &str); 2] = [("gpu_time", "nanoseconds"), ("gpu_launches", "count")];

/// The allocation types, in the profile's order (Go's heap profile names).
pub const ALLOC_TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];

/// A sample type a profile does not have.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("profile has no sample type '{wanted}'; it has: {}", available.join(", "))]
pub struct UnknownType {
    /// The type asked for.
    pub wanted: String,
    /// The types the profile has.
    pub available: Vec<String>,
}

impl Profile {
    /// An empty profile of these sample types.
    pub fn new(sample_types: Vec<SampleType>) -> Self {
        Self {
            sample_types,
            default_type: 0,
            frames: Interner::default(),
            stacks: Interner::default(),
            samples: Vec::new(),
            sample_index: Default::default(),
            time_nanos: 0,
            duration_nanos: 0,
            period_type: None,
            period: 0,
            comments: Vec::new(),
        }
    }

    /// The CPU profile `record` writes: `samples/count` and `cpu/nanoseconds`, CPU the default.
    pub fn cpu(period_ns: i64) -> Self {
        let mut p = Self::new(vec![
            SampleType::new("samples", "count"),
            SampleType::new("cpu", "nanoseconds"),
        ]);
        p.default_type = 1;
        p.period_type = Some(SampleType::new("cpu", "nanoseconds"));
        p.period = period_ns;
        p
    }

    /// `record --off-cpu`'s profile: the CPU types, then `off_cpu/nanoseconds` (time blocked,
    /// by the stack the thread blocked in). On-CPU samples carry 0 off-CPU time and off-CPU
    /// intervals 0 samples and CPU time, so each type's totals mean what they say; CPU stays
    /// the default type.
    pub fn cpu_and_off_cpu(period_ns: i64) -> Self {
        Self::with_sources(
            period_ns,
            Sources {
                off_cpu: true,
                ..Sources::default()
            },
        )
    }

    /// The profile of a capture: the CPU types, then `off_cpu/nanoseconds` with off-CPU time,
    /// `gil_wait/nanoseconds` (contended GIL waits, by the stack that waited) and
    /// `gil_held/nanoseconds` (on-CPU time of threads holding the GIL) with `--gil`, and Go's
    /// heap types `alloc_objects/count`, `alloc_space/bytes`, `inuse_objects/count`,
    /// `inuse_space/bytes` with allocation sampling. Each record carries only its own type's
    /// value; CPU stays the default type.
    pub fn with_sources(period_ns: i64, sources: Sources) -> Self {
        let mut p = Self::cpu(period_ns);
        if sources.off_cpu {
            p.sample_types
                .push(SampleType::new("off_cpu", "nanoseconds"));
        }
        if sources.gil {
            p.sample_types
                .push(SampleType::new("gil_wait", "nanoseconds"));
            p.sample_types
                .push(SampleType::new("gil_held", "nanoseconds"));
        }
        if sources.alloc {
            for (name, unit) in ALLOC_TYPES {
                p.sample_types.push(SampleType::new(name, unit));
            }
        }
        if sources.gpu_kernels {
            for (name, unit) in GPU_TYPES {
                p.sample_types.push(SampleType::new(name, unit));
            }
        }
        if sources.gc {
            p.sample_types.push(SampleType::new("gc", "nanoseconds"));
        }
        p
    }

    /// The id of `frame`, added when new.
    pub fn intern_frame(&mut self, frame: Frame) -> u32 {
        self.frames.intern(frame)
    }

    /// The id of a stack of frame ids (leaf first), added when new.
    pub fn intern_stack(&mut self, frames_leaf_first: Vec<u32>) -> u32 {
        self.stacks.intern(frames_leaf_first)
    }

    /// Adds `values` (one per sample type) to the sample with this stack and labels, and
    /// returns that sample's index in `samples`.
    pub fn add(&mut self, stack: u32, labels: Labels, values: &[i64]) -> usize {
        debug_assert_eq!(values.len(), self.sample_types.len());
        let key = (stack, labels);
        if let Some(&i) = self.sample_index.get(&key) {
            for (acc, v) in self.samples[i].values.iter_mut().zip(values) {
                *acc += v;
            }
            return i;
        }
        let index = self.samples.len();
        self.sample_index.insert(key.clone(), index);
        self.samples.push(Sample {
            stack: key.0,
            labels: key.1,
            values: values.to_vec(),
        });
        index
    }

    /// Rewrites every sample's labels, merging samples whose labels become equal.
    pub fn map_labels(&mut self, mut f: impl FnMut(&mut Labels)) {
        let samples = std::mem::take(&mut self.samples);
        self.sample_index.clear();
        for mut s in samples {
            f(&mut s.labels);
            self.add(s.stack, s.labels, &s.values);
        }
    }

    /// The profile of the samples `keep` says yes to (frames and stacks are shared as they
    /// are; writers only follow the samples' stacks).
    pub fn subset(&self, keep: impl Fn(&Sample) -> bool) -> Profile {
        let mut out = Profile {
            samples: Vec::new(),
            sample_index: Default::default(),
            ..self.clone()
        };
        for s in self.samples.iter().filter(|s| keep(s)) {
            out.add(s.stack, s.labels.clone(), &s.values);
        }
        out
    }

    /// Resolves a `--type` name: a sample type's name (`cpu`, `samples`), or `name/unit`.
    pub fn type_index(&self, wanted: &str) -> Result<usize, UnknownType> {
        self.sample_types
            .iter()
            .position(|t| t.name == wanted || format!("{}/{}", t.name, t.unit) == wanted)
            .ok_or_else(|| UnknownType {
                wanted: wanted.to_string(),
                available: self.sample_types.iter().map(|t| t.name.clone()).collect(),
            })
    }

    /// The type single-type outputs (folded, SVG) show without `--type`: sample counts when
    /// the profile has them, as FlameGraph users expect, else the default type.
    pub fn single_type_default(&self) -> usize {
        self.sample_types
            .iter()
            .position(|t| t.name == "samples" && t.unit == "count")
            .unwrap_or(self.default_type)
    }

    /// Total of one sample type over all samples.
    pub fn total(&self, type_index: usize) -> i64 {
        self.samples.iter().map(|s| s.values[type_index]).sum()
    }

    /// The frames of a stack, leaf first.
    pub fn stack_frames(&self, stack: u32) -> impl DoubleEndedIterator<Item = &Frame> + '_ {
        self.stacks.get(stack).iter().map(|&f| self.frames.get(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_aggregate_by_stack_and_labels() {
        let mut p = Profile::cpu(10);
        let a = p.intern_frame(Frame::named("a", FrameKind::Native));
        let b = p.intern_frame(Frame::named("b", FrameKind::Native));
        assert_eq!(a, p.intern_frame(Frame::named("a", FrameKind::Native)));
        let s1 = p.intern_stack(vec![a, b]);
        assert_eq!(s1, p.intern_stack(vec![a, b]));
        let l1 = Labels::new().with("pid", LabelValue::Num(1));
        p.add(s1, l1.clone(), &[1, 10]);
        p.add(s1, l1.clone(), &[1, 10]);
        p.add(s1, Labels::new().with("pid", LabelValue::Num(2)), &[1, 10]);
        assert_eq!(p.samples.len(), 2);
        assert_eq!(p.total(0), 3);
        assert_eq!(p.total(1), 30);
    }

    #[test]
    fn labels_are_order_independent() {
        let x = Labels::new()
            .with("b", LabelValue::Num(1))
            .with("a", LabelValue::Str("s".into()));
        let y = Labels::new()
            .with("a", LabelValue::Str("s".into()))
            .with("b", LabelValue::Num(1));
        assert_eq!(x, y);
        assert_eq!(x.get("b"), Some(&LabelValue::Num(1)));
    }

    #[test]
    fn unknown_type_lists_available() {
        let p = Profile::cpu(10);
        assert_eq!(p.type_index("cpu"), Ok(1));
        assert_eq!(p.type_index("samples/count"), Ok(0));
        let e = p.type_index("alloc_space").unwrap_err();
        assert_eq!(
            e.to_string(),
            "profile has no sample type 'alloc_space'; it has: samples, cpu"
        );
    }
}
