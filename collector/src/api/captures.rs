//! On-demand captures and dumps over HTTP (`POST /api/v1/captures`, `GET /api/v1/captures`,
//! `GET /api/v1/captures/ID`, `GET /api/v1/captures/ID/result`) and gRPC (`Captures.*`: the
//! agents' poll and upload, the CLI's create and get). The state is
//! [`crate::captures::Captures`]; this module checks credentials and translates.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use prost::Message;
use pyrometer_proto::capture::{
    CaptureRequest, GetRequest, Kind, PollReply, PollRequest, UploadReply, UploadRequest,
};
use pyrometer_proto::grpc::RawCodec;
use tonic::Status;

use crate::api::access::{authorize, denied, denied_status, is_grpc};
use crate::api::capture_query;
use crate::api::error::ApiError;
use crate::api::state::AppState;
use crate::auth::{PeerCertificate, Role};
use crate::captures::{CaptureError, MAX_RESULT_BYTES};

/// The tenant a capture request acts for: credentials with the `capture` (or `admin`) role.
fn capturer(
    state: &AppState,
    headers: &HeaderMap,
    cert: Option<&PeerCertificate>,
) -> Result<String, Box<Response>> {
    authorize(state, headers, cert, Role::Capture).map_err(|e| Box::new(denied(&e)))
}

/// The tenant that may look at captures: a reader of the tenant, or who may request them.
fn viewer(
    state: &AppState,
    headers: &HeaderMap,
    cert: Option<&PeerCertificate>,
) -> Result<String, Box<Response>> {
    authorize(state, headers, cert, Role::Read)
        .or_else(|_| authorize(state, headers, cert, Role::Capture))
        .map_err(|e| Box::new(denied(&e)))
}

impl From<CaptureError> for ApiError {
    fn from(e: CaptureError) -> Self {
        let code = match &e {
            CaptureError::Input(_) => StatusCode::BAD_REQUEST,
            CaptureError::NotFound(_) => StatusCode::NOT_FOUND,
            CaptureError::Offline(_) => StatusCode::SERVICE_UNAVAILABLE,
            CaptureError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
        };
        ApiError::new(code, e.to_string())
    }
}

fn status_of(e: &CaptureError) -> Status {
    match e {
        CaptureError::Input(m) => Status::invalid_argument(m),
        CaptureError::NotFound(m) => Status::not_found(m),
        CaptureError::Offline(m) => Status::unavailable(m),
        CaptureError::Busy(m) => Status::resource_exhausted(m),
    }
}

/// The body of `POST /api/v1/captures`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// The node; with `query`, only narrows it.
    #[serde(default)]
    pub node: String,
    /// Label matchers in place of `node` and `pid`: one request per node where recent
    /// pushes show matching processes.
    #[serde(default)]
    pub query: Option<String>,
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub pids: Vec<u32>,
    /// Seconds (fractions allowed); 5 when absent.
    #[serde(default)]
    pub duration_s: Option<f64>,
    /// 99 when absent.
    #[serde(default)]
    pub frequency_hz: Option<u32>,
    #[serde(default)]
    pub gil: bool,
    #[serde(default)]
    pub off_cpu: bool,
    #[serde(default)]
    pub alloc: bool,
    /// A dump's native frames too (read without stopping a thread).
    #[serde(default)]
    pub native: bool,
    /// `capture` (the default) or `dump`.
    #[serde(default)]
    pub kind: Option<String>,
}

impl CreateBody {
    fn request(self) -> Result<CaptureRequest, ApiError> {
        let kind = match self.kind.as_deref() {
            None | Some("capture") => Kind::Capture,
            Some("dump") => Kind::Dump,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "kind '{other}': use capture or dump"
                )));
            }
        };
        let duration = self.duration_s.unwrap_or(5.0);
        if !(duration.is_finite() && duration > 0.0 && duration <= 3600.0) {
            return Err(ApiError::bad_request(format!(
                "duration_s {duration}: give seconds, e.g. 5"
            )));
        }
        let mut pids = self.pids;
        pids.extend(self.pid);
        Ok(CaptureRequest {
            id: String::new(),
            node: self.node,
            pids,
            duration_ms: (duration * 1000.0).round() as u32,
            frequency_hz: self.frequency_hz.unwrap_or(99),
            gil: self.gil,
            off_cpu: self.off_cpu,
            alloc: self.alloc,
            kind: kind as i32,
            query: self.query.unwrap_or_default(),
            native: self.native,
        })
    }
}

/// Makes `request`: for its node and pids, or for every node and process its query
/// resolves to. The ids of the requests made.
async fn make(
    state: &Arc<AppState>,
    tenant: &str,
    request: CaptureRequest,
) -> Result<Vec<String>, ApiError> {
    if request.query.is_empty() {
        return Ok(vec![state.captures.create(tenant, request)?]);
    }
    if !request.pids.is_empty() {
        return Err(ApiError::bad_request(
            "give a query or pids, not both (--query or --pid)",
        ));
    }
    if request.query.len() > 4096 {
        return Err(ApiError::bad_request("the query is longer than 4096 bytes"));
    }
    let node = Some(request.node.clone()).filter(|n| !n.is_empty());
    let targets = capture_query::resolve(state, tenant, &request.query, node).await?;
    Ok(state.captures.create_many(tenant, request, targets)?)
}

