//! What the joined device work adds up to: `gpu_time` and `gpu_launches` by (launching stack,
//! leaf, device, stream, NVTX ranges), estimated from the sampled launches with their weights;
//! each device's exact summed time and its busy time (the union of its work's intervals) from
//! every record, sampled or not; and the work as slices for the Chrome trace, bounded.
//!
//! Generic over the stack handle `S` of the caller's capture, like [`super::join`].

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Arc;

use super::busy::Busy;
use super::join::{GpuEvent, Op};

/// The leaf frame of a GPU sample: what the device ran.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Leaf {
    /// A kernel, by the name CUPTI gives (mangled).
    Kernel(Arc<str>),
    /// A copy of CUPTI's kind (1 HtoD, 2 DtoH, ...).
    Memcpy(u8),
    Memset,
}

impl Leaf {
    fn of(op: &Op) -> Leaf {
        match op {
            Op::Kernel { name, .. } => Leaf::Kernel(name.clone()),
            Op::Memcpy { kind, .. } => Leaf::Memcpy(*kind),
            Op::Memset { .. } => Leaf::Memset,
        }
    }

    /// The frame's name: a kernel demangled (as Nsight and torch.profiler show it), a copy as
    /// `memcpy HtoD`.
    pub fn name(&self) -> String {
        match self {
            Leaf::Kernel(name) => demangle(name),
            Leaf::Memcpy(kind) => format!("memcpy {}", copy_kind(*kind)),
            Leaf::Memset => "memset".to_string(),
        }
    }
}

/// CUPTI's copy kinds by their usual short names.
pub fn copy_kind(kind: u8) -> &'static str {
    match kind {
        1 => "HtoD",
        2 => "DtoH",
        3 => "HtoA",
        4 => "AtoH",
        5 => "AtoA",
        6 => "AtoD",
        7 => "DtoA",
        8 => "DtoD",
        9 => "HtoH",
        10 => "PtoP",
        _ => "unknown",
    }
}

/// A kernel name demangled when it is a mangled C++ name (CUDA C++ kernels), else as it is
/// (Triton's, for one). The name came from the profiled process: the demangler's recursion is
/// bounded, and a name it cannot read stays as it was.
pub fn demangle(name: &str) -> String {
    if !name.starts_with("_Z") {
        return name.to_string();
    }
    let parse = cpp_demangle::ParseOptions::default().recursion_limit(96);
    let print = cpp_demangle::DemangleOptions::default().recursion_limit(96);
    cpp_demangle::Symbol::new_with_options(name.as_bytes(), &parse)
        .ok()
        .and_then(|s| s.demangle_with_options(&print).ok())
        .unwrap_or_else(|| name.to_string())
}

/// Which device, across processes: its UUID when CUPTI reported it, else the process's CUDA
/// ordinal (which means nothing outside the process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    Uuid([u8; 16]),
    Ordinal { pid: u32, ordinal: u32 },
}

impl DeviceId {
    fn of<S>(e: &GpuEvent<S>) -> DeviceId {
        match e.uuid {
            Some(u) => DeviceId::Uuid(u),
            None => DeviceId::Ordinal {
                pid: e.pid,
                ordinal: e.device,
            },
        }
    }

    /// The `gpu` label: the NVML index of the device with this UUID (what nvidia-smi shows and
    /// CUDA_VISIBLE_DEVICES selects by), else the UUID, else `cuda:ORDINAL`.
    pub fn label(&self, nvml_index: &HashMap<String, u32>) -> String {
        match self {
            DeviceId::Uuid(u) => {
                let uuid = super::channel::uuid_string(u);
                match nvml_index.get(&uuid) {
                    Some(i) => i.to_string(),
                    None => uuid,
                }
            }
            DeviceId::Ordinal { ordinal, .. } => format!("cuda:{ordinal}"),
        }
    }
}

/// What one GPU sample aggregates by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GpuKey<S> {
    pub pid: u32,
    /// The launching thread.
    pub tid: Option<u32>,
    /// The launching stack; None when it was lost ([`super::join::Stats::stacks_missing`]).
    pub stack: Option<S>,
    pub leaf: Leaf,
    pub device: DeviceId,
    pub stream: u32,
    pub nvtx: Option<Arc<str>>,
}

/// Estimated device ns and operations (launches sampled 1 in N count N each).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuSums {
    pub time_ns: f64,
    pub launches: f64,
}

