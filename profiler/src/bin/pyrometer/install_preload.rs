//! `pyrometer install-preload DIR`: writes the allocation sampler library this binary
//! carries into DIR, for set-ups that preload it from a file of their own (a systemd unit, a
//! container image, Ray workers).

use std::path::PathBuf;

use clap::Args;

use crate::{EXIT_INPUT, exit_error};

#[derive(Args, Debug)]
pub struct InstallPreloadArgs {
    /// Directory to write libpyrometer_alloc.so into (made, 0755, when missing; an existing
    /// copy is replaced whole, so processes that map it keep running).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Write the CUPTI library of --gpu-kernels (libpyrometer_cupti.so) instead, for
    /// CUDA_INJECTION64_PATH and NVTX_INJECTION64_PATH.
    #[arg(long)]
    gpu: bool,
}

pub fn run(args: InstallPreloadArgs) -> anyhow::Result<u8> {
    if args.gpu {
        let path = pyrometer::install_preload::install_gpu(&args.dir)
            .map_err(|e| exit_error(EXIT_INPUT, format!("install-preload: {e}")))?;
        println!("{}", path.display());
        eprintln!(
            "pyrometer: processes started with CUDA_INJECTION64_PATH={0} (and NVTX_INJECTION64_PATH={0}) report their GPU kernels by launching stack",
            path.display()
        );
        return Ok(0);
    }
    let path = pyrometer::install_preload::install(&args.dir)
        .map_err(|e| exit_error(EXIT_INPUT, format!("install-preload: {e}")))?;
    println!("{}", path.display());
    eprintln!(
        "pyrometer: processes started with LD_PRELOAD={} sample their allocations in process",
        path.display()
    );
    Ok(0)
}
