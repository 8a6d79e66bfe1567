//! What one tenant may send and ask, Pyroscope's per-tenant validation limits as the model:
//! every count and size of a push is checked against these before anything is allocated for
//! it, and a refusal names the limit and the value that broke it. Each is a flag and a key of
//! the config file (`[limits]`, and `[tenants.NAME.limits]` for one tenant); the defaults fit
//! a node agent pushing every 10 s with room to spare.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Limits of one tenant. Sizes in bytes, counts per push unless said otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest push (gRPC message, uncompressed: compressed messages are refused).
    pub max_push_bytes: usize,
    pub max_samples: usize,
    pub max_sample_types: usize,
    /// Frames of one stack, inlined functions counted one by one; a deeper stack keeps its
    /// leaf-most frames under a `[truncated]` root rather than refusing the push.
    pub max_stack_depth: usize,
    pub max_locations: usize,
    pub max_mappings: usize,
    pub max_functions: usize,
    /// Entries of the push's string table.
    pub max_strings: usize,
    /// Bytes of any one string (frame names, file names, sample type names).
    pub max_string_bytes: usize,
    pub max_labels_per_sample: usize,
    pub max_label_name_bytes: usize,
    pub max_label_value_bytes: usize,
    /// Entries of each table of an OTLP request's dictionary (and of its stack table).
    pub max_dictionary_entries: usize,
    /// Memory one push may decode into (its rows, and the names, stacks and label sets new to
    /// the collector), per byte pushed: a pprof stack names its locations by id, so a few
    /// bytes can stand for thousands of frames. An agent's pushes decode into 2 to 13 bytes
    /// per byte.
    pub max_expansion: usize,
    /// Label sets a tenant keeps (retention removes unused ones); samples of new label sets
    /// beyond it are refused and counted.
    pub max_label_sets: usize,
    /// Sustained ingest rate, MiB of pushes per second (0: unlimited).
    pub ingest_rate_mb: f64,
    /// Pushes allowed at once beyond the rate, in MiB (at least one largest push).
    pub ingest_burst_mb: f64,
    /// Queries of one tenant running at once; more wait their turn (up to the timeout).
    pub max_concurrent_queries: usize,
    /// How long a query may run (or wait for its turn) before it is answered 503.
    #[serde(with = "seconds")]
    pub query_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_push_bytes: 16 << 20,
            max_samples: 250_000,
            max_sample_types: 32,
            max_stack_depth: 4096,
            max_locations: 500_000,
            max_mappings: 10_000,
            max_functions: 500_000,
            max_strings: 1_000_000,
            max_string_bytes: 4096,
            max_labels_per_sample: 64,
            max_label_name_bytes: 1024,
            max_label_value_bytes: 2048,
            max_dictionary_entries: 500_000,
            max_expansion: 32,
            max_label_sets: 100_000,
            ingest_rate_mb: 64.0,
            ingest_burst_mb: 128.0,
            max_concurrent_queries: 4,
            query_timeout: Duration::from_secs(30),
        }
    }
}

/// A push over one of the limits: names the limit (as the config file spells it), the value
/// and the limit, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {value}, more than the limit of {limit} ({key})")]
pub struct LimitError {
    /// The config key, also the `reason` of the refusal on `/metrics`.
    pub key: &'static str,
    pub what: &'static str,
    pub value: u64,
    pub limit: u64,
}

impl Limits {
    /// `Err` when `value` is over the limit `key`, whose value is `limit`.
    pub fn check(
        key: &'static str,
        what: &'static str,
        value: usize,
        limit: usize,
    ) -> Result<(), LimitError> {
        if value > limit {
            return Err(LimitError {
                key,
                what,
                value: value as u64,
                limit: limit as u64,
            });
        }
        Ok(())
    }
}

