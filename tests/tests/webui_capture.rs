//! The web UI's "Capture…" panel in headless Chromium over a real collector and agent: a
//! capture of the 6:3:1 Python workload, asked from the page (node and pid from the query),
//! drawn as a flame graph whose six/three/one widths keep the split, a dump of the same
//! process from the panel's "Dump" button, and a dump with native frames of a sleeping one.

#[allow(dead_code)]
#[path = "../../collector/tests/chromium/mod.rs"]
mod chromium;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use chromium::Chromium;
use pyrometer_e2e::cluster::{Agent, Collector, enc, free_port, samples_of};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{privileged, scratch};

/// The capture panel's flame graph: the widest box of `six`, `three`, `one`, once drawn.
const WIDTHS: &str = r##"(() => {
    const out = {};
    for (const b of document.querySelectorAll("#cap-flame .frame")) {
        const w = b.getBoundingClientRect().width;
        // Python frames are named `function (file:line)`: one line each, so widths add.
        const name = b.dataset.name.split(" (")[0];
        out[name] = (out[name] || 0) + w;
    }
    const st = document.getElementById("cap-status");
    if (st.className === "failed") return { failed: st.textContent };
    if (!["six", "three", "one"].every(n => out[n])) return null;
    return { six: out.six, three: out.three, one: out.one,
        status: document.getElementById("cap-status").textContent };
})()"##;

#[test]
fn a_capture_and_a_dump_from_the_web_ui() {
    if !privileged() {
        return;
    }
    let dir = scratch("webui-capture");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let mut work = Command::new(pyrometer_e2e::python::pyenv("3.11.7"))
        .arg(pyrometer_e2e::python::source("py631.py"))
        .arg("100000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start py631.py");
    let pid = work.id();
    // Asleep in a system call under a Python function, for the native dump.
    let mut napper = Command::new(pyrometer_e2e::python::pyenv("3.11.7"))
        .args(["-c", "import time\ndef nap():\n    time.sleep(600)\nnap()"])
        .stdout(Stdio::null())
        .spawn()
        .expect("start the napper");
    let mut agent = Agent::start(
        &dir,
        "ui-node",
        &collector.url(),
        &["--pid", &pid.to_string(), "--pid", &napper.id().to_string()],
    );
    wait_until(
        Duration::from_secs(120),
        "the agent's samples of the workload",
        || samples_of(&collector, "ui-node", pid) > 20,
    );
    let query = enc(&format!("{{node=\"ui-node\",pid=\"{pid}\"}}"));
    let mut page = Chromium::launch(
        &format!("{}/?query={query}", collector.url()),
        &dir,
        1400,
        900,
    );
    page.open_capture_panel(
        "the panel with the query's node and pid",
        &format!(
            r#"(document.getElementById("cap-node").value === "ui-node" &&
                document.getElementById("cap-pid").value === "{pid}") ? true : null"#
        ),
    );
    page.eval(
        r#"document.getElementById("cap-duration").value = "3";
           document.getElementById("cap-start").click()"#,
    );
    let v = page.wait_for("the capture's flame graph", WIDTHS);
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("webui-capture");
    std::fs::create_dir_all(&shots).unwrap();
    page.screenshot(&shots.join("capture.png"));
    println!("screenshot: {}", shots.join("capture.png").display());
    assert!(v["failed"].is_null(), "the capture failed: {v}");
    let status = v["status"].as_str().unwrap_or_default();
    assert!(status.starts_with("done: "), "{v}");
    let w = |n: &str| v[n].as_f64().unwrap();
    let all = w("six") + w("three") + w("one");
    for (name, want) in [("six", 0.6), ("three", 0.3), ("one", 0.1)] {
        let got = w(name) / all;
        assert!(
            (got - want).abs() <= 0.05,
            "{name}: {got:.3} of the width, want {want}: {v}"
        );
    }

    page.eval(r#"document.getElementById("cap-dump").click()"#);
    let text = page.wait_for(
        "the dump's text",
        r#"(() => { const t = document.getElementById("cap-dump-text");
            return !t.hidden && t.textContent.includes("unit (") ? t.textContent : null; })()"#,
    );
    assert!(text.as_str().unwrap().contains("py631.py"), "{text}");
    page.screenshot(&shots.join("dump.png"));

    // With "native" ticked, the napper's dump has libc's sleep above nap().
    page.eval(&format!(
        r#"document.getElementById("cap-pid").value = "{}";
           document.getElementById("cap-native").checked = true;
           document.getElementById("cap-dump").click()"#,
        napper.id()
    ));
    let text = page.wait_for(
        "the native dump's text",
        r#"(() => { const t = document.getElementById("cap-dump-text");
            return !t.hidden && t.textContent.includes("nap (") ? t.textContent : null; })()"#,
    );
    let text = text.as_str().unwrap_or_default();
    let (sleep, nap) = (text.find("clock_nanosleep"), text.find("nap ("));
    assert!(
        sleep.is_some() && sleep < nap,
        "no native sleep above nap():\n{text}"
    );
    page.screenshot(&shots.join("dump-native.png"));

    drop(page);
    let _ = agent.stop();
    let _ = work.kill();
    let _ = work.wait();
    let _ = napper.kill();
    let _ = napper.wait();
    drop(collector);
    let _ = std::fs::remove_dir_all(&dir);
}
