use std::path::Path;

use super::*;

/// A crate written into a fresh folder: (path under src/, contents).
fn write_crate(name: &str, files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("xtask-arch-{name}-"))
        .tempdir()
        .unwrap();
    for (path, text) in files {
        let p = dir.path().join("src").join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir
}

fn file_names(report: &str) -> Vec<&str> {
    ["a.rs", "b.rs", "c.rs", "mod.rs"]
        .into_iter()
        .filter(|f| report.contains(f))
        .collect()
}

#[test]
fn an_inline_path_closes_a_cycle() {
    let dir = write_crate(
        "inline",
        &[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a.rs", "use crate::b::B;\npub struct A(B);\n"),
            // No `use` at all: the call alone imports a.
            (
                "b.rs",
                "pub struct B;\nfn f() { let _ = crate::a::helper(); }\n",
            ),
            ("c.rs", "use crate::a::A;\n"),
        ],
    );
    let graph = Graph::load(&dir.path().join("src/lib.rs")).unwrap();
    let found = cycles::cycles(&graph);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("import cycle among crate::{a, b}"),
        "{}",
        found[0]
    );
    assert_eq!(
        file_names(&found[0]),
        ["a.rs", "b.rs"],
        "c.rs is outside: {}",
        found[0]
    );
    assert!(
        found[0].contains("b.rs:2 (crate::a::helper)"),
        "{}",
        found[0]
    );
}

#[test]
fn paths_in_macros_super_and_aliases_count_and_tests_do_not() {
    let dir = write_crate(
        "macro",
        &[
            ("lib.rs", "mod a;\nmod b;\n"),
            (
                "a.rs",
                "pub fn f() -> u32 { 1 }\n#[cfg(test)]\nmod tests { use crate::b::g; }\n",
            ),
            (
                "b.rs",
                "use crate as root;\npub fn g() { println!(\"{}\", root::a::f()); }\n",
            ),
        ],
    );
    let graph = Graph::load(&dir.path().join("src/lib.rs")).unwrap();
    assert!(
        cycles::cycles(&graph).is_empty(),
        "a's test module does not count"
    );
    let to_a: Vec<_> = graph
        .edges
        .iter()
        .filter(|e| graph.nodes[e.to].name() == "a")
        .collect();
    assert_eq!(
        to_a.len(),
        1,
        "the path inside println! is found: {:?}",
        graph.edges
    );

    let dir = write_crate(
        "super",
        &[
            ("lib.rs", "mod p;\n"),
            ("p/mod.rs", "mod a;\nmod b;\npub use a::A;\n"),
            ("p/a.rs", "pub struct A;\nfn f() { super::b::g(); }\n"),
            ("p/b.rs", "use super::A;\npub fn g() {}\n"),
        ],
    );
    let graph = Graph::load(&dir.path().join("src/lib.rs")).unwrap();
    let found = cycles::cycles(&graph);
    // b's `super::A` is a's, re-exported by p: the facade hides no cycle.
    assert_eq!(found.len(), 1, "a → b → (p's re-export of) a: {found:?}");
    assert!(
        found[0].starts_with("import cycle among p::{a, b}"),
        "{}",
        found[0]
    );
    assert_eq!(file_names(&found[0]), ["a.rs", "b.rs"]);
}

#[test]
fn imports_from_a_higher_layer_are_refused() {
    let dir = write_crate(
        "layers",
        &[
            ("lib.rs", "mod os;\nmod agent;\nmod python;\nmod stray;\n"),
            (
                "os.rs",
                "pub fn alive() -> bool { crate::agent::running() }\n",
            ),
            (
                "agent.rs",
                "pub fn running() -> bool { crate::os::alive() }\n",
            ),
            ("python.rs", "use crate::os::alive;\n"),
            ("stray.rs", "\n"),
        ],
    );
    let graph = Graph::load(&dir.path().join("src/lib.rs")).unwrap();
    let found = layer_violations(&graph);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].contains("stray is in no layer"), "{}", found[0]);
    assert!(
        found[1].contains("os.rs:1: os (data model and OS facts) imports agent (commands"),
        "{}",
        found[1]
    );
}

#[test]
fn the_binary_is_held_to_the_public_api() {
    let dir = write_crate(
        "bin",
        &[(
            "main.rs",
            "use pyrometer::output::write;\nuse pyrometer::bpf;\nfn main() { let _ = bpf::Sampler::load(); let _ = pyrometer_ebpf::MAX_SLOTS; pyrometer::Profiler::open(); }\n",
        )],
    );
    let graph = Graph::load(&dir.path().join("src/main.rs")).unwrap();
    let public = vec!["output".to_string(), "bpf".to_string()];
    let found = public_api_violations(&graph, &public);
    let text = found.join("\n");
    assert!(text.contains("`pub mod bpf`"), "{text}");
    assert!(
        text.contains("main.rs:2: the binary uses pyrometer::bpf"),
        "{text}"
    );
    assert!(
        text.contains("uses pyrometer_ebpf::MAX_SLOTS directly"),
        "{text}"
    );
    assert!(
        !text.contains("output") && !text.contains("Profiler"),
        "{text}"
    );
}

#[test]
fn long_files_and_functions_are_found_and_tests_are_not() {
    let body = "    let x = 1;\n".repeat(160);
    let long_fn = format!("fn long() {{\n{body}}}\n");
    let test_fn = format!("#[test]\nfn long_test() {{\n{body}}}\n");
    let dir = write_crate("sizes", &[("a.rs", &format!("{long_fn}{test_fn}"))]);
    let found = sizes::check_file(&dir.path().join("src/a.rs")).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("a.rs:1: fn long is 162 lines"),
        "{}",
        found[0]
    );

    let many = "const X: u32 = 1;\n".repeat(801);
    let dir = write_crate("lines", &[("big.rs", &many), ("tests.rs", &many)]);
    assert_eq!(
        sizes::check_file(&dir.path().join("src/big.rs"))
            .unwrap()
            .len(),
        1
    );
    assert!(
        sizes::check_file(&dir.path().join("src/tests.rs"))
            .unwrap()
            .is_empty()
    );
    assert!(sizes::is_test_file(Path::new("collector/tests/webui.rs")));
}

#[test]
fn pending_breaks_are_let_through_until_fixed() {
    let found = vec!["cycle a".to_string(), "big file".to_string()];
    let pending = [("cycle a", "its fix")];
    assert_eq!(without_pending(found, &pending), ["big file"]);
    let fixed = without_pending(vec!["big file".into()], &pending);
    assert_eq!(fixed.len(), 2);
    assert!(
        fixed[1].contains("PENDING \"cycle a\" (its fix) is fixed"),
        "{fixed:?}"
    );
}

/// The rules hold in this workspace (`cargo xtask test` also runs the check first).
#[test]
fn the_workspace_keeps_its_architecture() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let found = violations(root).unwrap();
    assert!(found.is_empty(), "{}", found.join("\n"));
}
