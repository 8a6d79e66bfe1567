//! The GPU gauges of the agent's `/metrics`, in Prometheus text format: base units (ratios,
//! bytes, hertz, watts), every series labelled `gpu_uuid` and `gpu_index`.

use std::fmt::Write as _;

use super::{Field, GpuState};

/// (metric, help, field, factor from NVML's unit to the metric's).
const GAUGES: &[(&str, &str, Field, f64)] = &[
    (
        "pyrometer_gpu_utilization_ratio",
        "Share of the last sample period a kernel ran on the GPU.",
        Field::Utilization,
        0.01,
    ),
    (
        "pyrometer_gpu_memory_utilization_ratio",
        "Share of the last sample period device memory was read or written.",
        Field::MemoryUtilization,
        0.01,
    ),
    (
        "pyrometer_gpu_memory_used_bytes",
        "Device memory in use.",
        Field::MemoryUsed,
        1.0,
    ),
    (
        "pyrometer_gpu_memory_total_bytes",
        "Device memory installed.",
        Field::MemoryTotal,
        1.0,
    ),
    (
        "pyrometer_gpu_sm_clock_hertz",
        "Current SM clock.",
        Field::SmClock,
        1e6,
    ),
    (
        "pyrometer_gpu_memory_clock_hertz",
        "Current memory clock.",
        Field::MemoryClock,
        1e6,
    ),
    (
        "pyrometer_gpu_power_watts",
        "Power draw of the board.",
        Field::Power,
        1e-3,
    ),
    (
        "pyrometer_gpu_power_limit_watts",
        "Enforced power limit.",
        Field::PowerLimit,
        1e-3,
    ),
    (
        "pyrometer_gpu_temperature_celsius",
        "GPU die temperature.",
        Field::Temperature,
        1.0,
    ),
    (
        "pyrometer_gpu_pcie_tx_bytes_per_second",
        "PCIe transmit throughput (NVML's KB/s times 1024).",
        Field::PcieTx,
        1024.0,
    ),
    (
        "pyrometer_gpu_pcie_rx_bytes_per_second",
        "PCIe receive throughput (NVML's KB/s times 1024).",
        Field::PcieRx,
        1024.0,
    ),
];

