//! The agent's settings: flags, the TOML config file (flags win), and what they resolve to.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use pyrometer::agent::{AgentConfig as Config, AllocTargets};
use regex::Regex;
use serde::Deserialize;

use crate::gpu::NvmlArgs;
use crate::{EXIT_INPUT, exit_error, parse_bytes, parse_duration};

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// TOML file with the same settings as the flags (flags win), e.g. `collector = "http://c:4040"`.
    #[arg(long, value_name = "FILE")]
    pub(super) config: Option<PathBuf>,
    /// Process to profile (repeatable); default: every process.
    #[arg(short, long = "pid", value_name = "PID")]
    pub(super) pids: Vec<u32>,
    /// Profile processes whose name (comm, 15 bytes) matches this regex, anchored (the whole
    /// name: `ray::.*` for a prefix), including ones started later.
    #[arg(long, value_name = "REGEX")]
    pub(super) comm: Option<String>,
    /// Collector to push to, e.g. http://collector:4040.
    #[arg(long, value_name = "URL")]
    pub(super) collector: Option<String>,
    /// Also export each interval's profile to this OTLP gRPC endpoint in the OpenTelemetry
    /// profiles data model (e.g. http://otel-collector:4317); best effort, never spooled.
    #[arg(long, value_name = "URL")]
    pub(super) otlp_endpoint: Option<String>,
    /// The `node` label of everything this agent pushes (default: the hostname).
    #[arg(long)]
    pub(super) node_name: Option<String>,
    /// How often a profile is aggregated and pushed (default 10s).
    #[arg(long, value_parser = parse_duration)]
    pub(super) push_interval: Option<Duration>,
    /// Samples per second per CPU (default 19).
    #[arg(short = 'F', long)]
    pub(super) frequency: Option<u64>,
    /// Where batches wait for the collector (default /var/lib/pyrometer/spool).
    #[arg(long, value_name = "DIR")]
    pub(super) spool_dir: Option<PathBuf>,
    /// Spool size limit in MiB; when full the oldest batches are dropped (default 256).
    #[arg(long, value_name = "MIB")]
    pub(super) spool_max_mb: Option<u64>,
    /// File holding the collector's bearer token.
    #[arg(long, value_name = "FILE")]
    pub(super) token_file: Option<PathBuf>,
    /// PEM file of the CA that signed an https:// collector's certificate (default: the
    /// system's roots).
    #[arg(long, value_name = "FILE")]
    pub(super) ca: Option<PathBuf>,
    /// PEM client certificate to present to an https:// collector that authenticates agents
    /// by certificate (its --client-ca); needs --client-key.
    #[arg(long, value_name = "FILE", requires = "client_key")]
    pub(super) client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    pub(super) client_key: Option<PathBuf>,
    /// Send the token to a collector over plain http:// on another host, where anyone on
    /// the way can read it (by default refused: use https://).
    #[arg(long)]
    pub(super) insecure: bool,
    /// Serve the agent's own Prometheus /metrics on this address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub(super) metrics_listen: Option<SocketAddr>,
    /// The user the agent becomes once its programs are attached, as UID[:GID], or `root` to
    /// stay uid 0 (default 65534:65534, nobody). It keeps only the capabilities it needs
    /// either way.
    #[arg(long, value_name = "UID[:GID]")]
    pub(super) run_as: Option<String>,
    /// Do not profile processes whose cgroup path (in /proc/PID/cgroup) matches this regex:
    /// nothing of them is read and their samples are dropped, e.g. `pod<UID>` (a Kubernetes
    /// pod, `_` for `-` under the systemd cgroup driver) or `optout\.slice`.
    #[arg(long, value_name = "REGEX")]
    pub(super) exclude_cgroup: Option<String>,
    /// What a system call outside the agent's list does once it is attached: `kill` (the
    /// default) ends the agent, `log` has the kernel log it and lets it through, `off` installs
    /// no filter. With NVML loaded `kill` acts as `log`.
    #[arg(long, value_parser = ["kill", "log", "off"])]
    pub(super) seccomp: Option<String>,
    /// On exit, write what was sampled, pushed, dropped and left spooled as JSON here.
    #[arg(long, value_name = "FILE")]
    pub(super) stats: Option<PathBuf>,
    /// How to walk user stacks: `dwarf` (in-kernel .eh_frame unwinding, frame pointers where a
    /// binary has no table; the default) or `fp` (frame pointers only).
    #[arg(long, value_parser = ["dwarf", "fp"])]
    pub(super) unwind: Option<String>,
    /// Also measure off-CPU time of the targets (as `record --off-cpu`): blocked time by the
    /// stack that blocked, the `off_cpu/nanoseconds` type; a long block is reported in every
    /// push it spans, counted once.
    #[arg(long)]
    pub(super) off_cpu: bool,
    /// Also measure CPython's garbage-collector pauses (as `record --gc`): the `gc`
    /// nanoseconds type by the stack that set the collection off, and per process a
    /// histogram of pauses on /metrics.
    #[arg(long)]
    pub(super) gc: bool,
    /// Load the GIL probes, so on-demand captures can ask for --gil (wait and hold times of
    /// the GIL, as `record --gil`): they are attached to a capture's processes only, for its
    /// duration; the always-on profile has no GIL view.
    #[arg(long)]
    pub(super) gil: bool,
    /// Also show asyncio task stacks (as `record --async`): `[task] NAME` frames above the
    /// coroutines they ran and the `asyncio_task` label (CPython 3.11-3.15).
    #[arg(long = "async")]
    pub(super) asyncio: bool,
    /// Shortest blocked interval counted with --off-cpu (default 1ms).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(super) off_cpu_min: Option<Duration>,
    /// Capacity of the node's unwind row array, shared by all tables (default 1048576 rows,
    /// 16 MiB of kernel memory).
    #[arg(long, value_name = "ROWS")]
    pub(super) unwind_rows: Option<u32>,
    /// Also read DWARF for native frames' source lines and inlined functions, at most this many
    /// MiB of it (inflated) from the files open at once; a file whose DWARF does not fit is
    /// named from its symbol table. Default 0: symbol tables only (function names, static ones
    /// too from debug files). 12 fits the C library's debug file (9.5 MiB) and costs the agent
    /// ~20 MB and ~25 ms of CPU when it is first read.
    #[arg(long, value_name = "MIB")]
    pub(super) dwarf_mb: Option<u64>,
    /// What the agent may keep for one process (its perf map as parsed, its mappings), in
    /// MiB; a process over it is degraded: each of its user stacks is one `[budget]` frame
    /// (default 24).
    #[arg(long, value_name = "MIB")]
    pub(super) process_budget_mb: Option<u64>,
    /// CPU time the agent may spend on one process per push interval, in milliseconds
    /// (reading its files, its tables, symbol lookups); a process over it is degraded until
    /// the interval ends: each of its user stacks is one `[budget]` frame (default 2000).
    #[arg(long, value_name = "MS")]
    pub(super) process_cpu_budget_ms: Option<u64>,
    /// Do not poll the GPUs. By default the agent polls them whenever NVML loads (and says
    /// "GPU source off" once when it does not): gauges on /metrics, and `gpu` and
    /// `gpu_memory` labels on the samples of processes that use a GPU.
    #[arg(long)]
    pub(super) no_gpu: bool,
    #[command(flatten)]
    pub(super) nvml: NvmlArgs,
    /// Sample the allocations of this process (repeatable): uprobes on its allocator, as
    /// `record --alloc`. Opt-in per process: a uprobe traps on every call.
    #[arg(long = "alloc-pid", value_name = "PID")]
    pub(super) alloc_pids: Vec<u32>,
    /// Sample the allocations of processes whose name (comm, 15 bytes) matches this regex,
    /// anchored as --comm is, including ones started later.
    #[arg(long, value_name = "REGEX")]
    pub(super) alloc_comm: Option<String>,
    /// Mean bytes between allocation samples (default 512K).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub(super) alloc_sample_bytes: Option<u64>,
    /// Kernel BTF to load against (default /sys/kernel/btf/vmlinux).
    #[arg(long, value_name = "FILE", hide = true)]
    pub(super) btf_path: Option<PathBuf>,
    #[command(flatten)]
    pub(super) debuginfod: crate::debuginfod::DebuginfodArgs,
    /// Make the kernel refuse these stages (dwarf, off_cpu, gil, alloc): tests of the
    /// degraded paths.
    #[arg(long, hide = true, value_delimiter = ',')]
    pub(super) debug_reject: Vec<String>,
}

