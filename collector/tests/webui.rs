//! The web UI in real headless Chromium (1400×900) against the real `pyrometer-collector`
//! binary, fed recorded profiles over gRPC: the flame graph drawn in the browser with a
//! 250-frame stack in the selection, zoom, breadcrumbs, search, tooltips and frame kinds; the
//! label pickers; the function table and the sandwich of a function with known callers; the
//! chart's brush selecting the range; the compare view; state kept in the URL. Pointer input
//! (hover, clicks, the brush) is real input through the DevTools protocol. Screenshots land in
//! target/tmp/webui-*/ (paths printed) for a human to look at. Each test runs against both
//! stores (SQLite, and the collector binary on a private ClickHouse server).

mod chromium;
mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chromium::Chromium;
use common::clickhouse_server::ClickHouse;
use common::{Kind, profile_of, push, request};
use serde_json::{Value, json};

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 900;

/// The collector binary, killed when dropped (before its ClickHouse server, if any).
struct Collector {
    child: Child,
    addr: SocketAddr,
    _clickhouse: Option<ClickHouse>,
}

impl Collector {
    fn start(data_dir: &Path, kind: Kind) -> Collector {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pyrometer-collector"));
        cmd.arg("--listen").arg(addr.to_string());
        let clickhouse = match kind {
            Kind::Sqlite => {
                cmd.arg("--data-dir").arg(data_dir);
                None
            }
            Kind::ClickHouse => {
                let server = ClickHouse::start(data_dir);
                cmd.arg("--store")
                    .arg(server.url("webui"))
                    .arg("--store-credentials")
                    .arg(server.credentials_file());
                Some(server)
            }
        };
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .expect("start pyrometer-collector");
        let c = Collector {
            child,
            addr,
            _clickhouse: clickhouse,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "collector not up on {addr}");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn scratch(name: &str, kind: Kind) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("webui-{name}-{kind:?}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

type Stacks<'a> = Vec<(Vec<&'a str>, i64)>;

/// Pushes `(agent, node, process, stacks, time)` batches over gRPC.
fn seed(addr: SocketAddr, batches: &[(&str, &str, &str, Stacks<'_>, i64)]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for (seq, (agent, node, comm, stacks, time_s)) in batches.iter().enumerate() {
            let stacks: Vec<(&[&str], i64)> =
                stacks.iter().map(|(s, v)| (s.as_slice(), *v)).collect();
            let p = profile_of(comm, &stacks, *time_s);
            push(addr, None, request(agent, seq as u64 + 1, node, p))
                .await
                .expect("push accepted");
        }
    });
}

const PARSE: &str = "parse (app/codec.py:12)";
const HANDLE: &str = "handle_request (app/server.py:40)";
const LOAD_CONFIG: &str = "load_config (app/config.py:3)";
const PY_MAIN: &str = "<module> (app/server.py:1)";

/// n1 runs a native trainer with one 250-frame recursive stack beside two shallow ones; n2 a
/// Python server whose `parse` is called by `handle_request` (300) and `load_config` (100),
/// and a kernel frame. 1000 samples in all, a minute ago.
fn seed_profiles(addr: SocketAddr) {
    let deep: Vec<&str> = std::iter::once("main")
        .chain(std::iter::repeat_n("walk", 249))
        .collect();
    assert_eq!(deep.len(), 250);
    let t = now_s() - 60;
    seed(
        addr,
        &[
            (
                "agent-n1",
                "n1",
                "trainer",
                vec![
                    (vec!["main", "train_step", "matmul"], 300),
                    (vec!["main", "train_step", "load_batch"], 200),
                    (deep, 50),
                ],
                t,
            ),
            (
                "agent-n2",
                "n2",
                "server",
                vec![
                    (vec![PY_MAIN, HANDLE, PARSE], 300),
                    (vec![PY_MAIN, LOAD_CONFIG, PARSE], 100),
                    (vec![PY_MAIN, HANDLE, "sys_read_[k]"], 50),
                ],
                t,
            ),
        ],
    );
}

fn screenshot(page: &mut Chromium, dir: &Path, name: &str) {
    let shot = dir.join(format!("{name}.png"));
    page.screenshot(&shot);
    println!("screenshot: {}", shot.display());
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
}

/// JavaScript: the drawn frames of the flame graph in `#id` as `{name: {x, w, y, h, kind,
/// bg}}` (the widest box of each name), once it has some.
fn frames(id: &str) -> String {
    format!(
        r##"(() => {{
            const out = {{}};
            for (const b of document.querySelectorAll("#{id} .frame")) {{
                const r = b.getBoundingClientRect();
                const prev = out[b.dataset.name];
                if (prev && prev.w >= r.width) continue;
                out[b.dataset.name] = {{ x: r.left, w: r.width, y: r.top, h: r.height,
                    kind: b.dataset.kind, bg: getComputedStyle(b).backgroundColor,
                    match: b.classList.contains("match"), context: b.classList.contains("context") }};
            }}
            return Object.keys(out).length ? out : null;
        }})()"##
    )
}

