//! `cargo xtask arch` (also a step of `cargo xtask test`): the architecture rules the
//! compiler does not check, read from the sources with `syn`.
//!
//! - No import cycle between the modules of the node library, its binary and the collector.
//! - The node library's areas import only downward, through the layers of [`LAYERS`]
//!   (docs/src/internals.md draws them).
//! - The `pyrometer` binary uses the library's public API only: none of the modules of
//!   [`INTERNAL`], and neither the kernel-side crate nor the unwind-table crate directly.
//! - No source file over 800 lines, no function over 150 (tests aside).

mod cycles;
mod modules;
mod sizes;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use modules::Graph;

/// The node library's layers, lowest first: a module may import from its own layer (without
/// a cycle) and the ones below, never from above.
pub const LAYERS: &[(&str, &[&str])] = &[
    ("data model and OS facts", &["crate", "model", "os"]),
    (
        "kernel side and symbolization",
        &["bpf", "unwinder", "symbolize"],
    ),
    ("interpreters and allocations", &["python", "alloc", "ray"]),
    (
        "tables, capture and the profiler",
        &["tables", "capture", "profiler"],
    ),
    (
        "outputs, exports and GPU",
        &["output", "input", "diff", "otlp", "gpu"],
    ),
    (
        "commands: record, top, dump, verifier, install-preload, the agent",
        &[
            "command",
            "record",
            "top",
            "dump",
            "verifier",
            "install_preload",
            "agent",
        ],
    ),
];

/// Library modules the binary must not reach into: it goes through `Profiler`, the agent and
/// the outputs.
pub const INTERNAL: &[&str] = &[
    "os",
    "bpf",
    "unwinder",
    "symbolize",
    "python",
    "alloc",
    "ray",
    "tables",
    "capture",
];

/// Rules broken on this branch whose fix lands from another: each message's start, and the
/// fix. The check fails once one is no longer broken, so its entry leaves with the fix.
const PENDING: &[(&str, &str)] = &[];

/// Crates whose sizes are checked, with the roots whose import cycles are (the node library
/// and its binary, the collector).
const CRATES: &[(&str, &[&str])] = &[
    ("profiler", &["src/lib.rs", "src/bin/pyrometer/main.rs"]),
    ("collector", &["src/lib.rs", "src/main.rs"]),
    ("proto", &[]),
    ("diff", &[]),
    ("unwind", &[]),
    ("ebpf", &[]),
    ("alloc-preload", &[]),
    ("xtask", &[]),
];

/// Every rule broken in the workspace at `root`, one message each.
pub fn violations(root: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (dir, roots) in CRATES {
        for crate_root in *roots {
            let graph = Graph::load(&root.join(dir).join(crate_root))?;
            out.extend(cycles::cycles(&graph));
        }
        for file in rust_files(&root.join(dir).join("src"))? {
            out.extend(sizes::check_file(&file)?);
        }
        if root.join(dir).join("build.rs").exists() {
            out.extend(sizes::check_file(&root.join(dir).join("build.rs"))?);
        }
    }
    let lib = Graph::load(&root.join("profiler/src/lib.rs"))?;
    out.extend(layer_violations(&lib));
    let bin = Graph::load(&root.join("profiler/src/bin/pyrometer/main.rs"))?;
    out.extend(public_api_violations(
        &bin,
        &public_modules(&root.join("profiler/src/lib.rs"))?,
    ));
    Ok(without_pending(out, PENDING))
}

/// `found` less the pending ones; a pending entry that matches nothing is itself reported.
fn without_pending(found: Vec<String>, pending: &[(&str, &str)]) -> Vec<String> {
    let mut out: Vec<String> = found
        .iter()
        .filter(|v| !pending.iter().any(|(p, _)| v.starts_with(p)))
        .cloned()
        .collect();
    for (p, fix) in pending {
        if !found.iter().any(|v| v.starts_with(p)) {
            out.push(format!(
                "xtask/src/arch/mod.rs: PENDING \"{p}\" ({fix}) is fixed: remove its entry"
            ));
        } else {
            eprintln!("architecture: pending, fixed by {fix}: {p}");
        }
    }
    out
}

/// `cargo xtask arch`: prints each broken rule; fails when there is one.
pub fn check(root: &Path) -> Result<()> {
    let found = violations(root)?;
    for v in &found {
        eprintln!("{v}");
    }
    if !found.is_empty() {
        bail!(
            "{} architecture rule(s) broken (xtask/src/arch/mod.rs says why each exists)",
            found.len()
        );
    }
    eprintln!(
        "architecture: no import cycle, layers downward, binary on the public API, sizes within limits"
    );
    Ok(())
}

/// The layer of a library module, by its first path segment (`python::tracker` → python's).
fn layer_of(module: &[String]) -> Option<usize> {
    let area = module.first().map_or("crate", String::as_str);
    LAYERS.iter().position(|(_, areas)| areas.contains(&area))
}

fn layer_violations(graph: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for node in &graph.nodes {
        if layer_of(&node.module).is_none() {
            out.push(format!(
                "{}: module {} is in no layer: add it to LAYERS in xtask/src/arch/mod.rs (and to docs/src/internals.md)",
                node.file.display(),
                node.name()
            ));
        }
    }
    for e in &graph.edges {
        let (from, to) = (&graph.nodes[e.from], &graph.nodes[e.to]);
        let (Some(lf), Some(lt)) = (layer_of(&from.module), layer_of(&to.module)) else {
            continue;
        };
        if lt > lf {
            out.push(format!(
                "{}:{}: {} ({}) imports {} ({}), a layer above it: `{}`",
                from.file.display(),
                e.line,
                from.name(),
                LAYERS[lf].0,
                to.name(),
                LAYERS[lt].0,
                e.text
            ));
        }
    }
    out
}

/// The modules the library declares `pub`.
fn public_modules(lib: &Path) -> Result<Vec<String>> {
    let ast = syn::parse_file(&std::fs::read_to_string(lib)?)?;
    Ok(ast
        .items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Mod(m) if matches!(m.vis, syn::Visibility::Public(_)) => {
                Some(m.ident.to_string())
            }
            _ => None,
        })
        .collect())
}

fn public_api_violations(bin: &Graph, public: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for m in INTERNAL {
        if public.iter().any(|p| p == m) {
            out.push(format!(
                "profiler/src/lib.rs: `pub mod {m}`: an internal layer is not public API (make it `mod {m}`)"
            ));
        }
    }
    for x in &bin.externals {
        let file = bin.nodes[x.from].file.display();
        match x.krate.as_str() {
            "pyrometer_ebpf" | "pyrometer_unwind" => out.push(format!(
                "{file}:{}: the binary uses {}::{} directly: go through the library",
                x.line,
                x.krate,
                x.path.join("::")
            )),
            "pyrometer" => {
                let Some(first) = x.path.first() else {
                    continue;
                };
                let is_module = first.chars().next().is_some_and(|c| c.is_lowercase());
                if is_module && (INTERNAL.contains(&first.as_str()) || !public.contains(first)) {
                    out.push(format!(
                        "{file}:{}: the binary uses pyrometer::{}, not public API",
                        x.line,
                        x.path.join("::")
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

/// The `.rs` files under `dir`, sorted.
fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}
