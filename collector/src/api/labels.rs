//! `GET /api/v1/labels`, `/api/v1/label/NAME/values`, `/api/v1/types` and `/metrics`: what
//! the store holds, for pickers and scrapers.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::api::error::ApiError;
use crate::api::params::RangeParams;
use crate::api::state::AppState;

pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let store = state.store.clone();
    let size = tokio::task::spawn_blocking(move || store.size_bytes())
        .await
        .ok()
        .and_then(Result::ok);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(size),
    )
}

pub async fn label_names(
    State(state): State<Arc<AppState>>,
    Query(r): Query<RangeParams>,
) -> Result<Response, ApiError> {
    let (from, to) = r.range()?;
    let store = state.store.clone();
    let names = tokio::task::spawn_blocking(move || store.label_names(from, to))
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| ApiError::store(&state.metrics, e))?;
    Ok(axum::Json(serde_json::json!({ "names": names })).into_response())
}

pub async fn label_values(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    Query(r): Query<RangeParams>,
) -> Result<Response, ApiError> {
    let (from, to) = r.range()?;
    let store = state.store.clone();
    let values = tokio::task::spawn_blocking(move || store.label_values(&name, from, to))
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| ApiError::store(&state.metrics, e))?;
    Ok(axum::Json(serde_json::json!({ "values": values })).into_response())
}

pub async fn types(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let store = state.store.clone();
    let types = tokio::task::spawn_blocking(move || store.sample_types())
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| ApiError::store(&state.metrics, e))?;
    let types: Vec<serde_json::Value> = types
        .into_iter()
        .map(|(name, unit)| serde_json::json!({ "name": name, "unit": unit }))
        .collect();
    Ok(axum::Json(serde_json::json!({ "types": types })).into_response())
}