/// The config file: the flags' long names, in kebab case.
#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileConfig {
    pid: Option<Vec<u32>>,
    comm: Option<String>,
    collector: Option<String>,
    otlp_endpoint: Option<String>,
    node_name: Option<String>,
    push_interval: Option<String>,
    frequency: Option<u64>,
    spool_dir: Option<PathBuf>,
    spool_max_mb: Option<u64>,
    token_file: Option<PathBuf>,
    ca: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    insecure: Option<bool>,
    metrics_listen: Option<SocketAddr>,
    run_as: Option<String>,
    seccomp: Option<String>,
    exclude_cgroup: Option<String>,
    unwind: Option<String>,
    unwind_rows: Option<u32>,
    dwarf_mb: Option<u64>,
    process_budget_mb: Option<u64>,
    process_cpu_budget_ms: Option<u64>,
    off_cpu: Option<bool>,
    off_cpu_min: Option<String>,
    gc: Option<bool>,
    gil: Option<bool>,
    #[serde(rename = "async")]
    asyncio: Option<bool>,
    gpu: Option<bool>,
    gpu_interval: Option<String>,
    nvml_lib: Option<PathBuf>,
    alloc_pid: Option<Vec<u32>>,
    alloc_comm: Option<String>,
    alloc_sample_bytes: Option<String>,
    debuginfod: Option<Vec<String>>,
    debuginfod_cache: Option<PathBuf>,
    debuginfod_cache_mb: Option<u64>,
}

