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
    /// Largest gRPC message accepted, in bytes.
    pub max_message_bytes: usize,
    pub metrics: Metrics,
}
