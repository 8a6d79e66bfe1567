//! The collector's one port, served by hand rather than by `axum::serve` so that a careless or
//! hostile client cannot hold it: connections beyond a limit are closed at once (the process
//! keeps file descriptors for its store), a TLS handshake or an HTTP/1.1 request head that is
//! not complete within the header timeout is dropped, and a connection idle that long after
//! its last request is closed. TLS handshakes run on the connection's own task, so a stalled
//! one delays nobody else; a verified client certificate's common name travels with each
//! request of the connection. hyper tells HTTP/2 (gRPC) from HTTP/1.1 per connection.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;

use crate::auth::{PeerCertificate, common_name};
use crate::metrics::Metrics;

/// How connections are bounded.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// A TLS handshake, and each HTTP/1.1 request head, must be complete within this; so must
    /// the first request of any connection.
    pub header_timeout: Duration,
    /// A connection with no request for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
        }
    }
}

/// Connections the file limit leaves room for: all but 256 descriptors (the store's files,
/// ClickHouse connections, the log), at most 16384.
pub fn default_max_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into `lim`.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur as usize
    } else {
        1024
    };
    soft.saturating_sub(256).clamp(16, 16_384)
}

/// Raises the soft file limit to the hard one (systemd and shells start services at 1024).
pub fn raise_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only `lim`.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Serves `app` on `listener` (TLS when `tls` is given) until `shutdown` completes, then
/// stops accepting and lets open requests finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<ServerConfig>>,
    options: Options,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(options.max_connections.max(1)));
    let acceptor = tls.map(TlsAcceptor::from);
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(_) => {
                    // Out of file descriptors and the like: give the process a moment.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.connections_refused.fetch_add(1, Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (app, acceptor, metrics, stop) = (
            app.clone(),
            acceptor.clone(),
            metrics.clone(),
            stop_rx.clone(),
        );
        tokio::spawn(async move {
            connection(stream, peer, app, acceptor, options, &metrics, stop).await;
            drop(slot);
        });
    }
    let _ = stop_tx.send(true);
    // Open connections finish their requests (each closes when idle or told to stop).
    let _ = slots
        .acquire_many(options.max_connections.max(1) as u32)
        .await;
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    acceptor: Option<TlsAcceptor>,
    options: Options,
    metrics: &Metrics,
    stop: watch::Receiver<bool>,
) {
    match acceptor {
        None => http(stream, peer, None, app, options, stop).await,
        Some(acceptor) => {
            match tokio::time::timeout(options.header_timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let cert = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .and_then(|c| common_name(c))
                        .map(PeerCertificate);
                    http(tls, peer, cert, app, options, stop).await;
                }
                Ok(Err(_)) | Err(_) => {
                    // A plain-HTTP client, a wrong CA on the agent, a stalled handshake.
                    metrics.tls_handshake_failures.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

/// Activity of one connection: requests in flight, and when the last one began or ended
/// (milliseconds since the connection's start; 0 before the first).
#[derive(Default)]
struct Activity {
    in_flight: AtomicUsize,
    last_ms: AtomicU64,
}

async fn http<S>(
    io: S,
    peer: SocketAddr,
    cert: Option<PeerCertificate>,
    app: Router,
    options: Options,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let started = Instant::now();
    let activity = Arc::new(Activity::default());
    let seen = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let mut req = req.map(axum::body::Body::new);
        req.extensions_mut().insert(peer);
        if let Some(c) = &cert {
            req.extensions_mut().insert(c.clone());
        }
        let mut app = app.clone();
        let seen = seen.clone();
        seen.in_flight.fetch_add(1, Relaxed);
        seen.last_ms
            .store(started.elapsed().as_millis().max(1) as u64, Relaxed);
        async move {
            let answer = tower_service::Service::call(&mut app, req).await;
            seen.in_flight.fetch_sub(1, Relaxed);
            seen.last_ms
                .store(started.elapsed().as_millis().max(1) as u64, Relaxed);
            answer
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_timeout)
        .max_buf_size(64 << 10);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_concurrent_streams(256);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut closing = false;
    // Once closing, a connection that has not finished by then is dropped.
    let hard_stop = tokio::time::sleep(Duration::MAX);
    tokio::pin!(hard_stop);
    loop {
        let check = tokio::time::sleep(Duration::from_secs(1));
        tokio::select! {
            _ = conn.as_mut() => return,
            () = &mut hard_stop, if closing => return,
            _ = stop.changed(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
                hard_stop.as_mut().reset((Instant::now() + options.idle_timeout).into());
            }
            () = check, if !closing => {
                let last = activity.last_ms.load(Relaxed);
                let quiet = if last == 0 {
                    // No request yet: the first must begin within the header timeout.
                    started.elapsed() > options.header_timeout
                } else {
                    activity.in_flight.load(Relaxed) == 0
                        && started.elapsed().saturating_sub(Duration::from_millis(last))
                            > options.idle_timeout
                };
                if quiet {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                    hard_stop.as_mut().reset((Instant::now() + options.header_timeout).into());
                }
            }
        }
    }
}
