//! The agent's gRPC client for `Ingest.Push` (see `pyrometer_proto::ingest`). Blocking: it
//! owns a single-threaded tokio runtime and runs on the agent's pusher thread, so the
//! sampling loop stays synchronous.

use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use pyrometer_proto::grpc::RawCodec;
use pyrometer_proto::ingest::{PUSH_PATH, PushReply};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("invalid collector address '{url}': {reason} (expected e.g. http://collector:4040)")]
    Url { url: String, reason: String },
    #[error("{0}")]
    Tls(String),
    /// The credentials would cross the network in plain text.
    #[error("{0}")]
    Plaintext(String),
    #[error("collector unreachable: {0}")]
    Unreachable(String),
    /// The collector answered with an error status.
    #[error("collector refused the batch ({code:?}): {message}")]
    Refused { code: tonic::Code, message: String },
    #[error("collector sent an unreadable reply: {0}")]
    Reply(String),
}

impl PushError {
    /// The batch itself was rejected: retrying the same bytes cannot succeed.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            PushError::Refused {
                code: tonic::Code::InvalidArgument | tonic::Code::OutOfRange,
                ..
            }
        )
    }
}

pub struct PushClient {
    rt: tokio::runtime::Runtime,
    endpoint: Endpoint,
    channel: Option<Channel>,
    /// `authorization` header value; kept out of Debug output and logs.
    auth: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// The gRPC method called: `Ingest.Push`, or another unary method (OTLP export).
    path: &'static str,
}

impl PushClient {
    /// `ca` is a PEM file of the CA(s) that signed the collector's certificate; an
    /// `https://` collector without one is checked against the system's roots.
    pub fn new(
        url: &str,
        token: Option<&str>,
        ca: Option<&std::path::Path>,
        timeout: Duration,
    ) -> Result<Self, PushError> {
        Self::with_identity(url, token, ca, None, timeout)
    }

    /// [`PushClient::new`] presenting the PEM client certificate and key of `identity` to an
    /// `https://` collector that authenticates agents by certificate.
    pub fn with_identity(
        url: &str,
        token: Option<&str>,
        ca: Option<&std::path::Path>,
        identity: Option<(&std::path::Path, &std::path::Path)>,
        timeout: Duration,
    ) -> Result<Self, PushError> {
        let bad = |reason: String| PushError::Url {
            url: url.to_string(),
            reason,
        };
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(bad("the scheme must be http:// or https://".into()));
        }
        let mut endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|e| bad(e.to_string()))?
            .connect_timeout(timeout)
            .timeout(timeout);
        let https = url.starts_with("https://");
        if let Some(ca) = ca
            && !https
        {
            return Err(PushError::Tls(format!(
                "--ca {} is given but the collector URL {url} is not https://",
                ca.display()
            )));
        }
        if https {
            let mut tls = tonic::transport::ClientTlsConfig::new();
            tls = match ca {
                Some(path) => {
                    let pem = std::fs::read(path).map_err(|e| {
                        PushError::Tls(format!("cannot read the CA file {}: {e}", path.display()))
                    })?;
                    if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                        return Err(PushError::Tls(format!(
                            "the CA file {} holds no PEM certificate",
                            path.display()
                        )));
                    }
                    tls.ca_certificate(tonic::transport::Certificate::from_pem(pem))
                }
                None => tls.with_native_roots(),
            };
            if let Some((cert, key)) = identity {
                let read = |p: &std::path::Path| {
                    std::fs::read(p).map_err(|e| {
                        PushError::Tls(format!(
                            "cannot read the client certificate file {}: {e}",
                            p.display()
                        ))
                    })
                };
                tls = tls.identity(tonic::transport::Identity::from_pem(
                    read(cert)?,
                    read(key)?,
                ));
            }
            endpoint = endpoint.tls_config(tls).map_err(|e| {
                PushError::Tls(format!("TLS set-up for {url}: {}", error_chain(&e)))
            })?;
        }
        let auth = match token {
            Some(t) => {
                let mut v: tonic::metadata::MetadataValue<_> = format!("Bearer {t}")
                    .parse()
                    .map_err(|_| bad("the token has characters a header cannot carry".into()))?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| PushError::Unreachable(e.to_string()))?;
        Ok(Self {
            rt,
            endpoint,
            channel: None,
            auth,
            path: PUSH_PATH,
        })
    }

    /// The same client calling another unary gRPC method (e.g. OTLP's profiles export).
    pub fn with_path(mut self, path: &'static str) -> Self {
        self.path = path;
        self
    }

    /// Sends one encoded `PushRequest` and waits for the acknowledgement.
    pub fn push(&mut self, body: Vec<u8>) -> Result<PushReply, PushError> {
        let reply = self.call(body)?;
        PushReply::decode(reply).map_err(|e| PushError::Reply(e.to_string()))
    }

    /// Sends one encoded request to the client's method; the encoded reply.
    pub fn call(&mut self, body: Vec<u8>) -> Result<Bytes, PushError> {
        let result = self.rt.block_on(Self::send(
            &self.endpoint,
            &mut self.channel,
            self.auth.clone(),
            self.path,
            body,
        ));
        if matches!(result, Err(PushError::Unreachable(_))) {
            // Reconnect from scratch next time: the collector may have restarted.
            self.channel = None;
        }
        result
    }

    async fn send(
        endpoint: &Endpoint,
        channel: &mut Option<Channel>,
        auth: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<Bytes, PushError> {
        let ch = match channel {
            Some(c) => c.clone(),
            None => {
                let c = endpoint
                    .connect()
                    .await
                    .map_err(|e| PushError::Unreachable(error_chain(&e)))?;
                *channel = Some(c.clone());
                c
            }
        };
        // Capture results come back through the same client (tonic's default is 4 MiB).
        let mut grpc = tonic::client::Grpc::new(ch).max_decoding_message_size(80 << 20);
        grpc.ready()
            .await
            .map_err(|e| PushError::Unreachable(error_chain(&e)))?;
        let mut req = tonic::Request::new(Bytes::from(body));
        if let Some(v) = auth {
            req.metadata_mut().insert("authorization", v);
        }
        let path = http::uri::PathAndQuery::from_static(path);
        match grpc.unary(req, path, RawCodec).await {
            Ok(reply) => Ok(reply.into_inner()),
            Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown) => {
                Err(PushError::Unreachable(s.message().to_string()))
            }
            Err(s) => Err(PushError::Refused {
                code: s.code(),
                message: s.message().to_string(),
            }),
        }
    }
}