/// `POST /api/v1/captures`: 201 with the request's state, or why it cannot be made.
pub async fn create(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    cert: Option<axum::Extension<PeerCertificate>>,
    body: Result<Json<CreateBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let tenant = match capturer(&state, &headers, cert.as_deref()) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return ApiError::bad_request(e.body_text()).into_response(),
    };
    let request = match body.request() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let ids = match make(&state, &tenant, request).await {
        Ok(ids) => ids,
        Err(e) => return e.into_response(),
    };
    match state.captures.summary(&tenant, &ids[0]) {
        Some(mut s) => {
            s.members = ids;
            (StatusCode::CREATED, Json(s)).into_response()
        }
        None => ApiError::internal("the request ended at once").into_response(),
    }
}

/// `GET /api/v1/captures`: the tenant's requests, newest first, and the nodes whose agents
/// take requests.
pub async fn list(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    cert: Option<axum::Extension<PeerCertificate>>,
) -> Response {
    let tenant = match viewer(&state, &headers, cert.as_deref()) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    Json(serde_json::json!({
        "captures": state.captures.list(&tenant),
        "nodes": state.captures.nodes(&tenant),
    }))
    .into_response()
}

#[derive(Debug, Default, serde::Deserialize)]
pub struct GetParams {
    /// Seconds to wait for the request to end.
    #[serde(default)]
    pub wait: Option<f64>,
    /// `pprof` (default) or `chrome`, for the result.
    #[serde(default)]
    pub format: Option<String>,
}

/// `GET /api/v1/captures/ID[?wait=S]`: the request's state (held up to S seconds until it ends).
pub async fn get(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(params): Query<GetParams>,
    headers: HeaderMap,
    cert: Option<axum::Extension<PeerCertificate>>,
) -> Response {
    let tenant = match viewer(&state, &headers, cert.as_deref()) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let wait = Duration::from_secs_f64(params.wait.unwrap_or(0.0).clamp(0.0, 60.0));
    if let Err(e) = state.captures.get(&tenant, &id, wait, false).await {
        return ApiError::from(e).into_response();
    }
    match state.captures.summary(&tenant, &id) {
        Some(s) => Json(s).into_response(),
        None => ApiError::new(StatusCode::NOT_FOUND, format!("no capture {id}")).into_response(),
    }
}

/// `GET /api/v1/captures/ID/result[?format=pprof|chrome]`: the gzipped pprof, or the Chrome
/// trace's JSON.
pub async fn result(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(params): Query<GetParams>,
    headers: HeaderMap,
    cert: Option<axum::Extension<PeerCertificate>>,
) -> Response {
    let tenant = match viewer(&state, &headers, cert.as_deref()) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let chrome = match params.format.as_deref() {
        None | Some("pprof") => false,
        Some("chrome") => true,
        Some("flame") => return flame(&state, &tenant, &id).await,
        Some(other) => {
            return ApiError::bad_request(format!("format '{other}': use pprof, chrome or flame"))
                .into_response();
        }
    };
    let Some(bytes) = state.captures.result(&tenant, &id, chrome) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!("capture {id} has no result (yet): see GET /api/v1/captures/{id}"),
        )
        .into_response();
    };
    let (kind, name) = if chrome {
        ("application/json", format!("capture-{id}.trace.json"))
    } else {
        ("application/octet-stream", format!("capture-{id}.pb.gz"))
    };
    let body = if chrome {
        let mut out = Vec::new();
        let mut gz = flate2::read::GzDecoder::new(&bytes[..]);
        if std::io::Read::read_to_end(&mut gz, &mut out).is_err() {
            return ApiError::internal("the agent's timeline is not gzip").into_response();
        }
        out
    } else {
        bytes
    };
    (
        [
            (header::CONTENT_TYPE, kind.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}\""),
            ),
        ],
        body,
    )
        .into_response()
}

