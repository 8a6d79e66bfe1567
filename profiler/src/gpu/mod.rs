//! GPU telemetry from NVML: a poller thread reads every device (and the compute processes on
//! it) each interval into a bounded series, which `record` and `gpu` summarize, the CSV and
//! Chrome trace writers export, the agent serves as Prometheus gauges, and profiles use to
//! label the samples of GPU-using processes.
//!
//! NVML is loaded at run time (nvml-wrapper, through libloading), so machines without the
//! NVIDIA driver run everything else; [`source::NvmlSource::open`] says why GPUs are off.
//! Every NVML call may fail on its own (a field the device does not support, a GPU fallen
//! off the bus): failures are counted per device and field, never fatal, and a device that
//! reports GPU_IS_LOST is marked lost and no longer polled.

pub mod csv;
pub(crate) mod kernels;

/// The channel of the GPU library (`libpyrometer_cupti.so`) as pyrometer reads it: its parser
/// and the join of device records with sampled launches, for tools and tests that read a
/// channel the library wrote to a file (`PYROMETER_GPU_DUMP`).
pub mod channel {
    pub use crate::capture::gpu::channel::*;
    pub use crate::capture::gpu::join::{GpuEvent, Joiner, Limits, Op, Stats};
}
pub mod metrics;
pub mod source;
pub mod summary;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::capture::{CounterPoint, CounterTrack};
use crate::model::{LabelValue, Profile};

pub use source::NvmlSource;

/// The library `--nvml-lib` defaults to: the driver's versioned soname, which every driver
/// install has (the unversioned `libnvidia-ml.so` comes only with development packages).
pub const DEFAULT_NVML_LIB: &str = "libnvidia-ml.so.1";

/// Series points kept by default: a day of two devices at the default 1 s interval.
pub const DEFAULT_SERIES_CAPACITY: usize = 2 * 86_400;

/// One per-device reading, in NVML's own units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Field {
    /// Percent of the last sample period a kernel was running.
    Utilization,
    /// Percent of the last sample period device memory was read or written.
    MemoryUtilization,
    /// Bytes.
    MemoryUsed,
    /// Bytes.
    MemoryTotal,
    /// MHz.
    SmClock,
    /// MHz.
    MemoryClock,
    /// Milliwatts.
    Power,
    /// Milliwatts (the enforced limit).
    PowerLimit,
    /// Degrees Celsius.
    Temperature,
    /// KB/s.
    PcieTx,
    /// KB/s.
    PcieRx,
    /// NVML's clocks-throttle-reasons bit mask.
    ThrottleReasons,
    /// The running compute processes query (errors only).
    Processes,
    /// The per-process utilization samples query (errors only).
    ProcessUtilization,
    /// The device as a whole: its handle, or GPU_IS_LOST (errors only).
    Device,
}

impl Field {
    /// The fields a [`DeviceSample`] holds a value for, in CSV column order.
    pub const VALUES: [Field; 12] = [
        Field::Utilization,
        Field::MemoryUtilization,
        Field::MemoryUsed,
        Field::MemoryTotal,
        Field::SmClock,
        Field::MemoryClock,
        Field::Power,
        Field::PowerLimit,
        Field::Temperature,
        Field::PcieTx,
        Field::PcieRx,
        Field::ThrottleReasons,
    ];

    /// The name error counts and the `field` metric label use.
    pub fn name(self) -> &'static str {
        match self {
            Field::Utilization => "utilization",
            Field::MemoryUtilization => "memory_utilization",
            Field::MemoryUsed => "memory_used",
            Field::MemoryTotal => "memory_total",
            Field::SmClock => "sm_clock",
            Field::MemoryClock => "memory_clock",
            Field::Power => "power",
            Field::PowerLimit => "power_limit",
            Field::Temperature => "temperature",
            Field::PcieTx => "pcie_tx",
            Field::PcieRx => "pcie_rx",
            Field::ThrottleReasons => "throttle_reasons",
            Field::Processes => "processes",
            Field::ProcessUtilization => "process_utilization",
            Field::Device => "device",
        }
    }

    fn slot(self) -> Option<usize> {
        Field::VALUES.iter().position(|&f| f == self)
    }
}

/// A device as enumerated when NVML was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// NVML's index of the device.
    pub index: u32,
    /// Its UUID.
    pub uuid: String,
    /// Its product name.
    pub name: String,
    /// CLOCK_MONOTONIC ns when the device reported GPU_IS_LOST; it is not polled after that.
    pub lost_at_ns: Option<u64>,
}

