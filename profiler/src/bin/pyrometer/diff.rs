//! `pyrometer diff BASE NEW`: which functions' share of the profile grew or shrank, a
//! differential flame graph, and a CI gate (`--fail-above`) that exits 1 on a regression.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, ValueEnum};
use pyrometer::diff::{self, DiffOptions};
use pyrometer::model::Profile;
use pyrometer::output::svg;

use crate::{EXIT_INPUT, exit_error};

/// Exit code of a gate that found a regression (README "Exit codes").
const EXIT_REGRESSION: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DiffFormat {
    Text,
    Json,
}

#[derive(Args, Debug)]
pub struct DiffArgs {
    /// The baseline profile: pprof (gzipped or not) or folded stacks.
    base: PathBuf,
    /// The candidate profile to compare with it.
    new: PathBuf,
    /// Sample type to compare (default: sample counts when both have them).
    #[arg(short = 't', long = "type", value_name = "TYPE")]
    sample_type: Option<String>,
    /// Exit 1 when a function's share grew by more than PTS percentage points, significantly.
    #[arg(long, value_name = "PTS", value_parser = parse_points)]
    fail_above: Option<f64>,
    /// Judge inclusive shares (the function and its callees) instead of self shares.
    #[arg(long)]
    inclusive: bool,
    /// Judge kernel functions on their own; by default their time is charged to the user
    /// function that entered the kernel, so scheduler noise on a busy runner does not gate.
    #[arg(long)]
    kernel: bool,
    /// Fewest samples a function needs in NEW to be called a regression; with --fail-above,
    /// also the fewest samples each profile needs for the gate to judge at all.
    #[arg(long, default_value_t = DiffOptions::default().min_samples, value_name = "N")]
    min_samples: u64,
    /// Significance level of the two-proportion z-test (two-sided).
    #[arg(long, default_value_t = DiffOptions::default().alpha, value_name = "P", value_parser = parse_alpha)]
    alpha: f64,
    /// Rows in each of the "grew" and "shrank" tables.
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,
    /// Write a differential flame graph: NEW's shape, red where a frame grew, blue where it shrank.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Output on stdout: a table, or JSON for machines.
    #[arg(long, value_enum, default_value_t = DiffFormat::Text)]
    format: DiffFormat,
}

fn parse_points(s: &str) -> Result<f64, String> {
    match s.trim_end_matches('%').parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "invalid threshold '{s}': give percentage points, e.g. 5"
        )),
    }
}

fn parse_alpha(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v < 1.0 => Ok(v),
        _ => Err(format!(
            "invalid significance level '{s}': give a p-value between 0 and 1, e.g. 0.001"
        )),
    }
}

fn read(path: &Path) -> anyhow::Result<Profile> {
    pyrometer::input::read_profile(path).map_err(|e| exit_error(EXIT_INPUT, e.to_string()))
}

/// The type to compare in one profile: `--type`, else sample counts, else its default.
fn type_of(profile: &Profile, wanted: Option<&str>, path: &Path) -> anyhow::Result<usize> {
    match wanted {
        Some(t) => profile
            .type_index(t)
            .map_err(|e| exit_error(EXIT_INPUT, format!("{}: {e}", path.display()))),
        None => Ok(profile.single_type_default()),
    }
}

pub fn run(args: DiffArgs) -> anyhow::Result<u8> {
    let base = read(&args.base)?;
    let new = read(&args.new)?;
    let base_type = type_of(&base, args.sample_type.as_deref(), &args.base)?;
    let new_type = type_of(&new, args.sample_type.as_deref(), &args.new)?;
    let (bt, nt) = (&base.sample_types[base_type], &new.sample_types[new_type]);
    if bt != nt {
        return Err(exit_error(
            EXIT_INPUT,
            format!(
                "the profiles compare different types ({}/{} and {}/{}): choose one both have with --type",
                bt.name, bt.unit, nt.name, nt.unit
            ),
        ));
    }
    let options = DiffOptions {
        inclusive: args.inclusive,
        alpha: args.alpha,
        min_samples: args.min_samples,
        kernel: args.kernel,
    };
    let d = diff::diff(&base, base_type, &new, new_type, options);
    if args.fail_above.is_some() {
        for (path, totals) in [(&args.base, d.base), (&args.new, d.new)] {
            if totals.samples < args.min_samples {
                return Err(exit_error(
                    EXIT_INPUT,
                    format!(
                        "{} has {} samples, fewer than --min-samples {}: record longer or at a higher -F to gate on it",
                        path.display(),
                        totals.samples,
                        args.min_samples
                    ),
                ));
            }
        }
    }

    if let Some(path) = &args.svg {
        let file = std::fs::File::create(path)
            .map_err(|e| exit_error(EXIT_INPUT, format!("cannot write {}: {e}", path.display())))?;
        let mut w = BufWriter::new(file);
        let title = format!(
            "pyrometer diff: {} → {}",
            args.base.display(),
            args.new.display()
        );
        svg::write_differential_svg(&base, base_type, &new, new_type, &title, &mut w)
            .and_then(|()| w.flush().map_err(Into::into))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("pyrometer: wrote {}", path.display());
    }

    let mut stdout = std::io::stdout().lock();
    match args.format {
        DiffFormat::Text => stdout.write_all(d.render_table(args.top, args.fail_above).as_bytes()),
        DiffFormat::Json => writeln!(stdout, "{:#}", d.to_json(args.fail_above)),
    }
    .context("writing to stdout")?;
    drop(stdout);

    let Some(threshold) = args.fail_above else {
        return Ok(0);
    };
    let regressions = d.regressions(threshold);
    if regressions.is_empty() {
        return Ok(0);
    }
    let judged = if args.inclusive { "inclusive" } else { "self" };
    let list: Vec<String> = regressions
        .iter()
        .map(|f| {
            format!(
                "{} ({:.2}% → {:.2}%, {:+.2} pts, z = {:.1})",
                f.name,
                if args.inclusive {
                    f.base_inclusive_pct
                } else {
                    f.base_self_pct
                },
                if args.inclusive {
                    f.new_inclusive_pct
                } else {
                    f.new_self_pct
                },
                f.delta(args.inclusive),
                f.z
            )
        })
        .collect();
    eprintln!(
        "pyrometer: regression: {judged} share grew by more than {threshold} pts (p < {}): {}",
        args.alpha,
        list.join(", ")
    );
    Ok(EXIT_REGRESSION)
}
