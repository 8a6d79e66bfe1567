//! Reading profiles back (`report`, `diff`): pprof files (gzipped or raw) and folded stacks,
//! told apart by content, not by file name, so a misnamed file still reads.

use std::path::Path;

use crate::model::{Frame, FrameKind, Labels, Profile, SampleType};
use crate::output::folded::KERNEL_SUFFIX;
use crate::output::pprof::{self, PprofError};

/// Why a profile file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file holds nothing.
    #[error("{path} is empty")]
    Empty {
        /// The file.
        path: String,
    },
    /// The file is pprof (gzipped or not) but not a valid profile.
    #[error("corrupt profile file {path}: {source}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong with it.
        #[source]
        source: PprofError,
    },
    /// The file is text but not folded stacks.
    #[error("corrupt profile file {path}: {source}")]
    Folded {
        /// The file.
        path: String,
        /// Its first bad line.
        #[source]
        source: FoldedError,
    },
}

/// A line of folded input that is not `stack count`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FoldedError {
    /// No count after the stack.
    #[error("line {line}: expected 'stack count', found '{found}'")]
    Syntax {
        /// The line number, from 1.
        line: usize,
        /// The line.
        found: String,
    },
    /// The count is not a number of samples.
    #[error("line {line}: count '{count}' is not a non-negative integer")]
    Count {
        /// The line number, from 1.
        line: usize,
        /// The count as written.
        count: String,
    },
    /// Two `;` in a row, or one at either end.
    #[error("line {line}: empty frame name in '{found}'")]
    EmptyFrame {
        /// The line number, from 1.
        line: usize,
        /// The stack.
        found: String,
    },
}

/// Reads a profile file, detecting its format from its content.
pub fn read_profile(path: &Path) -> Result<Profile, InputError> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| InputError::Io {
        path: name.clone(),
        source,
    })?;
    parse_profile(&bytes, &name)
}

/// Whether bytes look like text a person wrote or a tool printed. Raw protobuf pprof starts
/// with field tags such as 0x08 and 0x12, control characters that text never has.
fn is_text(bytes: &[u8]) -> bool {
    std::str::from_utf8(bytes).is_ok_and(|s| {
        !s.chars()
            .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
    })
}

/// Parses the content of a profile file; `name` is only used in error messages.
pub fn parse_profile(bytes: &[u8], name: &str) -> Result<Profile, InputError> {
    let path = name.to_string();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(InputError::Empty { path });
    }
    if !pyrometer_proto::is_gzip(bytes) && is_text(bytes) {
        let text = std::str::from_utf8(bytes).expect("checked by is_text");
        return read_folded(text).map_err(|source| InputError::Folded { path, source });
    }
    pprof::read_pprof(bytes).map_err(|source| InputError::Corrupt { path, source })
}

/// Turns a folded frame name back into a frame: the kernel suffix marks kernel frames.
fn folded_frame(name: &str) -> Frame {
    match name.strip_suffix(KERNEL_SUFFIX) {
        Some(kernel) => Frame::named(kernel, FrameKind::Kernel),
        None if name == "[unknown]" => Frame::named(name, FrameKind::Unknown),
        None => Frame::named(name, FrameKind::Native),
    }
}

