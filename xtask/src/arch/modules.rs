//! A crate's module graph, read from its sources with `syn`: one node per file (inline
//! modules belong to their file), one edge per path that names an item of another file's
//! module. Paths count wherever they appear in code that is not a test: `use` items,
//! types, expressions, patterns, and the tokens of macro calls (`format!("{}", crate::a::b())`),
//! so an inline `crate::target::alive(..)` is an import like any `use`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// Visitor methods that leave test-only items out.
macro_rules! skip_tests {
    () => {
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            if !is_test(&f.attrs) {
                syn::visit::visit_item_fn(self, f);
            }
        }

        fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
            if !is_test(&i.attrs) {
                syn::visit::visit_item_impl(self, i);
            }
        }

        fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
            if !is_test(&f.attrs) {
                syn::visit::visit_impl_item_fn(self, f);
            }
        }

        fn visit_item_const(&mut self, c: &'ast syn::ItemConst) {
            if !is_test(&c.attrs) {
                syn::visit::visit_item_const(self, c);
            }
        }

        fn visit_item_static(&mut self, s: &'ast syn::ItemStatic) {
            if !is_test(&s.attrs) {
                syn::visit::visit_item_static(self, s);
            }
        }

        fn visit_item_struct(&mut self, s: &'ast syn::ItemStruct) {
            if !is_test(&s.attrs) {
                syn::visit::visit_item_struct(self, s);
            }
        }
    };
}

/// One file of the crate and the module path it defines (empty for the crate root).
#[derive(Debug, Clone)]
pub struct Node {
    pub module: Vec<String>,
    pub file: PathBuf,
}

impl Node {
    /// `python::tracker`, or `crate` for the root.
    pub fn name(&self) -> String {
        if self.module.is_empty() {
            "crate".into()
        } else {
            self.module.join("::")
        }
    }
}

/// `from` names something of `to` at `line` of `from`'s file.
#[derive(Debug, Clone)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub line: usize,
    pub text: String,
}

/// A path into another crate of the workspace (or any crate), resolved through the file's
/// own `use` items: `krate` and the segments after it.
#[derive(Debug, Clone)]
pub struct External {
    pub from: usize,
    pub krate: String,
    pub path: Vec<String>,
    pub line: usize,
}

#[derive(Debug, Default)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub edges: Vec<Edge>,
    pub externals: Vec<External>,
    /// Module path → node, inline modules included.
    scopes: HashMap<Vec<String>, usize>,
    /// Module path → the modules declared in it.
    children: HashMap<Vec<String>, Vec<String>>,
    /// Module path → the names its `use` items bring in.
    aliases: Aliases,
}

type Aliases = HashMap<Vec<String>, HashMap<String, Target>>;

impl Graph {
    /// The graph of the crate whose root file (`lib.rs`, `main.rs`) is `root`.
    pub fn load(root: &Path) -> Result<Self> {
        let mut graph = Graph::default();
        let mut files = Vec::new();
        graph.discover(root, Vec::new(), true, &mut files)?;
        for (node, ast) in &files {
            graph.collect_aliases(*node, ast);
        }
        for (node, ast) in &files {
            graph.resolve_file(*node, ast);
        }
        Ok(graph)
    }

