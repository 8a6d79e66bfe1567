//! The gRPC ingest methods (`Ingest.Push`, OTLP's `ProfilesService/Export`) as hand-written
//! tonic services, without generated code: authentication before the body is read, decoding
//! and storing on a blocking thread.

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

use crate::api::params::now_s;
use crate::api::state::AppState;
use crate::ingest;
use crate::store::Ingested;

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
            // Checked before the body is read, so an unauthenticated client cannot make the
            // collector buffer a large message.
            if let Some(token) = &state.token
                && !token_ok(
                    token,
                    req.headers().get("authorization").map(|v| v.as_bytes()),
                )
            {
                state.metrics.pushes_refused.add("unauthenticated");
                return Ok(Status::unauthenticated("missing or wrong bearer token").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .max_decoding_message_size(state.limits.max_push_bytes);
            Ok(grpc.unary(Handler(state, format), req).await)
        })
    }
}

/// One gRPC call of `format`: decoded and stored on a blocking thread, so a slow store or a
/// large push never holds up the runtime; refusals are counted by reason.
struct Handler(Arc<AppState>, Format);

impl Handler {
    fn decode_and_store(
        state: &AppState,
        format: Format,
        bytes: &[u8],
    ) -> Result<Vec<Ingested>, (&'static str, Status)> {
        let ctx = ingest::Context {
            retention_s: state.retention.as_secs() as i64,
            ..ingest::Context::new(&state.limits, now_s())
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
        let (state, format) = (self.0.clone(), self.1);
        Box::pin(async move {
            let started = Instant::now();
            let bytes = request.into_inner();
            let st = state.clone();
            let result =
                tokio::task::spawn_blocking(move || Self::decode_and_store(&st, format, &bytes))
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
                            let s = stored.first().copied().unwrap_or(Ingested {
                                duplicate: false,
                                rows: 0,
                            });
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
