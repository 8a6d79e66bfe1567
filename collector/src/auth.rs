//! Who may do what. A token file maps bearer tokens, and client certificates by their
//! subject's common name, to a tenant and roles:
//!
//! ```text
//! # token (or cn:NAME)      tenant    roles
//! 3b8f0c...                 default   push,read
//! 91d2aa...                 ci        read
//! cn:node-17.ci.internal    ci        push
//! e7c1f9...                 default   admin
//! ```
//!
//! A file of one word is a token of the default tenant with `push` and `read` (the format of
//! before tenants). Roles: `push` sends profiles, `read` queries (the web UI's data, the API,
//! `/metrics`), `admin` reads `/metrics` and may read any tenant named by `X-Scope-OrgID`.
//! The file is read again on SIGHUP; a file that does not parse leaves the old one in force.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::tenant_name::{self, valid_tenant};

/// What a request wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Push,
    Read,
    Admin,
    /// Asking agents for on-demand captures and dumps (and reading their results).
    Capture,
}

/// What one credential allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Internal name: empty for the default tenant.
    pub tenant: String,
    pub push: bool,
    pub read: bool,
    pub admin: bool,
    pub capture: bool,
}

impl Grant {
    fn allows(&self, role: Role) -> bool {
        match role {
            Role::Push => self.push,
            Role::Read => self.read || self.admin,
            Role::Admin => self.admin,
            Role::Capture => self.capture || self.admin,
        }
    }
}

/// A parsed token file.
#[derive(Debug, Default)]
pub struct TokenFile {
    tokens: Vec<(Vec<u8>, Grant)>,
    certificates: HashMap<String, Grant>,
}

impl TokenFile {
    pub fn parse(text: &str) -> Result<Self, String> {
        let lines: Vec<(usize, &str)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
            .collect();
        let mut out = TokenFile::default();
        if let [(_, only)] = lines.as_slice()
            && !only.contains(char::is_whitespace)
        {
            out.add_token(only, default_grant())?;
            return Ok(out);
        }
        for (n, line) in lines {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [credential, tenant, roles] = fields[..] else {
                return Err(format!(
                    "line {n}: expected `TOKEN TENANT ROLES` (or `cn:NAME TENANT ROLES`), \
                     e.g. `3b8f0c... default push,read`"
                ));
            };
            let grant = grant(tenant, roles).map_err(|e| format!("line {n}: {e}"))?;
            match credential.strip_prefix("cn:") {
                Some(cn) if !cn.is_empty() => {
                    if out.certificates.insert(cn.to_string(), grant).is_some() {
                        return Err(format!("line {n}: cn:{cn} is listed twice"));
                    }
                }
                Some(_) => return Err(format!("line {n}: cn: names no certificate")),
                None => out
                    .add_token(credential, grant)
                    .map_err(|e| format!("line {n}: {e}"))?,
            }
        }
        if out.tokens.is_empty() && out.certificates.is_empty() {
            return Err("it holds no token".into());
        }
        Ok(out)
    }

    fn add_token(&mut self, token: &str, grant: Grant) -> Result<(), String> {
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("a token must be printable ASCII".into());
        }
        if self.tokens.iter().any(|(t, _)| t == token.as_bytes()) {
            return Err("a token is listed twice".into());
        }
        self.tokens.push((token.as_bytes().to_vec(), grant));
        Ok(())
    }

    /// The grant of `token`, comparing it with every token in constant time.
    fn token(&self, token: &[u8]) -> Option<&Grant> {
        let mut found = None;
        for (t, g) in &self.tokens {
            if equal(t, token) {
                found = Some(g);
            }
        }
        found
    }
}

fn default_grant() -> Grant {
    Grant {
        tenant: String::new(),
        push: true,
        read: true,
        admin: false,
        capture: false,
    }
}

