//! A small blocking HTTP/1.1 client for ClickHouse's HTTP interface: POST a query (and, for
//! inserts, RowBinary rows) and read the whole answer. Blocking because the store trait is
//! called from blocking threads; std sockets because the interface needs nothing more than
//! keep-alive, Content-Length requests and chunked responses, and every timeout stays ours.
//! Over HTTPS (`clickhouses://`) the socket is wrapped in rustls, checked against a CA file
//! or the system's roots.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, ClientConnection, StreamOwned};

/// A connection to ClickHouse: plain TCP or TLS over it.
trait Transport: Read + Write + Send {
    fn tcp(&self) -> &TcpStream;
}

impl Transport for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl Transport for StreamOwned<ClientConnection, TcpStream> {
    fn tcp(&self) -> &TcpStream {
        self.get_ref()
    }
}

type Conn = BufReader<Box<dyn Transport>>;

/// Why a request got no answer, or an error answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Nothing answered, the connection broke, or the answer took too long: worth retrying.
    #[error("ClickHouse at {addr} is unavailable: {reason}")]
    Unavailable { addr: String, reason: String },
    /// ClickHouse answered with an exception (first line of its message).
    #[error("ClickHouse error (HTTP {status}): {message}")]
    Server { status: u16, message: String },
    #[error("ClickHouse answer larger than {0} bytes: narrow the query")]
    TooLarge(usize),
}

impl HttpError {
    /// Errors that say ClickHouse is down, overloaded or restarting rather than that the
    /// request is wrong: 503 to queries, a retryable status to agents.
    pub fn is_unavailable(&self) -> bool {
        match self {
            HttpError::Unavailable { .. } => true,
            // 159 TIMEOUT_EXCEEDED, 202 TOO_MANY_SIMULTANEOUS_QUERIES, 241 MEMORY_LIMIT_EXCEEDED,
            // 242 TABLE_IS_READ_ONLY, 252 TOO_MANY_PARTS, 394 QUERY_WAS_CANCELLED.
            HttpError::Server { status, message } => {
                *status == 503
                    || [
                        "Code: 159,",
                        "Code: 202,",
                        "Code: 241,",
                        "Code: 242,",
                        "Code: 252,",
                    ]
                    .iter()
                    .any(|c| message.starts_with(c))
            }
            HttpError::TooLarge(_) => false,
        }
    }
}

pub struct Client {
    host: String,
    /// The server's name for TLS, and the configuration; `None` in plain text.
    tls: Option<(ServerName<'static>, Arc<ClientConfig>)>,
    addr: SocketAddr,
    /// `Basic …` header value, or none for the passwordless `default` user.
    auth: Option<String>,
    timeout: Duration,
    max_answer: usize,
    /// Idle keep-alive connections.
    idle: Mutex<Vec<Conn>>,
}

/// Idle connections kept; more concurrent requests open (and then close) their own.
const MAX_IDLE: usize = 8;

impl Client {
    pub fn new(
        host: &str,
        port: u16,
        auth: Option<(String, String)>,
        timeout: Duration,
        max_answer: usize,
        tls: Option<Arc<ClientConfig>>,
    ) -> Result<Self, HttpError> {
        let unavailable = |reason: String| HttpError::Unavailable {
            addr: format!("{host}:{port}"),
            reason,
        };
        let addr = (host, port)
            .to_socket_addrs()
            .map_err(|e| unavailable(format!("cannot resolve: {e}")))?
            .next()
            .ok_or_else(|| unavailable("no address".into()))?;
        use base64::Engine;
        let auth = auth.map(|(user, password)| {
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            format!("Basic {token}")
        });
        let tls = match tls {
            Some(config) => {
                let name = ServerName::try_from(host.to_string())
                    .map_err(|e| unavailable(format!("not a TLS server name: {e}")))?;
                Some((name, config))
            }
            None => None,
        };
        Ok(Self {
            host: format!("{host}:{port}"),
            tls,
            addr,
            auth,
            timeout,
            max_answer,
            idle: Mutex::new(Vec::new()),
        })
    }

    fn unavailable(&self, reason: impl ToString) -> HttpError {
        HttpError::Unavailable {
            addr: self.host.clone(),
            reason: reason.to_string(),
        }
    }

    /// POSTs `body` to `/?params` and returns the answer's body. `params` are already
    /// URL-encoded `name=value` pairs (settings, and the query when the body holds data).
    pub fn post(&self, params: &[(&str, &str)], body: &[u8]) -> Result<Vec<u8>, HttpError> {
        self.post_within(params, body, self.timeout)
    }

