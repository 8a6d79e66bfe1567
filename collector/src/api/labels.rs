//! `GET /api/v1/labels`, `/api/v1/label/NAME/values`, `/api/v1/types` and `/metrics`: what
//! the store holds, for pickers and scrapers.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};

use crate::api::access::{Reader, authorize, denied, run_query, store_error};
use crate::api::error::ApiError;
use crate::api::params::RangeParams;
use crate::api::state::AppState;
use crate::auth::{PeerCertificate, Role};
use crate::store::TENANT_LABEL;

/// The collector's own metrics. With credentials configured they need a read or admin role
/// (they count every tenant's pushes), unless `--public-metrics`.
pub async fn metrics(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    cert: Option<axum::Extension<PeerCertificate>>,
) -> Response {
    if !state.auth.public_metrics
        && let Err(e) = authorize(&state, &headers, cert.as_deref(), Role::Read)
    {
        return denied(&e);
    }
    let store = state.store.clone();
    let size = tokio::task::spawn_blocking(move || store.size_bytes())
        .await
        .ok()
        .and_then(Result::ok);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(size),
    )
        .into_response()
}

pub async fn label_names(
    State(state): State<Arc<AppState>>,
    reader: Reader,
    Query(r): Query<RangeParams>,
) -> Result<Response, ApiError> {
    let (from, to) = r.range()?;
    let tenant = reader.0.clone();
    let st = state.clone();
    let mut names = run_query(&state, &reader, move |store| {
        let own = Reader(tenant);
        store
            .label_names(from, to, &|l| own.owns(l))
            .map_err(|e| store_error(&st, e))
    })
    .await?;
    names.retain(|n| n != TENANT_LABEL);
    Ok(axum::Json(serde_json::json!({ "names": names })).into_response())
}

pub async fn label_values(
    State(state): State<Arc<AppState>>,
    reader: Reader,
    Path(name): Path<String>,
    Query(r): Query<RangeParams>,
) -> Result<Response, ApiError> {
    let (from, to) = r.range()?;
    let tenant = reader.0.clone();
    let st = state.clone();
    let values = run_query(&state, &reader, move |store| {
        let own = Reader(tenant);
        store
            .label_values(&name, from, to, &|l| own.owns(l))
            .map_err(|e| store_error(&st, e))
    })
    .await?;
    Ok(axum::Json(serde_json::json!({ "values": values })).into_response())
}

pub async fn types(
    State(state): State<Arc<AppState>>,
    reader: Reader,
) -> Result<Response, ApiError> {
    let st = state.clone();
    let types = run_query(&state, &reader, move |store| {
        store.sample_types().map_err(|e| store_error(&st, e))
    })
    .await?;
    let types: Vec<serde_json::Value> = types
        .into_iter()
        .map(|(name, unit)| serde_json::json!({ "name": name, "unit": unit }))
        .collect();
    Ok(axum::Json(serde_json::json!({ "types": types })).into_response())
}
