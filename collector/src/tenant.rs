//! What each tenant may use at run time: its limits, its ingest rate, its query slots. Who a
//! request acts for is decided in [`crate::auth`]; how tenants are named, in
//! [`crate::tenant_name`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Config;
use crate::limits::Limits;
use crate::tenant_name::display;

/// Tenants with run-time state beyond this are refused new state (a trusted proxy could
/// otherwise name unboundedly many).
const MAX_TENANTS: usize = 10_000;

/// Per-tenant state: limits from the config, an ingest rate bucket, query slots.
pub struct Tenants {
    config: Config,
    state: Mutex<HashMap<String, Arc<State>>>,
}

struct State {
    /// Bytes that may be pushed now, and when it was last filled.
    bucket: Mutex<(f64, Instant)>,
    queries: Arc<Semaphore>,
}

/// Why a tenant's request must wait: answered 429 / `ResourceExhausted` (or 503 for a query
/// whose turn did not come), retryable.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Busy {
    #[error(
        "tenant {tenant} pushes more than its ingest rate of {rate} MiB/s (ingest_rate_mb): \
         the push is kept by the agent and sent again"
    )]
    Rate { tenant: String, rate: f64 },
    #[error(
        "tenant {tenant} has {slots} queries running (max_concurrent_queries) and none ended \
         within {seconds} s: try again"
    )]
    Queries {
        tenant: String,
        slots: usize,
        seconds: u64,
    },
    #[error("too many tenants are active ({MAX_TENANTS})")]
    Tenants,
}

impl Tenants {
    pub fn new(config: Config) -> Self {
        Self {
            config,
            state: Mutex::new(HashMap::new()),
        }
    }

    pub fn limits(&self, tenant: &str) -> &Limits {
        self.config.limits(tenant)
    }

    /// The largest push any tenant may send (what the gRPC layer reads at most).
    pub fn max_push_bytes(&self) -> usize {
        self.config
            .tenants
            .values()
            .map(|l| l.max_push_bytes)
            .fold(self.config.limits.max_push_bytes, usize::max)
    }

    fn state(&self, tenant: &str) -> Result<Arc<State>, Busy> {
        let mut m = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = m.get(tenant) {
            return Ok(s.clone());
        }
        if m.len() >= MAX_TENANTS {
            return Err(Busy::Tenants);
        }
        let limits = self.limits(tenant);
        let s = Arc::new(State {
            bucket: Mutex::new((burst(limits), Instant::now())),
            queries: Arc::new(Semaphore::new(limits.max_concurrent_queries.max(1))),
        });
        m.insert(tenant.to_string(), s.clone());
        Ok(s)
    }

    /// Takes `bytes` from the tenant's ingest rate, or says it must wait.
    pub fn admit_push(&self, tenant: &str, bytes: usize) -> Result<(), Busy> {
        let limits = self.limits(tenant);
        if limits.ingest_rate_mb <= 0.0 {
            return Ok(());
        }
        let state = self.state(tenant)?;
        let mut bucket = state.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let rate = limits.ingest_rate_mb * MIB;
        let (tokens, at) = *bucket;
        let tokens = (tokens + rate * now.duration_since(at).as_secs_f64()).min(burst(limits));
        let bytes = bytes as f64;
        if bytes > tokens {
            *bucket = (tokens, now);
            return Err(Busy::Rate {
                tenant: display(tenant).to_string(),
                rate: limits.ingest_rate_mb,
            });
        }
        *bucket = (tokens - bytes, now);
        Ok(())
    }

    /// A query slot of the tenant, waiting for one at most its query timeout.
    pub async fn query_slot(&self, tenant: &str) -> Result<OwnedSemaphorePermit, Busy> {
        let limits = self.limits(tenant);
        let state = self.state(tenant)?;
        let busy = || Busy::Queries {
            tenant: display(tenant).to_string(),
            slots: limits.max_concurrent_queries,
            seconds: limits.query_timeout.as_secs(),
        };
        match tokio::time::timeout(limits.query_timeout, state.queries.clone().acquire_owned())
            .await
        {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(busy()),
        }
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// Bytes a tenant may push at once: its burst, and never less than one largest push.
fn burst(limits: &Limits) -> f64 {
    (limits.ingest_burst_mb * MIB).max(limits.max_push_bytes as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingest_rate_and_query_slots_are_per_tenant() {
        let config = Config::parse(
            "[tenants.slow.limits]\ningest_rate_mb = 1\ningest_burst_mb = 1\n\
             max_push_bytes = 1048576\nmax_concurrent_queries = 1\nquery_timeout = 1\n",
        )
        .unwrap();
        let t = Tenants::new(config);
        assert!(t.admit_push("slow", 1 << 20).is_ok());
        let e = t.admit_push("slow", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("ingest_rate_mb"), "{e}");
        assert!(
            t.admit_push("", 1 << 20).is_ok(),
            "other tenants are not slowed"
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let held = t.query_slot("slow").await.unwrap();
            let e = t.query_slot("slow").await.unwrap_err();
            assert!(e.to_string().contains("max_concurrent_queries"), "{e}");
            assert!(t.query_slot("").await.is_ok());
            drop(held);
            assert!(t.query_slot("slow").await.is_ok());
        });
    }
}
