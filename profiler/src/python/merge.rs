//! One stack from native and Python frames: the Python frames the kernel walked are spliced
//! into the native stack at the `_PyEval_EvalFrameDefault` call that runs them, so a native
//! extension called from Python sits under the Python line that called it.
//!
//! Each eval call runs one group of Python frames: one frame up to 3.10, several from 3.11
//! (Python-to-Python calls stay in the same C call); the kernel marks the outermost frame of
//! each group. Groups and eval frames are paired from the root when the native walk reached
//! the outermost frame (a thread that just entered a new eval call has not linked its frame
//! yet, which would shift a leaf-first pairing), and from the leaf when it did not (the root
//! end is missing then).

use crate::model::{Frame, FrameKind};

/// Which frames a stack keeps (`record --frames`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FrameView {
    /// Every native frame, with the Python frames spliced in.
    All,
    /// Python frames plus the native frames that are not the interpreter's own (extensions,
    /// libraries, the kernel); the thread start-up frames below the outermost Python frame go
    /// too.
    #[default]
    Mixed,
    /// Python frames only (py-spy's default view); a stack without any keeps its native frames.
    Python,
}

impl FrameView {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "all" => Some(Self::All),
            "mixed" => Some(Self::Mixed),
            "python" => Some(Self::Python),
            _ => None,
        }
    }
}