/// A compute process on a device at one poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessSample {
    /// The process.
    pub pid: u32,
    /// GPU memory the process holds, when NVML knows it.
    pub used_memory: Option<u64>,
    /// The process's latest SM and memory utilization samples (percent), when NVML has any
    /// since the previous poll.
    pub sm_util: Option<u32>,
    /// ... and memory utilization, percent.
    pub mem_util: Option<u32>,
}

/// One poll of one device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSample {
    /// The device's NVML index.
    pub index: u32,
    /// CLOCK_MONOTONIC ns, the clock BPF sample timestamps use, so the two line up.
    pub timestamp_ns: u64,
    /// Wall-clock time, ms since the Unix epoch (for the CSV).
    pub unix_ms: u64,
    /// One value per [`Field::VALUES`] entry; `None` where the call failed.
    pub values: [Option<u64>; 12],
    /// The compute processes on the device.
    pub processes: Vec<ProcessSample>,
}

impl DeviceSample {
    /// The value of `field`, when it was read.
    pub fn get(&self, field: Field) -> Option<u64> {
        field.slot().and_then(|i| self.values[i])
    }

    /// Sets the value of `field` (`None`: the call failed).
    pub fn set(&mut self, field: Field, value: Option<u64>) {
        if let Some(i) = field.slot() {
            self.values[i] = value;
        }
    }
}

/// Failed NVML calls by (device index, field, NVML error name).
pub type ErrorCounts = BTreeMap<(u32, Field, &'static str), u64>;

/// What one process did on one device over a span of polls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Most GPU memory seen held at once, bytes.
    pub max_memory: u64,
    /// Polls that listed the process.
    pub polls: u64,
    /// Highest SM utilization sample, percent.
    pub max_sm_util: Option<u32>,
}

/// Everything the poller has gathered; shared with readers under a mutex.
#[derive(Debug, Clone, Default)]
pub struct GpuState {
    /// The devices, as enumerated.
    pub devices: Vec<DeviceInfo>,
    /// Oldest first, all devices interleaved in poll order; bounded by `capacity`.
    pub series: VecDeque<DeviceSample>,
    /// The most samples `series` keeps.
    pub capacity: usize,
    /// Points dropped from the front of `series` because it was full.
    pub dropped: u64,
    /// The last sample of each device (by position in `devices`).
    pub latest: Vec<Option<DeviceSample>>,
    /// Failed calls, counted.
    pub errors: ErrorCounts,
    /// When the poller started (CLOCK_MONOTONIC ns).
    pub started_ns: u64,
    /// Per (pid, device index), since the last [`GpuState::take_process_usage`]; kept apart
    /// from the series so that the agent, which keeps no series, still sees every poll.
    interval_usage: BTreeMap<(u32, u32), ProcessUsage>,
}

fn add_usage(usage: &mut BTreeMap<(u32, u32), ProcessUsage>, sample: &DeviceSample) {
    for p in &sample.processes {
        let u = usage.entry((p.pid, sample.index)).or_default();
        u.max_memory = u.max_memory.max(p.used_memory.unwrap_or(0));
        u.polls += 1;
        if let Some(sm) = p.sm_util {
            u.max_sm_util = Some(u.max_sm_util.map_or(sm, |m| m.max(sm)));
        }
    }
}

impl GpuState {
    /// An empty state for `devices`, keeping `capacity` samples, started at `started_ns`.
    pub fn new(devices: Vec<DeviceInfo>, capacity: usize, started_ns: u64) -> Self {
        Self {
            latest: vec![None; devices.len()],
            devices,
            capacity: capacity.max(1),
            started_ns,
            ..Self::default()
        }
    }

    /// Adds one device's poll.
    pub fn push(&mut self, sample: DeviceSample) {
        add_usage(&mut self.interval_usage, &sample);
        if let Some(pos) = self.devices.iter().position(|d| d.index == sample.index) {
            self.latest[pos] = Some(sample.clone());
        }
        if self.series.len() >= self.capacity {
            self.series.pop_front();
            self.dropped += 1;
        }
        self.series.push_back(sample);
    }

    /// Per (pid, device index) usage since the previous call (the agent's push interval).
    pub fn take_process_usage(&mut self) -> BTreeMap<(u32, u32), ProcessUsage> {
        std::mem::take(&mut self.interval_usage)
    }

    /// Per (pid, device index) usage over the series.
    pub fn process_usage(&self) -> BTreeMap<(u32, u32), ProcessUsage> {
        let mut usage = BTreeMap::new();
        for s in &self.series {
            add_usage(&mut usage, s);
        }
        usage
    }

    /// The device with NVML index `index`.
    pub fn device(&self, index: u32) -> Option<&DeviceInfo> {
        self.devices.iter().find(|d| d.index == index)
    }

    /// The samples of one device, oldest first.
    pub fn device_series(&self, index: u32) -> impl Iterator<Item = &DeviceSample> {
        self.series.iter().filter(move |s| s.index == index)
    }