fn grant(tenant: &str, roles: &str) -> Result<Grant, String> {
    if !valid_tenant(tenant) {
        return Err(format!(
            "'{tenant}' is not a tenant name (1 to 64 letters, digits, '-' or '_')"
        ));
    }
    let mut g = Grant {
        tenant: tenant_name::internal(tenant).to_string(),
        push: false,
        read: false,
        admin: false,
        capture: false,
    };
    for role in roles.split(',') {
        match role {
            "push" => g.push = true,
            "read" => g.read = true,
            "admin" => g.admin = true,
            "capture" => g.capture = true,
            other => {
                return Err(format!(
                    "unknown role '{other}': use push, read, capture or admin"
                ));
            }
        }
    }
    Ok(g)
}

/// Constant-time comparison, so response timing does not reveal how much of a token matched.
fn equal(want: &[u8], given: &[u8]) -> bool {
    given.len() == want.len()
        && given
            .iter()
            .zip(want)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Why a request was refused: the `reason` on `/metrics`, and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// No token, certificate or trusted tenant header (401).
    Missing,
    /// A token no entry of the token file holds (401).
    WrongToken,
    /// Credentials without the role, or a certificate the token file does not list (403).
    Forbidden(String),
}

impl Denied {
    pub fn reason(&self) -> &'static str {
        match self {
            Denied::Missing => "missing",
            Denied::WrongToken => "wrong_token",
            Denied::Forbidden(_) => "forbidden",
        }
    }

    pub fn message(&self) -> String {
        match self {
            Denied::Missing => {
                "authentication required: send `Authorization: Bearer TOKEN` (a token of the \
                 collector's token file) or a client certificate"
                    .into()
            }
            Denied::WrongToken => "wrong bearer token".into(),
            Denied::Forbidden(why) => why.clone(),
        }
    }

    /// 401 or 403.
    pub fn unauthenticated(&self) -> bool {
        !matches!(self, Denied::Forbidden(_))
    }
}

/// The verified client certificate of a connection: its subject's common name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCertificate(pub String);

/// How requests are authenticated, shared by every connection.
pub struct Auth {
    tokens: RwLock<Option<Arc<TokenFile>>>,
    token_path: Option<PathBuf>,
    /// Client certificates are verified by the TLS layer (`--client-ca`).
    client_certificates: bool,
    /// `X-Scope-OrgID` names the tenant of requests without credentials (`--trust-tenant-header`).
    trust_tenant_header: bool,
    /// `/metrics` answers without credentials.
    pub public_metrics: bool,
}

impl Auth {
    /// No credentials needed: everything is the default tenant's (or the trusted header's).
    pub fn open() -> Self {
        Self {
            tokens: RwLock::new(None),
            token_path: None,
            client_certificates: false,
            trust_tenant_header: false,
            public_metrics: false,
        }
    }

    /// Tokens from `text` (as a token file holds them), for tests and embedding.
    pub fn with_tokens(mut self, text: &str) -> Result<Self, String> {
        self.tokens = RwLock::new(Some(Arc::new(TokenFile::parse(text)?)));
        Ok(self)
    }

    /// Tokens from the file at `path`, read again by [`Auth::reload`].
    pub fn with_token_file(mut self, path: &Path) -> Result<Self, String> {
        self.token_path = Some(path.to_path_buf());
        self.tokens = RwLock::new(Some(Arc::new(read(path)?)));
        Ok(self)
    }

    pub fn with_client_certificates(mut self, on: bool) -> Self {
        self.client_certificates = on;
        self
    }

    pub fn trusting_tenant_header(mut self, on: bool) -> Self {
        self.trust_tenant_header = on;
        self
    }

    /// Whether requests need credentials at all.
    pub fn required(&self) -> bool {
        self.client_certificates || self.token_file().is_some()
    }

    fn token_file(&self) -> Option<Arc<TokenFile>> {
        self.tokens
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Reads the token file again; on an error the old one stays in force.
    pub fn reload(&self) -> Result<(), String> {
        let Some(path) = &self.token_path else {
            return Ok(());
        };
        let fresh = read(path)?;
        *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(fresh));
        Ok(())
    }

