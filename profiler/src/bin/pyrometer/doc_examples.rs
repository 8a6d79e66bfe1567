//! The command examples of the README and the book (`docs/src`), extracted so that a test can
//! parse each one with the real CLI definition: an example that no longer parses fails the
//! suite instead of misleading a reader. Shared with `pyrometer-collector`'s tests (included
//! there by path), so both binaries check their own examples with the same rules.
//!
//! What counts as an example:
//! - a line of a fenced code block whose first word is the binary (or a path ending in it),
//!   except in blocks marked `text` (usage synopses and program output), with `\` line
//!   continuations joined and a trailing shell comment, pipe or redirection cut off;
//! - an inline code span that starts with the binary and has at least one argument beyond the
//!   subcommand (`pyrometer diff` alone names a command; `pyrometer diff a b` is an example).

use std::path::{Path, PathBuf};

/// One example: where it is and its arguments (the binary first, as clap expects).
#[derive(Debug)]
pub struct Example {
    pub location: String,
    pub args: Vec<String>,
}

/// The README and every page of the book, relative to the workspace root.
pub fn documentation_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut stack = vec![root.join("docs/src")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Every example of `binary` in `files`.
pub fn examples(root: &Path, binary: &str) -> Vec<Example> {
    let mut out = Vec::new();
    for file in documentation_files(root) {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let name = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        out.extend(examples_in(&name, &text, binary));
    }
    out
}

/// The examples of `binary` in one markdown text.
pub fn examples_in(name: &str, text: &str, binary: &str) -> Vec<Example> {
    let mut out = Vec::new();
    let mut fence: Option<bool> = None; // Some(checked) inside a fenced block
    let mut pending: Option<(usize, String)> = None; // a command continued with `\`
    let mut prose = String::new();
    let mut prose_start = 1;
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            match fence {
                None => {
                    inline_examples(name, prose_start, &prose, binary, &mut out);
                    prose.clear();
                    let info = trimmed.trim_start_matches('`').trim();
                    fence = Some(info != "text");
                }
                Some(_) => {
                    fence = None;
                    prose_start = number + 1;
                }
            }
            continue;
        }
        match fence {
            Some(true) => {
                let (start, mut command) = pending.take().unwrap_or((number, String::new()));
                match line.trim_end().strip_suffix('\\') {
                    Some(head) => {
                        command.push_str(head);
                        command.push(' ');
                        pending = Some((start, command));
                    }
                    None => {
                        command.push_str(line);
                        if let Some(args) = command_args(&command, binary) {
                            out.push(Example {
                                location: format!("{name}:{start}"),
                                args,
                            });
                        }
                    }
                }
            }
            Some(false) => {}
            None => {
                prose.push_str(line);
                prose.push('\n');
            }
        }
    }
    inline_examples(name, prose_start, &prose, binary, &mut out);
    out
}

/// Inline code spans of `binary` with arguments, in prose starting at line `first`.
fn inline_examples(name: &str, first: usize, prose: &str, binary: &str, out: &mut Vec<Example>) {
    let mut rest = prose;
    let mut line = first;
    while let Some(open) = rest.find('`') {
        line += rest[..open].matches('\n').count();
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        let span = after[..close].replace('\n', " ");
        if let Some(args) = command_args(&span, binary)
            && args.len() >= if binary == "pyrometer" { 3 } else { 2 }
        {
            out.push(Example {
                location: format!("{name}:{line}"),
                args,
            });
        }
        line += after[..close].matches('\n').count();
        rest = &after[close + 1..];
    }
}

/// The arguments of a shell command line that runs `binary`, or None when it runs something
/// else. Leading `$ ` prompts, `sudo` and `VAR=value` assignments are skipped.
fn command_args(line: &str, binary: &str) -> Option<Vec<String>> {
    let words = shell_words(line.trim().trim_start_matches("$ "));
    let mut words = words
        .into_iter()
        .skip_while(|w| w == "sudo" || (w.contains('=') && !w.starts_with('-')));
    let program = words.next()?;
    if program != binary && !program.ends_with(&format!("/{binary}")) {
        return None;
    }
    Some(
        std::iter::once(binary.to_string())
            .chain(words.take_while(|w| {
                !matches!(w.as_str(), "|" | "||" | "&&" | ";" | "&")
                    && !w.starts_with('>')
                    && !w.starts_with("2>")
            }))
            .collect(),
    )
}

/// POSIX-like word splitting: single and double quotes, backslash escapes, `#` comments.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                word.extend(chars.by_ref().take_while(|&c| c != '\''));
            }
            '"' => {
                in_word = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        c => word.push(c),
                    }
                }
            }
            '\\' => {
                in_word = true;
                word.extend(chars.next());
            }
            '#' if !in_word => break,
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The workspace root, from the crate's manifest directory (one level down).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crates live in the workspace")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extraction_rules() {
        let md = "\
Run `pyrometer record --pid 7 -o a.svg` or `pyrometer
diff a.pb.gz b.pb.gz`; `pyrometer diff` names one, `pyrometer: error` is output.

```sh
$ sudo pyrometer report in.pb.gz --top 5 | head   # a comment
target/release/pyrometer record \\
    --comm 'ray::.*' -o \"x y.svg\"
cargo xtask demo
```

```text
pyrometer record [--pid PID]...
```
";
        let found = examples_in("x.md", md, "pyrometer");
        let got: Vec<(String, Vec<String>)> =
            found.into_iter().map(|e| (e.location, e.args)).collect();
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            got,
            vec![
                (
                    "x.md:1".into(),
                    v(&["pyrometer", "record", "--pid", "7", "-o", "a.svg"])
                ),
                (
                    "x.md:1".into(),
                    v(&["pyrometer", "diff", "a.pb.gz", "b.pb.gz"])
                ),
                (
                    "x.md:5".into(),
                    v(&["pyrometer", "report", "in.pb.gz", "--top", "5"])
                ),
                (
                    "x.md:6".into(),
                    v(&["pyrometer", "record", "--comm", "ray::.*", "-o", "x y.svg"])
                ),
            ]
        );
    }
}