/// A capture's profile as the UI's flame graph JSON (its CPU samples), decoded with the
/// checks and limits of a push.
async fn flame(state: &Arc<AppState>, tenant: &str, id: &str) -> Response {
    let Some(node) = state.captures.summary(tenant, id).map(|s| s.node) else {
        return ApiError::new(StatusCode::NOT_FOUND, format!("no capture {id}")).into_response();
    };
    let Some(bytes) = state.captures.result(tenant, id, false) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!("capture {id} has no result (yet)"),
        )
        .into_response();
    };
    let st = state.clone();
    let tenant = tenant.to_string();
    let id = id.to_string();
    let made = tokio::task::spawn_blocking(move || -> Result<String, ApiError> {
        let profile = pyrometer_proto::decode(&bytes).map_err(ApiError::internal)?;
        let push = pyrometer_proto::ingest::PushRequest {
            agent_id: format!("capture-{id}"),
            sequence: 0,
            node,
            profile: Some(profile),
        }
        .encode_to_vec();
        let limits = st.tenants.limits(&tenant);
        let ctx = crate::ingest::Context {
            tenant: &tenant,
            retention_s: st.retention.as_secs() as i64,
            ..crate::ingest::Context::new(limits, crate::api::params::now_s())
        };
        let batch = crate::ingest::decode(&push, &ctx).map_err(ApiError::internal)?;
        let ty = batch
            .sample_types
            .iter()
            .position(|(name, _)| name == "cpu")
            .unwrap_or(0);
        let stacks: Vec<crate::store::Stacked> = batch
            .rows
            .into_iter()
            .filter(|r| r.sample_type == ty)
            .map(|r| crate::store::Stacked {
                labels: r.labels,
                stack: r.stack,
                value: r.value,
            })
            .collect();
        let (name, unit) = batch.sample_types.get(ty).cloned().unwrap_or_default();
        Ok(crate::render::flame_json(&stacks, (&name, &unit)))
    })
    .await;
    match made {
        Ok(Ok(body)) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::internal(e).into_response(),
    }
}

/// The gRPC methods of `Captures`.
#[derive(Clone, Copy)]
pub enum Method {
    Poll,
    Upload,
    Create,
    Get,
}

#[derive(Clone)]
pub struct CaptureService(Arc<AppState>, Method);

pub fn service(state: Arc<AppState>, method: Method) -> CaptureService {
    CaptureService(state, method)
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower_service::Service<http::Request<B>> for CaptureService
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
        let (state, method) = (self.0.clone(), self.1);
        Box::pin(async move {
            if !is_grpc(req.headers()) {
                return Ok(
                    Status::invalid_argument("content-type must be application/grpc").into_http(),
                );
            }
            let cert = req.extensions().get::<PeerCertificate>();
            let role = match method {
                Method::Poll | Method::Upload => Role::Push,
                Method::Create | Method::Get => Role::Capture,
            };
            let tenant = match authorize(&state, req.headers(), cert, role) {
                Ok(t) => t,
                Err(e) => return Ok(denied_status(&e).into_http()),
            };
            let max = match method {
                Method::Upload => MAX_RESULT_BYTES,
                _ => 64 << 10,
            };
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .max_decoding_message_size(max)
                .max_encoding_message_size(MAX_RESULT_BYTES + (1 << 20));
            Ok(grpc.unary(Handler(state, method, tenant), req).await)
        })
    }
}

struct Handler(Arc<AppState>, Method, String);

impl tonic::server::UnaryService<Bytes> for Handler {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let (state, method, tenant) = (self.0.clone(), self.1, self.2.clone());
        Box::pin(async move {
            let bytes = request.into_inner();
            let bad = |e: prost::DecodeError| Status::invalid_argument(e.to_string());
            let reply = match method {
                Method::Poll => {
                    let poll = PollRequest::decode(bytes).map_err(bad)?;
                    let wait = Duration::from_millis(u64::from(poll.wait_ms));
                    let requests = state.captures.poll(&tenant, &poll.node, wait).await;
                    PollReply { requests }.encode_to_vec()
                }
                Method::Upload => {
                    let upload = UploadRequest::decode(bytes).map_err(bad)?;
                    let id = upload.id.clone();
                    state
                        .captures
                        .upload(&tenant, upload)
                        .map_err(|e| status_of(&e))?;
                    // Kept on disk before the agent hears back; a failure to keep it is the
                    // collector's to report, the result stays in memory.
                    let st = state.clone();
                    let saved = tokio::task::spawn_blocking(move || st.captures.save(&id)).await;
                    if let Ok(Err(e)) = saved {
                        eprintln!("pyrometer-collector: cannot keep a capture on disk: {e}");
                    }
                    UploadReply {}.encode_to_vec()
                }
                Method::Create => {
                    let create = CaptureRequest::decode(bytes).map_err(bad)?;
                    let ids = make(&state, &tenant, create)
                        .await
                        .map_err(|e| e.to_status())?;
                    let mut status = state
                        .captures
                        .get(&tenant, &ids[0], Duration::ZERO, false)
                        .await
                        .map_err(|e| status_of(&e))?;
                    status.members = ids;
                    status.encode_to_vec()
                }
                Method::Get => {
                    let get = GetRequest::decode(bytes).map_err(bad)?;
                    let wait = Duration::from_millis(u64::from(get.wait_ms));
                    let status = state
                        .captures
                        .get(&tenant, &get.id, wait, get.result)
                        .await
                        .map_err(|e| status_of(&e))?;
                    status.encode_to_vec()
                }
            };
            Ok(tonic::Response::new(Bytes::from(reply)))
        })
    }
}