/// Whether a native frame is the interpreter's eval loop.
pub fn is_eval_frame(f: &Frame) -> bool {
    f.kind == FrameKind::Native
        && !f.inlined
        && f.function
            .strip_prefix("_PyEval_EvalFrameDefault")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// Splits leaf-first Python frames into the groups of one eval call each (leaf first). A
/// group ends with its entry frame; frames after the last entry (a chain cut short) make a
/// last group.
fn groups(python: &[(Frame, bool)]) -> Vec<Vec<Frame>> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    for (f, entry) in python {
        current.push(f.clone());
        if *entry {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The user part of one stack, leaf first: `native` (symbolized, leaf first) with `python`
/// (leaf first, each with its entry mark) spliced in per `view`. `interpreter` is the module
/// path of the process's interpreter binary; `complete` says the native walk reached the
/// outermost frame.
pub fn merge(
    native: Vec<Frame>,
    python: &[(Frame, bool)],
    view: FrameView,
    interpreter: Option<&str>,
    complete: bool,
) -> Vec<Frame> {
    if python.is_empty() {
        return native;
    }
    let groups = groups(python);
    if view == FrameView::Python {
        return groups.into_iter().flatten().collect();
    }
    let evals: Vec<usize> = native
        .iter()
        .enumerate()
        .filter(|(_, f)| is_eval_frame(f))
        .map(|(i, _)| i)
        .collect();
    // (native index the group goes before, group); groups without an eval frame go to the
    // root end.
    let mut placed: Vec<(usize, Vec<Frame>)> = Vec::new();
    let rootward: Vec<Frame> = if complete {
        let n = evals.len().min(groups.len());
        let extra = groups.len() - n;
        let mut groups = groups.into_iter();
        // Groups leafward of every matched one have no eval frame of their own: they join the
        // innermost matched group (or the root end when nothing matched).
        let mut spill: Vec<Frame> = groups.by_ref().take(extra).flatten().collect();
        for (k, g) in groups.enumerate() {
            let at = evals[evals.len() - n + k];
            let mut g = g;
            if !spill.is_empty() {
                spill.append(&mut g);
                g = std::mem::take(&mut spill);
            }
            placed.push((at, g));
        }
        spill
    } else {
        let mut groups = groups.into_iter();
        for &at in &evals {
            match groups.next() {
                Some(g) => placed.push((at, g)),
                None => break,
            }
        }
        groups.flatten().collect()
    };

    let is_interp = |f: &Frame| interpreter.is_some_and(|m| f.module.as_deref() == Some(m));
    let mut out = Vec::with_capacity(native.len() + python.len());
    let mut next = placed.into_iter().peekable();
    let mut last_python = None;
    for (i, f) in native.into_iter().enumerate() {
        while let Some((at, _)) = next.peek() {
            if *at != i {
                break;
            }
            let (_, g) = next.next().expect("peeked");
            out.extend(g);
            last_python = Some(out.len());
        }
        if view == FrameView::Mixed && is_interp(&f) {
            continue;
        }
        out.push(f);
    }
    if !rootward.is_empty() {
        out.extend(rootward);
        last_python = Some(out.len());
    }
    if view == FrameView::Mixed
        && let Some(end) = last_python
    {
        // Below the outermost Python frame only the thread's start-up remains (`_start`,
        // `clone3`, `main`).
        out.truncate(end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(name: &str, module: &str) -> Frame {
        Frame {
            module: Some(module.to_string()),
            ..Frame::named(name, FrameKind::Native)
        }
    }

    fn py(name: &str) -> Frame {
        Frame::named(name, FrameKind::Python)
    }

    fn names(frames: &[Frame]) -> Vec<&str> {
        frames.iter().map(|f| f.function.as_str()).collect()
    }

    const LIB: &str = "/usr/lib/libpython3.11.so";

    /// zlib's deflate called from `compress` (one eval call), called from `<module>` (another).
    fn stack() -> (Vec<Frame>, Vec<(Frame, bool)>) {
        let native = vec![
            native("deflate", "/lib/libz.so.1"),
            native("zlib_compress", "/lib/zlib.so"),
            native("cfunction_vectorcall", LIB),
            native("_PyEval_EvalFrameDefault", LIB),
            native("_PyEval_Vector", LIB),
            native("_PyEval_EvalFrameDefault", LIB),
            native("PyRun_SimpleFile", LIB),
            native("main", "/usr/bin/python3.11"),
            native("_start", "/usr/bin/python3.11"),
        ];
        let python = vec![
            (py("compress_all"), true),
            (py("work"), false),
            (py("<module>"), true),
        ];
        (native, python)
    }

    #[test]
    fn all_keeps_every_native_frame() {
        let (n, p) = stack();
        let out = merge(n, &p, FrameView::All, Some(LIB), true);
        assert_eq!(
            names(&out),
            [
                "deflate",
                "zlib_compress",
                "cfunction_vectorcall",
                "compress_all",
                "_PyEval_EvalFrameDefault",
                "_PyEval_Vector",
                "work",
                "<module>",
                "_PyEval_EvalFrameDefault",
                "PyRun_SimpleFile",
                "main",
                "_start"
            ]
        );
    }

    #[test]
    fn mixed_drops_interpreter_and_start_up_frames() {
        let (n, p) = stack();
        let out = merge(n, &p, FrameView::Mixed, Some(LIB), true);
        assert_eq!(
            names(&out),
            [
                "deflate",
                "zlib_compress",
                "compress_all",
                "work",
                "<module>"
            ]
        );
    }

    #[test]
    fn python_view_has_python_frames_only() {
        let (n, p) = stack();
        let out = merge(n, &p, FrameView::Python, Some(LIB), true);
        assert_eq!(names(&out), ["compress_all", "work", "<module>"]);
        let alone = merge(
            vec![native("epoll_wait", "/lib/libc.so.6")],
            &[],
            FrameView::Python,
            Some(LIB),
            true,
        );
        assert_eq!(
            names(&alone),
            ["epoll_wait"],
            "no Python frames: native kept"
        );
    }

    #[test]
    fn a_frame_not_linked_yet_does_not_shift_a_complete_stack() {
        // The innermost eval call has not pushed its frame: only one group for two evals.
        let (n, _) = stack();
        let p = vec![(py("work"), false), (py("<module>"), true)];
        let out = merge(n, &p, FrameView::All, Some(LIB), true);
        let at = |name: &str| names(&out).iter().position(|f| *f == name).unwrap();
        assert!(at("<module>") < at("PyRun_SimpleFile"));
        assert!(at("work") > at("_PyEval_Vector"), "{:?}", names(&out));
    }

    #[test]
    fn a_cut_native_stack_pairs_from_the_leaf() {
        let (mut n, p) = stack();
        n.truncate(4); // up to the first eval frame
        let out = merge(n, &p, FrameView::Mixed, Some(LIB), false);
        assert_eq!(
            names(&out),
            [
                "deflate",
                "zlib_compress",
                "compress_all",
                "work",
                "<module>"
            ],
            "the groups without an eval frame go to the root end"
        );
    }

    #[test]
    fn no_eval_frame_puts_python_at_the_root_end() {
        let n = vec![native("[unknown]", "[anon]")];
        let p = vec![(py("f"), true)];
        let out = merge(n, &p, FrameView::All, Some(LIB), true);
        assert_eq!(names(&out), ["[unknown]", "f"]);
    }

    #[test]
    fn eval_frames_are_told_by_name() {
        assert!(is_eval_frame(&native("_PyEval_EvalFrameDefault", LIB)));
        assert!(is_eval_frame(&native("_PyEval_EvalFrameDefault.cold", LIB)));
        assert!(!is_eval_frame(&native("_PyEval_EvalFrameDefaultX", LIB)));
        assert!(!is_eval_frame(&native("_PyEval_EvalFrame", LIB)));
    }
}