/// The default of `--dwarf-mb`: symbol tables only. Reading DWARF was the always-on agent's
/// largest cost: the C library's debug file alone (`libc6-dbg`, 3.8 MB of zlib-compressed
/// DWARF, 10 MB inflated) took ~25 ms to inflate at the first push, a third of the agent's
/// CPU time in its first minute, and each MB read added ~1.7 MB resident (77 MB in all with
/// Debian's python3.11 debug file). Function names, which is what a flame graph shows, come
/// from the symbol tables; Python frames have their lines from the interpreter either way.
pub(super) const DEFAULT_DWARF_MB: u64 = 0;

/// `--process-budget-mb` in bytes; its default when not given.
fn budget_bytes(mib: Option<u64>) -> u64 {
    mib.map_or(pyrometer::agent::DEFAULT_PROCESS_BUDGET, |mb| {
        mb.saturating_mul(1 << 20)
    })
}

/// `--process-cpu-budget-ms` as a duration; its default when not given.
fn cpu_budget(ms: Option<u64>) -> Duration {
    ms.map_or(
        pyrometer::agent::DEFAULT_PROCESS_CPU_BUDGET,
        Duration::from_millis,
    )
}

pub(super) fn input(msg: impl Into<String>) -> anyhow::Error {
    exit_error(EXIT_INPUT, msg)
}

/// The debuginfod servers and cache of the flags, else the file's. Only servers given there:
/// never DEBUGINFOD_URLS, which a root daemon's environment may carry from wherever it was
/// started.
fn debuginfod(
    args: &crate::debuginfod::DebuginfodArgs,
    file: &mut FileConfig,
) -> anyhow::Result<Option<pyrometer::command::debuginfod::DebuginfodConfig>> {
    let urls = if args.urls.is_empty() {
        file.debuginfod.take().unwrap_or_default()
    } else {
        args.urls.clone()
    };
    args.resolve(
        "debuginfod",
        &urls,
        file.debuginfod_cache.take(),
        file.debuginfod_cache_mb,
    )
}

