//! How tenants are named: who a request acts for is the collector's decision (from the token
//! or client certificate, or a trusted proxy's `X-Scope-OrgID`), never the request's, and the
//! name it decides on is one of these.

/// Whether `name` can name a tenant: 1 to 64 ASCII letters, digits, `-` or `_`.
pub fn valid_tenant(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// How the default tenant is written in token files, headers and messages; inside the
/// collector it is the empty name (its samples carry no tenant label).
pub const DEFAULT_TENANT: &str = "default";

/// The tenant's name inside the collector: `default` is the empty name.
pub fn internal(name: &str) -> &str {
    if name == DEFAULT_TENANT { "" } else { name }
}

/// The tenant's name in messages.
pub fn display(tenant: &str) -> &str {
    if tenant.is_empty() {
        DEFAULT_TENANT
    } else {
        tenant
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_tenant("team-a_1"));
        for bad in ["", "a b", "a/b", "ä", &"x".repeat(65)] {
            assert!(!valid_tenant(bad), "{bad}");
        }
        assert_eq!(internal("default"), "");
        assert_eq!(display(""), "default");
        assert_eq!(internal("ci"), "ci");
    }
}
