//! Traces in the web UI, in real headless Chromium against the real collector binary: a
//! trace's permanent link (`/trace/ID`, for a trace viewer's link patterns) opens the flame
//! graph of that trace's samples only, which names the trace and links back; a trace viewer's
//! link pasted into the trace field opens that trace; a flame graph of no one trace lists the
//! traces in it, largest first, each a click from its own; text without a trace id says so.
//! Samples carry `trace_id` labels as the agent pushes them (pyrometer-otel spans).

// This test drives the page by script, not by pointer: part of the helper goes unused.
#[allow(dead_code)]
mod chromium;
mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chromium::Chromium;
use common::{get, profile_of, push, request};
use pyrometer_proto as pb;
use serde_json::Value;

const TRACE_A: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACE_B: &str = "0af7651916cd43dd8448eb211c80319c";

struct Collector {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(data_dir: &Path) -> Collector {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_pyrometer-collector"))
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--data-dir")
        .arg(data_dir)
        .stdin(Stdio::null())
        .spawn()
        .expect("start pyrometer-collector");
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "collector not up on {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Collector { child, addr }
}

/// A profile of `stack` whose samples carry `trace_id` (and a span id), as the agent pushes
/// the samples of a thread inside a span.
fn traced(stack: &[&str], samples: i64, trace: &str, time_s: i64) -> pb::Profile {
    let mut p = profile_of("svc", &[(stack, samples)], time_s);
    let mut id = |s: &str| {
        p.string_table.push(s.to_string());
        p.string_table.len() as i64 - 1
    };
    let labels = [
        (id("trace_id"), id(trace)),
        (id("span_id"), id(&trace[..16])),
    ];
    for s in &mut p.sample {
        for (key, value) in labels {
            s.label.push(pb::Label {
                key,
                str: value,
                ..Default::default()
            });
        }
    }
    p
}

/// JavaScript: the names of the flame graph's drawn frames, once there are some.
const FRAME_NAMES: &str = r##"(() => { const n = [...document.querySelectorAll("#flame .frame")]
    .map(b => b.dataset.name); return n.length ? [...new Set(n)].sort() : null; })()"##;

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_trace_link_opens_the_traces_flame_graph_and_a_pasted_link_too() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace-ui");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let collector = start(&dir.join("data"));
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        - 60;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let a = traced(&["main", "handle", "parse"], 300, TRACE_A, t);
        let b = traced(&["main", "handle", "render"], 100, TRACE_B, t);
        for (seq, p) in [a, b].into_iter().enumerate() {
            push(
                collector.addr,
                None,
                request("agent", seq as u64 + 1, "n1", p),
            )
            .await
            .expect("push accepted");
        }
        // Not a trace id: a one-line reason, not a page.
        let (status, body) = get(collector.addr, "/trace/not-a-trace").await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("32 hex digits"), "{body}");
    });

    // The permanent link lands on the flame graph of that trace alone.
    let mut page = Chromium::launch(
        &format!("http://{}/trace/{}", collector.addr, TRACE_A.to_uppercase()),
        &dir,
        1400,
        900,
    );
    let drawn = names(&page.wait_for("trace A's flame graph", FRAME_NAMES));
    assert!(drawn.contains(&"parse".to_string()), "{drawn:?}");
    assert!(!drawn.contains(&"render".to_string()), "{drawn:?}");
    let query = page.eval(r##"new URLSearchParams(location.search).get("query")"##);
    assert_eq!(query, format!("{{trace_id=\"{TRACE_A}\"}}"));
    // ... which names its trace and links back to it.
    let info = page.eval(
        r##"[document.getElementById("trace-info").hidden,
            document.getElementById("trace-id").textContent,
            document.getElementById("trace-link").getAttribute("href")]"##,
    );
    assert_eq!(
        info,
        serde_json::json!([false, TRACE_A, format!("/trace/{TRACE_A}")])
    );
    let shot = dir.join("trace.png");
    page.screenshot(&shot);
    println!("screenshot: {}", shot.display());

    // A trace viewer's link pasted in the trace field opens that trace.
    page.eval(&format!(
        r##"(() => {{ const f = document.getElementById("trace-open");
            f.value = "http://jaeger:16686/trace/{TRACE_B}?uiFind=x";
            f.dispatchEvent(new KeyboardEvent("keydown", {{ key: "Enter" }})); }})()"##
    ));
    let drawn = names(&page.wait_for(
        "trace B's flame graph",
        r##"(() => { const n = [...document.querySelectorAll("#flame .frame")].map(b => b.dataset.name);
            return n.includes("render") ? [...new Set(n)].sort() : null; })()"##,
    ));
    assert!(!drawn.contains(&"parse".to_string()), "{drawn:?}");
    assert_eq!(
        page.eval(r##"document.getElementById("trace-id").textContent"##),
        TRACE_B
    );

    // A flame graph of no one trace lists the traces in it, largest first; a click on one
    // opens its flame graph.
    page.navigate(&format!(
        "http://{}/?view=flame&from=now-1h",
        collector.addr
    ));
    let listed = page.wait_for(
        "the traces listed under the flame graph",
        r##"(() => { const l = document.getElementById("trace-list");
            const ids = [...l.querySelectorAll("a.trace")].map(a => a.dataset.trace);
            return !l.hidden && ids.length ? ids : null; })()"##,
    );
    assert_eq!(listed, serde_json::json!([TRACE_A, TRACE_B]));
    page.eval(&format!(
        r##"document.querySelector('#trace-list a[data-trace="{TRACE_B}"]').click()"##
    ));
    page.wait_for(
        "trace B's flame graph from the list",
        &format!(
            r##"(() => document.getElementById("trace-id").textContent === "{TRACE_B}"
                && !document.getElementById("trace-info").hidden
                && document.getElementById("trace-list").hidden ? true : null)()"##
        ),
    );
    let drawn = names(&page.wait_for(
        "trace B's frames",
        r##"(() => { const n = [...document.querySelectorAll("#flame .frame")].map(b => b.dataset.name);
            return n.includes("render") && !n.includes("parse") ? [...new Set(n)].sort() : null; })()"##,
    ));
    assert!(drawn.contains(&"render".to_string()), "{drawn:?}");

    // Text without a trace id says so, and changes nothing.
    page.eval(
        r##"(() => { const f = document.getElementById("trace-open"); f.value = "abc";
            f.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter" })); })()"##,
    );
    let error = page.eval(r##"document.getElementById("error").textContent"##);
    assert!(error.as_str().unwrap().contains("no trace id"), "{error}");
}