    /// [`Client::post`] waiting at most `timeout` for the answer.
    pub fn post_within(
        &self,
        params: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, HttpError> {
        let mut target = String::from("/?");
        for (i, (k, v)) in params.iter().enumerate() {
            if i > 0 {
                target.push('&');
            }
            target.push_str(k);
            target.push('=');
            target.extend(percent_encoding::utf8_percent_encode(
                v,
                percent_encoding::NON_ALPHANUMERIC,
            ));
        }
        let mut head = format!(
            "POST {target} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: keep-alive\r\n",
            self.host,
            body.len()
        );
        if let Some(a) = &self.auth {
            head.push_str("Authorization: ");
            head.push_str(a);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        // A pooled connection may have been closed by the server's keep-alive timeout: if it
        // fails before any answer, the request is sent once more on a fresh connection.
        // (A repeated insert is harmless: readers count each batch's rows once.)
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(mut conn) = pooled {
            let _ = conn.get_ref().tcp().set_read_timeout(Some(timeout));
            match self.exchange(&mut conn, head.as_bytes(), body) {
                Ok((answer, reusable)) => {
                    self.release(conn, reusable);
                    return answer;
                }
                Err(Exchange::BeforeAnswer(_)) => {}
                Err(Exchange::Failed(e)) => return Err(e),
            }
        }
        let stream =
            TcpStream::connect_timeout(&self.addr, self.timeout.min(Duration::from_secs(3)))
                .map_err(|e| self.unavailable(e))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(self.timeout)))
            .and_then(|()| stream.set_nodelay(true))
            .map_err(|e| self.unavailable(e))?;
        let transport: Box<dyn Transport> = match &self.tls {
            None => Box::new(stream),
            Some((name, config)) => {
                let tls = ClientConnection::new(config.clone(), name.clone())
                    .map_err(|e| self.unavailable(format!("TLS: {e}")))?;
                Box::new(StreamOwned::new(tls, stream))
            }
        };
        let mut conn: Conn = BufReader::with_capacity(1 << 16, transport);
        match self.exchange(&mut conn, head.as_bytes(), body) {
            Ok((answer, reusable)) => {
                self.release(conn, reusable);
                answer
            }
            Err(Exchange::BeforeAnswer(e) | Exchange::Failed(e)) => Err(e),
        }
    }

    fn release(&self, conn: Conn, reusable: bool) {
        if reusable {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
    }

    /// One request and its answer. The outer error is an I/O failure; the inner result is the
    /// server's answer (its body, or its exception), with whether the connection can be kept.
    fn exchange(
        &self,
        conn: &mut Conn,
        head: &[u8],
        body: &[u8],
    ) -> Result<(Result<Vec<u8>, HttpError>, bool), Exchange> {
        let before = |e: std::io::Error| Exchange::BeforeAnswer(self.unavailable(e));
        let stream = conn.get_mut();
        stream.write_all(head).map_err(before)?;
        stream.write_all(body).map_err(before)?;
        stream.flush().map_err(before)?;
        let mut status_line = String::new();
        match conn.read_line(&mut status_line) {
            Ok(0) => {
                return Err(Exchange::BeforeAnswer(
                    self.unavailable("connection closed before an answer"),
                ));
            }
            Ok(_) => {}
            // A slow server is not retried: that would double the wait.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Exchange::Failed(self.unavailable("no answer in time")));
            }
            Err(e) => return Err(before(e)),
        }
        let failed = |e: std::io::Error| Exchange::Failed(self.unavailable(e));
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                Exchange::Failed(self.unavailable(format!("not HTTP: {}", status_line.trim())))
            })?;
        let (mut length, mut chunked, mut close) = (None, false, false);
        loop {
            let mut line = String::new();
            if conn.read_line(&mut line).map_err(failed)? == 0 {
                return Err(Exchange::Failed(self.unavailable("truncated answer")));
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.parse::<usize>().ok(),
                "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                "connection" => close = value.eq_ignore_ascii_case("close"),
                _ => {}
            }
        }
        let mut answer = Vec::new();
        if chunked {
            loop {
                let mut size = String::new();
                conn.read_line(&mut size).map_err(failed)?;
                let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                    .map_err(|_| Exchange::Failed(self.unavailable("bad chunk size")))?;
                if size == 0 {
                    let mut end = String::new();
                    conn.read_line(&mut end).map_err(failed)?;
                    break;
                }
                if answer.len() + size > self.max_answer {
                    return Ok((Err(HttpError::TooLarge(self.max_answer)), false));
                }
                let at = answer.len();
                answer.resize(at + size, 0);
                conn.read_exact(&mut answer[at..]).map_err(failed)?;
                let mut crlf = [0u8; 2];
                conn.read_exact(&mut crlf).map_err(failed)?;
            }
        } else if let Some(n) = length {
            if n > self.max_answer {
                return Ok((Err(HttpError::TooLarge(self.max_answer)), false));
            }
            answer.resize(n, 0);
            conn.read_exact(&mut answer).map_err(failed)?;
        } else {
            close = true;
            conn.take(self.max_answer as u64 + 1)
                .read_to_end(&mut answer)
                .map_err(failed)?;
            if answer.len() > self.max_answer {
                return Ok((Err(HttpError::TooLarge(self.max_answer)), false));
            }
        }
        if status != 200 {
            let text = String::from_utf8_lossy(&answer);
            let message = text.lines().next().unwrap_or("").trim().to_string();
            return Ok((Err(HttpError::Server { status, message }), !close));
        }
        Ok((Ok(answer), !close))
    }
}

enum Exchange {
    /// Failed before any byte of an answer: the server may never have seen the request.
    BeforeAnswer(HttpError),
    Failed(HttpError),
}
