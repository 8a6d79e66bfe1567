//! The book under `docs/` (mdBook): its internal links are checked here — a link to a page
//! that does not exist, or to an `#anchor` that no heading of the page makes, fails the test
//! command — and then mdbook (installed with `cargo install` once a machine, see `mdbook_prefix`)
//! renders it into `target/book`. Pages added later are covered as they come: every `.md`
//! under `docs/src` is checked, and each must be listed in `SUMMARY.md` (mdbook silently
//! leaves unlisted pages out of the book).
//!
//! The command examples in the pages are parsed against the CLI by the binaries' own tests
//! (`documented_examples_parse`), which nextest runs with the rest of the suite.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The mdbook release the book is built with: 0.5.4 builds with rustc 1.88 and later. Without
/// its default `serve` and `watch` features it compiles in about half the time.
const MDBOOK_VERSION: &str = "0.5.4";

/// Checks the links of the README and the book, then builds the book.
pub fn check(root: &Path) -> Result<()> {
    let files = markdown_files(root);
    let problems = link_problems(root, &files)?;
    if !problems.is_empty() {
        bail!(
            "the book has {} broken internal link(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    eprintln!("book: links of {} files checked", files.len());
    let mdbook = install_mdbook(root)?;
    crate::run(Command::new(mdbook).arg("build").arg(root.join("docs")))
}

/// Where mdbook is installed: one folder a version for the whole machine where it can be made
/// (as root), so a second clone does not build it again (five minutes on two cores), else
/// `target/mdbook` in the clone.
fn mdbook_prefix(root: &Path) -> PathBuf {
    let shared = PathBuf::from(format!(
        "/var/cache/pyrometer-tools/mdbook-{MDBOOK_VERSION}"
    ));
    if std::fs::create_dir_all(&shared).is_ok() {
        shared
    } else {
        root.join("target/mdbook")
    }
}

/// `bin/mdbook` under [`mdbook_prefix`], installed when missing or of another version.
fn install_mdbook(root: &Path) -> Result<PathBuf> {
    let prefix = mdbook_prefix(root);
    let bin = prefix.join("bin/mdbook");
    let installed = Command::new(&bin).arg("--version").output().is_ok_and(|o| {
        String::from_utf8_lossy(&o.stdout).trim() == format!("mdbook v{MDBOOK_VERSION}")
    });
    if !installed {
        crate::run(
            crate::cargo()
                .args(["install", "--locked", "mdbook", "--version", MDBOOK_VERSION])
                .args(["--no-default-features", "--features", "search", "--root"])
                .arg(&prefix),
        )?;
    }
    Ok(bin)
}

/// README.md and every markdown file under docs/src.
pub fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Every broken internal link of `files`, and every page missing from SUMMARY.md, as
/// `file:line: what`.
pub fn link_problems(root: &Path, files: &[PathBuf]) -> Result<Vec<String>> {
    let mut texts = BTreeMap::new();
    for file in files {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        texts.insert(file.clone(), text);
    }
    let name = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    let mut problems = Vec::new();
    for (file, text) in &texts {
        for link in links(text) {
            let (path, anchor) = match link.target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.target.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                normalize(&file.parent().unwrap_or(root).join(path))
            };
            let here = format!("{}:{}", name(file), link.line);
            if !target.exists() {
                problems.push(format!("{here}: {} does not exist", link.target));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if target.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let anchors = match texts.get(&target) {
                Some(t) => heading_anchors(t),
                None => heading_anchors(&std::fs::read_to_string(&target)?),
            };
            if !anchors.contains(anchor) {
                problems.push(format!(
                    "{here}: {} has no heading with anchor #{anchor}",
                    name(&target)
                ));
            }
        }
    }
    let src = root.join("docs/src");
    if let Some(summary) = texts.get(&src.join("SUMMARY.md")) {
        let listed: BTreeSet<PathBuf> = links(summary)
            .into_iter()
            .map(|l| normalize(&src.join(l.target.split('#').next().unwrap_or_default())))
            .collect();
        for file in texts.keys() {
            if file.starts_with(&src) && !file.ends_with("SUMMARY.md") && !listed.contains(file) {
                problems.push(format!(
                    "{}: not listed in docs/src/SUMMARY.md (mdbook would leave it out)",
                    name(file)
                ));
            }
        }
    }
    Ok(problems)
}

/// `a/./b/../c` → `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[derive(Debug, PartialEq)]
pub struct Link {
    pub line: usize,
    pub target: String,
}

/// Internal links of a markdown text: inline `[text](target)` and reference definitions
/// `[name]: target`, outside code blocks and code spans; URLs with a scheme are external.
pub fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    let mut in_fence = false;
    for (index, raw) in text.lines().enumerate() {
        if raw.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let line = strip_code_spans(raw);
        let mut targets = Vec::new();
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            targets.push(
                after[..end]
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_string(),
            );
            rest = &after[end..];
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some((_, target)) = trimmed.split_once("]: ")
        {
            targets.push(target.split_whitespace().next().unwrap_or("").to_string());
        }
        for target in targets {
            let target = target.trim_start_matches('<').trim_end_matches('>');
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            out.push(Link {
                line: index + 1,
                target: target.to_string(),
            });
        }
    }
    out
}

/// The line with its code spans blanked out, so links shown as code are not links.
fn strip_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else {
            out.push(if in_code { ' ' } else { c });
        }
    }
    out
}