fn width(f: &Value, name: &str) -> f64 {
    f[name]["w"]
        .as_f64()
        .unwrap_or_else(|| panic!("no frame {name} drawn: {f}"))
}

/// The centre of a drawn frame, for real pointer input.
fn centre(f: &Value, name: &str) -> (f64, f64) {
    let x = f[name]["x"].as_f64().unwrap() + width(f, name) / 2.0;
    let y = f[name]["y"].as_f64().unwrap() + f[name]["h"].as_f64().unwrap() / 2.0;
    (x, y)
}

fn close(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance
}

fn url_param(page: &mut Chromium, name: &str) -> Value {
    page.eval(&format!(
        r##"new URLSearchParams(location.search).get("{name}")"##
    ))
}

#[test]
fn flame_graph_stays_readable_with_a_deep_stack_zooms_searches_and_picks_labels_sqlite() {
    flame_graph_stays_readable_with_a_deep_stack_zooms_searches_and_picks_labels(Kind::Sqlite);
}

#[test]
fn flame_graph_stays_readable_with_a_deep_stack_zooms_searches_and_picks_labels_clickhouse() {
    flame_graph_stays_readable_with_a_deep_stack_zooms_searches_and_picks_labels(Kind::ClickHouse);
}

fn flame_graph_stays_readable_with_a_deep_stack_zooms_searches_and_picks_labels(kind: Kind) {
    let dir = scratch("flame", kind);
    let collector = Collector::start(&dir.join("data"), kind);
    seed_profiles(collector.addr);
    let mut page = Chromium::launch(&format!("http://{}/", collector.addr), &dir, WIDTH, HEIGHT);

    let f = page.wait_for(
        "the flame graph with both processes",
        &format!(
            r##"(() => {{ const f = {}; return f && f.trainer && f.server && f.walk ? f : null; }})()"##,
            frames("flame")
        ),
    );
    screenshot(&mut page, &dir, "flame");
    // The deep stack does not shrink the graph: the root spans the viewport and the shallow
    // frames keep their shares of it (550, 300 and 450 of 1000 samples).
    let viewport = page.eval(
        r##"(() => { const v = document.querySelector("#flame .fg-viewport");
            return { w: v.clientWidth, h: v.clientHeight, scroll: v.scrollHeight }; })()"##,
    );
    let full = viewport["w"].as_f64().unwrap();
    assert!(full > 1000.0, "{viewport}");
    assert!(close(width(&f, "all"), full, 1.0), "{f}");
    for (name, share) in [("trainer", 0.55), ("matmul", 0.30), ("server", 0.45)] {
        let w = width(&f, name);
        assert!(close(w / full, share, 0.005), "{name}: {w} of {full}");
    }
    // Fixed row height: the 250th frame of the deep stack sits 252 rows down (below "all"
    // and the process), past the bottom of the viewport, which scrolls instead.
    for name in ["all", "trainer", "matmul", "walk"] {
        assert!(close(f[name]["h"].as_f64().unwrap(), 17.0, 0.5), "{f}");
    }
    let deepest = page.eval(
        r##"Math.max(...[...document.querySelectorAll("#flame .frame")].map(b => parseFloat(b.style.top)))"##,
    );
    assert_eq!(deepest.as_f64().unwrap(), 251.0 * 18.0);
    assert!(
        viewport["scroll"].as_f64().unwrap() >= 252.0 * 18.0
            && viewport["h"].as_f64().unwrap() < 900.0,
        "{viewport}"
    );
    // Colours by frame kind, with a legend.
    for (name, kind) in [
        ("trainer", "process"),
        ("matmul", "native"),
        (PARSE, "python"),
        ("sys_read_[k]", "kernel"),
    ] {
        assert_eq!(f[name]["kind"], kind, "{name}: {f}");
    }
    assert_ne!(f["matmul"]["bg"], f[PARSE]["bg"]);
    assert_eq!(
        page.eval(r##"document.getElementById("legend").textContent"##),
        "Pythonnativekernelprocess"
    );

    // A tooltip with total, self and percent under the pointer.
    let (x, y) = centre(&f, "matmul");
    page.hover(x, y);
    let tip = page.wait_for(
        "the tooltip",
        r##"(() => { const t = document.getElementById("tooltip"); return t.hidden ? null : t.innerText; })()"##,
    );
    let tip = tip.as_str().unwrap();
    for want in [
        "matmul",
        "total 300 (30.00 %)",
        "self 300 (30.00 %)",
        "kind native",
    ] {
        assert!(tip.contains(want), "{want} not in {tip}");
    }

    // A click zooms: train_step spans the width, its children keep their split, the other
    // process is not drawn, and breadcrumbs lead back out.
    let (x, y) = centre(&f, "train_step");
    page.click_at(x, y);
    let z = page.wait_for(
        "the zoomed graph",
        &format!(
            r##"(() => {{ const f = {}; return f && !f.server ? f : null; }})()"##,
            frames("flame")
        ),
    );
    assert!(close(width(&z, "train_step"), full, 1.0), "{z}");
    assert!(close(width(&z, "matmul") / full, 0.6, 0.005), "{z}");
    assert_eq!(z["trainer"]["context"], true, "{z}");
    let crumbs =
        page.eval(r##"[...document.querySelectorAll("#flame .crumb")].map(c => c.textContent)"##);
    assert_eq!(crumbs, json!(["all", "trainer", "main", "train_step"]));
    screenshot(&mut page, &dir, "flame-zoomed");
    page.eval(r##"document.querySelector("#flame .crumb").click()"##);
    let back = page.wait_for(
        "the graph zoomed out by its breadcrumb",
        &format!(
            r##"(() => {{ const f = {}; return f && f.server ? f : null; }})()"##,
            frames("flame")
        ),
    );
    assert!(close(width(&back, "trainer") / full, 0.55, 0.005), "{back}");

    // Search highlights the matching frames and says their share of the total.
    page.eval(
        r##"(() => { const s = document.getElementById("search");
            s.value = "matmul|load_batch"; s.dispatchEvent(new Event("input")); })()"##,
    );
    let s = page.wait_for("search matches", &frames("flame"));
    assert_eq!(s["matmul"]["match"], true);
    assert_eq!(s["load_batch"]["match"], true);
    assert_eq!(s["train_step"]["match"], false);
    assert_eq!(
        page.eval(r##"document.getElementById("match-share").textContent"##),
        "2 frames match, 50.00 % of the total (500)"
    );
    assert_eq!(url_param(&mut page, "search"), "matmul|load_batch");
    screenshot(&mut page, &dir, "flame-search");

    // The node picker narrows the query, the graph and the URL to one node.
    page.eval(
        r##"(() => { const s = document.getElementById("search");
            s.value = ""; s.dispatchEvent(new Event("input")); })()"##,
    );
    let nodes = page.wait_for(
        "the node picker",
        r##"(() => { const v = [...document.querySelectorAll('#label-list details[data-label="node"] li.value')]
            .map(l => l.textContent); return v.length ? v : null; })()"##,
    );
    assert_eq!(nodes, json!(["n1", "n2"]));
    let labels = page.eval(
        r##"[...document.querySelectorAll("#label-list details")].map(d => d.dataset.label)"##,
    );
    assert_eq!(labels, json!(["comm", "node"]));
    page.eval(
        r##"[...document.querySelectorAll('#label-list details[data-label="node"] li.value')]
            .find(l => l.textContent === "n2").click()"##,
    );
    let n2 = page.wait_for(
        "n2's flame graph",
        &format!(
            r##"(() => {{ const f = {}; return f && !f.trainer ? f : null; }})()"##,
            frames("flame")
        ),
    );
    assert!(close(width(&n2, "server"), full, 1.0), "{n2}");
    assert!(
        close(width(&n2, HANDLE) / full, 350.0 / 450.0, 0.005),
        "{n2}"
    );
    assert_eq!(
        page.eval(r##"document.getElementById("query").value"##),
        r#"{node="n2"}"#
    );
    assert_eq!(url_param(&mut page, "query"), r#"{node="n2"}"#);
    // The pointer still rests where train_step was: a redrawn graph drops the old tooltip
    // (the browser may show the frame now under the pointer, never the one that is gone).
    assert_eq!(
        page.eval(
            r##"(() => { const t = document.getElementById("tooltip");
                return t.hidden || !t.innerText.startsWith("train_step"); })()"##
        ),
        true
    );
    assert_eq!(
        page.eval(r##"document.querySelector('#label-list li.value.on').textContent"##),
        "n2"
    );
    screenshot(&mut page, &dir, "labels");
}

