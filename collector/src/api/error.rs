//! The one error type of the HTTP API: a status and a one-line message, answered as JSON.

use std::sync::atomic::Ordering::Relaxed;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::metrics::Metrics;
use crate::store::StoreError;

/// A JSON error body: `{"error": "...", "code": 400}`.
#[derive(Debug)]
pub struct ApiError {
    code: StatusCode,
    message: String,
    /// The store stopped the query at its deadline.
    timed_out: bool,
}

impl ApiError {
    pub(crate) fn new(code: StatusCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            timed_out: false,
        }
    }

    pub(crate) fn is_timeout(&self) -> bool {
        self.timed_out
    }

    pub(crate) fn bad_request(message: impl ToString) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message.to_string())
    }

    /// The same error, its message naming the parameter group it came from.
    pub(crate) fn prefixed(self, what: &str) -> Self {
        Self {
            code: self.code,
            message: format!("{what}: {}", self.message),
            timed_out: self.timed_out,
        }
    }

    #[cfg(test)]
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn internal(message: impl ToString) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message.to_string())
    }

    /// 503 with the reason when the store is unavailable (counted on `/metrics`), 500
    /// otherwise.
    pub(crate) fn store(metrics: &Metrics, e: StoreError) -> Self {
        if matches!(e, StoreError::Timeout) {
            return Self {
                timed_out: true,
                ..Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            };
        }
        if e.is_unavailable() {
            metrics.queries_unavailable.fetch_add(1, Relaxed);
            Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        } else {
            Self::internal(e)
        }
    }
}

impl ApiError {
    /// The same error as a gRPC status, for the hand-written gRPC services.
    pub(crate) fn to_status(&self) -> tonic::Status {
        let m = self.message.clone();
        match self.code {
            StatusCode::BAD_REQUEST => tonic::Status::invalid_argument(m),
            StatusCode::NOT_FOUND => tonic::Status::not_found(m),
            StatusCode::SERVICE_UNAVAILABLE => tonic::Status::unavailable(m),
            StatusCode::TOO_MANY_REQUESTS => tonic::Status::resource_exhausted(m),
            StatusCode::UNAUTHORIZED => tonic::Status::unauthenticated(m),
            StatusCode::FORBIDDEN => tonic::Status::permission_denied(m),
            _ => tonic::Status::internal(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message, "code": self.code.as_u16() });
        (self.code, axum::Json(body)).into_response()
    }
}
