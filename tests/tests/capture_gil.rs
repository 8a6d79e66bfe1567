//! `pyrometer capture --gil` through the collector: an agent started with `--gil` puts the
//! GIL probes on a captured process for the capture's duration; the result carries the GIL
//! table `record --gil` prints and the `gil_wait` type, and a second capture measures from
//! its own start; the web UI's panel shows the table. An agent without `--gil` refuses in one
//! line.

#[allow(dead_code)]
#[path = "../../collector/tests/chromium/mod.rs"]
mod chromium;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use chromium::Chromium;
use pyrometer_e2e::captures::{Killed, one_line_failure};
use pyrometer_e2e::cluster::{Agent, Collector, enc, free_port, samples_of};
use pyrometer_e2e::gil_table::table;
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{
    assert_ok, pprof_samples, pprof_type, privileged, pyrometer, read_pprof, scratch, stderr,
};

/// Four CPU-bound threads sharing the GIL (fixtures/gil_threads.py), for two minutes.
fn four_spinners() -> Killed {
    let python = pyrometer_e2e::python::pyenv("3.11.7");
    Killed(
        Command::new(python)
            .arg(pyrometer_e2e::python::source("gil_threads.py"))
            .args(["cpu4", "120"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start gil_threads.py"),
    )
}

fn capture_gil(url: &str, node: &str, pid: u32, out: &std::path::Path) -> std::process::Output {
    pyrometer(&[
        "capture",
        "--collector",
        url,
        "--node",
        node,
        "--pid",
        &pid.to_string(),
        "--gil",
        "--duration",
        "3s",
        "-F",
        "199",
        "-o",
        out.to_str().unwrap(),
    ])
}

#[test]
fn a_gil_capture_shows_the_processes_gil_table_and_waits() {
    if !privileged() {
        return;
    }
    let dir = scratch("capture-gil");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let url = collector.url();
    let work = four_spinners();
    let pid = work.0.id();
    let pid_arg = pid.to_string();
    let _gil = Agent::start(&dir, "node-g", &url, &["--gil", "--pid", &pid_arg]);
    let _plain = Agent::start(&dir, "node-p", &url, &["--pid", &pid_arg]);
    wait_until(
        Duration::from_secs(120),
        "both agents' always-on samples of the spinners",
        || samples_of(&collector, "node-g", pid) > 20 && samples_of(&collector, "node-p", pid) > 20,
    );

    for round in 0..2 {
        let out_file = dir.join(format!("gil-{round}.pb.gz"));
        let out = capture_gil(&url, "node-g", pid, &out_file);
        assert_ok(&out);
        let err = stderr(&out);
        assert!(
            err.contains("pyrometer: node node-g: GIL over"),
            "no GIL table:\n{err}"
        );
        println!("round {round}:\n{err}");
        let rows = table(&err);
        for k in 0..4 {
            let name = format!("spinner-{k}");
            let r = rows
                .get(&name)
                .unwrap_or_else(|| panic!("round {round}: no {name} in the table:\n{err}"));
            // Measured from the capture's own start: a thread's time is within the 3 s
            // capture, not the minutes the process has run (nor a sum over both captures).
            assert!(
                r.time > 0.5 && r.time <= 3.5,
                "round {round}: {name}'s time {:.2} s in a 3 s capture:\n{err}",
                r.time
            );
            // Four threads share one GIL: each holds it a fair part of its time and waits
            // for it much of the rest (the bounds of `record --gil`'s test, widened for the
            // preemption the capture does not measure).
            assert!(
                (5.0..=50.0).contains(&r.holds) && r.holds + r.waits >= 50.0,
                "round {round}: {name} holds {:.1} % and waits {:.1} %:\n{err}",
                r.holds,
                r.waits
            );
        }
        // The contended waits by their stacks: under spin().
        let p = read_pprof(&out_file);
        let wait = pprof_type(&p, "gil_wait");
        let (mut all, mut in_spin) = (0i64, 0i64);
        for s in pprof_samples(&p) {
            all += s.values[wait];
            if s.functions.iter().any(|f| f.starts_with("spin")) {
                in_spin += s.values[wait];
            }
        }
        assert!(
            all > 500_000_000 && in_spin as f64 >= 0.8 * all as f64,
            "round {round}: {in_spin} of {all} ns of GIL wait under spin()"
        );
    }

    // The same from the web UI's capture panel, with its GIL box ticked: the table under the
    // flame graph.
    let query = enc(&format!("{{node=\"node-g\",pid=\"{pid}\"}}"));
    let mut page = Chromium::launch(&format!("{url}/?query={query}"), &dir, 1400, 1000);
    page.open_capture_panel(
        "the panel with the query's node and pid",
        &format!(r#"document.getElementById("cap-pid").value === "{pid}" ? true : null"#),
    );
    page.eval(
        r#"document.getElementById("cap-duration").value = "3";
           document.getElementById("cap-hz").value = "199";
           document.getElementById("cap-gil").checked = true;
           document.getElementById("cap-start").click()"#,
    );
    let shown = page.wait_for(
        "the GIL table under the capture's flame graph",
        r#"(() => { const st = document.getElementById("cap-status");
            if (st.className === "failed") return "failed: " + st.textContent;
            const t = document.getElementById("cap-dump-text");
            return !t.hidden && t.textContent.includes("GIL over") ? t.textContent : null; })()"#,
    );
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("capture-gil");
    std::fs::create_dir_all(&shots).unwrap();
    page.screenshot(&shots.join("gil.png"));
    println!("screenshot: {}", shots.join("gil.png").display());
    let shown = shown.as_str().unwrap_or_default().to_string();
    let rows = table(&format!("pyrometer: {shown}"));
    assert!(
        (0..4).all(|k| rows.contains_key(&format!("spinner-{k}"))),
        "the page's GIL table:\n{shown}"
    );
    drop(page);

    // The same process through an agent that runs without the GIL probes: one line, exit 3
    // (what the node can do, as a feature the kernel refused).
    let out = capture_gil(&url, "node-p", pid, &dir.join("refused.pb.gz"));
    one_line_failure(
        &out,
        3,
        "the agent of node 'node-p' runs without the GIL probes (start it with --gil",
    );
    drop(work);
}