pub(super) fn resolve(args: &AgentArgs) -> anyhow::Result<Config> {
    let mut file: FileConfig = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| input(format!("cannot read {}: {e}", path.display())))?;
            toml::from_str(&text)
                .map_err(|e| input(format!("{}: {}", path.display(), e.message())))?
        }
        None => FileConfig::default(),
    };
    let debuginfod = debuginfod(&args.debuginfod, &mut file)?;
    let off_cpu_min_ns = off_cpu_min_ns(args, &file)?;
    let pids = if args.pids.is_empty() {
        file.pid.unwrap_or_default()
    } else {
        args.pids.clone()
    };
    let comm = match args.comm.clone().or(file.comm) {
        Some(re) => Some(
            Regex::new(&format!("^(?:{re})$"))
                .map_err(|e| input(format!("invalid --comm regex '{re}': {e}")))?,
        ),
        None => None,
    };
    let collector = args.collector.clone().or(file.collector);
    let otlp_endpoint = args.otlp_endpoint.clone().or(file.otlp_endpoint);
    if collector.is_none() && otlp_endpoint.is_none() {
        return Err(input(
            "no collector: give --collector http://HOST:4040 or --otlp-endpoint URL (or `collector` in --config)",
        ));
    }
    let interval = match (args.push_interval, file.push_interval) {
        (Some(d), _) => d,
        (None, Some(s)) => parse_duration(&s).map_err(|e| input(format!("push-interval: {e}")))?,
        (None, None) => Duration::from_secs(10),
    };
    let frequency = args.frequency.or(file.frequency).unwrap_or(19);
    if !(1..=10_000).contains(&frequency) {
        return Err(input("frequency must be between 1 and 10000 Hz"));
    }
    let token = read_token(args.token_file.clone().or(file.token_file))?;
    let client_identity = client_identity(
        args.client_cert.clone().or(file.client_cert),
        args.client_key.clone().or(file.client_key),
    )?;
    let node = match args.node_name.clone().or(file.node_name) {
        Some(n) if !n.is_empty() => n,
        _ => hostname(),
    };
    let gpu = if args.no_gpu || file.gpu == Some(false) {
        None
    } else {
        let interval = match (args.nvml.gpu_interval, file.gpu_interval) {
            (Some(d), _) => d,
            (None, Some(s)) => {
                crate::gpu::parse_interval(&s).map_err(|e| input(format!("gpu-interval: {e}")))?
            }
            (None, None) => crate::gpu::DEFAULT_INTERVAL,
        };
        // Flag, then environment, then the file: as for every other setting, the most
        // local wins.
        let lib = match (&args.nvml.nvml_lib, file.nvml_lib) {
            (Some(_), _) | (None, None) => args.nvml.library(),
            (None, Some(path)) => std::env::var_os("PYROMETER_NVML_LIB")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| path.into_os_string()),
        };
        Some((interval, lib))
    };
    let alloc_pids = if args.alloc_pids.is_empty() {
        file.alloc_pid.unwrap_or_default()
    } else {
        args.alloc_pids.clone()
    };
    let alloc_comm = match args.alloc_comm.clone().or(file.alloc_comm) {
        Some(re) => Some(
            Regex::new(&format!("^(?:{re})$"))
                .map_err(|e| input(format!("invalid --alloc-comm regex '{re}': {e}")))?,
        ),
        None => None,
    };
    let sample_bytes = match (args.alloc_sample_bytes, file.alloc_sample_bytes) {
        (Some(b), _) => b,
        (None, Some(s)) => {
            parse_bytes(&s).map_err(|e| input(format!("alloc-sample-bytes: {e}")))?
        }
        (None, None) => pyrometer::command::DEFAULT_ALLOC_SAMPLE_BYTES,
    };
    let alloc = (!alloc_pids.is_empty() || alloc_comm.is_some()).then_some(AllocTargets {
        pids: alloc_pids,
        comm: alloc_comm,
        sample_bytes,
    });
    Ok(Config {
        debuginfod,
        btf_path: args.btf_path.clone(),
        debug_reject: crate::debug_reject_bits(&args.debug_reject)?,
        alloc,
        gpu,
        pids,
        comm,
        collector,
        otlp_endpoint,
        node,
        interval,
        frequency,
        spool_dir: args
            .spool_dir
            .clone()
            .or(file.spool_dir)
            .unwrap_or_else(|| PathBuf::from("/var/lib/pyrometer/spool")),
        spool_max_bytes: args.spool_max_mb.or(file.spool_max_mb).unwrap_or(256) << 20,
        token,
        ca: args.ca.clone().or(file.ca),
        client_identity,
        insecure: args.insecure || file.insecure == Some(true),
        metrics_listen: args.metrics_listen.or(file.metrics_listen),
        exclude_cgroup: exclude_cgroup(args.exclude_cgroup.clone().or(file.exclude_cgroup))?,
        seccomp: seccomp(args.seccomp.clone().or(file.seccomp))?,
        run_as: parse_run_as(args.run_as.clone().or(file.run_as).as_deref())
            .map_err(|e| input(format!("run-as: {e}")))?,
        dwarf: match args.unwind.clone().or(file.unwind).as_deref() {
            None | Some("dwarf") => true,
            Some("fp") => false,
            Some(other) => {
                return Err(input(format!("unwind must be dwarf or fp, not '{other}'")));
            }
        },
        unwind_rows: args.unwind_rows.or(file.unwind_rows).unwrap_or(1 << 20),
        dwarf_budget_bytes: args
            .dwarf_mb
            .or(file.dwarf_mb)
            .unwrap_or(DEFAULT_DWARF_MB)
            .saturating_mul(1 << 20),
        gc: args.gc || file.gc == Some(true),
        gil: args.gil || file.gil == Some(true),
        asyncio: args.asyncio || file.asyncio == Some(true),
        process_budget_bytes: budget_bytes(args.process_budget_mb.or(file.process_budget_mb)),
        process_cpu_budget: cpu_budget(args.process_cpu_budget_ms.or(file.process_cpu_budget_ms)),
        off_cpu_min_ns,
    })
}

