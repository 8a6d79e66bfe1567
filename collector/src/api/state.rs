//! What every handler shares: the store, who may do what, each tenant's limits, the metrics.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::Auth;
use crate::captures::Captures;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::Store;
use crate::tenant::Tenants;

pub struct AppState {
    pub store: Arc<dyn Store>,
    pub auth: Auth,
    pub tenants: Tenants,
    /// How long samples are kept: older batches are refused.
    pub retention: Duration,
    pub metrics: Arc<Metrics>,
    /// On-demand captures and dumps, and the agents polling for them.
    pub captures: Captures,
}

impl AppState {
    /// Over `store`, open to everyone (as on loopback), the default limits, a week kept.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            auth: Auth::open(),
            tenants: Tenants::new(Config::default()),
            retention: Duration::from_secs(7 * 86_400),
            metrics: Arc::default(),
            captures: Captures::default(),
        }
    }

    pub fn with_auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }

    pub fn with_config(mut self, config: Config) -> Self {
        self.tenants = Tenants::new(config);
        self
    }

    pub fn with_captures(mut self, captures: Captures) -> Self {
        self.captures = captures;
        self
    }

    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }
}