/// One device's work, exactly: every record counts.
#[derive(Debug, Clone, Default)]
pub struct DeviceTotals {
    pub kernels: u64,
    pub copies: u64,
    /// Device ns summed over records (streams overlap: can exceed the wall time).
    pub summed_ns: u64,
    busy: Busy,
    /// Estimated from the sampled launches alone, for comparison with `summed_ns`.
    pub estimated_ns: f64,
}

impl DeviceTotals {
    /// Ns the device had at least one kernel, copy or set running.
    pub fn busy_ns(&mut self) -> u64 {
        self.busy.busy()
    }
}

/// A record for the Chrome trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSlice<S> {
    pub pid: u32,
    pub device: DeviceId,
    pub stream: u32,
    pub start: u64,
    pub end: u64,
    pub leaf: Leaf,
    pub correlation: u32,
    /// The launching stack and thread, and when the probe took the stack (CLOCK_MONOTONIC),
    /// for a sampled launch.
    pub stack: Option<S>,
    pub tid: Option<u32>,
    pub launched: Option<u64>,
    /// The key of the sums it counts in, for a sampled launch.
    pub key: Option<GpuKey<S>>,
}

/// Bounds of an account.
#[derive(Debug, Clone, Copy)]
pub struct AccountLimits {
    /// Distinct (stack, leaf, device, stream, ranges) sums; beyond, a sample loses its stack.
    pub keys: usize,
    /// Slices kept for a trace (0: none are kept).
    pub slices: usize,
}

impl Default for AccountLimits {
    fn default() -> Self {
        AccountLimits {
            keys: 1 << 20,
            slices: 0,
        }
    }
}

/// The running account of one capture (or one push interval of the agent).
#[derive(Debug, Clone)]
pub struct Account<S: Hash + Eq> {
    limits: AccountLimits,
    pub sums: HashMap<GpuKey<S>, GpuSums>,
    pub devices: BTreeMap<DeviceId, DeviceTotals>,
    pub slices: Vec<GpuSlice<S>>,
    /// Slices not kept (the bound), and sums whose stack was dropped (the key bound).
    pub slices_dropped: u64,
    pub keys_folded: u64,
}

impl<S: Clone + Hash + Eq> Account<S> {
    pub fn new(limits: AccountLimits) -> Self {
        Account {
            limits,
            sums: HashMap::new(),
            devices: BTreeMap::new(),
            slices: Vec::new(),
            slices_dropped: 0,
            keys_folded: 0,
        }
    }

    pub fn add(&mut self, e: GpuEvent<S>) {
        let device = DeviceId::of(&e);
        let dur = e.duration();
        let leaf = Leaf::of(&e.op);
        let totals = self.devices.entry(device).or_default();
        match e.op {
            Op::Kernel { .. } => totals.kernels += 1,
            _ => totals.copies += 1,
        }
        totals.summed_ns += dur;
        totals.busy.add(e.start, e.end);
        let (stack, tid, launched) = match &e.sample {
            Some(s) => (s.stack.clone(), s.tid, s.launched),
            None => (None, None, None),
        };
        let mut key = e.sample.as_ref().map(|sample| GpuKey {
            pid: e.pid,
            tid,
            stack: stack.clone(),
            leaf: leaf.clone(),
            device,
            stream: e.stream,
            nvtx: sample.nvtx.clone(),
        });
        if let Some(k) = key.as_mut()
            && self.sums.len() >= self.limits.keys
            && !self.sums.contains_key(k)
        {
            // Past the bound a sample still counts, under no stack.
            k.stack = None;
            k.tid = None;
            self.keys_folded += 1;
        }
        if self.slices.len() < self.limits.slices {
            self.slices.push(GpuSlice {
                pid: e.pid,
                device,
                stream: e.stream,
                start: e.start,
                end: e.end,
                leaf,
                correlation: e.correlation,
                stack,
                tid,
                launched,
                key: key.clone(),
            });
        } else if self.limits.slices > 0 {
            self.slices_dropped += 1;
        }
        let (Some(sample), Some(key)) = (e.sample, key) else {
            return;
        };
        let weight = f64::from(sample.weight);
        totals.estimated_ns += weight * dur as f64;
        let s = self.sums.entry(key).or_default();
        s.time_ns += weight * dur as f64;
        s.launches += weight;
    }

    /// Records added, all devices.
    pub fn kernels_and_copies(&self) -> u64 {
        self.devices.values().map(|d| d.kernels + d.copies).sum()
    }