    /// The tenant (internal name) a request acts for, if it may do `role`. `authorization`
    /// is the header's value, `org` the `X-Scope-OrgID` header's.
    pub fn authorize(
        &self,
        authorization: Option<&[u8]>,
        certificate: Option<&PeerCertificate>,
        org: Option<&[u8]>,
        role: Role,
    ) -> Result<String, Denied> {
        let header_tenant = || -> Result<Option<String>, Denied> {
            let Some(org) = org else { return Ok(None) };
            let name = std::str::from_utf8(org).unwrap_or("");
            if !valid_tenant(name) {
                return Err(Denied::Forbidden(format!(
                    "X-Scope-OrgID '{}' is not a tenant name (1 to 64 letters, digits, '-' or '_')",
                    name.chars().take(64).collect::<String>()
                )));
            }
            Ok(Some(tenant_name::internal(name).to_string()))
        };
        let file = self.token_file();
        let grant = match (authorization, &file) {
            (Some(h), Some(file)) => {
                let token = h.strip_prefix(b"Bearer ").ok_or(Denied::WrongToken)?;
                Some(file.token(token).ok_or(Denied::WrongToken)?.clone())
            }
            _ => match (certificate, &file) {
                (Some(PeerCertificate(cn)), Some(file)) => {
                    Some(file.certificates.get(cn).cloned().ok_or_else(|| {
                        Denied::Forbidden(format!(
                            "the client certificate cn:{cn} is not in the collector's token file"
                        ))
                    })?)
                }
                // Without a token file, every certificate the CA signed is the default
                // tenant's.
                (Some(_), None) => Some(default_grant()),
                _ => None,
            },
        };
        match grant {
            Some(g) => {
                if !g.allows(role) {
                    return Err(Denied::Forbidden(format!(
                        "these credentials (tenant {}) may not {}",
                        tenant_name::display(&g.tenant),
                        match role {
                            Role::Push => "push",
                            Role::Read => "read",
                            Role::Admin => "administer",
                            Role::Capture => "request captures (the capture role)",
                        }
                    )));
                }
                // A token's tenant wins; an admin may read another tenant by naming it.
                if g.admin
                    && role == Role::Read
                    && let Some(t) = header_tenant()?
                {
                    return Ok(t);
                }
                Ok(g.tenant)
            }
            None if self.trust_tenant_header && header_tenant()?.is_some() => {
                Ok(header_tenant()?.unwrap_or_default())
            }
            None if !self.required() => Ok(String::new()),
            None => Err(Denied::Missing),
        }
    }
}

fn read(path: &Path) -> Result<TokenFile, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
    TokenFile::parse(&text).map_err(|e| format!("the token file {}: {e}", path.display()))
}

/// The subject common name of a DER certificate (the first one, UTF-8 or printable), read
/// with a small DER walk: `Name ::= SEQUENCE OF SET OF SEQUENCE { OID, value }`.
pub fn common_name(der: &[u8]) -> Option<String> {
    let der = rustls_pki_types::CertificateDer::from(der);
    let cert = webpki::EndEntityCert::try_from(&der).ok()?;
    let mut name = cert.subject();
    while !name.is_empty() {
        let (tag, set, rest) = der_item(name)?;
        name = rest;
        if tag != 0x31 {
            continue;
        }
        let mut set = set;
        while !set.is_empty() {
            let (tag, atv, rest) = der_item(set)?;
            set = rest;
            if tag != 0x30 {
                continue;
            }
            let (oid_tag, oid, value) = der_item(atv)?;
            // 2.5.4.3, commonName.
            if oid_tag == 0x06 && oid == [0x55, 0x04, 0x03] {
                let (_, text, _) = der_item(value)?;
                return std::str::from_utf8(text).ok().map(String::from);
            }
        }
    }
    None
}

