//! Import cycles of a crate, level by level: at every module, its child modules (each with
//! everything below it) must not import each other in a circle. A file that names an item
//! of another child's subtree is an edge between the two children. A module and its own
//! descendants are one thing, so a parent's `pub use` of its children and the children's
//! `super::` items are not edges; the children among themselves, and their subtrees as
//! wholes against the parent's siblings, are. `python::version` → `unwinder` and `unwinder`
//! → `python::tracker` make a cycle between `python` and `unwinder` at the crate's top.

use std::collections::{BTreeMap, VecDeque};

use super::modules::Graph;

/// Each group of sibling modules that import each other in a circle, with one cycle spelled
/// out edge by edge.
pub fn cycles(graph: &Graph) -> Vec<String> {
    // Parent module → (child, child) → the first file edge that makes it.
    let mut levels: BTreeMap<Vec<String>, BTreeMap<(String, String), usize>> = BTreeMap::new();
    for (i, e) in graph.edges.iter().enumerate() {
        let (from, to) = (&graph.nodes[e.from].module, &graph.nodes[e.to].module);
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if common == from.len() || common == to.len() {
            continue; // a module and its own descendant
        }
        levels
            .entry(from[..common].to_vec())
            .or_default()
            .entry((from[common].clone(), to[common].clone()))
            .or_insert(i);
    }
    let mut reports = Vec::new();
    for (parent, edges) in levels {
        let mut names: Vec<String> = edges
            .keys()
            .flat_map(|(a, b)| [a.clone(), b.clone()])
            .collect();
        names.sort();
        names.dedup();
        let index = |n: &String| names.binary_search(n).expect("collected above");
        let mut out: Vec<Vec<(usize, usize)>> = vec![Vec::new(); names.len()];
        for ((a, b), edge) in &edges {
            out[index(a)].push((index(b), *edge));
        }
        for component in components(&out) {
            if component.len() < 2 {
                continue;
            }
            let mut members: Vec<&str> = component.iter().map(|&i| names[i].as_str()).collect();
            members.sort();
            let start = *component.iter().min().expect("not empty");
            let prefix = if parent.is_empty() {
                "crate".to_string()
            } else {
                parent.join("::")
            };
            reports.push(format!(
                "import cycle among {prefix}::{{{}}}\n  one cycle: {}",
                members.join(", "),
                shortest_cycle(graph, &out, &names, start, &component)
            ));
        }
    }
    reports
}

/// Tarjan's strongly connected components of `out` (vertex → (vertex, label)), iteratively.
fn components(out: &[Vec<(usize, usize)>]) -> Vec<Vec<usize>> {
    let n = out.len();
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut stack = Vec::new();
    let mut next = 0;
    let mut result = Vec::new();
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0usize)];
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (v, ref mut at)) = work.last_mut() {
            if let Some(&(w, _)) = out[v].get(*at) {
                *at += 1;
                if index[w] == usize::MAX {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                result.push(component);
            }
        }
    }
    result
}

/// The shortest way from `start` back to itself inside `component`, each step shown by the
/// file edge that makes it: `bpf/mod.rs:499 (crate::python::tracker::PyTracker) → …`.
fn shortest_cycle(
    graph: &Graph,
    out: &[Vec<(usize, usize)>],
    names: &[String],
    start: usize,
    component: &[usize],
) -> String {
    let mut via: Vec<Option<(usize, usize)>> = vec![None; out.len()];
    let mut seen = vec![false; out.len()];
    seen[start] = true;
    let mut queue = VecDeque::from([start]);
    let mut closing = None;
    'search: while let Some(v) = queue.pop_front() {
        for &(w, edge) in &out[v] {
            if w == start {
                closing = Some((v, edge));
                break 'search;
            }
            if component.contains(&w) && !seen[w] {
                seen[w] = true;
                via[w] = Some((v, edge));
                queue.push_back(w);
            }
        }
    }
    let Some((mut v, last)) = closing else {
        return "(none found)".into();
    };
    let mut chain = vec![last];
    while v != start {
        let (prev, edge) = via[v].expect("reached through an edge");
        chain.push(edge);
        v = prev;
    }
    chain.reverse();
    let mut text = String::new();
    for e in chain {
        let edge = &graph.edges[e];
        text.push_str(&format!(
            "{}:{} ({}) → ",
            graph.nodes[edge.from].file.display(),
            edge.line,
            edge.text
        ));
    }
    text.push_str(&names[start]);
    text
}
