//! Reading devices through nvml-wrapper.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::time::SystemTime;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::{DeviceInfo, DeviceSample, ErrorCounts, Field, ProcessSample};
use crate::os::clock::monotonic_now_ns;

/// Why the GPU source is off.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The NVML library could not be loaded: no NVIDIA driver, or a wrong `--nvml-lib`.
    #[error("{path} not found")]
    LibraryNotFound {
        /// The library asked for.
        path: String,
    },
    /// The file is there but is no loadable library (wrong architecture, not ELF, ...).
    #[error("cannot load {path}: {detail}")]
    LibraryUnusable {
        /// The library.
        path: String,
        /// The loader's reason.
        detail: String,
    },
    /// The library loaded but NVML did not start (driver not running, no permission).
    #[error("NVML did not initialize from {path}: {error}")]
    Init {
        /// The library.
        path: String,
        /// NVML's error.
        error: String,
    },
    /// NVML started and sees no device.
    #[error("NVML found no GPUs")]
    NoDevices,
}

/// An open NVML library and the devices it had at start.
pub struct NvmlSource {
    nvml: Nvml,
    devices: Vec<DeviceInfo>,
    errors: ErrorCounts,
    /// Per device: the newest process-utilization timestamp seen (µs), so each poll asks
    /// only for samples taken since the previous one.
    last_seen_us: HashMap<u32, u64>,
}

/// NVML's name for an error, as nvidia-smi and the NVML docs spell it.
pub fn error_name(e: &NvmlError) -> &'static str {
    match e {
        NvmlError::NotSupported => "NOT_SUPPORTED",
        NvmlError::GpuLost => "GPU_IS_LOST",
        NvmlError::NoPermission => "NO_PERMISSION",
        NvmlError::Uninitialized => "UNINITIALIZED",
        NvmlError::InvalidArg => "INVALID_ARGUMENT",
        NvmlError::NotFound => "NOT_FOUND",
        NvmlError::Timeout => "TIMEOUT",
        NvmlError::InsufficientSize(_) => "INSUFFICIENT_SIZE",
        NvmlError::InsufficientPower => "INSUFFICIENT_POWER",
        NvmlError::DriverNotLoaded => "DRIVER_NOT_LOADED",
        NvmlError::IrqIssue => "IRQ_ISSUE",
        NvmlError::FailedToLoadSymbol(_) | NvmlError::FunctionNotFound => "FUNCTION_NOT_FOUND",
        NvmlError::ResetRequired => "RESET_REQUIRED",
        NvmlError::OperatingSystem => "OPERATING_SYSTEM",
        NvmlError::LibRmVersionMismatch => "LIB_RM_VERSION_MISMATCH",
        NvmlError::InUse => "IN_USE",
        NvmlError::NoData => "NO_DATA",
        _ => "UNKNOWN",
    }
}

impl NvmlSource {
    /// Loads `lib` (a soname searched like dlopen does, or a path) and lists its devices.
    pub fn open(lib: &OsStr) -> Result<NvmlSource, GpuError> {
        let path = lib.to_string_lossy().into_owned();
        let nvml = Nvml::builder().lib_path(lib).init().map_err(|e| match e {
            NvmlError::LibloadingError(e) => {
                let detail = e.to_string();
                // dlopen's message is the only place that says which of the two it was.
                if detail.contains("No such file") || detail.contains("cannot open shared object") {
                    GpuError::LibraryNotFound { path: path.clone() }
                } else {
                    GpuError::LibraryUnusable {
                        path: path.clone(),
                        detail,
                    }
                }
            }
            other => GpuError::Init {
                path: path.clone(),
                error: other.to_string(),
            },
        })?;
        let count = nvml.device_count().map_err(|e| GpuError::Init {
            path: path.clone(),
            error: e.to_string(),
        })?;
        if count == 0 {
            return Err(GpuError::NoDevices);
        }
        let mut devices = Vec::new();
        let mut errors = ErrorCounts::new();
        for index in 0..count {
            // A device that fails here is kept, so indexes stay NVML's; polls retry it
            // unless it is lost.
            let (uuid, name, lost) = match nvml.device_by_index(index) {
                Ok(d) => (
                    d.uuid().unwrap_or_else(|_| format!("GPU-unknown-{index}")),
                    d.name().unwrap_or_default(),
                    false,
                ),
                Err(e) => {
                    *errors
                        .entry((index, Field::Device, error_name(&e)))
                        .or_default() += 1;
                    let lost = matches!(e, NvmlError::GpuLost);
                    (format!("GPU-unknown-{index}"), String::new(), lost)
                }
            };
            devices.push(DeviceInfo {
                index,
                uuid,
                name,
                lost_at_ns: lost.then(monotonic_now_ns),
            });
        }
        Ok(NvmlSource {
            nvml,
            devices,
            errors,
            last_seen_us: HashMap::new(),
        })
    }

    /// The devices NVML enumerated.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// Failed calls, counted.
    pub fn errors(&self) -> &ErrorCounts {
        &self.errors
    }

