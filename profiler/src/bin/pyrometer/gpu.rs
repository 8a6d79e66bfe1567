//! `pyrometer gpu`: poll the GPUs alone (no BPF, no root) and print the summary and a CSV of
//! the series; and the NVML options `record` and `agent` share.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Args;
use pyrometer::gpu::source::GpuError;
use pyrometer::gpu::{self, NvmlSource, Poller};

use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error, parse_duration};

/// Where NVML comes from and how often it is polled.
#[derive(Args, Debug, Clone)]
pub struct NvmlArgs {
    /// How often the GPUs are polled (default 1s; at least 20ms).
    #[arg(long, value_parser = parse_interval, value_name = "D")]
    pub gpu_interval: Option<Duration>,
    /// The NVML library to load (default: $PYROMETER_NVML_LIB, else libnvidia-ml.so.1).
    #[arg(long, value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,
}

/// The poll interval: NVML's utilization counters update at most every ~17 ms, and the
/// poller's own cost matters below that.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(20) {
        return Err(format!(
            "GPU poll interval '{s}' is too short: use 20ms or more"
        ));
    }
    Ok(d)
}

pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

impl NvmlArgs {
    pub fn interval(&self) -> Duration {
        self.gpu_interval.unwrap_or(DEFAULT_INTERVAL)
    }

    /// `--nvml-lib`, else PYROMETER_NVML_LIB, else the driver's soname.
    pub fn library(&self) -> OsString {
        self.nvml_lib
            .clone()
            .map(PathBuf::into_os_string)
            .or_else(|| std::env::var_os("PYROMETER_NVML_LIB").filter(|v| !v.is_empty()))
            .unwrap_or_else(|| gpu::DEFAULT_NVML_LIB.into())
    }
}

#[derive(Args, Debug)]
pub struct GpuArgs {
    /// How long to poll (e.g. 30s, 2m); default: until Ctrl-C.
    #[arg(short, long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// CSV of the series, one row per device per poll. Default: pyrometer-gpu-<time>.csv,
    /// printed at the end.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    #[command(flatten)]
    nvml: NvmlArgs,
}

pub fn run(args: GpuArgs) -> anyhow::Result<u8> {
    pyrometer::command::install_signal_handlers();
    let output = args.output.clone().unwrap_or_else(|| {
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from(format!("pyrometer-gpu-{stamp}.csv"))
    });
    // Before NVML: a bad -o is the user's to fix whatever the GPUs do.
    let file = File::create(&output).map_err(|e| {
        exit_error(
            EXIT_INPUT,
            format!("cannot write {}: {e}", output.display()),
        )
    })?;
    let lib = args.nvml.library();
    let source = match NvmlSource::open(&lib) {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_file(&output);
            eprintln!("pyrometer: GPU source off: {e}");
            let hint = match e {
                GpuError::LibraryNotFound { .. } | GpuError::LibraryUnusable { .. } => {
                    "install the NVIDIA driver, or give its libnvidia-ml.so.1 with --nvml-lib PATH (or PYROMETER_NVML_LIB)"
                }
                GpuError::Init { .. } => {
                    "check that the NVIDIA driver is loaded (nvidia-smi) and that this user may open /dev/nvidia*"
                }
                GpuError::NoDevices => "NVML sees no GPUs on this machine (see nvidia-smi)",
            };
            return Err(exit_error(
                EXIT_PRIVILEGES,
                format!("no GPUs to poll: {hint}"),
            ));
        }
    };
    let interval = args.nvml.interval();
    eprintln!(
        "pyrometer: polling {} GPU{} every {:.3}s{}; Ctrl-C to stop",
        source.devices().len(),
        if source.devices().len() == 1 { "" } else { "s" },
        interval.as_secs_f64(),
        args.duration
            .map(|d| format!(" for {:.1}s", d.as_secs_f64()))
            .unwrap_or_default()
    );
    let poller = Poller::start(source, interval, gpu::DEFAULT_SERIES_CAPACITY)
        .context("starting the GPU poller")?;
    let started = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(50));
        if pyrometer::command::signal_received()
            || args.duration.is_some_and(|d| started.elapsed() >= d)
        {
            break;
        }
    }
    let state = poller.stop();
    let mut w = BufWriter::new(file);
    gpu::csv::write_csv(&state, &mut w)
        .and_then(|()| w.flush())
        .with_context(|| format!("writing {}", output.display()))?;
    let summaries = gpu::summary::summarize(&state, None, None);
    print!("{}", gpu::summary::render(&summaries));
    if state.dropped > 0 {
        eprintln!(
            "pyrometer: the series holds the last {} polls; {} earlier ones were dropped (poll less often, or for less long)",
            state.series.len(),
            state.dropped
        );
    }
    eprintln!(
        "pyrometer: {} polls of {} GPU{} in {:.1}s; wrote {}",
        state.series.len(),
        state.devices.len(),
        if state.devices.len() == 1 { "" } else { "s" },
        started.elapsed().as_secs_f64(),
        output.display()
    );
    Ok(0)
}
