//! Two tenants on one collector, on both stores: neither can read or push the other's data,
//! whether it tries with its token, a client certificate or a forged `X-Scope-OrgID`; roles
//! are enforced; both tenants' agents may use the same agent id and sequence; behind a
//! trusted proxy the header names the tenant. Then the web UI in real headless Chromium asks
//! each tenant's reader for a token and shows that tenant's profiles only.

#[allow(dead_code)]
mod chromium;
#[macro_use]
mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use common::binary::{Server, http_get};
use common::{Kind, call, dechunk, enc, now_s, test_store};
use common::{certs, hostile};
use pyrometer_collector::api::AppState;
use pyrometer_collector::auth::Auth;
use pyrometer_proto::grpc::RawCodec;
use pyrometer_proto::ingest::PUSH_PATH;
use serde_json::Value;

for_each_store!(tenants_see_and_push_only_their_own);
for_each_store!(behind_a_trusted_proxy_the_header_names_the_tenant);

const TOKENS: &str = "\
# token              tenant   roles
tok-a-push-00000001  alpha    push
tok-a-read-00000001  alpha    read
tok-b-push-00000001  beta     push
tok-b-read-00000001  beta     read
tok-admin-000000001  default  admin
cn:agent-b.internal  beta     push
";

/// A CA; a server certificate for 127.0.0.1; client certificates `agent-b.internal` and
/// `stranger` signed by the CA; and `rogue`, signed by a CA of its own.
fn make_certs(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    certs::ca(dir, "ca");
    certs::ca(dir, "rogue-ca");
    certs::sign(dir, "server", "localhost", "ca", certs::SERVER);
    for (name, cn, ca) in [
        ("agent-b", "agent-b.internal", "ca"),
        ("stranger", "stranger", "ca"),
        ("rogue", "agent-b.internal", "rogue-ca"),
    ] {
        certs::sign(dir, name, cn, ca, certs::CLIENT);
    }
}

/// A push over TLS presenting the client certificate `name` of `dir`.
async fn push_with_cert(
    addr: std::net::SocketAddr,
    dir: &Path,
    name: &str,
    body: Vec<u8>,
) -> Result<(), tonic::Status> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")))
        .identity(Identity::from_pem(
            read(&format!("{name}.pem")),
            read(&format!("{name}.key")),
        ))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("{e:?}")))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(PUSH_PATH);
    grpc.unary(tonic::Request::new(Bytes::from(body)), path, RawCodec)
        .await
        .map(|_| ())
}

/// A GET with a token and headers.
async fn get(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
    headers: &str,
) -> (u16, String) {
    let (path, token, headers) = (
        path.to_string(),
        token.map(String::from),
        headers.to_string(),
    );
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: t\r\n{auth}{headers}Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text[9..12].parse().unwrap();
        let body = text.split_once("\r\n\r\n").unwrap().1.to_string();
        let body = if text
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(&body)
        } else {
            body
        };
        (status, body)
    })
    .await
    .unwrap()
}

/// The processes (`comm` values) a token's reader sees in the last hour.
async fn processes(addr: std::net::SocketAddr, token: &str, headers: &str) -> Value {
    let (code, body) = get(addr, "/api/v1/label/comm/values", Some(token), headers).await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()["values"].clone()
}

