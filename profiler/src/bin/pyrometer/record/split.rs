//! `record --split-by trace|span`: besides the main output, one file per trace (or span) the
//! samples were taken in, named after the main one (`flame.svg` → `flame.trace-<id>.svg`).

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use pyrometer::model::{LabelValue, Profile};
use pyrometer::output::{self, OutputFormat};

/// Files one `--split-by` writes at most; past it the rest are counted and left out (the main
/// output holds every sample anyway).
pub const MAX_SPLIT_FILES: usize = 1000;

/// What `--split-by` accepts.
pub const KINDS: [&str; 2] = ["trace", "span"];

/// The label a `--split-by` kind splits on.
fn label(kind: &str) -> &'static str {
    if kind == "span" {
        "span_id"
    } else {
        "trace_id"
    }
}

/// `flame.pb.gz` → `flame.KIND-ID.pb.gz` (the extension is everything after the first dot).
pub fn split_path(main: &Path, kind: &str, id: &str) -> PathBuf {
    let name = main
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let file = match name.find('.') {
        Some(dot) if dot > 0 => format!("{}.{kind}-{id}{}", &name[..dot], &name[dot..]),
        _ => format!("{name}.{kind}-{id}"),
    };
    main.with_file_name(file)
}

/// Writes one output per value of the kind's label; returns the files written and how many
/// values were left out past [`MAX_SPLIT_FILES`].
pub fn write(
    profile: &Profile,
    kind: &str,
    main: &Path,
    format: OutputFormat,
    type_index: usize,
    title: &str,
) -> anyhow::Result<(Vec<PathBuf>, usize)> {
    let key = label(kind);
    let mut ids: Vec<String> = profile
        .samples
        .iter()
        .filter_map(|s| match s.labels.get(key) {
            Some(LabelValue::Str(id)) => Some(id.clone()),
            _ => None,
        })
        .collect();
    ids.sort();
    ids.dedup();
    let left_out = ids.len().saturating_sub(MAX_SPLIT_FILES);
    let mut written = Vec::new();
    for id in ids.into_iter().take(MAX_SPLIT_FILES) {
        let part =
            profile.subset(|s| matches!(s.labels.get(key), Some(LabelValue::Str(v)) if *v == id));
        let path = split_path(main, kind, &id);
        let file = std::fs::File::create(&path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let mut w = BufWriter::new(file);
        let title = format!("{title} ({key}={id})");
        output::write_with_timeline(&part, None, format, type_index, &title, &mut w)
            .map_err(anyhow::Error::from)
            .and_then(|()| w.flush().map_err(Into::into))
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok((written, left_out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_files_are_named_after_the_main_one() {
        let p = |s: &str| split_path(Path::new(s), "trace", "ab12");
        assert_eq!(p("/tmp/flame.svg"), Path::new("/tmp/flame.trace-ab12.svg"));
        assert_eq!(p("out.pb.gz"), Path::new("out.trace-ab12.pb.gz"));
        assert_eq!(p("noext"), Path::new("noext.trace-ab12"));
        assert_eq!(p(".hidden"), Path::new(".hidden.trace-ab12"));
    }
}