#[test]
fn table_sorts_and_filters_and_the_sandwich_lists_known_callers_sqlite() {
    table_sorts_and_filters_and_the_sandwich_lists_known_callers(Kind::Sqlite);
}

#[test]
fn table_sorts_and_filters_and_the_sandwich_lists_known_callers_clickhouse() {
    table_sorts_and_filters_and_the_sandwich_lists_known_callers(Kind::ClickHouse);
}

fn table_sorts_and_filters_and_the_sandwich_lists_known_callers(kind: Kind) {
    let dir = scratch("table", kind);
    let collector = Collector::start(&dir.join("data"), kind);
    seed_profiles(collector.addr);
    let mut page = Chromium::launch(
        &format!("http://{}/?view=table", collector.addr),
        &dir,
        WIDTH,
        HEIGHT,
    );
    let rows_js = r##"(() => { const r = [...document.querySelectorAll("#functions tbody tr")]
        .map(tr => [...tr.cells].map(c => c.textContent)); return r.length ? r : null; })()"##;
    let rows = page.wait_for("the function table", rows_js);
    // By self, largest first: parse (400), matmul (300); totals count recursion once.
    assert_eq!(rows[0], json!([PARSE, "400 40.00 %", "400 40.00 %"]));
    assert_eq!(rows[1][0], "matmul");
    let walk = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r[0] == "walk")
        .unwrap();
    assert_eq!(walk, &json!(["walk", "50 5.00 %", "50 5.00 %"]));
    screenshot(&mut page, &dir, "table");
    // Sorted by total: trainer's main (550), train_step (500), the Python module (450).
    page.eval(r##"document.querySelector('#functions th[data-sort="total"]').click()"##);
    let rows = page.eval(rows_js);
    assert_eq!(
        [&rows[0][0], &rows[1][0], &rows[2][0]],
        ["main", "train_step", PY_MAIN]
    );
    // Filtered, ignoring case, and still sorted by total.
    page.eval(
        r##"(() => { const f = document.getElementById("filter");
            f.value = "LOAD_"; f.dispatchEvent(new Event("input")); })()"##,
    );
    let rows = page.eval(rows_js);
    let names: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r[0].as_str().unwrap())
        .collect();
    assert_eq!(names, ["load_batch", LOAD_CONFIG]);
    page.eval(
        r##"(() => { const f = document.getElementById("filter");
            f.value = ""; f.dispatchEvent(new Event("input")); })()"##,
    );

    // Choosing parse shows its sandwich: its known callers and no callees.
    page.eval(&format!(
        r##"[...document.querySelectorAll("#functions tbody tr")].find(tr => tr.cells[0].textContent === "{PARSE}").click()"##
    ));
    let callers = page.wait_for("the callers graph", &frames("callers"));
    let callees = page.wait_for("the callees graph", &frames("callees"));
    let mut names: Vec<&str> = callers
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    names.sort();
    assert_eq!(
        names,
        [PY_MAIN, HANDLE, LOAD_CONFIG, PARSE, "server"],
        "{callers}"
    );
    // The callers graph is inverted: parse at the bottom, its direct callers right above it
    // with 300:100 of its width.
    let root_y = callers[PARSE]["y"].as_f64().unwrap();
    for caller in [HANDLE, LOAD_CONFIG] {
        assert!(
            close(callers[caller]["y"].as_f64().unwrap(), root_y - 18.0, 0.5),
            "{callers}"
        );
    }
    let w = width(&callers, PARSE);
    assert!(close(width(&callers, HANDLE) / w, 0.75, 0.005), "{callers}");
    assert!(
        close(width(&callers, LOAD_CONFIG) / w, 0.25, 0.005),
        "{callers}"
    );
    assert_eq!(
        callees.as_object().unwrap().keys().collect::<Vec<_>>(),
        [PARSE]
    );
    assert!(
        page.eval(r##"document.getElementById("sandwich-title").textContent"##)
            .as_str()
            .unwrap()
            .starts_with(&format!("{PARSE}: total 400 (40.00 %), self 400 (40.00 %)")),
    );
    assert_eq!(url_param(&mut page, "view"), "sandwich");
    assert_eq!(url_param(&mut page, "fn"), PARSE);
    screenshot(&mut page, &dir, "sandwich");

    // The URL is the state: reloading it opens the same sandwich; handle_request's callees
    // are parse and the kernel read.
    let url = page.eval(&format!(
        r##"(() => {{ const u = new URL(location.href); u.searchParams.set("fn", {});
            return u.toString(); }})()"##,
        json!(HANDLE)
    ));
    page.navigate(url.as_str().unwrap());
    let callees = page.wait_for(
        "handle_request's callees after loading the URL",
        &format!(
            r##"(() => {{ const f = {}; return f && f["{HANDLE}"] ? f : null; }})()"##,
            frames("callees")
        ),
    );
    let w = width(&callees, HANDLE);
    assert!(
        close(width(&callees, PARSE) / w, 300.0 / 350.0, 0.005),
        "{callees}"
    );
    assert!(
        close(width(&callees, "sys_read_[k]") / w, 50.0 / 350.0, 0.005),
        "{callees}"
    );
    assert_eq!(page.eval(r##"document.body.className"##), "view-sandwich");
}

#[test]
fn brushing_the_chart_selects_the_flame_graphs_range_and_splits_by_label_sqlite() {
    brushing_the_chart_selects_the_flame_graphs_range_and_splits_by_label(Kind::Sqlite);
}

#[test]
fn brushing_the_chart_selects_the_flame_graphs_range_and_splits_by_label_clickhouse() {
    brushing_the_chart_selects_the_flame_graphs_range_and_splits_by_label(Kind::ClickHouse);
}

fn brushing_the_chart_selects_the_flame_graphs_range_and_splits_by_label(kind: Kind) {
    let dir = scratch("chart", kind);
    let collector = Collector::start(&dir.join("data"), kind);
    let now = now_s();
    seed(
        collector.addr,
        &[
            (
                "agent-n1",
                "n1",
                "app",
                vec![(vec!["main", "early"], 100)],
                now - 3000,
            ),
            (
                "agent-n1",
                "n1",
                "app",
                vec![(vec!["main", "late"], 100)],
                now - 300,
            ),
            (
                "agent-n2",
                "n2",
                "app",
                vec![(vec!["main", "late"], 50)],
                now - 300,
            ),
        ],
    );
    let mut page = Chromium::launch(
        &format!("http://{}/?by=node", collector.addr),
        &dir,
        WIDTH,
        HEIGHT,
    );
    let f = page.wait_for(
        "the flame graph of the hour",
        &format!(
            r##"(() => {{ const f = {}; return f && f.early && f.late ? f : null; }})()"##,
            frames("flame")
        ),
    );
    assert!(width(&f, "late") > width(&f, "early"), "{f}");
    // Split by node: one series per node, each with its samples at its times.
    let series = page.wait_for(
        "the chart split by node",
        r##"chart && chart.series.length === 3 && document.querySelector("#chart .u-over")
            ? chart.series.slice(1).map((s, i) => [s.label, chart.data[i + 1].reduce((a, b) => a + b, 0)]) : null"##,
    );
    assert_eq!(series, json!([["n1", 200], ["n2", 50]]));
    screenshot(&mut page, &dir, "chart");

    // Brush the last quarter of the hour (real pointer drag on the plot): the flame graph
    // shows only what ran then, and the URL holds the absolute range.
    let over = page.eval(
        r##"(() => { const r = document.querySelector("#chart .u-over").getBoundingClientRect();
            return [r.left, r.top, r.width, r.height]; })()"##,
    );
    let [left, top, w, h] = [0, 1, 2, 3].map(|i| over[i].as_f64().unwrap());
    page.drag(
        (left + w * 0.75, top + h / 2.0),
        (left + w - 2.0, top + h / 2.0),
    );
    let f = page.wait_for(
        "the flame graph of the brushed range",
        &format!(
            r##"(() => {{ const f = {}; return f && !f.early ? f : null; }})()"##,
            frames("flame")
        ),
    );
    assert!(f["late"].is_object(), "{f}");
    let from: i64 = url_param(&mut page, "from")
        .as_str()
        .unwrap()
        .parse()
        .expect("an absolute from after brushing");
    let to: i64 = url_param(&mut page, "to")
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (now - 3000 + 10..=now - 300).contains(&from) && to >= now - 300 && to <= now + 120,
        "brushed {from}..{to}, now {now}"
    );
    assert_eq!(
        page.eval(r##"document.getElementById("range").value"##),
        "custom"
    );
    // The chart now spans the brushed range.
    let span = page.wait_for(
        "the chart of the brushed range",
        &format!(
            r##"document.getElementById("chart").dataset.from == {from} && chart.data[0].length"##
        ),
    );
    assert!(span.as_i64().unwrap() > 1, "{span}");
    screenshot(&mut page, &dir, "chart-brushed");

    // Another type keeps the range: CPU time (10 ns a sample), in its unit on the graph and
    // the chart's axis.
    page.eval(
        r##"(() => { const t = document.getElementById("type");
            t.value = "cpu"; t.dispatchEvent(new Event("change")); })()"##,
    );
    let status = page.wait_for(
        "the CPU time flame graph",
        r##"(() => { const s = document.querySelector("#flame .fg-status").textContent;
            return s.includes("µs") ? s : null; })()"##,
    );
    assert_eq!(status, "1.5 µs total");
    assert_eq!(url_param(&mut page, "type"), "cpu");
    assert_eq!(url_param(&mut page, "from"), from.to_string().as_str());
    // uPlot draws tick labels on a canvas: ask the axis for the labels it would draw.
    let ticks = page.wait_for(
        "the chart's axis in CPU time",
        r##"document.getElementById("chart").dataset.unit === "nanoseconds"
            && chart.axes[1].values(chart, [500, 1500, 2e6])"##,
    );
    assert_eq!(ticks, json!(["500 ns", "1.5 µs", "2.0 ms"]));
}

