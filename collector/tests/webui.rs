//! The web UI in real headless Chromium against the real `pyrometer-collector` binary, fed
//! synthetic batches over gRPC: node list, flame graph per query, inferno's click-to-zoom and
//! the compare view's differential flame graph and tables. Screenshots land in
//! target/tmp/webui-<store>/ (paths printed) for a human to look at. Runs against both stores.

mod chromium;
mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chromium::Chromium;
use common::clickhouse_server::ClickHouse;
use common::{Kind, profile_of, push, request};
use serde_json::Value;

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

fn scratch(kind: Kind) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("webui-{kind:?}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Two nodes with distinct processes and stacks; n1 also an hour and a half ago, with its
/// time split the other way, for the compare view's default baseline (2 h to 1 h ago).
fn seed(addr: SocketAddr) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let batches = [
        (
            "agent-n1",
            1,
            "n1",
            profile_of(
                "trainer",
                &[
                    (&["main", "train_step", "matmul"], 300),
                    (&["main", "train_step", "load_batch"], 500),
                ],
                now - 5400,
            ),
        ),
        (
            "agent-n1",
            2,
            "n1",
            profile_of(
                "trainer",
                &[
                    (&["main", "train_step", "matmul"], 600),
                    (&["main", "train_step", "load_batch"], 200),
                ],
                now - 60,
            ),
        ),
        (
            "agent-n2",
            1,
            "n2",
            profile_of(
                "server",
                &[
                    (&["main", "handle", "parse_json"], 300),
                    (&["main", "handle", "render"], 100),
                ],
                now - 60,
            ),
        ),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for (agent, seq, node, p) in batches {
            push(addr, None, request(agent, seq, node, p))
                .await
                .expect("push accepted");
        }
    });
}

/// JavaScript: the `<title>`s of an `<object>`'s flame graph frames, once it has loaded.
fn frames_of(object_id: &str) -> String {
    format!(
        r##"(() => {{
            const d = document.getElementById("{object_id}").contentDocument;
            const g = d && d.querySelectorAll("#frames > g");
            return g && g.length ? [...g].map(f => f.querySelector("title").textContent) : null;
        }})()"##
    )
}

