//! The per-device summary `record --gpu` and `pyrometer gpu` print at the end.
//!
//! Idle while on-CPU: poll k of a device reports the utilization of the period before it,
//! so it stands for the interval (t(k-1), t(k)]. An interval is *on-CPU* when the profiled
//! processes had at least one CPU sample in it, and *idle* when the device's utilization
//! was at most [`IDLE_UTILIZATION_PERCENT`]. The share is the idle on-CPU time over all
//! on-CPU time: "of the time the program ran on the CPU, how much did this GPU sit idle".
//! The first poll has no interval before it and does not count.

use std::fmt::Write as _;

use super::{ErrorCounts, Field, GpuState, ProcessUsage};
use crate::capture::Activity;

/// At or below this utilization (percent) a GPU counts as idle. Not 0: drivers report a
/// few percent for housekeeping on GPUs no process uses.
pub const IDLE_UTILIZATION_PERCENT: u64 = 5;

/// Time the GPU was idle while the profiled processes were on the CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IdleShare {
    /// On-CPU time (ns) during which the GPU was idle.
    pub idle_on_cpu_ns: u64,
    /// On-CPU time (ns) of the profiled processes.
    pub on_cpu_ns: u64,
}

impl IdleShare {
    /// The share in 0..=1, or `None` when the processes were never on the CPU.
    pub fn share(&self) -> Option<f64> {
        (self.on_cpu_ns > 0).then(|| self.idle_on_cpu_ns as f64 / self.on_cpu_ns as f64)
    }
}

/// One device's numbers over the recording.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceSummary {
    /// NVML's index of the device.
    pub index: u32,
    /// Its UUID.
    pub uuid: String,
    /// Its product name.
    pub name: String,
    /// Polls of it.
    pub polls: u64,
    /// From its first poll to its last, ns.
    pub span_ns: u64,
    /// Mean GPU utilization, percent.
    pub utilization_mean: Option<f64>,
    /// Highest GPU utilization, percent.
    pub utilization_max: Option<u64>,
    /// Mean memory utilization, percent.
    pub memory_utilization_mean: Option<f64>,
    /// Most memory used at once, bytes.
    pub memory_used_max: Option<u64>,
    /// Its memory, bytes.
    pub memory_total: Option<u64>,
    /// Watts.
    pub power_mean: Option<f64>,
    /// Its power limit, watts.
    pub power_limit: Option<f64>,
    /// Highest temperature, degrees Celsius.
    pub temperature_max: Option<u64>,
    /// Only when the caller knew when the processes were on the CPU.
    pub idle: Option<IdleShare>,
    /// Per process of interest: its pid and what it did on this device.
    pub processes: Vec<(u32, ProcessUsage)>,
    /// (field, NVML error, count).
    pub errors: Vec<(Field, &'static str, u64)>,
    /// Seconds after the start that the device was lost, if it was.
    pub lost_after_s: Option<f64>,
}

fn mean(values: &[u64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<u64>() as f64 / values.len() as f64)
}

/// Summarizes every device. `activity` (the profiled processes' CPU samples over time)
/// enables the idle-while-on-CPU share; `pids`, when given, limits the process list to
/// those pids (the profiled ones).
pub fn summarize(
    state: &GpuState,
    activity: Option<&Activity>,
    pids: Option<&dyn Fn(u32) -> bool>,
) -> Vec<DeviceSummary> {
    state
        .devices
        .iter()
        .map(|d| {
            let series: Vec<_> = state.device_series(d.index).collect();
            let field = |f: Field| -> Vec<u64> { series.iter().filter_map(|s| s.get(f)).collect() };
            let util = field(Field::Utilization);
            let power = field(Field::Power);
            let limit = field(Field::PowerLimit);
            let idle = activity.map(|a| {
                let mut share = IdleShare::default();
                for w in series.windows(2) {
                    let (from, to) = (w[0].timestamp_ns, w[1].timestamp_ns);
                    let Some(u) = w[1].get(Field::Utilization) else {
                        continue;
                    };
                    if a.samples_between(from, to) > 0 {
                        share.on_cpu_ns += to - from;
                        if u <= IDLE_UTILIZATION_PERCENT {
                            share.idle_on_cpu_ns += to - from;
                        }
                    }
                }
                share
            });
            let processes = state
                .process_usage()
                .iter()
                .filter(|((pid, index), _)| *index == d.index && pids.is_none_or(|f| f(*pid)))
                .map(|(&(pid, _), u)| (pid, *u))
                .collect();
            DeviceSummary {
                index: d.index,
                uuid: d.uuid.clone(),
                name: d.name.clone(),
                polls: series.len() as u64,
                span_ns: match (series.first(), series.last()) {
                    (Some(a), Some(b)) => b.timestamp_ns - a.timestamp_ns,
                    _ => 0,
                },
                utilization_mean: mean(&util),
                utilization_max: util.iter().copied().max(),
                memory_utilization_mean: mean(&field(Field::MemoryUtilization)),
                memory_used_max: field(Field::MemoryUsed).into_iter().max(),
                memory_total: field(Field::MemoryTotal).into_iter().max(),
                power_mean: mean(&power).map(|mw| mw / 1000.0),
                power_limit: limit.last().map(|&mw| mw as f64 / 1000.0),
                temperature_max: field(Field::Temperature).into_iter().max(),
                idle,
                processes,
                errors: device_errors(&state.errors, d.index),
                lost_after_s: d
                    .lost_at_ns
                    .map(|t| t.saturating_sub(state.started_ns) as f64 / 1e9),
            }
        })
        .collect()
}

