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
}

pub fn run(args: InstallPreloadArgs) -> anyhow::Result<u8> {
    let path = pyrometer::install_preload::install(&args.dir)
        .map_err(|e| exit_error(EXIT_INPUT, format!("install-preload: {e}")))?;
    println!("{}", path.display());
    eprintln!(
        "pyrometer: processes started with LD_PRELOAD={} sample their allocations in process",
        path.display()
    );
    Ok(0)
}