/// Parses folded stacks (`root;...;leaf count` per line; blank lines and `#` comments are
/// skipped) into a profile with the single sample type samples/count.
pub fn read_folded(text: &str) -> Result<Profile, FoldedError> {
    let mut profile = Profile::new(vec![SampleType::new("samples", "count")]);
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let shown = || trimmed.chars().take(80).collect::<String>();
        // The count is after the last whitespace: frame names may contain spaces.
        let Some((stack, count)) = trimmed.rsplit_once(char::is_whitespace) else {
            return Err(FoldedError::Syntax {
                line,
                found: shown(),
            });
        };
        let stack = stack.trim_end();
        if stack.is_empty() {
            return Err(FoldedError::Syntax {
                line,
                found: shown(),
            });
        }
        let count: i64 = count
            .parse::<u64>()
            .ok()
            .and_then(|c| i64::try_from(c).ok())
            .ok_or_else(|| FoldedError::Count {
                line,
                count: count.to_string(),
            })?;
        let mut frames = Vec::new();
        for name in stack.split(';') {
            if name.is_empty() {
                return Err(FoldedError::EmptyFrame {
                    line,
                    found: shown(),
                });
            }
            frames.push(profile.intern_frame(folded_frame(name)));
        }
        // Folded lines are root first; the model is leaf first.
        frames.reverse();
        let stack = profile.intern_stack(frames);
        profile.add(stack, Labels::new(), &[count]);
    }
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{fixture, folded, pprof::write_pprof};
    use prost::Message as _;

    #[test]
    fn folded_round_trips_through_the_writer() {
        let text = "# captured by hand\n\nmain;b;c_[k] 3\nmain;a 1\r\n  main;b;c_[k] 2\n";
        let p = read_folded(text).unwrap();
        assert_eq!(p.sample_types, [SampleType::new("samples", "count")]);
        assert_eq!(p.total(0), 6);
        let leaf = p.stack_frames(p.samples[0].stack).next().unwrap();
        assert_eq!(
            (leaf.function.as_str(), leaf.kind),
            ("c", FrameKind::Kernel)
        );
        assert_eq!(
            folded::to_folded(&p, 0).unwrap(),
            "main;a 1\nmain;b;c_[k] 5\n"
        );
        // Names with spaces keep them: only the last field is the count.
        let p = read_folded("<frozen importlib> x;f (a b) 4\n").unwrap();
        assert_eq!(
            folded::to_folded(&p, 0).unwrap(),
            "<frozen importlib> x;f (a b) 4\n"
        );
    }

    #[test]
    fn folded_errors_name_the_line() {
        let err = |t: &str| read_folded(t).unwrap_err().to_string();
        assert_eq!(
            err("a 1\nb 2\nnocount\n"),
            "line 3: expected 'stack count', found 'nocount'"
        );
        assert_eq!(
            err("a;b 1.5\n"),
            "line 1: count '1.5' is not a non-negative integer"
        );
        assert_eq!(
            err("a -3\n"),
            "line 1: count '-3' is not a non-negative integer"
        );
        assert_eq!(err("\n\na;;b 2\n"), "line 3: empty frame name in 'a;;b 2'");
        assert_eq!(err(" 5\n"), "line 1: expected 'stack count', found '5'");
    }

    #[test]
    fn detects_formats_by_content() {
        let orig = fixture::profile();
        let mut gz = Vec::new();
        write_pprof(&orig, &mut gz).unwrap();
        let raw = pprof::to_pprof(&orig).encode_to_vec();
        for bytes in [&gz, &raw] {
            let p = parse_profile(bytes, "x.bin").unwrap();
            assert_eq!(p.sample_types, orig.sample_types);
            assert_eq!(p.total(1), orig.total(1));
        }
        let folded = folded::to_folded(&orig, 0).unwrap();
        let p = parse_profile(folded.as_bytes(), "x.pb.gz").unwrap();
        assert_eq!(folded::to_folded(&p, 0).unwrap(), folded);
    }

    #[test]
    fn bad_files_give_clear_errors() {
        let err = |b: &[u8]| parse_profile(b, "p.pb.gz").unwrap_err().to_string();
        assert_eq!(err(b""), "p.pb.gz is empty");
        assert_eq!(err(b" \n"), "p.pb.gz is empty");
        let mut gz = Vec::new();
        write_pprof(&fixture::profile(), &mut gz).unwrap();
        let truncated = err(&gz[..gz.len() - 20]);
        assert!(
            truncated.starts_with("corrupt profile file p.pb.gz: bad gzip data"),
            "{truncated}"
        );
        let junk = err(&[0x0a, 0x05, 0x00, 0xff, 0x00]);
        assert!(
            junk.starts_with("corrupt profile file p.pb.gz: bad protobuf data"),
            "{junk}"
        );
        assert_eq!(
            err(b"a b c\n"),
            "corrupt profile file p.pb.gz: line 1: count 'c' is not a non-negative integer"
        );
        // Every prefix of a valid file fails cleanly or parses; none may panic.
        for n in 0..gz.len() {
            let _ = parse_profile(&gz[..n], "p");
        }
        let raw = pprof::to_pprof(&fixture::profile()).encode_to_vec();
        for n in 0..raw.len() {
            let _ = parse_profile(&raw[..n], "p");
        }
        let missing = read_profile(Path::new("/nonexistent/p.pb.gz"))
            .unwrap_err()
            .to_string();
        assert!(
            missing.starts_with("cannot read /nonexistent/p.pb.gz: "),
            "{missing}"
        );
    }
}
