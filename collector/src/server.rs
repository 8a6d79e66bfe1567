//! One port, two protocols: axum routes the HTTP API and web UI, and hands the gRPC path to a
//! hand-written tonic service (HTTP/2 is detected per connection by hyper's auto builder).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use prost::Message;
use pyrometer_proto::grpc::RawCodec;
use pyrometer_proto::ingest::{PUSH_PATH, PushReply};
use serde::Deserialize;
use tonic::Status;

use crate::ingest::{self, Limits};
use crate::metrics::Metrics;
use crate::query::{Selector, parse_time};
use crate::render;
use crate::store::{Selection, Store, StoreError};

pub struct AppState {
    pub store: Arc<dyn Store>,
    /// The bearer token pushes must carry; `None` accepts every push.
    pub token: Option<String>,
    pub limits: Limits,
    /// Largest gRPC message accepted, in bytes.
    pub max_message_bytes: usize,
    pub metrics: Metrics,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(crate::ui::index))
        .route("/ui/{*path}", get(crate::ui::asset))
        .route("/metrics", get(metrics))
        .route("/api/v1/profile", get(profile))
        .route("/api/v1/diff", get(crate::diff_api::diff))
        .route("/api/v1/series", get(crate::series_api::series))
        .route("/api/v1/labels", get(label_names))
        .route("/api/v1/label/{name}/values", get(label_values))
        .route("/api/v1/types", get(types))
        .route("/trace/{id}", get(crate::trace_link::trace))
        .route_service(PUSH_PATH, IngestService(state.clone(), Format::Push))
        .route_service(
            pyrometer_proto::otlp::EXPORT_PATH,
            IngestService(state.clone(), Format::Otlp),
        )
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state)
}

/// The stored `(name, unit)` of sample type `name`, or the error that says which types exist.
pub(crate) fn sample_type<'a>(
    types: &'a [(String, String)],
    name: &str,
) -> Result<&'a (String, String), ApiError> {
    types.iter().find(|(n, _)| n == name).ok_or_else(|| {
        if types.is_empty() {
            return ApiError::new(StatusCode::NOT_FOUND, "the store holds no profiles yet");
        }
        let have: Vec<&str> = types.iter().map(|(n, _)| n.as_str()).collect();
        ApiError::bad_request(format!(
            "unknown sample type '{name}': the store has {}",
            have.join(", ")
        ))
    })
}

pub fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A JSON error body: `{"error": "...", "code": 400}`.
#[derive(Debug)]
pub struct ApiError {
    code: StatusCode,
    message: String,
}

