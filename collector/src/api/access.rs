//! Reads are authenticated when pushes are: every data endpoint takes a [`Reader`], the
//! tenant its credentials name (401/403 otherwise), and selects only that tenant's samples.
//! Queries run in the tenant's query slots, at most its query timeout.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::error::ApiError;
use crate::api::state::AppState;
use crate::auth::{Denied, PeerCertificate, Role};
use crate::store::{LabelSet, Store, StoreError, TENANT_LABEL, with_deadline};
use crate::tenant_name;

/// The tenant (internal name) a read acts for.
pub struct Reader(pub String);

impl Reader {
    /// Whether a label set is this tenant's.
    pub fn owns(&self, labels: &LabelSet) -> bool {
        labels.get(TENANT_LABEL).map_or("", String::as_str) == self.0
    }
}

/// The tenant a request may act for in `role`, from its headers and client certificate.
pub fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    certificate: Option<&PeerCertificate>,
    role: Role,
) -> Result<String, Denied> {
    let result = state.auth.authorize(
        headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes),
        certificate,
        headers.get("x-scope-orgid").map(HeaderValue::as_bytes),
        role,
    );
    if let Err(e) = &result {
        state.metrics.auth_failures.add(e.reason());
    }
    result
}

/// The answer to a refused request: 401 (with `WWW-Authenticate`) or 403, as JSON.
pub fn denied(e: &Denied) -> Response {
    if e.unauthenticated() {
        let mut r = ApiError::new(StatusCode::UNAUTHORIZED, e.message()).into_response();
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"pyrometer\""),
        );
        r
    } else {
        ApiError::new(StatusCode::FORBIDDEN, e.message()).into_response()
    }
}

/// The gRPC answer to a refused call: `UNAUTHENTICATED` or `PERMISSION_DENIED`.
pub fn denied_status(e: &Denied) -> tonic::Status {
    if e.unauthenticated() {
        tonic::Status::unauthenticated(e.message())
    } else {
        tonic::Status::permission_denied(e.message())
    }
}

/// Whether a request is protobuf over gRPC (`application/grpc` or `application/grpc+proto`):
/// what the hand-written gRPC services decode, and not a form a browser page can send.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "application/grpc" || v.starts_with("application/grpc+proto"))
}

impl FromRequestParts<Arc<AppState>> for Reader {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let cert = parts.extensions.get::<PeerCertificate>();
        authorize(state, &parts.headers, cert, Role::Read)
            .map(Reader)
            .map_err(|e| denied(&e))
    }
}

/// Runs `query` against the store on a blocking thread, in one of the tenant's query slots
/// and within its query timeout (the stores stop at the deadline; the answer is 503).
pub async fn run_query<T: Send + 'static>(
    state: &Arc<AppState>,
    reader: &Reader,
    query: impl FnOnce(&dyn Store) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let limits = state.tenants.limits(&reader.0);
    let timeout = limits.query_timeout;
    let started = Instant::now();
    let slot = state
        .tenants
        .query_slot(&reader.0)
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    let deadline = started + timeout;
    let store = state.store.clone();
    let work = tokio::task::spawn_blocking(move || {
        // Held until the work really ends, so a query past its deadline still counts.
        let _slot = slot;
        with_deadline(deadline, || query(store.as_ref()))
    });
    let late = || {
        state
            .metrics
            .queries_timed_out
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the query ran longer than tenant {}'s query timeout of {} s (query_timeout): \
                 narrow its range or labels",
                tenant_name::display(&reader.0),
                timeout.as_secs()
            ),
        )
    };
    // A little grace: a store that stops at the deadline answers with its own error.
    match tokio::time::timeout_at((deadline + std::time::Duration::from_secs(1)).into(), work).await
    {
        Ok(Ok(Err(e))) if e.is_timeout() => Err(late()),
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(ApiError::internal(e)),
        Err(_) => Err(late()),
    }
}

/// Runs `f` (rendering an answer: pprof, SVG, JSON of thousands of stacks) on a blocking
/// thread: on the runtime's few workers it would hold up the pushes they also serve.
pub async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ApiError::internal)
}

/// A store error as an API error (see [`ApiError::store`]).
pub fn store_error(state: &AppState, e: StoreError) -> ApiError {
    ApiError::store(&state.metrics, e)
}
