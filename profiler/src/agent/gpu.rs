//! The agent's part of GPU kernels by launching stack: every process started with the GPU
//! library (`CUDA_INJECTION64_PATH`) is recorded without flags, its probes fire only there.
//! The agent's own copy of the library is probed at start, a container's when a process
//! mapping it is seen; launches whose device records have not come by a push are joined in
//! the next interval's capture; /metrics gets the join's counters and each GPU's device time.

use std::collections::HashMap;

use super::Log;
use super::metrics::AgentMetrics;
use crate::capture::Capture;
use crate::capture::gpu::samples::GpuCapture;
use crate::gpu::Poller;
use crate::gpu::kernels::probes::{self, GpuProbes};
use crate::profiler::Profiler;

/// The GPU probes, unless the kernel refused them, on the agent's own copy of the library:
/// processes started with it are recorded from their first launch, started before the agent
/// or after it.
pub(super) fn open(profiler: &mut Profiler, log: &Log) -> Option<GpuProbes> {
    if profiler.refused(crate::bpf::Feature::GpuKernels) {
        return None;
    }
    let mut gpu = GpuProbes::default();
    match probes::library() {
        Ok(lib) => match gpu.attach_file(&lib, &mut profiler.sampler) {
            Ok(()) => log(&format!(
                "recording the GPU kernels of processes started with CUDA_INJECTION64_PATH={}",
                lib.display()
            )),
            Err(e) => log(&format!("cannot probe {}: {e}", lib.display())),
        },
        // Other copies (a container's) are still probed as processes map them.
        Err(e) => log(&format!("GPU kernels by stack: {e}")),
    }
    Some(gpu)
}

/// Probes the copies of the library mapped by the processes whose maps changed.
pub(super) fn attach_mapped(
    probes: &mut GpuProbes,
    profiler: &mut Profiler,
    pids: &[u32],
    log: &Log,
) {
    for &pid in pids {
        if let Some(Err(e)) = profiler
            .registry
            .get(pid)
            .and_then(|p| probes.attach_mapped(p, &mut profiler.sampler))
        {
            log(&format!("pid {pid}: {e}"));
        }
    }
}

/// NVML's index of each GPU's UUID, the `gpu` label: the poller's device list, read once.
pub(super) fn nvml_index(poller: Option<&Poller>) -> HashMap<String, u32> {
    poller
        .map(|p| {
            let state = p.state();
            let st = state.lock().expect("not poisoned");
            st.devices
                .iter()
                .map(|d| (d.uuid.clone(), d.index))
                .collect()
        })
        .unwrap_or_default()
}

/// The GPU state of an interval's capture.
pub(super) fn capture(nvml_index: &HashMap<String, u32>) -> GpuCapture {
    let mut g = GpuCapture::new(0);
    g.nvml_index = nvml_index.clone();
    g
}

/// The join's counters, cumulative, for /metrics.
pub(super) fn publish_stats(metrics: &AgentMetrics, capture: &Capture) {
    if let Some(g) = &capture.gpu {
        *metrics.gpu_kernels.lock().expect("not poisoned") = g.stats();
    }
}

/// At a push: launches whose device records have not come yet go to `next`; each GPU's
/// device time goes to /metrics. Returns the device records `taken` holds.
pub(super) fn end_interval(metrics: &AgentMetrics, taken: &mut Capture, next: &mut Capture) -> u64 {
    taken.hand_over_gpu(next);
    let Some(g) = taken.gpu.as_mut() else {
        return 0;
    };
    let mut devices = metrics.gpu_device_ns.lock().expect("not poisoned");
    for (device, d) in &mut g.account.devices {
        let busy = d.busy_ns();
        let e = devices.entry(device.label(&g.nvml_index)).or_default();
        e.0 += d.summed_ns;
        e.1 += busy;
    }
    g.account.kernels_and_copies()
}