impl ApiError {
    pub(crate) fn new(code: StatusCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl ToString) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message.to_string())
    }

    /// The same error, its message naming the parameter group it came from.
    pub(crate) fn prefixed(self, what: &str) -> Self {
        Self {
            code: self.code,
            message: format!("{what}: {}", self.message),
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
        if e.is_unavailable() {
            metrics.queries_unavailable.fetch_add(1, Relaxed);
            Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        } else {
            Self::internal(e)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message, "code": self.code.as_u16() });
        (self.code, axum::Json(body)).into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
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

#[derive(Deserialize, Default)]
pub struct RangeParams {
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
}

impl RangeParams {
    /// `[from, to)` in seconds; defaults to the last hour.
    pub(crate) fn range(&self) -> Result<(i64, i64), ApiError> {
        let now = now_s();
        let to = match &self.to {
            Some(t) if !t.is_empty() => parse_time(t, now).map_err(ApiError::bad_request)?,
            _ => now,
        };
        let from = match &self.from {
            Some(f) if !f.is_empty() => parse_time(f, now).map_err(ApiError::bad_request)?,
            _ => to - 3600,
        };
        if from >= to {
            return Err(ApiError::bad_request(format!(
                "empty time range: from ({from}) must be before to ({to})"
            )));
        }
        // `to` is inclusive for users (a batch taken "now" is shown); buckets start before it.
        Ok((from, to + 1))
    }
}

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

async fn profile(
    State(state): State<Arc<AppState>>,
    Query(p): Query<ProfileParams>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let result = profile_inner(&state, p).await;
    state
        .metrics
        .observe_query(started.elapsed(), result.is_ok());
    result
}

async fn profile_inner(state: &Arc<AppState>, p: ProfileParams) -> Result<Response, ApiError> {
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
    let by: Vec<String> =
        p.by.as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
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
    let store = state.store.clone();
    let wanted = p.sample_type.clone();
    let (types, stacks) = tokio::task::spawn_blocking(move || {
        let types = store.sample_types()?;
        let name = wanted.unwrap_or_else(|| "samples".into());
        let matcher = |l: &crate::store::LabelSet| selector.matches(l);
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
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(|e| ApiError::store(&state.metrics, e))?;
    let name = p.sample_type.as_deref().unwrap_or("samples");
    let ty = sample_type(&types, name)?;
    let total: i64 = stacks.iter().map(|s| s.value).sum();
    if !by.is_empty() {
        let groups: Vec<serde_json::Value> = render::group_totals(&stacks, &by)
            .into_iter()
            .map(|(labels, total)| serde_json::json!({ "labels": labels, "total": total }))
            .collect();
        let body = serde_json::json!({
            "type": ty.0, "unit": ty.1, "by": by, "total": total, "groups": groups
        });
        return Ok(axum::Json(body).into_response());
    }
    match format.as_str() {
        "folded" => Ok((
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            render::folded_text(&stacks),
        )
            .into_response()),
        "pprof" => {
            let bytes = pyrometer_proto::encode_gz(&render::pprof(&stacks, (&ty.0, &ty.1)));
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
            render::flame_json(&stacks, (&ty.0, &ty.1)),
        )
            .into_response()),
        "top" => {
            let rows = render::top(&stacks, p.limit.unwrap_or(50));
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
            match render::svg(&stacks, &title, &count_name) {
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

async fn label_names(
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

async fn label_values(
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

async fn types(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
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

/// Constant-time comparison, so response timing does not reveal how much of a token matched.
fn token_ok(expected: &str, header: Option<&[u8]>) -> bool {
    let Some(given) = header.and_then(|h| h.strip_prefix(b"Bearer ")) else {
        return false;
    };
    let want = expected.as_bytes();
    given.len() == want.len()
        && given
            .iter()
            .zip(want)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// What a gRPC ingest method receives.
#[derive(Clone, Copy)]
enum Format {
    /// pyrometer's own `Ingest.Push`.
    Push,
    /// OTLP's `ProfilesService/Export` (profiles/v1development).
    Otlp,
}

/// The gRPC ingest methods (`Ingest.Push`, OTLP's export), without generated code.
#[derive(Clone)]
struct IngestService(Arc<AppState>, Format);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower_service::Service<http::Request<B>> for IngestService
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let state = self.0.clone();
        let format = self.1;
        Box::pin(async move {
            // Checked before the body is read, so an unauthenticated client cannot make the
            // collector buffer a large message.
            if let Some(token) = &state.token
                && !token_ok(
                    token,
                    req.headers().get("authorization").map(|v| v.as_bytes()),
                )
            {
                state.metrics.refused_unauthenticated.fetch_add(1, Relaxed);
                return Ok(Status::unauthenticated("missing or wrong bearer token").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .max_decoding_message_size(state.max_message_bytes);
            Ok(match format {
                Format::Push => grpc.unary(Push(state), req).await,
                Format::Otlp => grpc.unary(OtlpExport(state), req).await,
            })
        })
    }
}

struct Push(Arc<AppState>);

impl tonic::server::UnaryService<Bytes> for Push {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let started = Instant::now();
            let bytes = request.into_inner();
            let st = state.clone();
            let result = tokio::task::spawn_blocking(move || {
                let batch = ingest::decode(&bytes, &st.limits, now_s())
                    .map_err(|e| (true, Status::invalid_argument(e.to_string())))?;
                st.store
                    .ingest(&batch)
                    .map_err(|e| (false, Status::unavailable(e.to_string())))
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
            match result {
                Ok(stored) => {
                    state.metrics.observe_ingest(started.elapsed(), stored);
                    let reply = PushReply {
                        duplicate: stored.duplicate,
                        samples: stored.rows,
                    };
                    Ok(tonic::Response::new(Bytes::from(reply.encode_to_vec())))
                }
                Err((invalid, status)) => {
                    let counter = if invalid {
                        &state.metrics.refused_invalid
                    } else {
                        &state.metrics.store_errors
                    };
                    counter.fetch_add(1, Relaxed);
                    // Every store failure is retryable for the agent (Unavailable): it keeps
                    // the batch in its spool and pushes it again later.
                    Err(status)
                }
            }
        })
    }
}

/// OTLP profiles export: every (resource, profile) of the request is stored as one batch.
struct OtlpExport(Arc<AppState>);

impl tonic::server::UnaryService<Bytes> for OtlpExport {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let started = Instant::now();
            let bytes = request.into_inner();
            let st = state.clone();
            let result = tokio::task::spawn_blocking(move || {
                let batches = crate::otlp_ingest::decode(&bytes, &st.limits, now_s())
                    .map_err(|e| (true, Status::invalid_argument(e.to_string())))?;
                batches
                    .iter()
                    .map(|b| st.store.ingest(b))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| (false, Status::unavailable(e.to_string())))
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
            match result {
                Ok(stored) => {
                    for s in stored {
                        state.metrics.observe_ingest(started.elapsed(), s);
                    }
                    let reply = pyrometer_proto::otlp::ExportProfilesServiceResponse::default();
                    Ok(tonic::Response::new(Bytes::from(reply.encode_to_vec())))
                }
                Err((invalid, status)) => {
                    let counter = if invalid {
                        &state.metrics.refused_invalid
                    } else {
                        &state.metrics.store_errors
                    };
                    counter.fetch_add(1, Relaxed);
                    Err(status)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::token_ok;

    #[test]
    fn tokens() {
        assert!(token_ok("s3cret", Some(b"Bearer s3cret")));
        assert!(!token_ok("s3cret", Some(b"Bearer s3cres")));
        assert!(!token_ok("s3cret", Some(b"Bearer s3cret2")));
        assert!(!token_ok("s3cret", Some(b"s3cret")));
        assert!(!token_ok("s3cret", None));
    }
}
