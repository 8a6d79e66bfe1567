//! Local outputs of a [`Profile`]: folded stacks, flame graph SVG, pprof, speedscope, the
//! Chrome trace, and the `top` table.
//!
//! Single-type formats (folded, SVG, speedscope) render one sample type chosen by index;
//! pprof carries every type and ignores the index. The Chrome trace is drawn from a
//! [`Timeline`] of per-sample times, which only a live capture has.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::capture::Timeline;
use crate::model::Profile;

pub mod chrome;
pub mod folded;
pub mod pprof;
pub mod speedscope;
pub mod svg;
pub mod top;

#[cfg(test)]
pub(crate) mod fixture;
#[cfg(test)]
mod golden_tests;

/// A file format `write` can produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputFormat {
    /// Folded stacks (`.folded`, `.txt`).
    Folded,
    /// A flame graph (`.svg`).
    Svg,
    /// Gzipped pprof (`.pb.gz`, `.pprof`).
    Pprof,
    /// speedscope's JSON (`.speedscope.json`).
    Speedscope,
    /// A Chrome trace (`.trace.json`).
    ChromeTrace,
}

/// Name and file-name suffixes of each format. Suffixes are matched on the whole file name,
/// so multi-dot ones such as `.speedscope.json` work, and the longest matching suffix wins.
const FORMATS: &[(OutputFormat, &str, &[&str])] = &[
    (OutputFormat::Folded, "folded", &[".folded", ".txt"]),
    (OutputFormat::Svg, "svg", &[".svg"]),
    (OutputFormat::Pprof, "pprof", &[".pb.gz", ".pprof"]),
    (
        OutputFormat::Speedscope,
        "speedscope",
        &[".speedscope.json"],
    ),
    (OutputFormat::ChromeTrace, "chrome", &[".trace.json"]),
];

impl OutputFormat {
    /// Every format, in the order help texts list them.
    pub fn all() -> impl Iterator<Item = OutputFormat> {
        FORMATS.iter().map(|&(f, _, _)| f)
    }

    /// The name `--format` accepts.
    pub fn name(self) -> &'static str {
        FORMATS
            .iter()
            .find(|(f, _, _)| *f == self)
            .map(|&(_, name, _)| name)
            .expect("every format has a row in FORMATS")
    }

    /// The suffix a default output file name gets.
    pub fn extension(self) -> &'static str {
        FORMATS
            .iter()
            .find(|(f, _, _)| *f == self)
            .map(|&(_, _, exts)| exts[0])
            .expect("every format has a row in FORMATS")
    }

    /// Whether the format shows only one sample type (and so honours `--type`).
    pub fn is_single_type(self) -> bool {
        !matches!(self, OutputFormat::Pprof | OutputFormat::ChromeTrace)
    }

    /// Whether the format needs per-sample times (a [`Timeline`]), which profile files lack.
    pub fn needs_timeline(self) -> bool {
        matches!(self, OutputFormat::ChromeTrace)
    }

    /// The format a file name implies (case-insensitive), or `None` for unknown suffixes.
    pub fn from_path(path: &Path) -> Option<OutputFormat> {
        let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
        FORMATS
            .iter()
            .flat_map(|&(f, _, exts)| exts.iter().map(move |e| (f, *e)))
            // A bare ".svg" is a hidden file named "svg", not an SVG.
            .filter(|(_, ext)| name.len() > ext.len() && name.ends_with(ext))
            .max_by_key(|(_, ext)| ext.len())
            .map(|(f, _)| f)
    }
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn format_names() -> String {
    OutputFormat::all()
        .map(OutputFormat::name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for OutputFormat {
    type Err = OutputError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        OutputFormat::all()
            .find(|f| f.name() == lower)
            .ok_or_else(|| OutputError::UnknownFormat(s.to_string()))
    }
}

/// Why an output could not be written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// A `--format` value that names no format.
    #[error("unknown format '{0}'; valid formats: {names}", names = format_names())]
    UnknownFormat(String),
    /// A sample type the profile does not have.
    #[error("sample type index {index} out of range: the profile has {count} sample types")]
    NoSuchType {
        /// The type asked for.
        index: usize,
        /// The types there are.
        count: usize,
    },
    /// Nothing of the type to draw (its name).
    #[error("no samples of type '{0}' to draw")]
    Empty(String),
    /// inferno failed.
    #[error("cannot render flame graph: {0}")]
    Flamegraph(#[source] std::io::Error),
    #[error(
        "the Chrome trace needs per-sample times, which profile files do not keep: record it \
         with `pyrometer record -o FILE.trace.json`, or convert to speedscope, svg, folded or pprof"
    )]
    /// A Chrome trace asked of a profile without per-sample times.
    NeedsTimeline,
    /// The output could not be written.
    #[error("write failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Checks a type index before a single-type writer uses it, so a bad `--type` resolution is