    /// Reads every device that is not lost. Failed fields are counted and left empty.
    pub fn poll(&mut self) -> Vec<DeviceSample> {
        let mut out = Vec::with_capacity(self.devices.len());
        for pos in 0..self.devices.len() {
            if self.devices[pos].lost_at_ns.is_some() {
                continue;
            }
            let index = self.devices[pos].index;
            let timestamp_ns = monotonic_now_ns();
            let unix_ms = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let mut sample = DeviceSample {
                index,
                timestamp_ns,
                unix_ms,
                values: [None; 12],
                processes: Vec::new(),
            };
            let mut lost = false;
            let errors = &mut self.errors;
            let mut note = |field: Field, e: &NvmlError| {
                *errors.entry((index, field, error_name(e))).or_default() += 1;
                lost |= matches!(e, NvmlError::GpuLost);
            };
            let device = match self.nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    note(Field::Device, &e);
                    if lost {
                        self.devices[pos].lost_at_ns = Some(timestamp_ns);
                    }
                    continue;
                }
            };
            match device.utilization_rates() {
                Ok(u) => {
                    sample.set(Field::Utilization, Some(u.gpu.into()));
                    sample.set(Field::MemoryUtilization, Some(u.memory.into()));
                }
                // The first call of a poll: a GPU that fell off the bus fails here, and
                // counts once, not once per field.
                Err(NvmlError::GpuLost) => {
                    note(Field::Device, &NvmlError::GpuLost);
                    self.devices[pos].lost_at_ns = Some(timestamp_ns);
                    continue;
                }
                Err(e) => {
                    // One call reads both fields, so both count its failure.
                    note(Field::Utilization, &e);
                    note(Field::MemoryUtilization, &e);
                }
            }
            match device.memory_info() {
                Ok(m) => {
                    sample.set(Field::MemoryUsed, Some(m.used));
                    sample.set(Field::MemoryTotal, Some(m.total));
                }
                Err(e) => {
                    note(Field::MemoryUsed, &e);
                    note(Field::MemoryTotal, &e);
                }
            }
            let mut put = |sample: &mut DeviceSample, field, r: Result<u64, NvmlError>| match r {
                Ok(v) => sample.set(field, Some(v)),
                Err(e) => note(field, &e),
            };
            let u = |r: Result<u32, NvmlError>| r.map(u64::from);
            put(&mut sample, Field::SmClock, u(device.clock_info(Clock::SM)));
            put(
                &mut sample,
                Field::MemoryClock,
                u(device.clock_info(Clock::Memory)),
            );
            put(&mut sample, Field::Power, u(device.power_usage()));
            put(
                &mut sample,
                Field::PowerLimit,
                u(device.enforced_power_limit()),
            );
            put(
                &mut sample,
                Field::Temperature,
                u(device.temperature(TemperatureSensor::Gpu)),
            );
            put(
                &mut sample,
                Field::PcieTx,
                u(device.pcie_throughput(PcieUtilCounter::Send)),
            );
            put(
                &mut sample,
                Field::PcieRx,
                u(device.pcie_throughput(PcieUtilCounter::Receive)),
            );
            put(
                &mut sample,
                Field::ThrottleReasons,
                device.current_throttle_reasons().map(|r| r.bits()),
            );
            sample.processes = read_processes(
                &device,
                self.last_seen_us.entry(index).or_default(),
                &mut note,
            );
            if lost {
                // Values read before the loss are still the device's last word.
                self.devices[pos].lost_at_ns = Some(timestamp_ns);
            }
            out.push(sample);
        }
        out
    }
}

/// The device's compute processes with their memory and, from the samples since
/// `last_seen_us` (which moves on), their utilization.
fn read_processes(
    device: &nvml_wrapper::Device<'_>,
    last_seen_us: &mut u64,
    note: &mut impl FnMut(Field, &NvmlError),
) -> Vec<ProcessSample> {
    let mut processes: Vec<ProcessSample> = match device.running_compute_processes() {
        Ok(list) => list
            .into_iter()
            .map(|p| ProcessSample {
                pid: p.pid,
                used_memory: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                },
                sm_util: None,
                mem_util: None,
            })
            .collect(),
        Err(e) => {
            note(Field::Processes, &e);
            Vec::new()
        }
    };
    let since = (*last_seen_us > 0).then_some(*last_seen_us);
    match device.process_utilization_stats(since) {
        Ok(samples) => {
            // The newest sample of each process wins.
            let mut newest: HashMap<u32, (u64, u32, u32)> = HashMap::new();
            for s in samples {
                let e = newest.entry(s.pid).or_insert((0, 0, 0));
                if s.timestamp >= e.0 {
                    *e = (s.timestamp, s.sm_util, s.mem_util);
                }
            }
            if let Some(max) = newest.values().map(|v| v.0).max() {
                *last_seen_us = max;
            }
            for p in &mut processes {
                if let Some(&(_, sm, mem)) = newest.get(&p.pid) {
                    p.sm_util = Some(sm);
                    p.mem_util = Some(mem);
                }
            }
        }
        // No sample since the last one seen: the driver samples processes every
        // ~1/6 s, and answers NOT_FOUND (not an empty list) for an idle device or a
        // poll between two samples. The processes keep no utilization for this poll.
        Err(NvmlError::NotFound) => {}
        Err(e) => note(Field::ProcessUtilization, &e),
    }
    processes
}