    /// Counter tracks for the Chrome trace: per device, utilization (GPU and memory, %),
    /// memory used (bytes) and power (W); points where a field failed are left out.
    pub fn counter_tracks(&self) -> Vec<CounterTrack> {
        let mut tracks = Vec::new();
        for d in &self.devices {
            let process = format!("GPU {} {} ({})", d.index, d.name, d.uuid);
            let mut util = Vec::new();
            let mut mem = Vec::new();
            let mut power = Vec::new();
            for s in self.device_series(d.index) {
                let mut values = Vec::new();
                if let Some(u) = s.get(Field::Utilization) {
                    values.push(("gpu_%".to_string(), u as f64));
                }
                if let Some(u) = s.get(Field::MemoryUtilization) {
                    values.push(("memory_%".to_string(), u as f64));
                }
                if !values.is_empty() {
                    util.push(CounterPoint {
                        timestamp_ns: s.timestamp_ns,
                        values,
                    });
                }
                if let Some(b) = s.get(Field::MemoryUsed) {
                    mem.push(CounterPoint {
                        timestamp_ns: s.timestamp_ns,
                        values: vec![("bytes".to_string(), b as f64)],
                    });
                }
                if let Some(mw) = s.get(Field::Power) {
                    power.push(CounterPoint {
                        timestamp_ns: s.timestamp_ns,
                        values: vec![("watts".to_string(), mw as f64 / 1000.0)],
                    });
                }
            }
            for (name, points) in [
                ("GPU utilization", util),
                ("GPU memory used", mem),
                ("GPU power", power),
            ] {
                if !points.is_empty() {
                    tracks.push(CounterTrack {
                        process: process.clone(),
                        process_index: d.index,
                        name: name.to_string(),
                        points,
                    });
                }
            }
        }
        tracks
    }
}

/// The GPUs one process used over a span: device indexes and the most memory it held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PidGpus {
    /// The NVML indexes of the devices it used.
    pub devices: Vec<u32>,
    /// Sum over its devices of the most memory held on each, bytes.
    pub memory: u64,
}

/// Groups per (pid, device) usage by pid.
pub fn gpus_by_pid(usage: &BTreeMap<(u32, u32), ProcessUsage>) -> HashMap<u32, PidGpus> {
    let mut out: HashMap<u32, PidGpus> = HashMap::new();
    for (&(pid, index), u) in usage {
        let e = out.entry(pid).or_default();
        e.devices.push(index);
        e.memory += u.max_memory;
    }
    out
}

/// Labels the samples of processes that used a GPU: `gpu` (the NVML device index, several
/// joined by commas, e.g. `0,1`) and `gpu_memory` (bytes; pprof gets the unit). The index
/// rather than the UUID, because it is what CUDA_VISIBLE_DEVICES and nvidia-smi show; the
/// summary, CSV and metrics map it to the UUID.
pub fn label_profile(profile: &mut Profile, by_pid: &HashMap<u32, PidGpus>) {
    if by_pid.is_empty() {
        return;
    }
    profile.map_labels(|labels| {
        let pid = match labels.get("pid") {
            Some(LabelValue::Num(n)) => u32::try_from(*n).ok(),
            Some(LabelValue::Str(s)) => s.parse().ok(),
            None => None,
        };
        if let Some(g) = pid.and_then(|p| by_pid.get(&p)) {
            let gpu = g
                .devices
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",");
            labels.set("gpu", LabelValue::Str(gpu));
            labels.set(
                "gpu_memory",
                LabelValue::Num(i64::try_from(g.memory).unwrap_or(i64::MAX)),
            );
        }
    });
}