/// NVML's clocks-throttle-reason bits and the `reason` label of each.
pub const THROTTLE_REASONS: &[(u64, &str)] = &[
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// Writes one metric family, or nothing when it has no series (a family with only
/// metadata tells a dashboard nothing).
fn family(o: &mut String, name: &str, kind: &str, help: &str, rows: &[(String, f64)]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in rows {
        let _ = writeln!(o, "{name}{{{labels}}} {v}");
    }
}

/// Appends the GPU metrics of `state` (the latest poll of each device) to `o`.
pub fn render(state: &GpuState, o: &mut String) {
    let device_labels =
        |index: u32, uuid: &str| format!("gpu_uuid=\"{uuid}\",gpu_index=\"{index}\"");
    // A lost device's last values are stale: only its `lost` gauge and errors remain.
    let live: Vec<_> = state
        .devices
        .iter()
        .zip(&state.latest)
        .filter(|(d, _)| d.lost_at_ns.is_none())
        .filter_map(|(d, s)| s.as_ref().map(|s| (d, s)))
        .collect();
    for &(name, help, field, factor) in GAUGES {
        let rows: Vec<(String, f64)> = live
            .iter()
            .filter_map(|(d, s)| {
                s.get(field)
                    .map(|v| (device_labels(d.index, &d.uuid), v as f64 * factor))
            })
            .collect();
        family(o, name, "gauge", help, &rows);
    }
    let mut throttle = Vec::new();
    for (d, s) in &live {
        if let Some(bits) = s.get(Field::ThrottleReasons) {
            for &(bit, reason) in THROTTLE_REASONS {
                throttle.push((
                    format!("{},reason=\"{reason}\"", device_labels(d.index, &d.uuid)),
                    if bits & bit != 0 { 1.0 } else { 0.0 },
                ));
            }
        }
    }
    family(
        o,
        "pyrometer_gpu_throttle_reasons",
        "gauge",
        "1 for each reason NVML gives for holding the clocks down.",
        &throttle,
    );
    let lost: Vec<(String, f64)> = state
        .devices
        .iter()
        .map(|d| {
            (
                device_labels(d.index, &d.uuid),
                if d.lost_at_ns.is_some() { 1.0 } else { 0.0 },
            )
        })
        .collect();
    family(
        o,
        "pyrometer_gpu_lost",
        "gauge",
        "1 once the device reported GPU_IS_LOST; it is no longer polled.",
        &lost,
    );
    let per_process = |f: &dyn Fn(&super::ProcessSample) -> Option<f64>| -> Vec<(String, f64)> {
        let mut rows = Vec::new();
        for (d, s) in &live {
            for p in &s.processes {
                if let Some(v) = f(p) {
                    rows.push((
                        format!("{},pid=\"{}\"", device_labels(d.index, &d.uuid), p.pid),
                        v,
                    ));
                }
            }
        }
        rows
    };
    family(
        o,
        "pyrometer_gpu_process_memory_used_bytes",
        "gauge",
        "GPU memory held by a compute process.",
        &per_process(&|p| p.used_memory.map(|b| b as f64)),
    );
    family(
        o,
        "pyrometer_gpu_process_sm_utilization_ratio",
        "gauge",
        "A process's share of SM time in its latest utilization sample.",
        &per_process(&|p| p.sm_util.map(|u| f64::from(u) / 100.0)),
    );
    family(
        o,
        "pyrometer_gpu_process_memory_utilization_ratio",
        "gauge",
        "A process's share of memory-interface time in its latest utilization sample.",
        &per_process(&|p| p.mem_util.map(|u| f64::from(u) / 100.0)),
    );
    let errors: Vec<(String, f64)> = state
        .errors
        .iter()
        .map(|(&(index, field, error), &n)| {
            let uuid = state.device(index).map_or("", |d| d.uuid.as_str());
            (
                format!(
                    "{},field=\"{}\",error=\"{error}\"",
                    device_labels(index, uuid),
                    field.name()
                ),
                n as f64,
            )
        })
        .collect();
    family(
        o,
        "pyrometer_gpu_errors_total",
        "counter",
        "NVML calls that failed, by field and NVML error.",
        &errors,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::tests::sample;
    use crate::gpu::{DeviceInfo, ProcessSample};

    #[test]
    fn gauges_in_base_units_and_lost_devices_go_quiet() {
        let devices = (0..2)
            .map(|i| DeviceInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                name: String::new(),
                lost_at_ns: (i == 1).then_some(5),
            })
            .collect();
        let mut st = GpuState::new(devices, 10, 0);
        let mut a = sample(0, 0, Some(80));
        a.set(Field::Power, Some(150_000));
        a.set(Field::SmClock, Some(1410));
        a.set(Field::ThrottleReasons, Some(0x5));
        a.processes.push(ProcessSample {
            pid: 9,
            used_memory: Some(1 << 30),
            sm_util: Some(40),
            mem_util: None,
        });
        st.push(a);
        st.push(sample(1, 0, Some(25)));
        st.errors.insert((1, Field::Power, "NOT_SUPPORTED"), 3);
        let mut o = String::new();
        render(&st, &mut o);
        let l0 = "gpu_uuid=\"GPU-0\",gpu_index=\"0\"";
        for line in [
            format!("pyrometer_gpu_utilization_ratio{{{l0}}} 0.8"),
            format!("pyrometer_gpu_power_watts{{{l0}}} 150"),
            format!("pyrometer_gpu_sm_clock_hertz{{{l0}}} 1410000000"),
            format!("pyrometer_gpu_throttle_reasons{{{l0},reason=\"gpu_idle\"}} 1"),
            format!("pyrometer_gpu_throttle_reasons{{{l0},reason=\"applications_clocks_setting\"}} 0"),
            format!("pyrometer_gpu_throttle_reasons{{{l0},reason=\"sw_power_cap\"}} 1"),
            format!("pyrometer_gpu_process_memory_used_bytes{{{l0},pid=\"9\"}} 1073741824"),
            format!("pyrometer_gpu_process_sm_utilization_ratio{{{l0},pid=\"9\"}} 0.4"),
            "pyrometer_gpu_lost{gpu_uuid=\"GPU-1\",gpu_index=\"1\"} 1".to_string(),
            "pyrometer_gpu_errors_total{gpu_uuid=\"GPU-1\",gpu_index=\"1\",field=\"power\",error=\"NOT_SUPPORTED\"} 3".to_string(),
        ] {
            assert!(o.lines().any(|l| l == line), "missing {line} in\n{o}");
        }
        assert!(
            !o.contains("pyrometer_gpu_utilization_ratio{gpu_uuid=\"GPU-1\""),
            "{o}"
        );
        assert!(
            !o.contains("process_memory_utilization"),
            "no samples, no family: {o}"
        );
        assert_eq!(
            o.matches("# TYPE pyrometer_gpu_utilization_ratio gauge")
                .count(),
            1
        );
    }
}
