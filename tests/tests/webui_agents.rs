//! The web UI over a collector filled by a real agent: a process whose every sample is a
//! ~250-frame stack (the `recurse` fixture, no frame pointers) beside the 6:3:1 workload, both
//! sampled by `pyrometer agent` and pushed over gRPC. In headless Chromium the deep stack must
//! not shrink the flame graph: the root spans the viewport, each process keeps the width of
//! its share of the samples (as the collector's API counts them), the shallow workload's
//! leaves keep their 6:3:1 split, and the deep stack scrolls instead.

// The collector's own web UI tests drive the browser with this module; these use part of it.
#[allow(dead_code)]
#[path = "../../collector/tests/chromium/mod.rs"]
mod chromium;

use std::path::Path;
use std::time::Duration;

use chromium::Chromium;
use pyrometer_e2e::cluster::{Agent, Collector, free_port, workload};
use pyrometer_e2e::wait::wait_for;
use pyrometer_e2e::{fixture, privileged, scratch};
use serde_json::Value;

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 900;
/// `rec` frames of the deep process's stacks: with main, bottom and the C library's start-up
/// frames, ~250 frames a stack (the kernel walks up to 256).
const DEPTH: u32 = 245;

/// JavaScript: the widest drawn box of each frame name in the main flame graph, as
/// `{name: {w, top}}`, with the viewport's width, once it has drawn `want`.
fn frames(want: &[&str]) -> String {
    let want = serde_json::to_string(want).unwrap();
    format!(
        r##"(() => {{
            const out = {{}};
            for (const b of document.querySelectorAll("#flame .frame")) {{
                const w = b.getBoundingClientRect().width;
                const prev = out[b.dataset.name];
                if (prev && prev.w >= w) continue;
                out[b.dataset.name] = {{ w, top: parseFloat(b.style.top) }};
            }}
            if (!{want}.every(n => out[n])) return null;
            const v = document.querySelector("#flame .fg-viewport");
            return {{ frames: out, full: v.clientWidth, height: v.clientHeight,
                scroll: v.scrollHeight,
                deepest: Math.max(...[...document.querySelectorAll("#flame .frame")]
                    .map(b => parseFloat(b.style.top))) }};
        }})()"##
    )
}

fn width(v: &Value, name: &str) -> f64 {
    v["frames"][name]["w"]
        .as_f64()
        .unwrap_or_else(|| panic!("no frame {name}: {v}"))
}

#[test]
fn a_real_agents_deep_stack_leaves_the_flame_graph_readable() {
    if !privileged() {
        return;
    }
    let dir = scratch("webui-agents");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let deep_exe = dir.join("deepwl");
    pyrometer_e2e::copy_executable(&fixture("recurse"), &deep_exe);
    // Long enough for any start-up; killed once the samples are in.
    let mut deep = std::process::Command::new(&deep_exe)
        .args(["300", &DEPTH.to_string()])
        .spawn()
        .expect("start the deep workload");
    let mut shallow = workload(&dir, "shallowwl", 300);
    let mut agent = Agent::start(
        &dir,
        "ui-node",
        &collector.url(),
        &["--comm", "^(deepwl|shallowwl)$", "--frequency", "99"],
    );
    // A debug-build agent starts (BPF verification, unwind tables) and pushes every second:
    // a few hundred samples of each process make the shallow one's 6:3:1 split show.
    wait_for(
        Duration::from_secs(120),
        "300 samples of each workload in the collector",
        || {
            let groups = collector.totals_by("comm");
            let enough = |c: &str| groups.get(c).is_some_and(|&n| n >= 300);
            if enough("deepwl") && enough("shallowwl") {
                Ok(())
            } else {
                Err(groups)
            }
        },
    );
    let stats = agent.stop();
    let _ = deep.kill();
    let _ = shallow.kill();
    let _ = deep.wait();
    let _ = shallow.wait();

    let groups = collector.totals_by("comm");
    let total: i64 = groups.values().sum();
    let share = |comm: &str| {
        groups
            .get(comm)
            .map(|&v| v as f64 / total as f64)
            .unwrap_or_else(|| panic!("no {comm} samples: {groups:?}\n{stats}"))
    };
    let (deep_share, shallow_share) = (share("deepwl"), share("shallowwl"));
    assert!(
        deep_share > 0.2 && shallow_share > 0.2,
        "both processes sampled: {groups:?}"
    );

    let mut page = Chromium::launch(&format!("{}/", collector.url()), &dir, WIDTH, HEIGHT);
    let v = page.wait_for(
        "the flame graph of both processes",
        &frames(&[
            "all",
            "deepwl",
            "shallowwl",
            "rec",
            "leaf_a",
            "leaf_b",
            "leaf_c",
        ]),
    );
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("webui-agents");
    std::fs::create_dir_all(&shots).unwrap();
    let shot = shots.join("flame.png");
    page.screenshot(&shot);
    println!("screenshot: {}", shot.display());

    // The root spans the viewport; each process keeps its share of it, deep stack or not.
    let full = v["full"].as_f64().unwrap();
    assert!(full > 1000.0, "{v}");
    assert!((width(&v, "all") - full).abs() <= 1.0, "{v}");
    for (name, want) in [("deepwl", deep_share), ("shallowwl", shallow_share)] {
        let got = width(&v, name) / full;
        assert!(
            (got - want).abs() <= 0.01,
            "{name}: {got:.3} of the width, {want:.3} of the samples"
        );
    }
    // The shallow process's leaves keep the workload's 6:3:1 within it.
    let leaves: f64 = ["leaf_a", "leaf_b", "leaf_c"]
        .iter()
        .map(|l| width(&v, l))
        .sum();
    for (leaf, want) in [("leaf_a", 0.6), ("leaf_b", 0.3), ("leaf_c", 0.1)] {
        let got = width(&v, leaf) / leaves;
        assert!(
            (got - want).abs() <= 0.08,
            "{leaf}: {got:.3} of the leaves' width, expected {want}"
        );
    }
    // The deep stack is drawn whole at the fixed row height (18 px a row) and scrolls.
    let deepest_row = v["deepest"].as_f64().unwrap() / 18.0;
    assert!(
        deepest_row >= f64::from(DEPTH),
        "the deepest frame is row {deepest_row}, the stacks are ~{DEPTH} deep: {}",
        v["deepest"]
    );
    assert!(
        v["scroll"].as_f64().unwrap() > v["height"].as_f64().unwrap(),
        "the graph scrolls: {v}"
    );
    drop(page);
    drop(collector);
    let _ = std::fs::remove_dir_all(&dir);
}