/// Polls a [`NvmlSource`] on its own thread every `interval` until stopped.
pub struct Poller {
    state: Arc<Mutex<GpuState>>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Starts polling now (the first poll happens at once) and then every `interval`.
    pub fn start(
        mut source: NvmlSource,
        interval: Duration,
        capacity: usize,
    ) -> std::io::Result<Poller> {
        let state = Arc::new(Mutex::new(GpuState::new(
            source.devices().to_vec(),
            capacity,
            crate::os::clock::monotonic_now_ns(),
        )));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread = {
            let state = state.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("gpu-poller".into())
                .spawn(move || {
                    loop {
                        // NVML calls can block (a GPU falling off the bus); poll outside
                        // the lock so readers of the state never wait on the driver.
                        let polled = source.poll();
                        {
                            let mut st = state.lock().expect("not poisoned");
                            st.devices = source.devices().to_vec();
                            for s in polled {
                                st.push(s);
                            }
                            st.errors = source.errors().clone();
                        }
                        let (lock, cv) = &*stop;
                        let stopped = lock.lock().expect("not poisoned");
                        let (stopped, _) = cv
                            .wait_timeout_while(stopped, interval, |s| !*s)
                            .expect("not poisoned");
                        if *stopped {
                            return;
                        }
                    }
                })?
        };
        Ok(Poller {
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// The live state (the agent's /metrics reads it while polling goes on).
    pub fn state(&self) -> Arc<Mutex<GpuState>> {
        self.state.clone()
    }

    /// Stops polling and returns everything gathered.
    pub fn stop(mut self) -> GpuState {
        self.halt();
        self.state.lock().expect("not poisoned").clone()
    }

    fn halt(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().expect("not poisoned") = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, FrameKind, Labels};

    pub(crate) fn sample(index: u32, t_ms: u64, util: Option<u64>) -> DeviceSample {
        let mut s = DeviceSample {
            index,
            timestamp_ns: t_ms * 1_000_000,
            unix_ms: 1_700_000_000_000 + t_ms,
            values: [None; 12],
            processes: Vec::new(),
        };
        s.set(Field::Utilization, util);
        s
    }

    fn info(index: u32) -> DeviceInfo {
        DeviceInfo {
            index,
            uuid: format!("GPU-{index}"),
            name: format!("Test {index}"),
            lost_at_ns: None,
        }
    }

    #[test]
    fn series_is_bounded_and_usage_accumulates() {
        let mut st = GpuState::new(vec![info(0), info(1)], 3, 0);
        for t in 0..4u32 {
            let mut s = sample(t % 2, u64::from(t) * 100, Some(u64::from(t) * 10));
            s.processes.push(ProcessSample {
                pid: 7,
                used_memory: Some(100 * (u64::from(t) + 1)),
                sm_util: Some(t),
                mem_util: None,
            });
            st.push(s);
        }
        assert_eq!((st.series.len(), st.dropped), (3, 1));
        assert_eq!(
            st.latest[1].as_ref().unwrap().get(Field::Utilization),
            Some(30)
        );
        let u = st.take_process_usage();
        assert_eq!(u[&(7, 0)].max_memory, 300);
        assert_eq!(u[&(7, 1)].max_memory, 400);
        assert_eq!(u[&(7, 1)].max_sm_util, Some(3));
        assert!(st.take_process_usage().is_empty(), "taken once");
        // Over the series, which dropped the first poll.
        assert_eq!(st.process_usage()[&(7, 0)].polls, 1);
        assert_eq!(st.process_usage()[&(7, 1)].polls, 2);
        let by_pid = gpus_by_pid(&st.process_usage());
        assert_eq!(
            by_pid[&7],
            PidGpus {
                devices: vec![0, 1],
                memory: 700
            }
        );
    }

    #[test]
    fn labels_go_to_gpu_processes_only() {
        let mut p = Profile::cpu(10);
        let f = p.intern_frame(Frame::named("f", FrameKind::Native));
        let s = p.intern_stack(vec![f]);
        let l = |pid| Labels::new().with("pid", LabelValue::Num(pid));
        p.add(s, l(7), &[1, 10]);
        p.add(s, l(8), &[1, 10]);
        let by_pid = HashMap::from([(
            7,
            PidGpus {
                devices: vec![1],
                memory: 512,
            },
        )]);
        label_profile(&mut p, &by_pid);
        assert_eq!(
            p.samples[0].labels.get("gpu"),
            Some(&LabelValue::Str("1".into()))
        );
        assert_eq!(
            p.samples[0].labels.get("gpu_memory"),
            Some(&LabelValue::Num(512))
        );
        assert_eq!(p.samples[1].labels.get("gpu"), None);
        // The index still finds the relabelled sample.
        let relabelled = p.samples[0].labels.clone();
        p.add(s, relabelled, &[1, 10]);
        assert_eq!(p.samples.len(), 2);
        assert_eq!(p.samples[0].values, [2, 20]);
    }

    #[test]
    fn counter_tracks_skip_failed_fields() {
        let mut st = GpuState::new(vec![info(0), info(1)], 10, 0);
        let mut a = sample(0, 0, Some(50));
        a.set(Field::Power, Some(150_000));
        a.set(Field::MemoryUsed, Some(1 << 30));
        st.push(a);
        st.push(sample(1, 0, Some(20)));
        let tracks = st.counter_tracks();
        let names: Vec<(u32, &str)> = tracks
            .iter()
            .map(|t| (t.process_index, t.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                (0, "GPU utilization"),
                (0, "GPU memory used"),
                (0, "GPU power"),
                (1, "GPU utilization")
            ]
        );
        assert_eq!(tracks[2].points[0].values, [("watts".to_string(), 150.0)]);
    }
}
