//! Size limits: a source file past `MAX_FILE_LINES` lines or a function past
//! `MAX_FN_LINES` is a module or function with more than one job. Tests (files of their
//! own, `#[cfg(test)]` modules, `#[test]` functions) are left out, as are generated and
//! vendored sources, which are not under `src/`.

use std::path::Path;

use anyhow::{Context, Result};
use syn::spanned::Spanned;
use syn::visit::Visit;

use super::modules::is_test;

pub const MAX_FILE_LINES: usize = 800;
pub const MAX_FN_LINES: usize = 150;

/// Whether a file holds tests only (by its name or folder).
pub fn is_test_file(path: &Path) -> bool {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    name == "tests.rs"
        || name.ends_with("_tests.rs")
        || path
            .components()
            .any(|c| matches!(c.as_os_str().to_str(), Some("tests" | "benches")))
}

/// The limits `file` breaks, one line each.
pub fn check_file(file: &Path) -> Result<Vec<String>> {
    if is_test_file(file) {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut out = Vec::new();
    let lines = text.lines().count();
    if lines > MAX_FILE_LINES {
        out.push(format!(
            "{}: {lines} lines (at most {MAX_FILE_LINES}): split it by job",
            file.display()
        ));
    }
    let ast = syn::parse_file(&text).with_context(|| format!("parsing {}", file.display()))?;
    let mut fns = Functions { long: Vec::new() };
    fns.visit_file(&ast);
    for (name, line, len) in fns.long {
        out.push(format!(
            "{}:{line}: fn {name} is {len} lines (at most {MAX_FN_LINES}): split it into steps",
            file.display()
        ));
    }
    Ok(out)
}

struct Functions {
    long: Vec<(String, usize, usize)>,
}

impl Functions {
    fn check(&mut self, name: &syn::Ident, sig: &syn::Signature, block: &syn::Block) {
        let start = sig.fn_token.span.start().line;
        let end = block.span().end().line;
        let len = end.saturating_sub(start) + 1;
        if len > MAX_FN_LINES {
            self.long.push((name.to_string(), start, len));
        }
    }
}

impl<'ast> Visit<'ast> for Functions {
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if is_test(&f.attrs) {
            return;
        }
        self.check(&f.sig.ident, &f.sig, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_test(&f.attrs) {
            return;
        }
        self.check(&f.sig.ident, &f.sig, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.check(&f.sig.ident, &f.sig, block);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_test(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        if !is_test(&i.attrs) {
            syn::visit::visit_item_impl(self, i);
        }
    }
}
