//! `pyrometer report`: convert a pprof or folded file into another format, or print its top
//! functions.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use pyrometer::output::{self, OutputFormat};

use crate::{EXIT_INPUT, exit_error, resolve_format};

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Profile to read: pprof (gzipped or not) or folded stacks.
    input: PathBuf,
    /// Output file; the format follows the extension (.svg, .folded/.txt, .pb.gz/.pprof,
    /// .speedscope.json).
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Output format (overrides the extension): folded, svg, pprof, speedscope.
    #[arg(short, long)]
    format: Option<String>,
    /// Sample type for single-type outputs and --top (default: the profile's default type).
    #[arg(short = 't', long = "type", value_name = "TYPE")]
    sample_type: Option<String>,
    /// Print the N functions with the most self time, like `go tool pprof -top`.
    #[arg(long, value_name = "N")]
    top: Option<usize>,
}

pub fn run(args: ReportArgs) -> anyhow::Result<u8> {
    let format = resolve_format(
        args.output.as_ref(),
        args.format.as_deref(),
        OutputFormat::Svg,
    )?;
    if format.needs_timeline() {
        return Err(exit_error(
            EXIT_INPUT,
            output::OutputError::NeedsTimeline.to_string(),
        ));
    }
    let profile = pyrometer::input::read_profile(&args.input)
        .map_err(|e| exit_error(EXIT_INPUT, e.to_string()))?;
    let type_index = match &args.sample_type {
        Some(t) => profile
            .type_index(t)
            .map_err(|e| exit_error(EXIT_INPUT, e.to_string()))?,
        None => profile.single_type_default(),
    };
    if args.output.is_none() && args.top.is_none() {
        return Err(exit_error(
            EXIT_INPUT,
            "nothing to do: give -o FILE to convert, or --top N to print the top functions",
        ));
    }
    if let Some(n) = args.top {
        print!("{}", output::top::render(&profile, type_index, n));
    }
    if let Some(path) = &args.output {
        let file = std::fs::File::create(path)
            .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
        let mut w = BufWriter::new(file);
        let title = format!("pyrometer: {}", args.input.display());
        output::write(&profile, format, type_index, &title, &mut w)
            .and_then(|()| w.flush().map_err(Into::into))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("pyrometer: wrote {}", path.display());
    }
    Ok(0)
}