/// Whether `url` names a collector on this host (loopback), where plain text stays local.
fn loopback(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses to send a token in plain text beyond this host unless `insecure` (anyone on the
/// way could read it and push or read as its owner), and a client certificate over plain
/// text at all (it would not be presented).
pub fn check_transport(
    url: &str,
    token: bool,
    identity: bool,
    insecure: bool,
) -> Result<(), PushError> {
    let plain = url.starts_with("http://");
    if plain && identity {
        return Err(PushError::Plaintext(format!(
            "--client-cert is for an https:// collector, and {url} is not"
        )));
    }
    if plain && token && !insecure && !loopback(url) {
        return Err(PushError::Plaintext(format!(
            "the collector {url} is plain http: the token would cross the network readable \
             by anyone on the way; use https:// (with --ca FILE for a private CA), or give \
             --insecure to send it anyway"
        )));
    }
    Ok(())
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        // Many errors repeat their source in their own message.
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token goes over plain http only to this host, or when told `insecure`; a client
    /// certificate only over https.
    #[test]
    fn tokens_travel_encrypted_unless_told_otherwise() {
        let err = check_transport("http://collector:4040", true, false, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("https://") && err.contains("--insecure"),
            "{err}"
        );
        for (url, insecure) in [
            ("https://collector:4040", false),
            ("http://collector:4040", true),
            ("http://127.0.0.1:4040", false),
            ("http://127.9.9.9:4040/", false),
            ("http://[::1]:4040", false),
            ("http://localhost:4040/", false),
            ("http://localhost", false),
        ] {
            assert!(
                check_transport(url, true, false, insecure).is_ok(),
                "{url} insecure={insecure}"
            );
        }
        for url in [
            "http://localhost.evil.example:4040",
            "http://10.0.0.1:4040",
            "http://[::2]:4040",
            "http://127.0.0.1.nip.io:4040",
        ] {
            assert!(check_transport(url, true, false, false).is_err(), "{url}");
        }
        assert!(
            check_transport("http://collector:4040", false, false, false).is_ok(),
            "no token, nothing to read"
        );
        let err = check_transport("http://127.0.0.1:4040", false, true, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("https://"), "{err}");
        assert!(check_transport("https://c:4040", true, true, false).is_ok());
    }
}
