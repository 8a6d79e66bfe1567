//! One debuginfod request (`GET URL/buildid/<id>/debuginfo`) streamed into a file, over
//! HTTP/1.1 (hyper) or HTTPS (rustls, the system's roots), with a connect timeout, a timeout
//! on each read, a deadline on the whole download and a cap on its size. Runs on a worker
//! thread, in a runtime of its own.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// The limits of one download.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The longest wait for a connection (and a TLS handshake).
    pub connect: Duration,
    /// The longest wait for the server's headers or any part of its body.
    pub read: Duration,
    /// The whole request, from connecting to the last byte.
    pub deadline: Duration,
    /// The largest answer accepted.
    pub max_bytes: u64,
}

/// A server's answer.
#[derive(Debug, PartialEq, Eq)]
pub enum Got {
    /// The file, this many bytes, written.
    Stored(u64),
    /// 404: the server has no debug file of that build id.
    NotFound,
}

/// Fetches `url` into `out`. Errors are one line, naming what failed.
pub fn get(url: &str, out: &mut File, limits: Limits) -> Result<Got, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let got = rt.block_on(async {
        match timeout(limits.deadline, fetch(url, out, limits)).await {
            Ok(r) => r,
            Err(_) => Err(format!("no complete answer within {:?}", limits.deadline)),
        }
    });
    // A name lookup still blocked in the resolver is left to finish on its own thread: a
    // plain drop of the runtime would wait for it.
    rt.shutdown_timeout(Duration::ZERO);
    got
}

async fn fetch(url: &str, out: &mut File, limits: Limits) -> Result<Got, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err("the URL must start with http:// or https://".to_string()),
    };
    let host = uri.host().ok_or("the URL has no host")?.to_string();
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    // An IPv6 literal comes bracketed in a URL.
    let bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let tcp = timeout(limits.connect, TcpStream::connect((bare.as_str(), port)))
        .await
        .map_err(|_| format!("cannot connect within {:?}", limits.connect))?
        .map_err(|e| format!("cannot connect: {e}"))?;
    let authority = uri
        .authority()
        .map(|a| a.as_str().to_string())
        .unwrap_or(host);
    let path = uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".to_string());
    if tls {
        let stream = timeout(limits.connect, tls_connect(&bare, tcp))
            .await
            .map_err(|_| format!("no TLS handshake within {:?}", limits.connect))??;
        exchange(stream, &authority, &path, out, limits).await
    } else {
        exchange(tcp, &authority, &path, out, limits).await
    }
}

async fn tls_connect(
    host: &str,
    tcp: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, String> {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| format!("TLS: {e}"))?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    authority: &str,
    path: &str,
    out: &mut File,
    limits: Limits,
) -> Result<Got, String> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    let conn = tokio::spawn(conn);
    let req = http::Request::get(path)
        .header(http::header::HOST, authority)
        .header(
            http::header::USER_AGENT,
            concat!("pyrometer/", env!("CARGO_PKG_VERSION")),
        )
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| format!("HTTP: {e}"))?;
    let resp = timeout(limits.read, sender.send_request(req))
        .await
        .map_err(|_| format!("no answer within {:?}", limits.read))?
        .map_err(|e| format!("HTTP: {e}"))?;
    let got = match resp.status() {
        http::StatusCode::OK => read_body(resp.into_body(), out, limits).await,
        http::StatusCode::NOT_FOUND => Ok(Got::NotFound),
        s => Err(format!("the server answered {s}")),
    };
    conn.abort();
    got
}

async fn read_body(
    mut body: hyper::body::Incoming,
    out: &mut File,
    limits: Limits,
) -> Result<Got, String> {
    if let Some(len) = hyper::body::Body::size_hint(&body).exact()
        && len > limits.max_bytes
    {
        return Err(format!(
            "the file is {len} bytes, over the {} allowed",
            limits.max_bytes
        ));
    }
    let mut written = 0u64;
    loop {
        let frame = timeout(limits.read, body.frame())
            .await
            .map_err(|_| format!("the answer stalled for {:?}", limits.read))?;
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| format!("HTTP: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        written += data.len() as u64;
        if written > limits.max_bytes {
            return Err(format!(
                "the file is over the {} bytes allowed",
                limits.max_bytes
            ));
        }
        out.write_all(&data)
            .map_err(|e| format!("cannot write to the cache: {e}"))?;
    }
    Ok(Got::Stored(written))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    const LIMITS: Limits = Limits {
        connect: Duration::from_secs(2),
        read: Duration::from_millis(300),
        deadline: Duration::from_secs(5),
        max_bytes: 1000,
    };

    /// A listener that answers one connection with `answer` (after reading the request),
    /// or holds it without a word when `answer` is None.
    fn peer(answer: Option<Vec<u8>>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/buildid/ab/debuginfo", l.local_addr().unwrap());
        std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf);
            match answer {
                Some(a) => {
                    let _ = c.write_all(&a);
                }
                None => std::thread::sleep(Duration::from_secs(3)),
            }
        });
        url
    }

    fn fetch(answer: Option<Vec<u8>>) -> (Result<Got, String>, Vec<u8>) {
        let url = peer(answer);
        // The peer's port makes the name unique among tests running at once.
        let port = url
            .rsplit(':')
            .next()
            .unwrap_or("")
            .split('/')
            .next()
            .unwrap_or("");
        let path =
            std::env::temp_dir().join(format!("pyrometer-http-{}-{port}", std::process::id()));
        let mut file = File::create(&path).unwrap();
        let r = get(&url, &mut file, LIMITS);
        let body = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        (r, body)
    }

    #[test]
    fn a_body_is_written_and_a_404_is_not_found() {
        let (r, body) = fetch(Some(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
        ));
        assert_eq!(r, Ok(Got::Stored(5)));
        assert_eq!(body, b"hello");
        let (r, _) = fetch(Some(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ));
        assert_eq!(r, Ok(Got::NotFound));
        let (r, _) = fetch(Some(
            b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ));
        assert!(r.unwrap_err().contains("500"));
    }

    #[test]
    fn answers_over_the_cap_are_refused_announced_or_not() {
        let announced = b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n".to_vec();
        let (r, body) = fetch(Some(announced));
        assert!(r.unwrap_err().contains("5000 bytes"));
        assert!(body.is_empty(), "nothing written before the refusal");
        // Chunked, no length: cut once past the cap.
        let mut chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..4 {
            chunked.extend_from_slice(b"190\r\n");
            chunked.extend_from_slice(&[b'x'; 400]);
            chunked.extend_from_slice(b"\r\n");
        }
        chunked.extend_from_slice(b"0\r\n\r\n");
        let (r, body) = fetch(Some(chunked));
        assert!(r.unwrap_err().contains("over the 1000 bytes"));
        assert!(body.len() <= 1000);
    }

    #[test]
    fn a_peer_that_never_answers_times_out() {
        let started = std::time::Instant::now();
        let (r, _) = fetch(None);
        assert!(r.unwrap_err().contains("no answer within"));
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}