fn device_errors(errors: &ErrorCounts, index: u32) -> Vec<(Field, &'static str, u64)> {
    errors
        .iter()
        .filter(|((i, _, _), _)| *i == index)
        .map(|(&(_, f, e), &n)| (f, e, n))
        .collect()
}

/// Bytes as GiB with two decimals (GPU memory sizes are GiB-scale).
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn or_dash<T>(v: Option<T>, f: impl FnOnce(T) -> String) -> String {
    v.map_or_else(|| "n/a".to_string(), f)
}

/// The summary as text, a few lines per device:
///
/// ```text
/// GPU 0 GPU-7e57…0000 (NVML Test Double 0): 15 polls over 2.8 s
///   utilization: mean 40.0 %, max 80 %; memory utilization mean 20.0 %
///   memory used: max 4.00 GiB of 16.00 GiB
///   power: mean 150.0 W, limit 300.0 W; temperature: max 65 °C
///   idle while on-CPU: 48.3 % of 2.8 s on-CPU
///   pid 1234: max 1.00 GiB GPU memory, SM max 40 % (15 polls)
///   errors: power: NOT_SUPPORTED ×15
/// ```
pub fn render(summaries: &[DeviceSummary]) -> String {
    let mut o = String::new();
    for s in summaries {
        let _ = writeln!(
            o,
            "GPU {} {} ({}): {} polls over {:.1} s{}",
            s.index,
            s.uuid,
            if s.name.is_empty() { "?" } else { &s.name },
            s.polls,
            s.span_ns as f64 / 1e9,
            s.lost_after_s
                .map(|t| format!("; LOST after {t:.1} s"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            o,
            "  utilization: mean {}, max {}; memory utilization mean {}",
            or_dash(s.utilization_mean, |v| format!("{v:.1} %")),
            or_dash(s.utilization_max, |v| format!("{v} %")),
            or_dash(s.memory_utilization_mean, |v| format!("{v:.1} %")),
        );
        let _ = writeln!(
            o,
            "  memory used: max {} of {}",
            or_dash(s.memory_used_max, gib),
            or_dash(s.memory_total, gib),
        );
        let _ = writeln!(
            o,
            "  power: mean {}, limit {}; temperature: max {}",
            or_dash(s.power_mean, |v| format!("{v:.1} W")),
            or_dash(s.power_limit, |v| format!("{v:.1} W")),
            or_dash(s.temperature_max, |v| format!("{v} °C")),
        );
        if let Some(idle) = &s.idle {
            let _ = writeln!(
                o,
                "  idle while on-CPU: {} of {:.1} s on-CPU",
                or_dash(idle.share(), |v| format!("{:.1} %", v * 100.0)),
                idle.on_cpu_ns as f64 / 1e9
            );
        }
        for (pid, u) in &s.processes {
            let _ = writeln!(
                o,
                "  pid {pid}: max {} GPU memory{} ({} polls)",
                gib(u.max_memory),
                u.max_sm_util
                    .map(|sm| format!(", SM max {sm} %"))
                    .unwrap_or_default(),
                u.polls
            );
        }
        if !s.errors.is_empty() {
            let list: Vec<String> = s
                .errors
                .iter()
                .map(|(f, e, n)| format!("{}: {e} ×{n}", f.name()))
                .collect();
            let _ = writeln!(o, "  errors: {}", list.join(", "));
        }
    }
    o
}

/// The summaries as JSON (`record --stats`): one object per device, the same numbers as
/// [`render`], power in watts, memory in bytes, shares in 0..=1; `null` where unknown.
pub fn to_json(summaries: &[DeviceSummary]) -> serde_json::Value {
    let devices: Vec<serde_json::Value> = summaries
        .iter()
        .map(|s| {
            serde_json::json!({
                "index": s.index,
                "uuid": s.uuid,
                "name": s.name,
                "polls": s.polls,
                "span_ns": s.span_ns,
                "utilization_mean_pct": s.utilization_mean,
                "utilization_max_pct": s.utilization_max,
                "memory_utilization_mean_pct": s.memory_utilization_mean,
                "memory_used_max_bytes": s.memory_used_max,
                "memory_total_bytes": s.memory_total,
                "power_mean_w": s.power_mean,
                "power_limit_w": s.power_limit,
                "temperature_max_c": s.temperature_max,
                "on_cpu_ns": s.idle.map(|i| i.on_cpu_ns),
                "idle_on_cpu_ns": s.idle.map(|i| i.idle_on_cpu_ns),
                "idle_while_on_cpu_share": s.idle.and_then(|i| i.share()),
                "processes": s.processes.iter().map(|(pid, u)| serde_json::json!({
                    "pid": pid, "max_memory_bytes": u.max_memory, "polls": u.polls,
                    "sm_utilization_max_pct": u.max_sm_util,
                })).collect::<Vec<_>>(),
                "errors": s.errors.iter().map(|(f, e, n)| serde_json::json!({
                    "field": f.name(), "error": e, "count": n,
                })).collect::<Vec<_>>(),
                "lost_after_s": s.lost_after_s,
            })
        })
        .collect();
    serde_json::Value::Array(devices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::tests::sample;
    use crate::gpu::{DeviceInfo, ProcessSample};

    const MS: u64 = 1_000_000;

    fn state() -> GpuState {
        let devices = (0..2)
            .map(|i| DeviceInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                name: format!("Test {i}"),
                lost_at_ns: None,
            })
            .collect();
        let mut st = GpuState::new(devices, 100, 0);
        // Device 0 polled every 100 ms, utilization 0, 0, 80, 80, 0 (ms 0..400); device 1
        // reports no utilization and no power.
        for (k, u) in [0, 0, 80, 80, 0].into_iter().enumerate() {
            let mut s = sample(0, k as u64 * 100, Some(u));
            s.set(Field::Power, Some(100_000 + 10_000 * k as u64));
            s.set(Field::PowerLimit, Some(300_000));
            s.set(Field::MemoryUsed, Some((k as u64 + 1) << 30));
            s.set(Field::MemoryTotal, Some(16 << 30));
            s.processes.push(ProcessSample {
                pid: 42,
                used_memory: Some(1 << 30),
                sm_util: Some(10 * k as u32),
                mem_util: None,
            });
            st.push(s);
            st.push(sample(1, k as u64 * 100, None));
        }
        st.errors.insert((1, Field::Power, "NOT_SUPPORTED"), 5);
        st
    }

    #[test]
    fn means_maxima_and_errors() {
        let s = summarize(&state(), None, None);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].polls, 5);
        assert_eq!(s[0].span_ns, 400 * MS);
        assert_eq!(s[0].utilization_mean, Some(32.0));
        assert_eq!(s[0].utilization_max, Some(80));
        assert_eq!(s[0].memory_used_max, Some(5 << 30));
        assert_eq!(s[0].power_mean, Some(120.0));
        assert_eq!(s[0].power_limit, Some(300.0));
        assert_eq!(
            s[0].processes,
            [(
                42,
                ProcessUsage {
                    max_memory: 1 << 30,
                    polls: 5,
                    max_sm_util: Some(40)
                }
            )]
        );
        assert_eq!(s[0].idle, None);
        assert_eq!(s[1].utilization_mean, None);
        assert_eq!(s[1].errors, [(Field::Power, "NOT_SUPPORTED", 5)]);
        let text = render(&s);
        assert!(
            text.contains("GPU 0 GPU-0 (Test 0): 5 polls over 0.4 s"),
            "{text}"
        );
        assert!(
            text.contains("utilization: mean 32.0 %, max 80 %"),
            "{text}"
        );
        assert!(
            text.contains("memory used: max 5.00 GiB of 16.00 GiB"),
            "{text}"
        );
        assert!(
            text.contains("power: mean 120.0 W, limit 300.0 W"),
            "{text}"
        );
        assert!(
            text.contains("pid 42: max 1.00 GiB GPU memory, SM max 40 % (5 polls)"),
            "{text}"
        );
        assert!(text.contains("power: mean n/a, limit n/a"), "{text}");
        assert!(text.contains("errors: power: NOT_SUPPORTED ×5"), "{text}");
        let only_7 = |pid| pid == 7;
        assert!(
            summarize(&state(), None, Some(&only_7))[0]
                .processes
                .is_empty()
        );
    }

    #[test]
    fn idle_share_counts_on_cpu_intervals_only() {
        // On the CPU in (0, 300] ms only: intervals (0,100] idle, (100,200] busy,
        // (200,300] busy; (300,400] idle but off the CPU.
        let mut a = Activity::new(0, 10 * MS, 1000);
        for ms in (5..300).step_by(10) {
            a.add(ms * MS);
        }
        let s = summarize(&state(), Some(&a), None);
        let idle = s[0].idle.unwrap();
        assert_eq!(idle.on_cpu_ns, 300 * MS);
        assert_eq!(idle.idle_on_cpu_ns, 100 * MS);
        assert!((idle.share().unwrap() - 1.0 / 3.0).abs() < 1e-9);
        // No utilization readings: nothing to judge.
        assert_eq!(s[1].idle.unwrap().share(), None);
        assert!(render(&s).contains("idle while on-CPU: 33.3 % of 0.3 s on-CPU"));
        let json = to_json(&s);
        assert_eq!(json[0]["idle_on_cpu_ns"], 100 * MS);
        assert_eq!(json[1]["idle_while_on_cpu_share"], serde_json::Value::Null);
        let never = Activity::new(0, 10 * MS, 1000);
        assert_eq!(
            summarize(&state(), Some(&never), None)[0]
                .idle
                .unwrap()
                .share(),
            None
        );
    }
}
