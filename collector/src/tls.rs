//! TLS on the collector's one port: the server's certificate, and optionally the CA whose
//! client certificates authenticate agents (`--client-ca`). Connections are served by
//! [`crate::serve`].

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the TLS certificate {path}: {reason}")]
    Cert { path: String, reason: String },
    #[error("cannot read the TLS key {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("the TLS certificate and key do not go together: {0}")]
    Config(String),
    #[error("cannot use the client CA {path}: {reason}")]
    ClientCa { path: String, reason: String },
}

/// The server configuration from a PEM certificate chain and a PEM private key (PKCS#8,
/// PKCS#1 or SEC1), offering HTTP/2 for gRPC and HTTP/1.1 for browsers. With `client_ca`,
/// clients may present a certificate that CA signed (one it did not sign fails the
/// handshake); clients without one still connect, and authenticate with a token.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| TlsError::Cert {
            path: cert.display().to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Cert {
            path: cert.display().to_string(),
            reason: "no PEM certificate in it".into(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
        path: key.display().to_string(),
        reason: e.to_string(),
    })?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let bad = |reason: String| TlsError::ClientCa {
                path: path.display().to_string(),
                reason,
            };
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
                roots
                    .add(c.map_err(|e| bad(e.to_string()))?)
                    .map_err(|e| bad(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(bad("no PEM certificate in it".into()));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| bad(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