fn scratch(name: &str, kind: Kind) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "pyrometer-tenants-{name}-{kind:?}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn tenants_see_and_push_only_their_own(kind: Kind) {
    let dir = scratch("two", kind);
    let certs = dir.join("certs");
    let c = certs.clone();
    tokio::task::spawn_blocking(move || make_certs(&c))
        .await
        .unwrap();
    let store_dir = dir.join("store");
    let guard = tokio::task::spawn_blocking(move || test_store(kind, &store_dir))
        .await
        .unwrap();
    let auth = Auth::open()
        .with_tokens(TOKENS)
        .unwrap()
        .with_client_certificates(true);
    let state = Arc::new(AppState::new(guard.store.clone()).with_auth(auth));
    let addr = common::serve(state.clone()).await;
    // The same state behind TLS that asks for client certificates.
    let tls = pyrometer_collector::tls::server_config(
        &certs.join("server.pem"),
        &certs.join("server.key"),
        Some(&certs.join("ca.pem")),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tls_addr = listener.local_addr().unwrap();
    tokio::spawn(pyrometer_collector::serve::serve(
        listener,
        pyrometer_collector::api::router(state.clone()),
        Some(tls),
        pyrometer_collector::serve::Options::default(),
        state.metrics.clone(),
        std::future::pending(),
    ));

    let now = now_s();
    // The same agent id and sequence in both tenants: both stored.
    let push = |token: &'static str, comm: &str| {
        call(
            addr,
            Some(token),
            PUSH_PATH,
            hostile::simple("agent-1", 1, comm, 5, now - 20),
        )
    };
    push("tok-a-push-00000001", "alpha").await.unwrap();
    push("tok-b-push-00000001", "beta").await.unwrap();
    // A forged header does not move a push to another tenant.
    let mut forged = tonic::Request::new(Bytes::from(hostile::simple(
        "agent-2",
        1,
        "alpha-forged",
        5,
        now - 20,
    )));
    forged.metadata_mut().insert(
        "authorization",
        "Bearer tok-a-push-00000001".parse().unwrap(),
    );
    forged
        .metadata_mut()
        .insert("x-scope-orgid", "beta".parse().unwrap());
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        forged,
        http::uri::PathAndQuery::from_static(PUSH_PATH),
        RawCodec,
    )
    .await
    .unwrap();
    // A client certificate listed for beta pushes into beta.
    push_with_cert(
        tls_addr,
        &certs,
        "agent-b",
        hostile::simple("agent-3", 1, "beta-cert", 5, now - 20),
    )
    .await
    .unwrap();
    // One the CA signed but the token file does not list may not push; one of another CA
    // does not get through the handshake.
    let e = push_with_cert(
        tls_addr,
        &certs,
        "stranger",
        hostile::simple("agent-4", 1, "x", 5, now),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        push_with_cert(
            tls_addr,
            &certs,
            "rogue",
            hostile::simple("agent-5", 1, "x", 5, now)
        )
        .await
        .is_err()
    );
    // Roles: readers cannot push, pushers cannot read, nobody without credentials.
    let e = push("tok-a-read-00000001", "nope").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied);
    let e = call(addr, None, PUSH_PATH, hostile::simple("x", 1, "x", 1, now))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    assert_eq!(
        get(addr, "/api/v1/labels", Some("tok-a-push-00000001"), "")
            .await
            .0,
        403
    );
    assert_eq!(get(addr, "/api/v1/labels", None, "").await.0, 401);
    assert_eq!(
        get(addr, "/api/v1/labels", Some("wrong-token"), "").await.0,
        401
    );

    // Each reader sees its own tenant only, whatever header it sends.
    let a = "tok-a-read-00000001";
    let b = "tok-b-read-00000001";
    assert_eq!(
        processes(addr, a, "").await,
        serde_json::json!(["alpha", "alpha-forged"])
    );
    assert_eq!(
        processes(addr, b, "").await,
        serde_json::json!(["beta", "beta-cert"])
    );
    assert_eq!(
        processes(addr, a, "X-Scope-OrgID: beta\r\n").await,
        serde_json::json!(["alpha", "alpha-forged"])
    );
    for (token, other) in [(a, "beta"), (b, "alpha")] {
        // Even asked by name, another tenant's data is not there.
        let q = enc(&format!(r#"{{comm="{other}"}}"#));
        for path in [
            format!("/api/v1/profile?format=folded&query={q}"),
            format!("/api/v1/series?query={q}"),
            "/api/v1/profile?by=comm".to_string(),
        ] {
            let (code, body) = get(addr, &path, Some(token), "").await;
            assert!(!body.contains(other) || code != 200, "{path}: {body}");
        }
        let q = enc(r#"{__tenant__!=""}"#);
        let (_, body) = get(
            addr,
            &format!("/api/v1/profile?format=folded&query={q}"),
            Some(token),
            "",
        )
        .await;
        assert!(!body.contains(other), "{body}");
    }
    let (_, names) = get(addr, "/api/v1/labels", Some(a), "").await;
    assert!(!names.contains("__tenant__"), "{names}");
    // An admin reads the tenant it names.
    assert_eq!(
        processes(addr, "tok-admin-000000001", "X-Scope-OrgID: beta\r\n").await,
        serde_json::json!(["beta", "beta-cert"])
    );
    assert_eq!(state.metrics.auth_failures.get("wrong_token"), 1);
    assert!(state.metrics.auth_failures.get("forbidden") >= 3);
    assert!(state.metrics.auth_failures.get("missing") >= 2);
    let _ = std::fs::remove_dir_all(&dir);
}

async fn behind_a_trusted_proxy_the_header_names_the_tenant(kind: Kind) {
    let dir = scratch("proxy", kind);
    let store_dir = dir.join("store");
    let guard = tokio::task::spawn_blocking(move || test_store(kind, &store_dir))
        .await
        .unwrap();
    let state = Arc::new(
        AppState::new(guard.store.clone()).with_auth(Auth::open().trusting_tenant_header(true)),
    );
    let addr = common::serve(state).await;
    let now = now_s();
    for (tenant, comm) in [("team-c", "gamma"), ("team-d", "delta")] {
        let mut req = tonic::Request::new(Bytes::from(hostile::simple("a", 1, comm, 3, now - 20)));
        req.metadata_mut()
            .insert("x-scope-orgid", tenant.parse().unwrap());
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        grpc.unary(
            req,
            http::uri::PathAndQuery::from_static(PUSH_PATH),
            RawCodec,
        )
        .await
        .unwrap();
    }
    let seen = |tenant: &'static str| async move {
        let (_, body) = get(
            addr,
            "/api/v1/label/comm/values",
            None,
            &format!("X-Scope-OrgID: {tenant}\r\n"),
        )
        .await;
        serde_json::from_str::<Value>(&body).unwrap()["values"].clone()
    };
    assert_eq!(seen("team-c").await, serde_json::json!(["gamma"]));
    assert_eq!(seen("team-d").await, serde_json::json!(["delta"]));
    assert_eq!(seen("default").await, serde_json::json!([]));
    let (code, _) = get(addr, "/api/v1/labels", None, "X-Scope-OrgID: a/b\r\n").await;
    assert_eq!(code, 403);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The web UI of a collector with two tenants: the page asks for a read token, keeps it for
/// the tab, and shows only the profiles of the token's tenant; a wrong token is asked again.
#[test]
fn the_web_ui_asks_each_tenant_for_its_token_and_shows_its_own() {
    for kind in [Kind::Sqlite, Kind::ClickHouse] {
        ui_for_two_tenants(kind);
    }
}

fn ui_for_two_tenants(kind: Kind) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("webui-tenants-{kind:?}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, TOKENS).unwrap();
    let args = vec!["--token-file".to_string(), tokens.display().to_string()];
    let server = Server::start(kind, &dir.join("collector"), &args, None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let now = now_s();
    rt.block_on(async {
        for (token, comm, stack) in [
            ("tok-a-push-00000001", "alpha_app", "alpha_work"),
            ("tok-b-push-00000001", "beta_app", "beta_work"),
        ] {
            let mut p = hostile::Profile::new();
            p.sample_type("samples", "count");
            p.function(1, "main").function(2, stack);
            p.location(1, 1, 1).location(2, 2, 1);
            let (k, v) = (p.s("comm"), p.s(comm));
            p.sample(&[2, 1], &[50], &[(k, v)]);
            let body = hostile::push("ui", 1, "n1", &p.finish(now - 30));
            call(server.addr, Some(token), PUSH_PATH, body)
                .await
                .unwrap();
        }
    });
    // The page itself holds no data and loads without a token.
    assert_eq!(http_get(server.addr, "/", None).unwrap().0, 200);
    for (tenant, token, own, other) in [
        ("alpha", "tok-a-read-00000001", "alpha_work", "beta_work"),
        ("beta", "tok-b-read-00000001", "beta_work", "alpha_work"),
    ] {
        let profile = dir.join(format!("chromium-{tenant}"));
        let mut page =
            chromium::Chromium::launch(&format!("http://{}/", server.addr), &profile, 1400, 900);
        page.wait_for(
            "the sign-in form",
            r#"(() => { const f = document.getElementById("signin"); return f && !f.hidden; })()"#,
        );
        // A wrong token first: asked again, with a message.
        page.type_text("not-a-token");
        page.eval(r#"document.getElementById("signin-go").click()"#);
        page.wait_for(
            "the sign-in form asking again",
            r#"(() => !document.getElementById("signin").hidden &&
                document.getElementById("signin-error").textContent.includes("not accepted"))()"#,
        );
        page.type_text(token);
        let shot = dir.join(format!("{tenant}-signin.png"));
        page.screenshot(&shot);
        println!("screenshot: {}", shot.display());
        page.eval(r#"document.getElementById("signin-go").click()"#);
        let names = page.wait_for(
            "the tenant's flame graph",
            r##"(() => { const n = [...document.querySelectorAll("#flame .frame")].map(b => b.dataset.name);
                return n.length ? n : null; })()"##,
        );
        let names: Vec<String> = serde_json::from_value(names).unwrap();
        assert!(names.iter().any(|n| n == own), "{tenant}: {names:?}");
        assert!(
            !names.iter().any(|n| n == other),
            "{tenant} sees {other}: {names:?}"
        );
        assert_eq!(
            page.eval(r#"sessionStorage.getItem("pyrometer-token")"#),
            token,
            "kept for the tab"
        );
        assert!(!page.eval("location.href").as_str().unwrap().contains(token));
        let shot = dir.join(format!("{tenant}.png"));
        page.screenshot(&shot);
        println!("screenshot: {}", shot.display());
        // Reloaded, the tab keeps its token: no second sign-in.
        page.navigate(&format!("http://{}/", server.addr));
        page.wait_for(
            "the flame graph after a reload",
            r##"(() => document.querySelectorAll("#flame .frame").length > 0 &&
                document.getElementById("signin").hidden)()"##,
        );
    }
}
