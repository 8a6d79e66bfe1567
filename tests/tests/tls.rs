//! TLS between agents and the collector, with a CA and a server certificate made by openssl
//! for the test: the agent that trusts the CA pushes, one that does not keeps its batches
//! spooled, and plain-text clients are turned away while the collector keeps serving.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::cluster::{Agent, collector_bin, free_port, http_get, workload};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::{privileged, pyrometer, scratch, stderr};

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", stderr(&out));
    out
}

/// A CA, and a certificate it signed for 127.0.0.1 and localhost.
fn make_certs(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    run(Command::new("openssl")
        .current_dir(dir)
        .args(["req", "-x509"])
        .args(ec)
        .args(["-keyout", "ca.key", "-out", "ca.pem", "-days", "2"])
        .args(["-subj", "/CN=pyrometer test CA"]));
    run(Command::new("openssl")
        .current_dir(dir)
        .arg("req")
        .args(ec)
        .args(["-keyout", "server.key", "-out", "server.csr"])
        .args(["-subj", "/CN=localhost"]));
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
         extendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(Command::new("openssl").current_dir(dir).args([
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "server.ext",
    ]));
}

/// GET over HTTPS trusting only the test CA; None when the request fails.
fn https_get(dir: &Path, port: u16, path: &str) -> Option<String> {
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5", "--cacert"])
        .arg(dir.join("ca.pem"))
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
    let _collector = Server(
        Command::new(collector_bin())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
            .arg(dir.join("store"))
            .arg("--tls-cert")
            .arg(dir.join("server.pem"))
            .arg("--tls-key")
            .arg(dir.join("server.key"))
            .stdin(Stdio::null())
            .spawn()
            .expect("start pyrometer-collector"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while https_get(&dir, port, "/metrics").is_none() {
        assert!(Instant::now() < deadline, "collector never served HTTPS");
        std::thread::sleep(Duration::from_millis(100));
    }
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
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let pushed = https_get(&dir, port, "/metrics")
            .map(|m| metric(&m, "pyrometer_collector_batches_ingested_total"))
            .unwrap_or(0.0);
        if pushed >= 3.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no pushes over TLS arrived");
        std::thread::sleep(Duration::from_millis(300));
    }
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

/// A client certificate the CA signed, for an agent named `cn`, in `dir` as `NAME.pem` and
/// `NAME.key`.
fn make_client_cert(dir: &Path, name: &str, cn: &str) {
    run(Command::new("openssl")
        .current_dir(dir)
        .args([
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ])
        .args([
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ])
        .args(["-subj", &format!("/CN={cn}")]));
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    run(Command::new("openssl").current_dir(dir).args([
        "x509",
        "-req",
        "-in",
        &format!("{name}.csr"),
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        &format!("{name}.pem"),
        "-days",
        "2",
        "-extfile",
        "client.ext",
    ]));
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
    make_client_cert(&dir, "agent", "node-cert.internal");
    let port = free_port();
    let _collector = Server(
        Command::new(collector_bin())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
            .arg(dir.join("store"))
            .arg("--tls-cert")
            .arg(dir.join("server.pem"))
            .arg("--tls-key")
            .arg(dir.join("server.key"))
            .arg("--client-ca")
            .arg(dir.join("ca.pem"))
            .stdin(Stdio::null())
            .spawn()
            .expect("start pyrometer-collector"),
    );
    // Reads need credentials too: curl presents the agent's certificate.
    let get = |path: &str| -> Option<String> {
        let out = Command::new("curl")
            .args(["-sf", "--max-time", "5", "--cacert"])
            .arg(dir.join("ca.pem"))
            .arg("--cert")
            .arg(dir.join("agent.pem"))
            .arg("--key")
            .arg(dir.join("agent.key"))
            .arg(format!("https://127.0.0.1:{port}{path}"))
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
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
