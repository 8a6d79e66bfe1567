//! `pyrometer verifier`: the verifier table of this kernel (see pyrometer::verifier).

use std::path::PathBuf;

use clap::Args;
use pyrometer::verifier::{Table, VERIFIER_BUDGET};

use crate::{EXIT_INPUT, exit_error};

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
    let table = Table::measure(args.btf_path.as_deref()).map_err(crate::command_error)?;
    print!("{}", table.render());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&table.to_json())?;
        std::fs::write(path, text)
            .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
    }
    let failed = table.failed();
    if failed > 0 {
        eprintln!(
            "pyrometer: {failed} of {} programs refused or over the budget of {} processed instructions",
            table.rows.len(),
            VERIFIER_BUDGET
        );
        return Ok(1);
    }
    Ok(0)
}