/// an error, not a panic.
pub(crate) fn check_type(profile: &Profile, type_index: usize) -> Result<(), OutputError> {
    if type_index < profile.sample_types.len() {
        Ok(())
    } else {
        Err(OutputError::NoSuchType {
            index: type_index,
            count: profile.sample_types.len(),
        })
    }
}

/// Writes `profile` in `format`. `type_index` picks the sample type for single-type formats;
/// `title` is used by formats that show one (SVG, speedscope). Formats that need per-sample
/// times fail with [`OutputError::NeedsTimeline`]; see [`write_with_timeline`].
pub fn write(
    profile: &Profile,
    format: OutputFormat,
    type_index: usize,
    title: &str,
    out: &mut dyn std::io::Write,
) -> Result<(), OutputError> {
    write_with_timeline(profile, None, format, type_index, title, out)
}

/// [`write`], with the capture's per-sample times for formats that draw them.
pub fn write_with_timeline(
    profile: &Profile,
    timeline: Option<&Timeline>,
    format: OutputFormat,
    type_index: usize,
    title: &str,
    out: &mut dyn std::io::Write,
) -> Result<(), OutputError> {
    match format {
        OutputFormat::Folded => folded::write_folded(profile, type_index, out),
        OutputFormat::Svg => svg::write_svg(profile, type_index, title, out),
        OutputFormat::Pprof => pprof::write_pprof(profile, out),
        OutputFormat::Speedscope => speedscope::write_speedscope(profile, type_index, title, out),
        OutputFormat::ChromeTrace => match timeline {
            Some(t) => chrome::write_chrome_trace(profile, t, out),
            None => Err(OutputError::NeedsTimeline),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_from_extension() {
        let f = |p: &str| OutputFormat::from_path(Path::new(p));
        assert_eq!(f("out/flame.folded"), Some(OutputFormat::Folded));
        assert_eq!(f("stacks.TXT"), Some(OutputFormat::Folded));
        assert_eq!(f("/tmp/flame.svg"), Some(OutputFormat::Svg));
        assert_eq!(f("cpu.pb.gz"), Some(OutputFormat::Pprof));
        assert_eq!(f("cpu.pprof"), Some(OutputFormat::Pprof));
        assert_eq!(f("a.speedscope.json"), Some(OutputFormat::Speedscope));
        assert_eq!(f("a.trace.json"), Some(OutputFormat::ChromeTrace));
        assert_eq!(f("a.json"), None);
        assert_eq!(f("cpu.gz"), None);
        assert_eq!(f("cpu"), None);
        assert_eq!(f(".svg"), None);
    }

    #[test]
    fn format_names_parse_and_errors_list_them() {
        for f in OutputFormat::all() {
            assert_eq!(f.name().parse::<OutputFormat>().ok(), Some(f));
            assert_eq!(
                OutputFormat::from_path(Path::new(&format!("x{}", f.extension()))),
                Some(f)
            );
        }
        assert_eq!("SVG".parse::<OutputFormat>().ok(), Some(OutputFormat::Svg));
        assert_eq!(
            "x".parse::<OutputFormat>().unwrap_err().to_string(),
            "unknown format 'x'; valid formats: folded, svg, pprof, speedscope, chrome"
        );
    }

    #[test]
    fn write_dispatches_and_checks_type() {
        let p = fixture::profile();
        let mut folded = Vec::new();
        write(&p, OutputFormat::Folded, 0, "t", &mut folded).unwrap();
        assert_eq!(
            String::from_utf8(folded).unwrap(),
            folded::to_folded(&p, 0).unwrap()
        );
        let mut svg = Vec::new();
        write(&p, OutputFormat::Svg, 1, "My title", &mut svg).unwrap();
        assert!(String::from_utf8(svg).unwrap().contains("My title"));
        let mut pb = Vec::new();
        // pprof holds every type, so any index is accepted.
        write(&p, OutputFormat::Pprof, 99, "t", &mut pb).unwrap();
        assert!(pyrometer_proto::is_gzip(&pb));
        let mut ss = Vec::new();
        write(&p, OutputFormat::Speedscope, 0, "t", &mut ss).unwrap();
        assert!(String::from_utf8(ss).unwrap().contains(speedscope::SCHEMA));
        let err = write(&p, OutputFormat::ChromeTrace, 0, "t", &mut Vec::new()).unwrap_err();
        assert!(matches!(err, OutputError::NeedsTimeline), "{err}");
        let err = write(&p, OutputFormat::Folded, 2, "t", &mut Vec::new()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sample type index 2 out of range: the profile has 2 sample types"
        );
    }
}
