//! The GPU series as CSV: a header row, then one row per device per poll.
//!
//! Columns: `unix_ms` (wall clock), `elapsed_s` (since polling started), `index`, `uuid`,
//! then every field in NVML's units with the unit in the name (`utilization_pct`,
//! `memory_used_bytes`, `sm_clock_mhz`, `power_w`, `pcie_tx_kbps`, `throttle_reasons` as
//! NVML's bit mask in hex, ...), and `processes` (`pid:bytes` pairs joined by `;`). A field
//! whose NVML call failed in that poll is an empty cell.

use std::io::Write;

use super::{Field, GpuState};

/// The header of each field's column.
fn column(field: Field) -> &'static str {
    match field {
        Field::Utilization => "utilization_pct",
        Field::MemoryUtilization => "memory_utilization_pct",
        Field::MemoryUsed => "memory_used_bytes",
        Field::MemoryTotal => "memory_total_bytes",
        Field::SmClock => "sm_clock_mhz",
        Field::MemoryClock => "memory_clock_mhz",
        Field::Power => "power_w",
        Field::PowerLimit => "power_limit_w",
        Field::Temperature => "temperature_c",
        Field::PcieTx => "pcie_tx_kbps",
        Field::PcieRx => "pcie_rx_kbps",
        Field::ThrottleReasons => "throttle_reasons",
        Field::Processes | Field::ProcessUtilization | Field::Device => "processes",
    }
}

fn cell(field: Field, v: u64) -> String {
    match field {
        Field::Power | Field::PowerLimit => format!("{:.3}", v as f64 / 1000.0),
        Field::ThrottleReasons => format!("{v:#x}"),
        _ => v.to_string(),
    }
}

/// The header row (without the newline).
pub fn header() -> String {
    let mut cols = vec!["unix_ms", "elapsed_s", "index", "uuid"];
    cols.extend(Field::VALUES.iter().map(|&f| column(f)));
    cols.push("processes");
    cols.join(",")
}

/// Writes `state.series` as CSV.
pub fn write_csv(state: &GpuState, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "{}", header())?;
    for s in &state.series {
        let uuid = state.device(s.index).map_or("", |d| d.uuid.as_str());
        let mut row = vec![
            s.unix_ms.to_string(),
            format!(
                "{:.3}",
                s.timestamp_ns.saturating_sub(state.started_ns) as f64 / 1e9
            ),
            s.index.to_string(),
            // NVML UUIDs are `GPU-` and hex digits: nothing to quote.
            uuid.to_string(),
        ];
        for &f in &Field::VALUES {
            row.push(s.get(f).map(|v| cell(f, v)).unwrap_or_default());
        }
        let procs: Vec<String> = s
            .processes
            .iter()
            .map(|p| match p.used_memory {
                Some(b) => format!("{}:{b}", p.pid),
                None => format!("{}:", p.pid),
            })
            .collect();
        row.push(procs.join(";"));
        writeln!(out, "{}", row.join(","))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::tests::sample;
    use crate::gpu::{DeviceInfo, ProcessSample};

    #[test]
    fn rows_per_device_with_empty_failed_cells() {
        let devices = (0..2)
            .map(|i| DeviceInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                name: String::new(),
                lost_at_ns: None,
            })
            .collect();
        let mut st = GpuState::new(devices, 10, 0);
        let mut a = sample(0, 1500, Some(80));
        a.set(Field::Power, Some(150_500));
        a.set(Field::ThrottleReasons, Some(4));
        a.processes.push(ProcessSample {
            pid: 9,
            used_memory: Some(1024),
            sm_util: Some(3),
            mem_util: None,
        });
        st.push(a);
        st.push(sample(1, 1500, Some(25)));
        let mut out = Vec::new();
        write_csv(&st, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        let head: Vec<&str> = lines[0].split(',').collect();
        assert_eq!(head.len(), 17);
        assert_eq!(
            head[..5],
            ["unix_ms", "elapsed_s", "index", "uuid", "utilization_pct"]
        );
        let row = |i: usize| -> Vec<&str> { lines[i].split(',').collect() };
        let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
        assert_eq!(row(1)[col("elapsed_s")], "1.500");
        assert_eq!(row(1)[col("uuid")], "GPU-0");
        assert_eq!(row(1)[col("utilization_pct")], "80");
        assert_eq!(row(1)[col("power_w")], "150.500");
        assert_eq!(row(1)[col("throttle_reasons")], "0x4");
        assert_eq!(row(1)[col("processes")], "9:1024");
        assert_eq!(row(2)[col("index")], "1");
        assert_eq!(
            row(2)[col("power_w")],
            "",
            "a failed field is an empty cell"
        );
        assert_eq!(row(2).len(), head.len());
    }
}
