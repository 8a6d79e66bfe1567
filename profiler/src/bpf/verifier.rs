//! The verifier table (`pyrometer verifier`, `cargo xtask verifier`): every program in every
//! configuration loaded on the running kernel, with what the verifier spent on it. A program
//! over [`VERIFIER_BUDGET`] or refused is a failure: kernels differ, and a program that costs
//! a tenth of the limit here has room for the next kernel's stricter verifier.

use std::path::Path;
use std::time::Duration;

use aya::{Btf, Endianness};

use super::load::{self, Kind, LoadFailure, ProgramLoad, VERIFIER_BUDGET, VERIFIER_LIMIT};
use super::{
    AllocConfig, BpfError, DEFAULT_ALLOC_LIVE, DEFAULT_ALLOC_SAMPLE_BYTES, Filter,
    GpuKernelsConfig, SamplerConfig,
};

/// A configuration the agent or `record` can load: its name as a command line would say it.
pub struct Configuration {
    pub name: &'static str,
    pub config: SamplerConfig,
}

/// Every configuration whose programs differ for the verifier: the target filter, the DWARF
/// walk, and each optional stage alone and all together (uretprobes change the unwinder).
pub fn configurations(btf_path: &Path) -> Vec<Configuration> {
    let base = SamplerConfig {
        btf_path: btf_path.to_path_buf(),
        ..SamplerConfig::default()
    };
    let alloc = |own_targets| AllocConfig {
        sample_bytes: DEFAULT_ALLOC_SAMPLE_BYTES,
        live_entries: DEFAULT_ALLOC_LIVE,
        own_targets,
    };
    let off_cpu = Some(1_000_000);
    vec![
        Configuration {
            name: "--all",
            config: SamplerConfig {
                filter: Filter::All,
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid",
            config: base.clone(),
        },
        Configuration {
            name: "--pid --unwind fp",
            config: SamplerConfig {
                dwarf: false,
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --off-cpu",
            config: SamplerConfig {
                off_cpu_min_ns: off_cpu,
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --gil",
            config: SamplerConfig {
                gil: true,
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --gc",
            config: SamplerConfig {
                gc: true,
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --async --off-cpu",
            config: SamplerConfig {
                asyncio: true,
                off_cpu_min_ns: off_cpu,
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --alloc",
            config: SamplerConfig {
                alloc: Some(alloc(false)),
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --gpu-kernels",
            config: SamplerConfig {
                gpu_kernels: Some(GpuKernelsConfig { all: false }),
                ..base.clone()
            },
        },
        Configuration {
            name: "--pid --off-cpu --gil --alloc",
            config: SamplerConfig {
                off_cpu_min_ns: off_cpu,
                gil: true,
                alloc: Some(alloc(false)),
                ..base.clone()
            },
        },
        Configuration {
            name: "agent --all --off-cpu --alloc-comm --gpu-kernels",
            config: SamplerConfig {
                filter: Filter::All,
                off_cpu_min_ns: off_cpu,
                alloc: Some(alloc(true)),
                gpu_kernels: Some(GpuKernelsConfig { all: true }),
                ..base.clone()
            },
        },
        Configuration {
            name: "agent --all --off-cpu --gil --gc --alloc-comm --gpu-kernels",
            config: SamplerConfig {
                filter: Filter::All,
                off_cpu_min_ns: off_cpu,
                gil: true,
                gc: true,
                alloc: Some(alloc(true)),
                gpu_kernels: Some(GpuKernelsConfig { all: true }),
                ..base
            },
        },
    ]
}

/// One program of one configuration.
pub struct Row {
    /// The configuration loaded (`default`, `dwarf off`, ...).
    pub configuration: &'static str,
    /// The program.
    pub program: &'static str,
    /// What the verifier said of it.
    pub outcome: Result<ProgramLoad, LoadFailure>,
}

impl Row {
    /// Over budget or refused.
    pub fn failed(&self) -> bool {
        match &self.outcome {
            Ok(l) => l.processed.is_some_and(|p| p > VERIFIER_BUDGET),
            Err(_) => true,
        }
    }
}

/// Loads every program of every configuration on the running kernel.
pub fn verify_all(btf_path: &Path) -> Result<Vec<Row>, BpfError> {
    if !btf_path.exists() {
        return Err(BpfError::NoBtf(btf_path.to_path_buf()));
    }
    let btf = Btf::parse_file(btf_path, Endianness::default()).map_err(|e| BpfError::BadBtf {
        path: btf_path.to_path_buf(),
        reason: e.to_string(),
    })?;
    super::raise_memlock_limit();
    // States and peak states come only from the verifier's statistics lines, which aya
    // (patched, third_party/README.md) keeps for a program that loads when asked to.
    aya::programs::collect_verifier_stats(true);
    let rows = verify_configurations(btf_path, &btf);
    aya::programs::collect_verifier_stats(false);
    rows
}

fn verify_configurations(btf_path: &Path, btf: &Btf) -> Result<Vec<Row>, BpfError> {
    let mut rows = Vec::new();
    for c in configurations(btf_path) {
        let mut ebpf = load::open(&c.config, btf, c.config.dwarf, c.config.asyncio)?;
        let mut programs: Vec<(&'static str, Kind)> = load::LIFECYCLE
            .iter()
            .map(|&(p, tp)| (p, Kind::Tracepoint(tp)))
            .collect();
        programs.push((load::SAMPLER, Kind::PerfEvent));
        for feature in load::requested(&c.config) {
            programs.extend(load::feature_programs(feature));
        }
        for (program, kind) in programs {
            rows.push(Row {
                configuration: c.name,
                program,
                outcome: load::load_program(&mut ebpf, btf, program, kind),
            });
        }
    }
    Ok(rows)
}

/// The table as text: one row per program and configuration.
pub fn render(rows: &[Row], kernel: &str) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "BPF verifier on Linux {kernel}: processed instructions per program (budget {VERIFIER_BUDGET}, limit {VERIFIER_LIMIT})"
    );
    let _ = writeln!(
        out,
        "{:<36} {:<18} {:>10} {:>8} {:>7} {:>6} {:>9} {:>8}  result",
        "configuration",
        "program",
        "processed",
        "limit %",
        "states",
        "peak",
        "verify ms",
        "load ms"
    );
    let num = |v: Option<u32>| v.map_or("?".to_string(), |v| v.to_string());
    for r in rows {
        let (processed, share, states, peak, verify, time, result) = match &r.outcome {
            Ok(l) => {
                let share = l.processed.map_or("?".to_string(), |p| {
                    format!("{:.1}", 100.0 * f64::from(p) / f64::from(VERIFIER_LIMIT))
                });
                let result = if r.failed() { "OVER BUDGET" } else { "ok" };
                let stats = l.stats.unwrap_or_default();
                let verify = stats
                    .time_us
                    .map_or("?".to_string(), |us| format!("{:.1}", us as f64 / 1e3));
                (
                    num(l.processed),
                    share,
                    num(stats.total_states),
                    num(stats.peak_states),
                    verify,
                    l.load_time,
                    result.to_string(),
                )
            }
            Err(f) => (
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                f.load_time,
                format!("REFUSED: {}", f.reason),
            ),
        };
        let _ = writeln!(
            out,
            "{:<36} {:<18} {:>10} {:>8} {:>7} {:>6} {:>9} {:>8.1}  {}",
            r.configuration,
            r.program,
            processed,
            share,
            states,
            peak,
            verify,
            ms(time),
            result
        );
    }
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The table as JSON lines (for the kernel matrix and the benchmark).
pub fn to_json(rows: &[Row], kernel: &str) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| match &r.outcome {
            Ok(l) => serde_json::json!({
                "configuration": r.configuration,
                "program": r.program,
                "processed": l.processed,
                "total_states": l.stats.and_then(|s| s.total_states),
                "peak_states": l.stats.and_then(|s| s.peak_states),
                "verify_us": l.stats.and_then(|s| s.time_us),
                "load_ms": ms(l.load_time),
                "ok": !r.failed(),
            }),
            Err(f) => serde_json::json!({
                "configuration": r.configuration,
                "program": r.program,
                "refused": f.reason,
                "load_ms": ms(f.load_time),
                "ok": false,
            }),
        })
        .collect();
    serde_json::json!({ "kernel": kernel, "budget": VERIFIER_BUDGET, "limit": VERIFIER_LIMIT, "programs": rows })
}