/// The shortest blocked interval counted, when off-CPU time is measured (flags, else file).
fn off_cpu_min_ns(args: &AgentArgs, file: &FileConfig) -> anyhow::Result<Option<u64>> {
    if !(args.off_cpu || file.off_cpu == Some(true)) {
        return Ok(None);
    }
    let min = match (args.off_cpu_min, &file.off_cpu_min) {
        (Some(d), _) => d,
        (None, Some(s)) => parse_duration(s).map_err(|e| input(format!("off-cpu-min: {e}")))?,
        (None, None) => pyrometer::command::DEFAULT_OFF_CPU_MIN,
    };
    Ok(Some(u64::try_from(min.as_nanos()).unwrap_or(u64::MAX)))
}

fn exclude_cgroup(pattern: Option<String>) -> anyhow::Result<Option<Regex>> {
    pattern
        .map(|re| {
            Regex::new(&re)
                .map_err(|e| input(format!("invalid --exclude-cgroup regex '{re}': {e}")))
        })
        .transpose()
}

fn seccomp(mode: Option<String>) -> anyhow::Result<pyrometer::agent::SeccompMode> {
    use pyrometer::agent::SeccompMode;
    match mode.as_deref() {
        None | Some("kill") => Ok(SeccompMode::Kill),
        Some("log") => Ok(SeccompMode::Log),
        Some("off") => Ok(SeccompMode::Off),
        Some(other) => Err(input(format!(
            "seccomp must be kill, log or off, not '{other}'"
        ))),
    }
}

/// `UID[:GID]` (the group defaults to the uid's number) or `root`; nobody when not given.
fn parse_run_as(s: Option<&str>) -> Result<Option<(u32, u32)>, String> {
    let Some(s) = s else {
        return Ok(Some(pyrometer::agent::DEFAULT_RUN_AS));
    };
    if s == "root" {
        return Ok(None);
    }
    let (uid, gid) = s.split_once(':').unwrap_or((s, s));
    let num = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("'{s}' is not UID[:GID] (numbers) or root"))
    };
    match (num(uid)?, num(gid)?) {
        (0, 0) => Ok(None),
        (uid, gid) => Ok(Some((uid, gid))),
    }
}

/// The token, read from its file.
fn read_token(token_file: Option<PathBuf>) -> anyhow::Result<Option<String>> {
    let Some(path) = token_file else {
        return Ok(None);
    };
    let t = std::fs::read_to_string(&path).map_err(|e| {
        input(format!(
            "cannot read the token file {}: {e}",
            path.display()
        ))
    })?;
    Ok(Some(t.trim().to_string()).filter(|t| !t.is_empty()))
}

