//! How frames are named wherever stacks become text (folded stacks, flame graphs, `top`, the
//! collector's views), for `record` and the collector alike: a name cleaned for folded lines,
//! kernel frames with the `_[k]` suffix FlameGraph and inferno colour, Python frames
//! `function (file:line)` as py-spy writes them, with the file's installation prefix cut. In
//! pprof a frame's kind is [`crate::Line::kind`]; files without it (older agents, other tools)
//! are read by the convention of their mappings' names: [`KERNEL_MAPPING`], [`PYTHON_MAPPING`].

use std::borrow::Cow;

use crate::FrameKind;

/// The pseudo mapping of Python frames in pyrometer's pprof files.
pub const PYTHON_MAPPING: &str = "[python]";

/// The mapping of kernel frames (perf also writes `[kernel.kallsyms]_text`).
pub const KERNEL_MAPPING: &str = "[kernel.kallsyms]";

/// Prefix of an asyncio task's name where stacks are text: `[task] worker`.
pub const TASK_PREFIX: &str = "[task] ";

/// Suffix FlameGraph and inferno use to mark kernel frames (inferno's palettes colour it).
pub const KERNEL_SUFFIX: &str = "_[k]";

/// The kind a mapping's file name implies, for lines that do not say theirs.
pub fn mapping_kind(filename: &str) -> FrameKind {
    if filename.starts_with(KERNEL_MAPPING) {
        FrameKind::Kernel
    } else if filename == PYTHON_MAPPING {
        FrameKind::Python
    } else if filename == GPU_MAPPING {
        FrameKind::Gpu
    } else {
        FrameKind::Native
    }
}

/// A frame's name as name-based views show it: Python frames `function (file:line)`, kernel
/// frames with [`KERNEL_SUFFIX`], every name [`clean`]. Borrowed when nothing changes (the
/// common case).
pub fn frame_name<'a>(
    kind: FrameKind,
    function: &'a str,
    file: Option<&str>,
    line: Option<u32>,
) -> Cow<'a, str> {
    match kind {
        FrameKind::Python => {
            Cow::Owned(clean(&python_frame_name(function, file, line)).into_owned())
        }
        FrameKind::Kernel => {
            let name = clean(function);
            if name.ends_with(KERNEL_SUFFIX) {
                name
            } else {
                Cow::Owned(name.into_owned() + KERNEL_SUFFIX)
            }
        }
        FrameKind::AsyncioTask => Cow::Owned(format!("{TASK_PREFIX}{}", clean(function))),
        _ => clean(function),
    }
}

/// A name safe for a folded line: `;` separates frames and a line break ends the line, so
/// both are replaced (`;` by `:`, control characters by spaces); surrounding spaces go, and an
/// empty name reads `[unknown]`, which a missing frame would look like otherwise.
pub fn clean(name: &str) -> Cow<'_, str> {
    let clean = !name.is_empty()
        && !name.starts_with(char::is_whitespace)
        && !name.ends_with(char::is_whitespace)
        && !has_separator_or_control(name);
    if clean {
        return Cow::Borrowed(name);
    }
    let n: String = name
        .chars()
        .map(|c| match c {
            ';' => ':',
            c if c.is_control() => ' ',
            c => c,
        })
        .collect();
    let trimmed = n.trim();
    if trimmed.is_empty() {
        Cow::Borrowed("[unknown]")
    } else if trimmed.len() != n.len() {
        Cow::Owned(trimmed.to_string())
    } else {
        Cow::Owned(n)
    }
}

/// Whether `name` holds a `;` or a control character. ASCII names (nearly all) are settled
/// by one pass over the bytes with no early exit, which the compiler vectorizes (every
/// pushed frame name goes through here); only a name with other bytes is decoded.
fn has_separator_or_control(name: &str) -> bool {
    let mut found = 0u8;
    for &b in name.as_bytes() {
        found |= u8::from(b == b';' || b < 0x20 || b == 0x7f) | (u8::from(b >= 0x80) << 1);
    }
    if found & 2 == 0 {
        return found & 1 != 0;
    }
    name.chars().any(|c| c == ';' || c.is_control())
}
/// The pseudo mapping of GPU work (kernels, copies) in pyrometer's pprof files: the leaves of
/// `gpu_time` samples.
pub const GPU_MAPPING: &str = "[gpu]";

