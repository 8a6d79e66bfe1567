//! The collector's config file (`--config FILE`, TOML): the limits of every tenant under
//! `[limits]`, and one tenant's own under `[tenants.NAME.limits]`. A flag wins over `[limits]`;
//! a tenant's own key wins over both, being the more particular.
//!
//! ```toml
//! [limits]
//! max_label_sets = 200000
//! query_timeout = 20
//!
//! [tenants.ci.limits]
//! max_label_sets = 5000
//! ingest_rate_mb = 4
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::limits::{LimitFlags, Limits};
use crate::tenant_name::valid_tenant;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the config file {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("the config file {path}: {reason}")]
    Parse { path: String, reason: String },
}

/// The limits the config file and the flags give.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    /// Of every tenant without limits of its own.
    pub limits: Limits,
    /// Tenants with limits of their own (complete: the keys they leave out come from
    /// [`Config::limits`]).
    pub tenants: BTreeMap<String, Limits>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Raw {
    #[serde(default)]
    limits: toml::Table,
    #[serde(default)]
    tenants: BTreeMap<String, RawTenant>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    #[serde(default)]
    limits: toml::Table,
}

/// `base` with the keys of `table` put in (unknown keys and wrong types refused).
fn overlay(base: &Limits, table: &toml::Table) -> Result<Limits, String> {
    let mut t = toml::Table::try_from(base).map_err(|e| e.to_string())?;
    for (k, v) in table {
        if !t.contains_key(k) {
            return Err(format!("unknown limit '{k}'"));
        }
        t.insert(k.clone(), v.clone());
    }
    Limits::deserialize(t).map_err(|e| e.to_string())
}

impl Config {
    /// The config of `path` (none: the defaults) with `flags` put in.
    pub fn load(path: Option<&Path>, flags: &LimitFlags) -> Result<Self, ConfigError> {
        let raw = match path {
            None => Raw::default(),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError::Read {
                    path: p.display().to_string(),
                    reason: e.to_string(),
                })?;
                Self::parse_raw(&text).map_err(|reason| ConfigError::Parse {
                    path: p.display().to_string(),
                    reason,
                })?
            }
        };
        Self::from_raw(raw, flags).map_err(|reason| ConfigError::Parse {
            path: path.map_or_else(String::new, |p| p.display().to_string()),
            reason,
        })
    }

    /// The config of the text of a config file, without flags (for tests).
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::from_raw(Self::parse_raw(text)?, &LimitFlags::default())
    }

    fn parse_raw(text: &str) -> Result<Raw, String> {
        toml::from_str(text).map_err(|e| e.message().to_string())
    }

    fn from_raw(raw: Raw, flags: &LimitFlags) -> Result<Self, String> {
        let limits = flags.apply(overlay(&Limits::default(), &raw.limits)?);
        let mut tenants = BTreeMap::new();
        for (name, t) in raw.tenants {
            if !valid_tenant(&name) {
                return Err(format!(
                    "tenant '{name}': a tenant name is 1 to 64 letters, digits, '-' or '_'"
                ));
            }
            let own = overlay(&limits, &t.limits).map_err(|e| format!("tenant '{name}': {e}"))?;
            tenants.insert(name, own);
        }
        Ok(Self { limits, tenants })
    }

    /// The limits of `tenant`.
    pub fn limits(&self, tenant: &str) -> &Limits {
        self.tenants.get(tenant).unwrap_or(&self.limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_limits_and_a_tenants_own_over_both() {
        let c = Config::parse(
            "[limits]\nmax_samples = 10\nmax_label_sets = 7\n\
             [tenants.ci.limits]\nmax_label_sets = 3\nquery_timeout = 5\n",
        )
        .unwrap();
        assert_eq!(c.limits.max_samples, 10);
        assert_eq!(c.limits("ci").max_label_sets, 3);
        assert_eq!(c.limits("ci").max_samples, 10, "inherited");
        assert_eq!(c.limits("ci").query_timeout.as_secs(), 5);
        assert_eq!(c.limits("other").max_label_sets, 7);
        let flags = LimitFlags {
            max_samples: Some(99),
            ..Default::default()
        };
        let raw = Config::parse_raw("[limits]\nmax_samples = 10\n").unwrap();
        assert_eq!(
            Config::from_raw(raw, &flags).unwrap().limits.max_samples,
            99
        );
    }

    #[test]
    fn mistakes_are_named() {
        for (text, says) in [
            ("[limits]\nmax_sampels = 1\n", "unknown limit 'max_sampels'"),
            ("[limits]\nmax_samples = \"x\"\n", "invalid type"),
            ("[tenants.\"a b\".limits]\n", "tenant 'a b'"),
            ("[limit]\n", "unknown field"),
            ("[limits]\nquery_timeout = 0\n", "at least 1 second"),
        ] {
            let e = Config::parse(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