/// One DER item: `(tag, contents, rest)`.
fn der_item(data: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = data.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |l, &b| (l << 8) | usize::from(b));
        rest = &rest[n..];
        len
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "# token tenant roles\n\
        tok-default-0123456  default push,read\n\
        tok-ci-read-0123456  ci      read\n\
        tok-ci-push-0123456  ci      push\n\
        tok-admin-012345678  default admin\n\
        cn:node-1.ci         ci      push\n";

    fn bearer(t: &str) -> Vec<u8> {
        format!("Bearer {t}").into_bytes()
    }

    #[test]
    fn tokens_certificates_and_headers() {
        let auth = Auth::open().with_tokens(FILE).unwrap();
        let a = |token: Option<&str>, cert: Option<&str>, org: Option<&str>, role| {
            let b = token.map(bearer);
            let c = cert.map(|c| PeerCertificate(c.into()));
            auth.authorize(b.as_deref(), c.as_ref(), org.map(str::as_bytes), role)
        };
        assert_eq!(
            a(Some("tok-default-0123456"), None, None, Role::Push),
            Ok("".into())
        );
        assert_eq!(
            a(Some("tok-ci-read-0123456"), None, None, Role::Read),
            Ok("ci".into())
        );
        assert!(matches!(
            a(Some("tok-ci-read-0123456"), None, None, Role::Push),
            Err(Denied::Forbidden(_))
        ));
        // A token's tenant wins over the header.
        assert_eq!(
            a(
                Some("tok-ci-read-0123456"),
                None,
                Some("default"),
                Role::Read
            ),
            Ok("ci".into())
        );
        assert_eq!(
            a(Some("nope"), None, None, Role::Read),
            Err(Denied::WrongToken)
        );
        assert_eq!(a(None, None, None, Role::Read), Err(Denied::Missing));
        assert_eq!(a(None, None, Some("ci"), Role::Read), Err(Denied::Missing));
        assert_eq!(
            a(None, Some("node-1.ci"), None, Role::Push),
            Ok("ci".into())
        );
        assert!(matches!(
            a(None, Some("node-2.ci"), None, Role::Push),
            Err(Denied::Forbidden(_))
        ));
        // An admin reads /metrics, and any tenant it names.
        assert_eq!(
            a(Some("tok-admin-012345678"), None, Some("ci"), Role::Read),
            Ok("ci".into())
        );
        assert!(a(Some("tok-admin-012345678"), None, None, Role::Admin).is_ok());
        assert!(a(Some("tok-default-0123456"), None, None, Role::Admin).is_err());

        let proxy = Auth::open().trusting_tenant_header(true);
        assert_eq!(
            proxy.authorize(None, None, Some(b"ci"), Role::Push),
            Ok("ci".into())
        );
        assert_eq!(proxy.authorize(None, None, None, Role::Push), Ok("".into()));
        assert!(
            proxy
                .authorize(None, None, Some(b"a/b"), Role::Push)
                .is_err()
        );
        // Without the flag the header means nothing.
        assert_eq!(
            Auth::open().authorize(None, None, Some(b"ci"), Role::Read),
            Ok("".into())
        );
    }

    #[test]
    fn the_old_one_token_file_is_the_default_tenants_push_and_read() {
        let auth = Auth::open().with_tokens("s3cret\n").unwrap();
        assert_eq!(
            auth.authorize(Some(&bearer("s3cret")), None, None, Role::Read),
            Ok("".into())
        );
        assert_eq!(
            auth.authorize(Some(&bearer("s3cret")), None, None, Role::Push),
            Ok("".into())
        );
        assert!(
            auth.authorize(Some(&bearer("s3cres")), None, None, Role::Push)
                .is_err()
        );
        assert!(
            auth.authorize(Some(&bearer("s3cret2")), None, None, Role::Push)
                .is_err()
        );
        assert!(
            auth.authorize(Some(b"s3cret"), None, None, Role::Push)
                .is_err()
        );
    }

    #[test]
    fn bad_files_say_where() {
        for (text, says) in [
            ("", "holds no token"),
            ("a b\n", "line 1: expected"),
            ("t x/y read\n", "line 1: 'x/y' is not a tenant"),
            ("t ci write\n", "unknown role 'write'"),
            ("t ci read\nt ci push\n", "line 2: a token is listed twice"),
            ("cn: ci read\n", "names no certificate"),
        ] {
            let e = TokenFile::parse(text).unwrap_err();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }
}