/// `function (file:line)`, `function (file)` without a line, `function` without a file.
pub fn python_frame_name(function: &str, file: Option<&str>, line: Option<u32>) -> String {
    match (file.filter(|f| !f.is_empty()), line) {
        (Some(file), Some(line)) => format!("{function} ({}:{line})", short_path(file)),
        (Some(file), None) => format!("{function} ({})", short_path(file)),
        (None, _) => function.to_string(),
    }
}

/// A Python source path without the directory it was installed under:
/// `…/site-packages/requests/api.py` → `requests/api.py`,
/// `/usr/lib/python3.11/threading.py` → `threading.py`; anything else as it is.
pub fn short_path(path: &str) -> &str {
    for marker in ["/site-packages/", "/dist-packages/"] {
        if let Some(i) = path.rfind(marker) {
            return &path[i + marker.len()..];
        }
    }
    if let Some(i) = path.rfind("/lib/python") {
        let rest = &path[i + "/lib/python".len()..];
        if let Some(slash) = rest.find('/')
            && rest[..slash]
                .bytes()
                .all(|b| b.is_ascii_digit() || b == b'.')
        {
            return &rest[slash + 1..];
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths() {
        assert_eq!(
            python_frame_name("f", Some("/srv/app.py"), Some(3)),
            "f (/srv/app.py:3)"
        );
        assert_eq!(
            python_frame_name(
                "get",
                Some("/v/lib/python3.11/site-packages/requests/api.py"),
                None
            ),
            "get (requests/api.py)"
        );
        assert_eq!(
            short_path("/root/.pyenv/versions/3.12.1/lib/python3.12/threading.py"),
            "threading.py"
        );
        assert_eq!(
            short_path("/srv/lib/pythonic/x.py"),
            "/srv/lib/pythonic/x.py"
        );
        assert_eq!(python_frame_name("<module>", None, Some(1)), "<module>");
    }

    #[test]
    fn frames_are_named_by_their_kind() {
        let name = |kind, f| frame_name(kind, f, Some("/srv/app.py"), Some(3)).into_owned();
        assert_eq!(name(FrameKind::Python, "run"), "run (/srv/app.py:3)");
        assert_eq!(name(FrameKind::Kernel, "schedule"), "schedule_[k]");
        assert_eq!(name(FrameKind::Kernel, "schedule_[k]"), "schedule_[k]");
        assert_eq!(name(FrameKind::Native, "main"), "main", "no file or line");
        assert_eq!(name(FrameKind::Inlined, "a;b\n"), "a:b");
        assert!(matches!(
            frame_name(FrameKind::Native, "memcpy", None, None),
            Cow::Borrowed(_)
        ));
        assert_eq!(clean(" \t"), "[unknown]");
        assert_eq!(clean(""), "[unknown]");
        assert_eq!(clean("x\u{7}y"), "x y");
        assert_eq!(clean("x\u{85}y"), "x y");
        assert_eq!(clean("  pad\t"), "pad");
        assert!(matches!(clean("größe"), Cow::Borrowed(_)));
        assert_eq!(clean("x\u{7f}y;z"), "x y:z");
        assert_eq!(clean("größe;x"), "größe:x");
        assert_eq!(clean("größe\u{1b}"), "größe");
        assert!(matches!(
            frame_name(FrameKind::Kernel, "schedule_[k]", None, None),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn mappings_tell_the_kind_of_frames_without_one() {
        assert_eq!(mapping_kind("[kernel.kallsyms]"), FrameKind::Kernel);
        assert_eq!(mapping_kind("[kernel.kallsyms]_text"), FrameKind::Kernel);
        assert_eq!(mapping_kind(PYTHON_MAPPING), FrameKind::Python);
        assert_eq!(mapping_kind("/usr/lib/libc.so.6"), FrameKind::Native);
    }
}
