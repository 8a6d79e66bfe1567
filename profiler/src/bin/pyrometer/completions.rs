//! Shell completions (`pyrometer completions bash|zsh|fish`) and man pages (`pyrometer man
//! --out-dir DIR`, hidden: `cargo xtask test` runs it to fill `man/`), both generated from the
//! clap definition, so they cannot drift from the options the binary accepts.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, CommandFactory, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: Shell,
}

#[derive(Args, Debug)]
pub struct ManArgs {
    /// Directory to write pyrometer.1 and one page per subcommand into (created if missing).
    #[arg(long, value_name = "DIR")]
    out_dir: PathBuf,
}

/// Prints the completion script for the shell on stdout.
pub fn run(args: CompletionsArgs) -> anyhow::Result<u8> {
    let shell = match args.shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut visible_command(), "pyrometer", &mut script);
    let mut out = std::io::stdout().lock();
    out.write_all(&script)
        .and_then(|()| out.flush())
        .context("writing the completion script")?;
    Ok(0)
}

/// The CLI without its hidden subcommands (the generators would offer them): the same
/// definition, rebuilt with only the visible ones.
fn visible_command() -> clap::Command {
    let full = crate::Cli::command();
    let visible: Vec<clap::Command> = full
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let mut cmd = clap::Command::new("pyrometer")
        .version(env!("CARGO_PKG_VERSION"))
        .subcommand_required(true)
        .subcommands(visible);
    if let Some(about) = full.get_about() {
        cmd = cmd.about(about.clone());
    }
    cmd
}

/// Writes the man pages: `pyrometer.1` and `pyrometer-SUBCOMMAND.1` for each visible one.
pub fn man(args: ManArgs) -> anyhow::Result<u8> {
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("cannot create {}", args.out_dir.display()))?;
    clap_mangen::generate_to(crate::Cli::command(), &args.out_dir)
        .with_context(|| format!("writing man pages into {}", args.out_dir.display()))?;
    Ok(0)
}
