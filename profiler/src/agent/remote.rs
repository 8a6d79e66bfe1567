//! The client of on-demand captures and dumps (`pyrometer capture`, `pyrometer dump
//! --collector`): asks the collector, which hands the request to the node's agent, and waits
//! for the result, over gRPC with the transport checks of the agent's pushes.

use std::time::{Duration, Instant};

use prost::Message;
use pyrometer_proto::capture::{CREATE_PATH, CaptureStatus, Failure, GET_PATH, GetRequest};

use super::push::{self, PushClient, PushError};

pub use pyrometer_proto::capture::{
    CaptureRequest, Kind, MAX_DURATION_MS, MAX_FREQUENCY_HZ, UploadRequest,
};

/// How the collector is reached.
pub struct Collector<'a> {
    /// `http://` or `https://` address of the collector.
    pub url: &'a str,
    /// A token with the `capture` role.
    pub token: Option<&'a str>,
    /// The CA of the collector's certificate.
    pub ca: Option<&'a std::path::Path>,
    /// Send the token over plain http beyond this host.
    pub insecure: bool,
}

/// Why a request gave no result, by the exit code it means.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A pid or node that is not there, a malformed request (exit 2).
    #[error("{0}")]
    Input(String),
    /// No role, or refused by the node's kernel or agent (exit 3).
    #[error("{0}")]
    Privileges(String),
    /// The node's agent does not answer.
    #[error("{0}")]
    Offline(String),
    /// Anything else (the collector's own errors).
    #[error("{0}")]
    Other(String),
}

/// One request's answer per `Get`, held this long at most.
const GET_WAIT: Duration = Duration::from_secs(20);

fn refused(e: PushError) -> RemoteError {
    match e {
        PushError::Refused { code, message } => match code {
            tonic::Code::InvalidArgument | tonic::Code::NotFound => RemoteError::Input(message),
            tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
                RemoteError::Privileges(message)
            }
            tonic::Code::Unavailable => RemoteError::Offline(message),
            _ => RemoteError::Other(message),
        },
        PushError::Url { .. } | PushError::Tls(_) | PushError::Plaintext(_) => {
            RemoteError::Input(e.to_string())
        }
        other => RemoteError::Other(other.to_string()),
    }
}

/// Sends `request` and waits for its results: the agents' uploads (profile, timeline or
/// dump), one per node the request went to (a label query may reach several). A node whose
/// request failed is told through `progress` when others answered; when none did, the first
/// failure is the error.
pub fn run(
    collector: &Collector<'_>,
    request: CaptureRequest,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<UploadRequest>, RemoteError> {
    push::check_transport(
        collector.url,
        collector.token.is_some(),
        false,
        collector.insecure,
    )
    .map_err(refused)?;
    let client = |path| {
        PushClient::new(
            collector.url,
            collector.token,
            collector.ca,
            GET_WAIT + Duration::from_secs(10),
        )
        .map(|c| c.with_path(path))
        .map_err(refused)
    };
    let mut create = client(CREATE_PATH)?;
    let status = create
        .call(request.encode_to_vec())
        .map_err(refused)
        .and_then(|b| decode(&b))?;
    let id = status
        .request
        .as_ref()
        .map(|r| r.id.clone())
        .ok_or_else(|| RemoteError::Other("the collector named no request".into()))?;
    let mut members = status.members.clone();
    if members.is_empty() {
        members.push(id.clone());
    }
    if members.len() > 1 || !request.query.is_empty() {
        progress(&format!(
            "{} matches processes on {} node(s): request(s) {}",
            request.query,
            members.len(),
            members.join(", ")
        ));
    } else {
        progress(&format!("request {id}: {}", status.state));
    }
    let mut get = client(GET_PATH)?;
    let deadline = Instant::now()
        + Duration::from_millis(u64::from(request.duration_ms))
        + Duration::from_secs(60);
    let mut results = Vec::new();
    let mut first_error = None;
    for member in &members {
        match wait(&mut get, member, deadline, progress) {
            Ok(r) => results.push(r),
            Err(e) if members.len() > 1 => {
                progress(&format!("request {member}: {e}"));
                first_error.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    match first_error {
        Some(e) if results.is_empty() => Err(e),
        _ => Ok(results),
    }
}

/// Waits for request `id` to end: its result, or why it has none.
fn wait(
    get: &mut PushClient,
    id: &str,
    deadline: Instant,
    progress: &mut dyn FnMut(&str),
) -> Result<UploadRequest, RemoteError> {
    let mut last = String::new();
    loop {
        let body = GetRequest {
            id: id.to_string(),
            wait_ms: GET_WAIT.as_millis() as u32,
            result: true,
        };
        let status = get
            .call(body.encode_to_vec())
            .map_err(refused)
            .and_then(|b| decode(&b))?;
        if status.state != last && !last.is_empty() {
            progress(&format!("request {id}: {}", status.state));
        }
        last = status.state.clone();
        match status.state.as_str() {
            "done" => {
                return status
                    .result
                    .ok_or_else(|| RemoteError::Other(format!("request {id} has no result")));
            }
            "failed" => {
                let why = status.reason;
                return Err(match Failure::try_from(status.failure) {
                    Ok(Failure::Input) => RemoteError::Input(why),
                    Ok(Failure::Kernel) => RemoteError::Privileges(why),
                    Ok(Failure::Offline) => RemoteError::Offline(why),
                    _ => RemoteError::Other(why),
                });
            }
            _ if Instant::now() > deadline => {
                return Err(RemoteError::Offline(format!(
                    "request {id} is still {}: the node's agent did not answer",
                    status.state
                )));
            }
            _ => {}
        }
    }
}

fn decode(bytes: &[u8]) -> Result<CaptureStatus, RemoteError> {
    CaptureStatus::decode(bytes)
        .map_err(|e| RemoteError::Other(format!("the collector's answer is unreadable: {e}")))
}