fn titles(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

fn has_frame(titles: &[String], name: &str) -> bool {
    titles.iter().any(|t| t.starts_with(&format!("{name} (")))
}

#[test]
fn web_ui_lists_nodes_draws_zooms_and_compares_sqlite() {
    web_ui_lists_nodes_draws_zooms_and_compares(Kind::Sqlite);
}

#[test]
fn web_ui_lists_nodes_draws_zooms_and_compares_clickhouse() {
    web_ui_lists_nodes_draws_zooms_and_compares(Kind::ClickHouse);
}

fn web_ui_lists_nodes_draws_zooms_and_compares(kind: Kind) {
    let dir = scratch(kind);
    let collector = Collector::start(&dir.join("data"), kind);
    seed(collector.addr);
    let mut page = Chromium::launch(&format!("http://{}/", collector.addr), &dir, 1400, 1000);

    let nodes = page.wait_for(
        "the node list",
        r##"(() => { const n = [...document.querySelectorAll("#nodes li.node")].map(l => l.textContent);
                    return n.length ? n : null; })()"##,
    );
    assert_eq!(nodes, serde_json::json!(["n1", "n2"]));
    let all = titles(&page.wait_for("the flame graph", &frames_of("flame")));
    assert!(
        has_frame(&all, "matmul") && has_frame(&all, "parse_json"),
        "{all:?}"
    );

    // A click on a node narrows the query to it, and the graph to its processes.
    page.eval(r##"[...document.querySelectorAll("#nodes li.node")].find(l => l.textContent === "n1").click()"##);
    let n1 = titles(&page.wait_for(
        "n1's flame graph",
        &format!(
            r##"(() => {{ const t = {};
                return t && !t.some(x => x.startsWith("parse_json")) ? t : null; }})()"##,
            frames_of("flame")
        ),
    ));
    assert!(
        has_frame(&n1, "trainer") && has_frame(&n1, "load_batch"),
        "{n1:?}"
    );
    assert_eq!(
        page.eval(r##"document.getElementById("query").value"##),
        r##"{node="n1"}"##
    );
    let top = page.wait_for(
        "the top table",
        r##"document.querySelector("#top tbody tr td")?.textContent"##,
    );
    assert_eq!(top, "matmul");
    let shot = dir.join("flame.png");
    page.screenshot(&shot);
    println!("screenshot: {}", shot.display());
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );

    // inferno's script zooms on click: the frame spans the width, unrelated frames hide.
    let zoomed = page.eval(
        r##"(() => {
            const d = document.getElementById("flame").contentDocument;
            const frame = (name) => [...d.querySelectorAll("#frames > g")]
                .find(g => g.querySelector("title").textContent.startsWith(name + " ("));
            const load = frame("load_batch");
            const before = parseFloat(load.querySelector("rect").getAttribute("width"));
            load.querySelector("rect").dispatchEvent(new d.defaultView.MouseEvent("click", { bubbles: true }));
            return {
                before,
                after: parseFloat(load.querySelector("rect").getAttribute("width")),
                sibling_hidden: frame("matmul").classList.contains("hide"),
                parent_marked: frame("train_step").classList.contains("parent"),
                unzoom_shown: !d.getElementById("unzoom").classList.contains("hide"),
            };
        })()"##,
    );
    let before = zoomed["before"].as_f64().unwrap();
    assert!((20.0..30.0).contains(&before), "{zoomed}");
    assert!(zoomed["after"].as_f64().unwrap() > 99.0, "{zoomed}");
    assert_eq!(zoomed["sibling_hidden"], true, "{zoomed}");
    assert_eq!(zoomed["parent_marked"], true, "{zoomed}");
    assert_eq!(zoomed["unzoom_shown"], true, "{zoomed}");
    let shot = dir.join("flame-zoomed.png");
    page.screenshot(&shot);
    println!("screenshot: {}", shot.display());

    // Compare: n1 now against n1 an hour before (the form's default ranges).
    page.eval(
        r##"document.getElementById("tab-compare").click();
           document.getElementById("base-query").value = '{node="n1"}';
           document.getElementById("cmp-threshold").value = "5";
           document.getElementById("cmp-run").click();"##,
    );
    assert_eq!(
        page.eval(r##"getComputedStyle(document.querySelector("main")).display"##),
        "none",
        "the profile view stays visible in compare mode"
    );
    let diff = titles(&page.wait_for("the differential flame graph", &frames_of("diff-flame")));
    // matmul: 37.5 % -> 75 %; load_batch 62.5 % -> 25 %.
    assert!(
        diff.iter()
            .any(|t| t.starts_with("matmul (") && t.contains("+37.50%")),
        "{diff:?}"
    );
    assert!(
        diff.iter()
            .any(|t| t.starts_with("load_batch (") && t.contains("-37.50%")),
        "{diff:?}"
    );
    let colours = page.eval(
        r##"(() => {
            const d = document.getElementById("diff-flame").contentDocument;
            const fill = (name) => [...d.querySelectorAll("#frames > g")]
                .find(g => g.querySelector("title").textContent.startsWith(name + " ("))
                .querySelector("rect").getAttribute("fill").match(/\d+/g).map(Number);
            return { matmul: fill("matmul"), load_batch: fill("load_batch") };
        })()"##,
    );
    let rgb = |k: &str| -> Vec<i64> {
        colours[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_i64().unwrap())
            .collect()
    };
    let (m, l) = (rgb("matmul"), rgb("load_batch"));
    assert!(m[0] > m[2], "matmul grew but is not red: {m:?}");
    assert!(l[2] > l[0], "load_batch shrank but is not blue: {l:?}");
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
    let shot = dir.join("compare.png");
    page.screenshot(&shot);
    println!("screenshot: {}", shot.display());

    // "vs. previous" fills the compare form from the flame graph view: the selected hour
    // against the hour before it, for the view's query.
    let filled = page.eval(
        r##"(() => {
            document.getElementById("base-from").value = "now-9h";
            document.getElementById("cmp-summary").textContent = "";
            document.getElementById("tab-profile").click();
            document.getElementById("vs-earlier").click();
            return ["base-query", "base-from", "base-to", "new-from", "new-to"]
                .map(id => document.getElementById(id).value);
        })()"##,
    );
    assert_eq!(
        filled,
        serde_json::json!([r#"{node="n1"}"#, "now-2h", "now-1h", "now-1h", "now"])
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
