//! `pyrometer verifier`: the verifier table of this kernel (see pyrometer::bpf::verifier).

use std::path::PathBuf;

use clap::Args;
use pyrometer::bpf::{load, verifier};
use pyrometer::privileges;

use crate::{EXIT_INPUT, EXIT_PRIVILEGES, exit_error};

#[derive(Args)]
pub struct VerifierArgs {
    /// Also write the table as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Kernel BTF to load against (default /sys/kernel/btf/vmlinux).
    #[arg(long, value_name = "FILE", hide = true)]
    btf_path: Option<PathBuf>,
}

pub fn run(args: VerifierArgs) -> anyhow::Result<u8> {
    privileges::check(privileges::SAMPLING, privileges::effective())
        .map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    let btf = pyrometer::bpf::btf_path_or_default(args.btf_path.as_deref());
    let rows =
        verifier::verify_all(&btf).map_err(|e| exit_error(EXIT_PRIVILEGES, e.to_string()))?;
    let kernel = load::kernel_release();
    print!("{}", verifier::render(&rows, &kernel));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&verifier::to_json(&rows, &kernel))?;
        std::fs::write(path, text)
            .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
    }
    let failed = rows.iter().filter(|r| r.failed()).count();
    if failed > 0 {
        eprintln!(
            "pyrometer: {failed} of {} programs refused or over the budget of {} processed instructions",
            rows.len(),
            load::VERIFIER_BUDGET
        );
        return Ok(1);
    }
    Ok(0)
}
