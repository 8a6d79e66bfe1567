//! The gRPC ingest methods (`Ingest.Push`, OTLP's `ProfilesService/Export`) as hand-written
//! tonic services, without generated code: the content type and the credentials are checked
//! before the body is read (a browser page cannot post one: it cannot send `application/grpc`
//! across sites), the body is read up to the tenant's largest push, the tenant's ingest rate
//! is taken, and decoding and storing run on a blocking thread.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use prost::Message;
use pyrometer_proto::grpc::RawCodec;
use pyrometer_proto::ingest::PushReply;
use tonic::Status;

use crate::api::access::{authorize, denied_status, is_grpc};
use crate::api::params::now_s;
use crate::api::state::AppState;
use crate::auth::{PeerCertificate, Role};
use crate::ingest;
use crate::store::Ingested;

/// What a gRPC ingest method receives.
#[derive(Clone, Copy)]
pub enum Format {
    /// pyrometer's own `Ingest.Push`.
    Push,
    /// OTLP's `ProfilesService/Export` (profiles/v1development).
    Otlp,
}

/// The gRPC ingest methods (`Ingest.Push`, OTLP's export), without generated code.
#[derive(Clone)]
pub struct IngestService(Arc<AppState>, Format);

/// The service answering `format` requests.
pub fn service(state: Arc<AppState>, format: Format) -> IngestService {
    IngestService(state, format)
}

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
            if !is_grpc(req.headers()) {
                state.metrics.pushes_refused.add("content_type");
                let body = serde_json::json!({
                    "error": "pushes are gRPC: content-type must be application/grpc",
                    "code": 415,
                });
                return Ok(http::Response::builder()
                    .status(http::StatusCode::UNSUPPORTED_MEDIA_TYPE)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(tonic::body::Body::new(body.to_string()))
                    .expect("a valid response"));
            }
            // Checked before the body is read, so an unauthenticated client cannot make the
            // collector buffer a large message.
            let cert = req.extensions().get::<PeerCertificate>();
            let tenant = match authorize(&state, req.headers(), cert, Role::Push) {
                Ok(t) => t,
                Err(e) => {
                    state.metrics.pushes_refused.add(if e.unauthenticated() {
                        "unauthenticated"
                    } else {
                        "forbidden"
                    });
                    return Ok(denied_status(&e).into_http());
                }
            };
            let max = state.tenants.limits(&tenant).max_push_bytes;
            let mut grpc = tonic::server::Grpc::new(RawCodec).max_decoding_message_size(max);
            Ok(grpc.unary(Handler(state, format, tenant), req).await)
        })
    }
}

/// One gRPC call of `format`: decoded and stored on a blocking thread, so a slow store or a
/// large push never holds up the runtime; refusals are counted by reason.
struct Handler(Arc<AppState>, Format, String);

impl Handler {
    fn decode_and_store(
        state: &AppState,
        format: Format,
        tenant: &str,
        bytes: &[u8],
    ) -> Result<Vec<Ingested>, (&'static str, Status)> {
        let limits = state.tenants.limits(tenant);
        let ctx = ingest::Context {
            tenant,
            retention_s: state.retention.as_secs() as i64,
            ..ingest::Context::new(limits, now_s())
        };
        let refused =
            |e: ingest::IngestError| (e.reason(), Status::invalid_argument(e.to_string()));
        let batches = match format {
            Format::Push => vec![ingest::decode(bytes, &ctx).map_err(refused)?],
            Format::Otlp => crate::otlp_ingest::decode(bytes, &ctx).map_err(refused)?,
        };
        // Every store failure is retryable for the agent (Unavailable): it keeps the batch in
        // its spool and pushes it again later.
        batches
            .iter()
            .map(|b| state.store.ingest(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ("store_error", Status::unavailable(e.to_string())))
    }
}

impl tonic::server::UnaryService<Bytes> for Handler {
    type Response = Bytes;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let (state, format, tenant) = (self.0.clone(), self.1, self.2.clone());
        Box::pin(async move {
            let started = Instant::now();
            let bytes = request.into_inner();
            if let Err(busy) = state.tenants.admit_push(&tenant, bytes.len()) {
                state.metrics.pushes_refused.add("rate_limited");
                return Err(Status::resource_exhausted(busy.to_string()));
            }
            let st = state.clone();
            let result = tokio::task::spawn_blocking(move || {
                let cpu = crate::metrics::thread_cpu();
                let result = Self::decode_and_store(&st, format, &tenant, &bytes);
                // Dropped here too, on this thread: its freeing counts.
                let large = bytes.len() >= crate::memory::RELEASE_AFTER;
                drop(bytes);
                if large {
                    crate::memory::release();
                }
                st.metrics
                    .observe_push_cpu(crate::metrics::thread_cpu().saturating_sub(cpu));
                result
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
            match result {
                Ok(stored) => {
                    let took = started.elapsed();
                    for s in &stored {
                        state.metrics.observe_ingest(took, *s);
                    }
                    let reply = match format {
                        Format::Push => {
                            let s = stored.first().copied().unwrap_or_default();
                            PushReply {
                                duplicate: s.duplicate,
                                samples: s.rows,
                            }
                            .encode_to_vec()
                        }
                        Format::Otlp => {
                            pyrometer_proto::otlp::ExportProfilesServiceResponse::default()
                                .encode_to_vec()
                        }
                    };
                    Ok(tonic::Response::new(Bytes::from(reply)))
                }
                Err((reason, status)) => {
                    state.metrics.pushes_refused.add(reason);
                    Err(status)
                }
            }
        })
    }
}