/// The anchors mdbook gives the headings of a page: the heading's text without markup,
/// lower-cased, letters, digits, `_` and `-` kept, spaces made `-`, everything else dropped;
/// a repeated anchor gets `-1`, `-2`, ….
pub fn heading_anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let plain = strip_link_targets(title.trim());
        let base: String = plain
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_lowercase().next().unwrap_or(c))
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let count = seen.entry(base.clone()).or_default();
        let anchor = if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        };
        *count += 1;
        out.insert(anchor);
    }
    out
}

/// `[text](target)` → `text`, so a heading that is a link keeps only its words.
fn strip_link_targets(title: &str) -> String {
    let mut out = String::new();
    let mut rest = title;
    while let Some(at) = rest.find("](") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        rest = after.find(')').map_or("", |end| &after[end + 1..]);
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(pages: &[(&str, &str)]) -> (tempdir::Dir, Vec<PathBuf>) {
        let dir = tempdir::Dir::new();
        std::fs::create_dir_all(dir.path().join("docs/src")).unwrap();
        std::fs::write(
            dir.path().join("README.md"),
            "[book](docs/src/SUMMARY.md)\n",
        )
        .unwrap();
        for (name, text) in pages {
            std::fs::write(dir.path().join("docs/src").join(name), text).unwrap();
        }
        let files = markdown_files(dir.path());
        (dir, files)
    }

    #[test]
    fn anchors_follow_mdbook() {
        let anchors = heading_anchors(
            "# `pyrometer diff`\n## Agent and collector (cluster profiling)\n## Notes\n## Notes\n\
             ```\n# not a heading\n```\n#nospace\n",
        );
        let want: BTreeSet<String> = [
            "pyrometer-diff",
            "agent-and-collector-cluster-profiling",
            "notes",
            "notes-1",
        ]
        .map(String::from)
        .into();
        assert_eq!(anchors, want);
    }

    #[test]
    fn good_links_pass() {
        let (dir, files) = book(&[
            ("SUMMARY.md", "- [A](a.md)\n- [B](sub/../b.md)\n"),
            (
                "a.md",
                "# A\n## Part two\nsee [b](b.md#b-title) and [here](#part-two)\n",
            ),
            (
                "b.md",
                "# B title\n[ext](https://example.com) `[code](nope.md)`\n```\n[x](gone.md)\n```\n",
            ),
        ]);
        assert_eq!(
            link_problems(dir.path(), &files).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn missing_pages_anchors_and_unlisted_pages_fail() {
        let (dir, files) = book(&[
            ("SUMMARY.md", "- [A](a.md)\n- [Gone](gone.md)\n"),
            (
                "a.md",
                "# A\n[b](b.md#nowhere)\n\n[ref]: c.md\n[self](#a)\n[bad](#b)\n",
            ),
            ("b.md", "# B\n"),
        ]);
        let problems = link_problems(dir.path(), &files).unwrap();
        assert_eq!(
            problems,
            vec![
                "docs/src/SUMMARY.md:2: gone.md does not exist",
                "docs/src/a.md:2: docs/src/b.md has no heading with anchor #nowhere",
                "docs/src/a.md:4: c.md does not exist",
                "docs/src/a.md:6: docs/src/a.md has no heading with anchor #b",
                "docs/src/b.md: not listed in docs/src/SUMMARY.md (mdbook would leave it out)",
            ]
        );
    }

    /// The repository's own README and book are clean (the same check `cargo xtask test`
    /// runs before building the book).
    #[test]
    fn repository_book_links() {
        let root = crate::workspace_root();
        let problems = link_problems(&root, &markdown_files(&root)).unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    /// A private temporary directory, removed on drop (xtask has no tempfile dependency).
    mod tempdir {
        use std::path::{Path, PathBuf};
        use std::sync::atomic::{AtomicUsize, Ordering};

        pub struct Dir(PathBuf);

        impl Dir {
            pub fn new() -> Dir {
                static NEXT: AtomicUsize = AtomicUsize::new(0);
                let path = std::env::temp_dir().join(format!(
                    "xtask-book-{}-{}",
                    std::process::id(),
                    NEXT.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&path).unwrap();
                Dir(path)
            }

            pub fn path(&self) -> &Path {
                &self.0
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}