    /// Reads `file` as module `module` and, recursively, the files of the modules it
    /// declares (test modules left out).
    fn discover(
        &mut self,
        file: &Path,
        module: Vec<String>,
        mod_rs: bool,
        out: &mut Vec<(usize, syn::File)>,
    ) -> Result<()> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let ast = syn::parse_file(&text).with_context(|| format!("parsing {}", file.display()))?;
        let node = self.nodes.len();
        self.nodes.push(Node {
            module: module.clone(),
            file: file.to_path_buf(),
        });
        // Child files live beside a `mod.rs` (or crate root), else in a folder named after
        // the file.
        let dir = if mod_rs {
            file.parent().unwrap_or(Path::new(".")).to_path_buf()
        } else {
            file.with_extension("")
        };
        self.scan_items(&ast.items, &module, node, &dir, out)?;
        out.push((node, ast));
        Ok(())
    }

    fn scan_items(
        &mut self,
        items: &[syn::Item],
        module: &[String],
        node: usize,
        dir: &Path,
        out: &mut Vec<(usize, syn::File)>,
    ) -> Result<()> {
        self.scopes.insert(module.to_vec(), node);
        self.children.entry(module.to_vec()).or_default();
        for item in items {
            let syn::Item::Mod(m) = item else { continue };
            if is_test(&m.attrs) {
                continue;
            }
            let name = m.ident.to_string();
            let mut child = module.to_vec();
            child.push(name.clone());
            self.children
                .get_mut(module)
                .expect("inserted above")
                .push(name.clone());
            match &m.content {
                Some((_, inner)) => {
                    self.scan_items(inner, &child, node, &dir.join(&name), out)?;
                }
                None => {
                    let (file, mod_rs) = match path_attr(&m.attrs) {
                        Some(p) => (dir.join(p), false),
                        None => {
                            let flat = dir.join(format!("{name}.rs"));
                            if flat.exists() {
                                (flat, false)
                            } else {
                                (dir.join(&name).join("mod.rs"), true)
                            }
                        }
                    };
                    if !file.exists() {
                        bail!(
                            "module {} declared but {} is missing",
                            child.join("::"),
                            file.display()
                        );
                    }
                    self.discover(&file, child, mod_rs, out)?;
                }
            }
        }
        Ok(())
    }

    /// What the `use` items of one file bring into each of its module scopes.
    fn collect_aliases(&mut self, node: usize, ast: &syn::File) {
        let mut collector = AliasCollector {
            scope: self.nodes[node].module.clone(),
            aliases: HashMap::new(),
            graph: self,
        };
        collector.visit_file(ast);
        let found = collector.aliases;
        self.aliases.extend(found);
    }

    /// Adds the edges and external uses of one file.
    fn resolve_file(&mut self, node: usize, ast: &syn::File) {
        let module = self.nodes[node].module.clone();
        let aliases = std::mem::take(&mut self.aliases);
        let mut paths = PathCollector {
            scope: module,
            found: Vec::new(),
        };
        paths.visit_file(ast);
        for (scope, segments, line) in paths.found {
            let empty = HashMap::new();
            let scope_aliases = aliases.get(&scope).unwrap_or(&empty);
            match self.absolute(&scope, &segments, scope_aliases) {
                Some(Target::Local(abs)) => {
                    if let Some(to) = self.node_of(&abs, &aliases)
                        && to != node
                    {
                        self.edges.push(Edge {
                            from: node,
                            to,
                            line,
                            text: segments.join("::"),
                        });
                    }
                }
                Some(Target::External(krate, path)) => self.externals.push(External {
                    from: node,
                    krate,
                    path,
                    line,
                }),
                None => {}
            }
        }
        self.aliases = aliases;
    }

    /// Where `segments`, written in module `scope`, points: into this crate (an absolute
    /// module path and item), into another crate, or nowhere we follow (a local item, a
    /// variable, a generic).
    fn absolute(
        &self,
        scope: &[String],
        segments: &[String],
        aliases: &HashMap<String, Target>,
    ) -> Option<Target> {
        let (first, rest) = segments.split_first()?;
        let local = |mut base: Vec<String>, rest: &[String]| {
            base.extend(rest.iter().cloned());
            Some(Target::Local(base))
        };
        match first.as_str() {
            "crate" => local(Vec::new(), rest),
            "self" => local(scope.to_vec(), rest),
            "super" => {
                let mut base = scope.to_vec();
                base.pop();
                let mut rest = rest;
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
                local(base, rest)
            }
            "Self" | "std" | "core" | "alloc" => None,
            _ => {
                if self
                    .children
                    .get(scope)
                    .is_some_and(|c| c.iter().any(|c| c == first))
                {
                    let mut base = scope.to_vec();
                    base.push(first.clone());
                    return local(base, rest);
                }
                match aliases.get(first) {
                    Some(Target::Local(base)) => local(base.clone(), rest),
                    Some(Target::External(krate, base)) => {
                        let mut path = base.clone();
                        path.extend(rest.iter().cloned());
                        Some(Target::External(krate.clone(), path))
                    }
                    // A crate name, or an item of this module: only crates of interest matter
                    // and those the caller tells apart by name.
                    None if rest.is_empty() => None,
                    None => Some(Target::External(first.clone(), rest.to_vec())),
                }
            }
        }
    }

    /// The file that defines what `path` names: the one whose module is the longest prefix
    /// of it, or, when that module only re-exports the name (`pub use a::A`), the file it
    /// comes from.
    fn node_of(&self, path: &[String], aliases: &Aliases) -> Option<usize> {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let n = (0..=path.len())
                .rev()
                .find(|&n| self.scopes.contains_key(&path[..n]))?;
            let through = path
                .get(n)
                .and_then(|name| aliases.get(&path[..n])?.get(name));
            match through {
                Some(Target::Local(target)) if !target.starts_with(&path[..n + 1]) => {
                    let mut next = target.clone();
                    next.extend(path[n + 1..].iter().cloned());
                    path = next;
                }
                _ => return self.scopes.get(&path[..n]).copied(),
            }
        }
        (0..=path.len())
            .rev()
            .find_map(|n| self.scopes.get(&path[..n]).copied())
    }
}

#[derive(Debug, Clone)]
enum Target {
    Local(Vec<String>),
    External(String, Vec<String>),
}