/// The limits as flags, each overriding its config key for every tenant (`--max-samples N` is
/// `max_samples = N`).
#[derive(clap::Args, Debug, Default, Clone)]
#[command(next_help_heading = "Limits (per tenant; see the book's security page)")]
pub struct LimitFlags {
    /// Largest push, in bytes (default 16 MiB).
    #[arg(long, value_name = "BYTES")]
    pub max_push_bytes: Option<usize>,
    /// Samples per push (default 250000).
    #[arg(long, value_name = "N")]
    pub max_samples: Option<usize>,
    /// Sample types per push (default 32).
    #[arg(long, value_name = "N")]
    pub max_sample_types: Option<usize>,
    /// Frames of a stack, inlined ones included; deeper stacks are cut at the root (default 4096).
    #[arg(long, value_name = "N")]
    pub max_stack_depth: Option<usize>,
    /// Locations per push (default 500000).
    #[arg(long, value_name = "N")]
    pub max_locations: Option<usize>,
    /// Mappings per push (default 10000).
    #[arg(long, value_name = "N")]
    pub max_mappings: Option<usize>,
    /// Functions per push (default 500000).
    #[arg(long, value_name = "N")]
    pub max_functions: Option<usize>,
    /// Strings per push (default 1000000).
    #[arg(long, value_name = "N")]
    pub max_strings: Option<usize>,
    /// Bytes of one string (default 4096).
    #[arg(long, value_name = "BYTES")]
    pub max_string_bytes: Option<usize>,
    /// Labels of one sample (default 64).
    #[arg(long, value_name = "N")]
    pub max_labels_per_sample: Option<usize>,
    /// Bytes of a label name (default 1024).
    #[arg(long, value_name = "BYTES")]
    pub max_label_name_bytes: Option<usize>,
    /// Bytes of a label value (default 2048).
    #[arg(long, value_name = "BYTES")]
    pub max_label_value_bytes: Option<usize>,
    /// Entries of each table of an OTLP dictionary (default 500000).
    #[arg(long, value_name = "N")]
    pub max_dictionary_entries: Option<usize>,
    /// Bytes of rows and new names, stacks and label sets a push may decode into per byte
    /// pushed (default 32).
    #[arg(long, value_name = "N")]
    pub max_expansion: Option<usize>,
    /// Label sets a tenant keeps; samples of new ones beyond it are refused (default 100000).
    #[arg(long, value_name = "N")]
    pub max_label_sets: Option<usize>,
    /// Sustained ingest rate per tenant in MiB/s, 0 for none (default 64).
    #[arg(long, value_name = "MIB")]
    pub ingest_rate_mb: Option<f64>,
    /// Ingest burst per tenant in MiB (default 128).
    #[arg(long, value_name = "MIB")]
    pub ingest_burst_mb: Option<f64>,
    /// Queries of one tenant running at once (default 4; 1 with a clickhouse:// store).
    #[arg(long, value_name = "N")]
    pub max_concurrent_queries: Option<usize>,
    /// Seconds a query may run or wait for its turn (default 30).
    #[arg(long, value_name = "SECONDS")]
    pub query_timeout: Option<u64>,
}

impl LimitFlags {
    /// `limits` with every flag given put in.
    pub fn apply(&self, mut limits: Limits) -> Limits {
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f { limits.$f = v; } )* };
        }
        set!(
            max_push_bytes,
            max_samples,
            max_sample_types,
            max_stack_depth,
            max_locations,
            max_mappings,
            max_functions,
            max_strings,
            max_string_bytes,
            max_labels_per_sample,
            max_label_name_bytes,
            max_label_value_bytes,
            max_dictionary_entries,
            max_expansion,
            max_label_sets,
            ingest_rate_mb,
            ingest_burst_mb,
            max_concurrent_queries
        );
        if let Some(s) = self.query_timeout {
            limits.query_timeout = Duration::from_secs(s.max(1));
        }
        limits
    }
}

/// A duration in whole seconds, as the config file writes it.
mod seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = u64::deserialize(d)?;
        if s == 0 {
            return Err(serde::de::Error::custom("must be at least 1 second"));
        }
        Ok(Duration::from_secs(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_limit_and_the_value() {
        let e = Limits::check("max_samples", "samples", 300_000, 250_000).unwrap_err();
        assert_eq!(
            e.to_string(),
            "samples: 300000, more than the limit of 250000 (max_samples)"
        );
        assert!(Limits::check("max_samples", "samples", 250_000, 250_000).is_ok());
    }
}
