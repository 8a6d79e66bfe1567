//! The collector's one port: axum routes the HTTP API and web UI, and hands the gRPC paths to
//! hand-written tonic services (HTTP/2 is detected per connection by hyper's auto builder).
//! This module only routes; handlers live in the submodules, and the types they share in
//! [`error`], [`params`] and [`state`].

pub mod access;
pub mod capture_query;
pub mod captures;
pub mod diff;
pub mod error;
pub mod ingest;
pub mod labels;
pub mod params;
pub mod profile;
pub mod series;
pub mod state;
pub mod trace_link;

use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use pyrometer_proto::capture;
use pyrometer_proto::ingest::PUSH_PATH;

pub use error::ApiError;
pub use params::{RangeParams, now_s};
pub use state::AppState;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(crate::ui::index))
        .route("/ui/{*path}", get(crate::ui::asset))
        .route("/metrics", get(labels::metrics))
        .route("/api/v1/profile", get(profile::profile))
        .route("/api/v1/diff", get(diff::diff))
        .route("/api/v1/series", get(series::series))
        .route("/api/v1/labels", get(labels::label_names))
        .route("/api/v1/label/{name}/values", get(labels::label_values))
        .route("/api/v1/types", get(labels::types))
        .route("/trace/{id}", get(trace_link::trace))
        .route(
            "/api/v1/captures",
            post(captures::create).get(captures::list),
        )
        .route("/api/v1/captures/{id}", get(captures::get))
        .route("/api/v1/captures/{id}/result", get(captures::result))
        .route_service(
            PUSH_PATH,
            ingest::service(state.clone(), ingest::Format::Push),
        )
        .route_service(
            pyrometer_proto::otlp::EXPORT_PATH,
            ingest::service(state.clone(), ingest::Format::Otlp),
        )
        .route_service(
            capture::POLL_PATH,
            captures::service(state.clone(), captures::Method::Poll),
        )
        .route_service(
            capture::UPLOAD_PATH,
            captures::service(state.clone(), captures::Method::Upload),
        )
        .route_service(
            capture::CREATE_PATH,
            captures::service(state.clone(), captures::Method::Create),
        )
        .route_service(
            capture::GET_PATH,
            captures::service(state.clone(), captures::Method::Get),
        )
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(axum::middleware::map_response(security_headers))
        .with_state(state)
}

/// Headers every answer carries: the UI loads only its own scripts and styles, is never
/// framed by another site, and no answer is sniffed into another type.
async fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
             connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
             frame-ancestors 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    r
}