#[test]
fn compare_draws_the_differential_flame_graph_and_tables_sqlite() {
    compare_draws_the_differential_flame_graph_and_tables(Kind::Sqlite);
}

#[test]
fn compare_draws_the_differential_flame_graph_and_tables_clickhouse() {
    compare_draws_the_differential_flame_graph_and_tables(Kind::ClickHouse);
}

fn compare_draws_the_differential_flame_graph_and_tables(kind: Kind) {
    let dir = scratch("compare", kind);
    let collector = Collector::start(&dir.join("data"), kind);
    let now = now_s();
    // n1's split turns from 300:500 an hour and a half ago to 600:200 now.
    seed(
        collector.addr,
        &[
            (
                "agent-n1",
                "n1",
                "trainer",
                vec![
                    (vec!["main", "train_step", "matmul"], 300),
                    (vec!["main", "train_step", "load_batch"], 500),
                ],
                now - 5400,
            ),
            (
                "agent-n1",
                "n1",
                "trainer",
                vec![
                    (vec!["main", "train_step", "matmul"], 600),
                    (vec!["main", "train_step", "load_batch"], 200),
                ],
                now - 60,
            ),
            (
                "agent-n2",
                "n2",
                "server",
                vec![(vec!["main", "handle"], 300)],
                now - 60,
            ),
        ],
    );
    let mut page = Chromium::launch(&format!("http://{}/", collector.addr), &dir, WIDTH, HEIGHT);
    page.wait_for("the flame graph", &frames("flame"));
    page.eval(
        r##"(() => {
            document.querySelector('#tabs button[data-view="compare"]').click();
            document.getElementById("base-query").value = '{node="n1"}';
            document.getElementById("cmp-threshold").value = "5";
            document.getElementById("cmp-run").click(); })()"##,
    );
    assert_eq!(
        page.eval(r##"getComputedStyle(document.querySelector("main")).display"##),
        "none",
        "the profile view stays visible in compare mode"
    );
    let d = page.wait_for(
        "the differential flame graph",
        &format!(
            r##"(() => {{ const f = {}; return f && f.matmul ? f : null; }})()"##,
            frames("diff-flame")
        ),
    );
    // matmul: 37.5 % -> 75 % (drawn at the mean share, 56.25 %), red; load_batch 62.5 % ->
    // 25 %, blue. Code only: the process is not a frame here.
    let full = width(&d, "all");
    assert!(close(width(&d, "matmul") / full, 0.5625, 0.005), "{d}");
    assert!(close(width(&d, "load_batch") / full, 0.4375, 0.005), "{d}");
    assert!(d["trainer"].is_null(), "{d}");
    let rgb = |name: &str| -> Vec<f64> {
        d[name]["bg"]
            .as_str()
            .unwrap()
            .trim_start_matches("rgb(")
            .trim_end_matches(')')
            .split(',')
            .map(|c| c.trim().parse().unwrap())
            .collect()
    };
    let (m, l) = (rgb("matmul"), rgb("load_batch"));
    assert!(m[0] > m[2], "matmul grew but is not red: {m:?}");
    assert!(l[2] > l[0], "load_batch shrank but is not blue: {l:?}");
    let (x, y) = centre(&d, "matmul");
    page.hover(x, y);
    let tip = page.wait_for(
        "the diff tooltip",
        r##"(() => { const t = document.getElementById("tooltip"); return t.hidden ? null : t.innerText; })()"##,
    );
    let tip = tip.as_str().unwrap();
    for want in ["baseline 37.50 %", "candidate 75.00 %", "change +37.50 pts"] {
        assert!(tip.contains(want), "{want} not in {tip}");
    }
    let tables = page.wait_for(
        "the grew/shrank tables",
        r##"(() => {
            const rows = (id) => [...document.querySelectorAll(`#${id} tbody tr`)]
                .map(tr => ({ f: tr.cells[0].textContent, d: tr.cells[3].textContent, reg: tr.className }));
            const g = rows("grew"), s = rows("shrank");
            return g.length && s.length ? { grew: g, shrank: s,
                summary: document.getElementById("cmp-summary").textContent } : null;
        })()"##,
    );
    assert_eq!(tables["grew"][0]["f"], "matmul", "{tables}");
    assert_eq!(tables["grew"][0]["d"], "+37.50", "{tables}");
    assert_eq!(tables["grew"][0]["reg"], "regression", "{tables}");
    assert_eq!(tables["shrank"][0]["f"], "load_batch", "{tables}");
    assert!(
        tables["summary"]
            .as_str()
            .unwrap()
            .contains("Regressions: matmul"),
        "{tables}"
    );
    assert_eq!(url_param(&mut page, "view"), "compare");
    assert_eq!(url_param(&mut page, "base_query"), r#"{node="n1"}"#);
    screenshot(&mut page, &dir, "compare");

    // "vs. previous" fills the compare form from the flame graph view: the selected hour
    // against the hour before it, for the view's query.
    let filled = page.eval(
        r##"(() => {
            document.getElementById("base-from").value = "now-9h";
            document.getElementById("cmp-summary").textContent = "";
            document.querySelector('#tabs button[data-view="flame"]').click();
            document.getElementById("query").value = '{node="n1"}';
            document.getElementById("show").click();
            document.getElementById("vs-earlier").click();
            return ["base-query", "base-from", "base-to", "new-from", "new-to"]
                .map(id => document.getElementById(id).value);
        })()"##,
    );
    assert_eq!(
        filled,
        json!([r#"{node="n1"}"#, "now-2h", "now-1h", "now-1h", "now"])
    );
    let summary = page.wait_for(
        "the compare summary after vs. previous",
        r##"document.getElementById("cmp-summary").textContent"##,
    );
    assert!(
        summary
            .as_str()
            .unwrap()
            .starts_with("baseline 800 samples, candidate 800"),
        "{summary}"
    );
}
