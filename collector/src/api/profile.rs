//! `GET /api/v1/profile`: one selection merged into a flame graph (SVG or the UI's JSON),
//! folded stacks, pprof, a top-functions table, or totals per label value.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::api::access::{Reader, off_runtime, run_query, store_error};
use crate::api::error::ApiError;
use crate::api::params::{RangeParams, label_list, sample_type};
use crate::api::state::AppState;
use crate::query::Selector;
use crate::render;
use crate::store::{Selection, Stacked, StoreError};

#[derive(Deserialize)]
pub struct ProfileParams {
    query: Option<String>,
    #[serde(flatten)]
    range: RangeParams,
    #[serde(rename = "type")]
    sample_type: Option<String>,
    format: Option<String>,
    by: Option<String>,
    limit: Option<usize>,
}

pub async fn profile(
    State(state): State<Arc<AppState>>,
    reader: Reader,
    Query(p): Query<ProfileParams>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let result = profile_inner(&state, &reader, p).await;
    state
        .metrics
        .observe_query(started.elapsed(), result.is_ok());
    result
}

async fn profile_inner(
    state: &Arc<AppState>,
    reader: &Reader,
    p: ProfileParams,
) -> Result<Response, ApiError> {
    let selector =
        Selector::parse(p.query.as_deref().unwrap_or("")).map_err(ApiError::bad_request)?;
    let (from_s, to_s) = p.range.range()?;
    let format = p.format.as_deref().unwrap_or("svg").to_string();
    if !matches!(
        format.as_str(),
        "svg" | "folded" | "pprof" | "top" | "flame"
    ) {
        return Err(ApiError::bad_request(format!(
            "unknown format '{format}': use svg, folded, pprof, top or flame"
        )));
    }
    let by = label_list(p.by.as_deref());
    // The labels the answer reads: the stores merge label sets that differ only in others,
    // so an hour of a cluster is a few entries per stack (pprof keeps every label).
    let keep: Option<Vec<String>> = if !by.is_empty() {
        Some(by.clone())
    } else {
        match format.as_str() {
            "pprof" => None,
            "top" => Some(Vec::new()),
            _ => Some(vec!["comm".to_string()]),
        }
    };
    let wanted = p.sample_type.clone();
    let tenant = reader.0.clone();
    let st = state.clone();
    let (types, stacks) = run_query(state, reader, move |store| {
        let select = || {
            let types = store.sample_types()?;
            let name = wanted.unwrap_or_else(|| "samples".into());
            let own = Reader(tenant);
            let matcher = |l: &crate::store::LabelSet| own.owns(l) && selector.matches(l);
            let selection = Selection {
                from_s,
                to_s,
                sample_type: &name,
                labels: &matcher,
            };
            let stacks = match &keep {
                Some(keep) => {
                    let keep: Vec<&str> = keep.iter().map(String::as_str).collect();
                    store.select_merged(&selection, &keep)?
                }
                None => store.select(&selection)?,
            };
            Ok::<_, StoreError>((types, stacks))
        };
        select().map_err(|e| store_error(&st, e))
    })
    .await?;
    let name = p.sample_type.as_deref().unwrap_or("samples");
    let ty = sample_type(&types, name)?.clone();
    off_runtime(move || answer(&p, &format, &by, &ty, &stacks)).await?
}

/// The selection's stacks in the asked format.
fn answer(
    p: &ProfileParams,
    format: &str,
    by: &[String],
    ty: &(String, String),
    stacks: &[Stacked],
) -> Result<Response, ApiError> {
    let total = stacks.iter().fold(0i64, |t, s| t.saturating_add(s.value));
    if !by.is_empty() {
        let groups: Vec<serde_json::Value> = render::group_totals(stacks, by)
            .into_iter()
            .map(|(labels, total)| serde_json::json!({ "labels": labels, "total": total }))
            .collect();
        let body = serde_json::json!({
            "type": ty.0, "unit": ty.1, "by": by, "total": total, "groups": groups
        });
        return Ok(axum::Json(body).into_response());
    }
    match format {
        "folded" => Ok((
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            render::folded_text(stacks),
        )
            .into_response()),
        "pprof" => {
            let bytes = pyrometer_proto::encode_gz(&render::pprof(stacks, (&ty.0, &ty.1)));
            Ok((
                [
                    (header::CONTENT_TYPE, "application/octet-stream"),
                    (
                        header::CONTENT_DISPOSITION,
                        "attachment; filename=\"profile.pb.gz\"",
                    ),
                ],
                bytes,
            )
                .into_response())
        }
        "flame" => Ok((
            [(header::CONTENT_TYPE, "application/json")],
            render::flame_json(stacks, (&ty.0, &ty.1)),
        )
            .into_response()),
        "top" => {
            let rows = render::top(stacks, p.limit.unwrap_or(50));
            let body =
                serde_json::json!({ "type": ty.0, "unit": ty.1, "total": total, "rows": rows });
            Ok(axum::Json(body).into_response())
        }
        _ => {
            let title = format!("pyrometer: {}", p.query.as_deref().unwrap_or("{}"));
            let count_name = if ty.1 == "count" {
                ty.0.clone()
            } else {
                ty.1.clone()
            };
            match render::svg(stacks, &title, &count_name) {
                Ok(svg) => Ok(([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response()),
                Err(render::RenderError::Empty) => Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "nothing matched the query in this time range",
                )),
                Err(e) => Err(ApiError::internal(e)),
            }
        }
    }
}