    /// The sums so far, leaving the account empty of them (the agent, each push); device
    /// totals and slices stay.
    pub fn take_sums(&mut self) -> HashMap<GpuKey<S>, GpuSums> {
        std::mem::take(&mut self.sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::gpu::join::Sampled;

    fn event(op: Op, start: u64, end: u64, sample: Option<Sampled<u32>>) -> GpuEvent<u32> {
        GpuEvent {
            pid: 7,
            op,
            device: 0,
            uuid: Some([1; 16]),
            stream: 3,
            start,
            end,
            correlation: 9,
            sample,
        }
    }

    fn kernel(name: &str) -> Op {
        Op::Kernel {
            name: Arc::from(name),
            grid: [1; 3],
            block: [1; 3],
            graph: 0,
            cooperative: false,
        }
    }

    fn sampled(weight: u32, stack: u32) -> Option<Sampled<u32>> {
        Some(Sampled {
            weight,
            stack: Some(stack),
            tid: Some(11),
            nvtx: None,
            api: None,
            launched: Some(5),
        })
    }

    #[test]
    fn sampled_work_is_weighted_and_every_record_counts_in_totals() {
        let mut a: Account<u32> = Account::new(AccountLimits {
            slices: 2,
            ..AccountLimits::default()
        });
        a.add(event(kernel("_Z1kv"), 0, 100, sampled(4, 1)));
        a.add(event(kernel("_Z1kv"), 50, 150, None));
        a.add(event(
            Op::Memcpy { kind: 1, bytes: 8 },
            300,
            310,
            sampled(4, 1),
        ));
        let k = GpuKey {
            pid: 7,
            tid: Some(11),
            stack: Some(1),
            leaf: Leaf::Kernel(Arc::from("_Z1kv")),
            device: DeviceId::Uuid([1; 16]),
            stream: 3,
            nvtx: None,
        };
        assert_eq!(
            a.sums[&k],
            GpuSums {
                time_ns: 400.0,
                launches: 4.0
            }
        );
        let d = a.devices.get_mut(&DeviceId::Uuid([1; 16])).unwrap();
        assert_eq!((d.kernels, d.copies, d.summed_ns), (2, 1, 210));
        assert_eq!(d.busy_ns(), 160);
        assert_eq!(d.estimated_ns, 440.0);
        assert_eq!((a.slices.len(), a.slices_dropped), (2, 1));
        assert_eq!(a.slices[0].launched, Some(5));
    }

    #[test]
    fn past_the_key_bound_samples_keep_counting_without_their_stack() {
        let mut a: Account<u32> = Account::new(AccountLimits { keys: 1, slices: 0 });
        a.add(event(kernel("a"), 0, 10, sampled(1, 1)));
        a.add(event(kernel("a"), 0, 10, sampled(1, 2)));
        assert_eq!(a.keys_folded, 1);
        let total: f64 = a.sums.values().map(|s| s.time_ns).sum();
        assert_eq!(total, 20.0);
        assert!(a.sums.keys().any(|k| k.stack.is_none()));
    }

    #[test]
    fn leaves_are_named_as_tools_show_them() {
        assert_eq!(
            Leaf::Kernel(Arc::from("_Z6matmulILi128EEvPKfS1_Pf")).name(),
            "void matmul<128>(float const*, float const*, float*)"
        );
        assert_eq!(
            Leaf::Kernel(Arc::from("triton_poi_fused_add_0")).name(),
            "triton_poi_fused_add_0"
        );
        // Not a name the demangler can read: kept as it came.
        assert_eq!(Leaf::Kernel(Arc::from("_Z!!")).name(), "_Z!!");
        let deep = format!("_Z1f{}", "PA1_".repeat(5000));
        assert!(!Leaf::Kernel(Arc::from(deep.as_str())).name().is_empty());
        assert_eq!(Leaf::Memcpy(2).name(), "memcpy DtoH");
        assert_eq!(Leaf::Memset.name(), "memset");
    }

    #[test]
    fn gpu_labels_prefer_the_nvml_index() {
        let mut uuid = [0u8; 16];
        uuid[15] = 1;
        let by_uuid: HashMap<String, u32> =
            [("GPU-00000000-0000-0000-0000-000000000001".to_string(), 1)].into();
        assert_eq!(DeviceId::Uuid(uuid).label(&by_uuid), "1");
        assert_eq!(
            DeviceId::Uuid([0; 16]).label(&by_uuid),
            "GPU-00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(
            DeviceId::Ordinal { pid: 1, ordinal: 2 }.label(&by_uuid),
            "cuda:2"
        );
    }
}
