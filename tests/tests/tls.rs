//! TLS between agents and the collector, with a CA and a server certificate made by openssl
//! for the test: the agent that trusts the CA pushes, one that does not keeps its batches
//! spooled, and plain-text clients are turned away while the collector keeps serving.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pyrometer_e2e::cluster::{Agent, collector_bin, free_port, http_get, workload};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{certs, privileged, pyrometer, scratch, stderr};

/// A CA, and a certificate it signed for 127.0.0.1 and localhost.
fn make_certs(dir: &Path) {
    certs::ca(dir, "ca");
    certs::sign(dir, "server", "localhost", "ca", certs::SERVER);
}

/// GET over HTTPS trusting only the test CA; None when the request fails.
fn https_get(dir: &Path, port: u16, path: &str) -> Option<String> {
    https_get_as(dir, port, path, None)
}

/// [`https_get`] presenting the client certificate `NAME.pem` of `dir`, when given.
fn https_get_as(dir: &Path, port: u16, path: &str, cert: Option<&str>) -> Option<String> {
    let mut curl = Command::new("curl");
    curl.args(["-sf", "--max-time", "5", "--cacert"])
        .arg(dir.join("ca.pem"));
    if let Some(name) = cert {
        curl.arg("--cert")
            .arg(dir.join(format!("{name}.pem")))
            .arg("--key")
            .arg(dir.join(format!("{name}.key")));
    }
    let out = curl
        .arg(format!("https://127.0.0.1:{port}{path}"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The collector serving HTTPS on `port` with the certificate of [`make_certs`], asking
/// agents for client certificates the test CA signed when `client_ca`.
fn serve_tls(dir: &Path, port: u16, client_ca: bool) -> Server {
    let mut cmd = Command::new(collector_bin());
    cmd.args(["--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(dir.join("store"))
        .arg("--tls-cert")
        .arg(dir.join("server.pem"))
        .arg("--tls-key")
        .arg(dir.join("server.key"));
    if client_ca {
        cmd.arg("--client-ca").arg(dir.join("ca.pem"));
    }
    Server(
        cmd.stdin(Stdio::null())
            .spawn()
            .expect("start pyrometer-collector"),
    )
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[test]
fn tls_push_needs_the_ca_and_plain_text_is_refused() {
    if !privileged() {
        return;
    }
    let dir = scratch("tls");
    make_certs(&dir);
    let port = free_port();
    let _collector = serve_tls(&dir, port, false);
    wait_until(
        Duration::from_secs(30),
        "the collector serving HTTPS",
        || https_get(&dir, port, "/metrics").is_some(),
    );
    // Plain HTTP on the TLS port gets no answer, and the collector goes on serving.
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    assert_eq!(http_get(addr, "/metrics").map(|r| r.0), None);
    assert!(https_get(&dir, port, "/metrics").is_some());

    let mut load = workload(&dir, "tls-wl", 30);
    let url = format!("https://127.0.0.1:{port}");
    let ca = dir.join("ca.pem");
    let mut trusted = Agent::start(
        &dir,
        "node-trusts",
        &url,
        &["--comm", "tls-wl", "--ca", ca.to_str().unwrap()],
    );
    // The system's roots do not hold the test CA.
    let mut untrusted = Agent::start(&dir, "node-doubts", &url, &["--comm", "tls-wl"]);
    wait_until(Duration::from_secs(90), "three pushes over TLS", || {
        https_get(&dir, port, "/metrics")
            .is_some_and(|m| metric(&m, "pyrometer_collector_batches_ingested_total") >= 3.0)
    });
    let good = trusted.stop();
    let bad = untrusted.stop();
    let _ = load.kill();
    let _ = load.wait();

    assert_eq!(good["spool_samples"], 0, "{good}");
    let pushed = good["samples_pushed"].as_i64().unwrap();
    assert!(pushed > 0, "{good}");
    assert_eq!(bad["samples_pushed"], 0, "{bad}");
    assert!(bad["push_errors"].as_u64().unwrap() > 0, "{bad}");
    assert!(
        bad["spool_samples"].as_u64().unwrap() > 0,
        "refused batches stay spooled: {bad}"
    );

    let groups: serde_json::Value = serde_json::from_str(
        &https_get(&dir, port, "/api/v1/profile?by=node&type=samples").expect("query over TLS"),
    )
    .unwrap();
    let groups = groups["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(groups[0]["labels"]["node"], "node-trusts");
    assert_eq!(groups[0]["total"].as_i64(), Some(pushed));
    let m = https_get(&dir, port, "/metrics").unwrap();
    assert!(
        metric(&m, "pyrometer_collector_tls_handshake_failures_total") >= 2.0,
        "the plain-text GET and the untrusting agent: {m}"
    );
}

/// An agent authenticates with a client certificate (`--client-cert`/`--client-key`) to a
/// collector that asks for them (`--client-ca`): its pushes arrive; an agent without one is
/// refused and keeps its batches.
#[test]
fn a_client_certificate_authenticates_the_agent() {
    if !privileged() {
        return;
    }
    let dir = scratch("tls-client");
    make_certs(&dir);
    certs::sign(&dir, "agent", "node-cert.internal", "ca", certs::CLIENT);
    let port = free_port();
    let _collector = serve_tls(&dir, port, true);
    // Reads need credentials too: curl presents the agent's certificate.
    let get = |path: &str| https_get_as(&dir, port, path, Some("agent"));
    wait_until(
        Duration::from_secs(30),
        "the collector serving HTTPS",
        || get("/metrics").is_some(),
    );
    assert!(
        https_get(&dir, port, "/api/v1/labels").is_none(),
        "a read without credentials"
    );
    let mut load = workload(&dir, "cert-wl", 30);
    let url = format!("https://127.0.0.1:{port}");
    let ca = dir.join("ca.pem");
    let (cert, key) = (dir.join("agent.pem"), dir.join("agent.key"));
    let mut with = Agent::start(
        &dir,
        "node-cert",
        &url,
        &[
            "--comm",
            "cert-wl",
            "--ca",
            ca.to_str().unwrap(),
            "--client-cert",
            cert.to_str().unwrap(),
            "--client-key",
            key.to_str().unwrap(),
        ],
    );
    let mut without = Agent::start(
        &dir,
        "node-nocert",
        &url,
        &["--comm", "cert-wl", "--ca", ca.to_str().unwrap()],
    );
    wait_until(
        Duration::from_secs(90),
        "three pushes with the client certificate",
        || {
            get("/metrics")
                .is_some_and(|m| metric(&m, "pyrometer_collector_batches_ingested_total") >= 3.0)
        },
    );
    let good = with.stop();
    let bad = without.stop();
    let _ = load.kill();
    let _ = load.wait();
    assert!(good["samples_pushed"].as_i64().unwrap() > 0, "{good}");
    assert_eq!(bad["samples_pushed"], 0, "{bad}");
    assert!(bad["spool_samples"].as_u64().unwrap() > 0, "{bad}");
    let groups: serde_json::Value =
        serde_json::from_str(&get("/api/v1/profile?by=node&type=samples").unwrap()).unwrap();
    let nodes: Vec<&str> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["labels"]["node"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["node-cert"]);
}

#[test]
fn tls_set_up_errors_are_one_line() {
    let dir = scratch("tls-errors");
    let out = Command::new(collector_bin())
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.join("store"))
        .arg("--tls-cert")
        .arg(dir.join("absent.pem"))
        .arg("--tls-key")
        .arg(dir.join("absent.key"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("cannot read the TLS certificate"),
        "{}",
        stderr(&out)
    );
    let out = Command::new(collector_bin())
        .args(["--tls-cert", "x.pem"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--tls-key"), "{}", stderr(&out));

    let out = pyrometer(&[
        "agent",
        "--collector",
        "http://127.0.0.1:1",
        "--ca",
        "ca.pem",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is not https://"), "{}", stderr(&out));
    let not_pem = dir.join("ca.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let out = pyrometer(&[
        "agent",
        "--collector",
        "https://127.0.0.1:1",
        "--ca",
        not_pem.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("holds no PEM certificate"),
        "{}",
        stderr(&out)
    );
}
