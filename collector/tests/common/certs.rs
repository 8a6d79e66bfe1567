//! Certificates for tests, made by openssl in the test's own directory: CAs, and server and
//! client certificates they sign (EC P-256 keys, valid for two days). Shared by the
//! collector's tests and the e2e tests.

// Each user (collector tests, e2e tests, the store benchmark) needs only part of it.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// The extensions of a server certificate for 127.0.0.1 and localhost.
pub const SERVER: &str = "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
                          extendedKeyUsage=serverAuth\n";

/// The extensions of a client certificate.
pub const CLIENT: &str = "extendedKeyUsage=clientAuth\n";

const NEW_EC_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl (cargo xtask deps installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA in `dir`: `NAME.pem` and `NAME.key`, its subject `CN=NAME`.
pub fn ca(dir: &Path, name: &str) {
    let (key, pem, subject) = (
        format!("{name}.key"),
        format!("{name}.pem"),
        format!("/CN={name}"),
    );
    openssl(
        dir,
        &[
            &["req", "-x509"][..],
            &NEW_EC_KEY,
            &[
                "-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subject,
            ],
        ]
        .concat(),
    );
}

/// A certificate for `cn` with the extensions `ext`, signed by the CA `ca` (made by [`ca`]
/// in the same `dir`): `NAME.pem` and `NAME.key`.
pub fn sign(dir: &Path, name: &str, cn: &str, ca: &str, ext: &str) {
    let file = |suffix: &str| format!("{name}.{suffix}");
    let subject = format!("/CN={cn}");
    openssl(
        dir,
        &[
            &["req"][..],
            &NEW_EC_KEY,
            &[
                "-keyout",
                &file("key"),
                "-out",
                &file("csr"),
                "-subj",
                &subject,
            ],
        ]
        .concat(),
    );
    std::fs::write(dir.join(file("ext")), ext).unwrap();
    let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &file("csr"),
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &file("pem"),
            "-days",
            "2",
            "-extfile",
            &file("ext"),
        ],
    );
}
