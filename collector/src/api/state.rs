//! What every handler shares: the store, the limits, the metrics.

use std::sync::Arc;

use crate::ingest::Limits;
use crate::metrics::Metrics;
use crate::store::Store;

pub struct AppState {
    pub store: Arc<dyn Store>,
    /// The bearer token pushes must carry; `None` accepts every push.
    pub token: Option<String>,
    pub limits: Limits,
    /// How long samples are kept: older batches are refused.
    pub retention: std::time::Duration,
    pub metrics: Metrics,
}