/// The client certificate and its key, which go together.
fn client_identity(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> anyhow::Result<Option<(PathBuf, PathBuf)>> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some((cert, key))),
        (None, None) => Ok(None),
        _ => Err(input("--client-cert and --client-key go together")),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::ffi::OsString;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentArgs,
    }

    fn resolve_with(config: &str, flags: &[&str]) -> anyhow::Result<Config> {
        let dir = tempfile::Builder::new()
            .prefix("pyrometer-agent-cfg-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(&path, format!("collector = \"http://c:4040\"\n{config}")).unwrap();
        let mut argv = vec!["agent", "--config", path.to_str().unwrap()];
        argv.extend_from_slice(flags);
        resolve(&Cli::parse_from(argv).agent)
    }

    /// A client certificate comes with its key, from the flags or the file; `insecure` too.
    #[test]
    fn client_certificates_and_insecure_from_file_and_flags() {
        let c = resolve_with(
            "client-cert = \"a.pem\"\nclient-key = \"a.key\"\ninsecure = true",
            &[],
        )
        .unwrap();
        assert_eq!(c.client_identity, Some(("a.pem".into(), "a.key".into())));
        assert!(c.insecure);
        let c = resolve_with(
            "client-cert = \"a.pem\"\nclient-key = \"a.key\"",
            &["--client-cert", "b.pem", "--client-key", "b.key"],
        )
        .unwrap();
        assert_eq!(
            c.client_identity,
            Some(("b.pem".into(), "b.key".into())),
            "flags win"
        );
        assert!(!c.insecure, "off by default");
        let err = resolve_with("client-cert = \"a.pem\"", &[]).err().unwrap();
        assert!(err.to_string().contains("--client-key"), "{err}");
    }

    #[test]
    fn a_collector_or_an_otlp_endpoint_is_needed() {
        let parse = |argv: &[&str]| resolve(&Cli::parse_from(argv).agent);
        let err = parse(&["agent"]).err().unwrap().to_string();
        assert!(err.contains("--otlp-endpoint"), "{err}");
        let otlp_only = parse(&["agent", "--otlp-endpoint", "http://o:4317"]).unwrap();
        assert_eq!(otlp_only.collector, None);
        assert_eq!(otlp_only.otlp_endpoint.as_deref(), Some("http://o:4317"));
    }

    #[test]
    fn gpu_settings_from_file_and_flags() {
        let on = resolve_with("", &[]).unwrap();
        assert_eq!(on.gpu.unwrap().0, Duration::from_secs(1), "on by default");
        assert!(resolve_with("gpu = false", &[]).unwrap().gpu.is_none());
        assert!(resolve_with("", &["--no-gpu"]).unwrap().gpu.is_none());
        let (interval, _) = resolve_with("gpu-interval = \"250ms\"", &[])
            .unwrap()
            .gpu
            .unwrap();
        assert_eq!(interval, Duration::from_millis(250));
        let (interval, lib) = resolve_with(
            "gpu-interval = \"250ms\"\nnvml-lib = \"/file/lib.so\"",
            &["--gpu-interval", "2s", "--nvml-lib", "/flag/lib.so"],
        )
        .unwrap()
        .gpu
        .unwrap();
        assert_eq!(interval, Duration::from_secs(2), "flags win");
        assert_eq!(lib, OsString::from("/flag/lib.so"));
        let err = resolve_with("gpu-interval = \"1ms\"", &[]).err().unwrap();
        assert!(err.to_string().contains("gpu-interval"), "{err}");
    }

    #[test]
    fn allocation_sampling_is_opt_in_per_target() {
        assert!(
            resolve_with("", &[]).unwrap().alloc.is_none(),
            "off by default"
        );
        let a = resolve_with(
            "alloc-comm = \"worker.*\"\nalloc-sample-bytes = \"1M\"",
            &[],
        )
        .unwrap()
        .alloc
        .unwrap();
        assert_eq!(a.sample_bytes, 1 << 20);
        assert!(a.comm.unwrap().is_match("worker-3"));
        let a = resolve_with("", &["--alloc-pid", "42", "--alloc-pid", "43"])
            .unwrap()
            .alloc
            .unwrap();
        assert_eq!(
            (a.pids, a.sample_bytes),
            (vec![42, 43], pyrometer::command::DEFAULT_ALLOC_SAMPLE_BYTES)
        );
        let err = resolve_with("alloc-comm = \"(\"", &[]).err().unwrap();
        assert!(err.to_string().contains("--alloc-comm"), "{err}");
    }

    #[test]
    fn the_dwarf_budget_from_file_and_flags() {
        let mib = |c: &str, f: &[&str]| resolve_with(c, f).unwrap().dwarf_budget_bytes >> 20;
        assert_eq!(mib("", &[]), DEFAULT_DWARF_MB);
        assert_eq!(mib("dwarf-mb = 64", &[]), 64);
        assert_eq!(mib("dwarf-mb = 64", &["--dwarf-mb", "0"]), 0, "flags win");
    }

    /// Servers come from the flags or the file only, never from DEBUGINFOD_URLS (which the
    /// test's environment may carry; the agent must not care).
    #[test]
    fn debuginfod_servers_from_file_and_flags_only() {
        let d = |c: &str, f: &[&str]| resolve_with(c, f).unwrap().debuginfod;
        assert!(d("", &[]).is_none());
        let file =
            "debuginfod = [\"http://a:8002\"]\ndebuginfod-cache = \"/c\"\ndebuginfod-cache-mb = 5";
        let cfg = d(file, &[]).unwrap();
        assert_eq!(cfg.urls, ["http://a:8002"]);
        assert_eq!(cfg.cache_dir, PathBuf::from("/c"));
        assert_eq!(cfg.cache_max_bytes, 5 << 20);
        let cfg = d(file, &["--debuginfod", "https://b http://c:1"]).unwrap();
        assert_eq!(cfg.urls, ["https://b", "http://c:1"], "flags win");
        assert!(resolve_with("debuginfod = [\"ftp://x\"]", &[]).is_err());
    }
}
