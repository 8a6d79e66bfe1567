//! How Python frames are named wherever stacks become text (folded stacks, flame graphs, the
//! collector's views): `function (file:line)`, as py-spy writes them, with the file's
//! installation prefix cut. In pprof they are proper functions (name, file) and lines under
//! a mapping of this name, which tells them from native code.

/// The pseudo mapping of Python frames in pyrometer's pprof files.
pub const PYTHON_MAPPING: &str = "[python]";

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
}