/// Whether attributes mark a test-only item: `#[cfg(test)]`, `#[cfg(all(test, ...))]`, `#[test]`.
pub fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        if a.path().is_ident("test") {
            return true;
        }
        if !a.path().is_ident("cfg") {
            return false;
        }
        let syn::Meta::List(list) = &a.meta else {
            return false;
        };
        let text = list.tokens.to_string();
        text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|w| w == "test")
            && !text.starts_with("not")
    })
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find_map(|a| {
        if !a.path().is_ident("path") {
            return None;
        }
        let syn::Meta::NameValue(nv) = &a.meta else {
            return None;
        };
        match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        }
    })
}

/// First pass: what each `use` item of a file brings into scope, per module scope.
struct AliasCollector<'g> {
    scope: Vec<String>,
    aliases: HashMap<Vec<String>, HashMap<String, Target>>,
    graph: &'g Graph,
}

impl AliasCollector<'_> {
    fn add_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.add_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.bind(prefix, &n.ident.to_string(), &n.ident.to_string()),
            syn::UseTree::Rename(r) => {
                self.bind(prefix, &r.ident.to_string(), &r.rename.to_string())
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.add_tree(prefix, t);
                }
            }
            syn::UseTree::Glob(_) => {}
        }
    }

    fn bind(&mut self, prefix: &[String], name: &str, alias: &str) {
        let mut full = prefix.to_vec();
        if name != "self" {
            full.push(name.to_string());
        }
        let empty = HashMap::new();
        let known = self.aliases.get(&self.scope).unwrap_or(&empty);
        if let Some(target) = self.graph.absolute(&self.scope, &full, known) {
            let alias = if name == "self" {
                prefix.last().cloned().unwrap_or_default()
            } else {
                alias.to_string()
            };
            self.aliases
                .entry(self.scope.clone())
                .or_default()
                .insert(alias, target);
        } else if full.len() == 1 {
            // `use serde;` and the like: a crate brought in by name.
            self.aliases.entry(self.scope.clone()).or_default().insert(
                alias.to_string(),
                Target::External(full[0].clone(), Vec::new()),
            );
        }
    }
}

impl<'ast> Visit<'ast> for AliasCollector<'_> {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if !is_test(&u.attrs) {
            self.add_tree(&mut Vec::new(), &u.tree);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_test(&m.attrs) || m.content.is_none() {
            return;
        }
        self.scope.push(m.ident.to_string());
        syn::visit::visit_item_mod(self, m);
        self.scope.pop();
    }

    skip_tests!();
}

/// Second pass: every path written in the file's non-test code, with its scope and line.
struct PathCollector {
    scope: Vec<String>,
    found: Vec<(Vec<String>, Vec<String>, usize)>,
}

impl PathCollector {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree, line: usize) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree, line);
                prefix.pop();
            }
            syn::UseTree::Name(syn::UseName { ident })
            | syn::UseTree::Rename(syn::UseRename { ident, .. }) => {
                let mut full = prefix.clone();
                if ident != "self" {
                    full.push(ident.to_string());
                }
                self.found.push((self.scope.clone(), full, line));
            }
            syn::UseTree::Glob(_) => self.found.push((self.scope.clone(), prefix.clone(), line)),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t, line);
                }
            }
        }
    }

    /// `crate :: a :: b`, `super :: x`, `name :: y` sequences in a macro's tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(g) => {
                    self.tokens(g.stream());
                    i += 1;
                }
                TokenTree::Ident(first) => {
                    let line = first.span().start().line;
                    let mut segments = vec![first.to_string()];
                    let mut j = i + 1;
                    while is_colon(trees.get(j))
                        && is_colon(trees.get(j + 1))
                        && matches!(trees.get(j + 2), Some(TokenTree::Ident(_)))
                    {
                        if let Some(TokenTree::Ident(next)) = trees.get(j + 2) {
                            segments.push(next.to_string());
                        }
                        j += 3;
                    }
                    if segments.len() > 1 {
                        self.found.push((self.scope.clone(), segments, line));
                    }
                    i = j;
                }
                TokenTree::Punct(_) | TokenTree::Literal(_) => i += 1,
            }
        }
    }
}

fn is_colon(t: Option<&TokenTree>) -> bool {
    matches!(t, Some(TokenTree::Punct(p)) if p.as_char() == ':')
}

impl<'ast> Visit<'ast> for PathCollector {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if !is_test(&u.attrs) {
            let line = u.use_token.span.start().line;
            self.use_tree(&mut Vec::new(), &u.tree, line);
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segments: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 {
            let line = p
                .segments
                .first()
                .map_or(0, |s| s.ident.span().start().line);
            self.found.push((self.scope.clone(), segments, line));
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.tokens(m.tokens.clone());
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_test(&m.attrs) || m.content.is_none() {
            return;
        }
        self.scope.push(m.ident.to_string());
        syn::visit::visit_item_mod(self, m);
        self.scope.pop();
    }

    skip_tests!();
}
