//! The agent's side of on-demand captures: a thread long-polls the collector for the
//! requests of this node (the agent opens the connection, with the TLS and credentials of its
//! pushes, so nothing listens on the node), hands captures to the sampling loop and answers
//! dumps itself (reading a process's memory stays off the sampling loop); a second thread
//! uploads results.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::Duration;

use prost::Message;
use pyrometer_proto::capture::{
    CaptureRequest, Failure, Kind, POLL_PATH, PollReply, PollRequest, UPLOAD_PATH, UploadRequest,
};

use super::push::PushClient;
use super::{AgentConfig, Log};
use crate::command::CommandError;
use crate::os::workers::ProcessReads;

/// How long the collector holds a poll open (it answers at once when a request comes).
const POLL_WAIT: Duration = Duration::from_secs(10);
/// After a failed poll, before the next.
const RETRY: Duration = Duration::from_secs(2);
/// Captures queued for the sampling loop, and results for the uploader.
const QUEUE: usize = 4;

/// What the sampling loop holds: requests to run, and where their results go.
pub(super) struct Channel {
    pub requests: Receiver<CaptureRequest>,
    pub uploads: SyncSender<UploadRequest>,
}

fn client(cfg: &AgentConfig, url: &str, timeout: Duration) -> Result<PushClient, CommandError> {
    super::delivery::collector_client(cfg, url, timeout)
        .map_err(|e| CommandError::Input(e.to_string()))
}

/// Starts the poller and the uploader (with a collector; none without). Call after the
/// capability drop: threads keep the set they start with.
pub(super) fn start(cfg: &AgentConfig, log: Log) -> Result<Option<Channel>, CommandError> {
    let Some(url) = cfg.collector.as_deref() else {
        return Ok(None);
    };
    let poll = client(cfg, url, POLL_WAIT + Duration::from_secs(5))?.with_path(POLL_PATH);
    let mut upload = client(cfg, url, Duration::from_secs(30))?.with_path(UPLOAD_PATH);
    let (req_tx, req_rx) = sync_channel::<CaptureRequest>(QUEUE);
    let (up_tx, up_rx) = sync_channel::<UploadRequest>(QUEUE);
    let node = cfg.node.clone();
    let up = up_tx.clone();
    let poll_log = log.clone();
    std::thread::Builder::new()
        .name("capture-poll".into())
        .spawn(move || poller(poll, &node, &req_tx, &up, &poll_log))
        .map_err(|e| CommandError::Input(format!("cannot start the capture poller: {e}")))?;
    std::thread::Builder::new()
        .name("capture-upload".into())
        .spawn(move || {
            for result in up_rx {
                let id = result.id.clone();
                if let Err(e) = upload.call(result.encode_to_vec()) {
                    log(&format!("cannot upload capture {id}: {e}"));
                }
            }
        })
        .map_err(|e| CommandError::Input(format!("cannot start the capture uploader: {e}")))?;
    Ok(Some(Channel {
        requests: req_rx,
        uploads: up_tx,
    }))
}

/// A request's failure, as uploaded.
pub(super) fn failed(
    request: &CaptureRequest,
    node: &str,
    failure: Failure,
    why: String,
) -> UploadRequest {
    UploadRequest {
        id: request.id.clone(),
        node: node.to_string(),
        error: why,
        failure: failure as i32,
        ..Default::default()
    }
}

fn poller(
    mut client: PushClient,
    node: &str,
    requests: &SyncSender<CaptureRequest>,
    uploads: &SyncSender<UploadRequest>,
    log: &Log,
) {
    let body = PollRequest {
        node: node.to_string(),
        wait_ms: POLL_WAIT.as_millis() as u32,
    }
    .encode_to_vec();
    let mut told = false;
    // Dumps read each process's interpreter binary here, within a deadline: a process whose
    // read overran is left alone for a minute, and reads that never answer hold two
    // threads at most.
    let mut reads = ProcessReads::new(2, crate::dump::BINARY_DEADLINE, DUMP_BACKOFF);
    loop {
        let reply = match client.call(body.clone()) {
            Ok(bytes) => {
                told = false;
                PollReply::decode(bytes)
            }
            Err(e) => {
                if !told {
                    log(&format!("capture requests: {e} (retrying)"));
                    told = true;
                }
                std::thread::sleep(RETRY);
                continue;
            }
        };
        let Ok(reply) = reply else {
            std::thread::sleep(RETRY);
            continue;
        };
        for request in reply.requests {
            if request.kind == Kind::Dump as i32 {
                let _ = uploads.try_send(dump(&request, node, &mut reads));
                // What is kept of processes left alone stays bounded by the live ones.
                reads.retain(crate::os::pids::exists);
                continue;
            }
            match requests.try_send(request) {
                Ok(()) => {}
                Err(TrySendError::Full(r) | TrySendError::Disconnected(r)) => {
                    let why = format!("node '{node}' has {QUEUE} captures queued already");
                    let _ = uploads.try_send(failed(&r, node, Failure::Internal, why));
                }
            }
        }
    }
}

/// How long a process whose interpreter binary was not read in time is left alone by dumps.
const DUMP_BACKOFF: Duration = Duration::from_secs(60);

/// Every thread's Python stack of the request's processes, as JSON (one `ProcessDump` each),
/// with `native` its native frames too, read without stopping a thread (the agent's
/// system-call filter has no ptrace; see `python::native::Registers::Blocked`).
fn dump(request: &CaptureRequest, node: &str, reads: &mut ProcessReads) -> UploadRequest {
    let now = unix_now_ns();
    let mut dumps = Vec::new();
    for &pid in &request.pids {
        match crate::dump::dump_with(
            std::path::Path::new("/proc"),
            pid,
            request
                .native
                .then_some(crate::python::native::Registers::Blocked),
            reads,
        ) {
            Ok(d) => dumps.push(d),
            Err(e) => {
                let failure = match e {
                    crate::dump::PythonError::Permission(_) => Failure::Kernel,
                    _ => Failure::Input,
                };
                return failed(request, node, failure, format!("node '{node}': {e}"));
            }
        }
    }
    UploadRequest {
        id: request.id.clone(),
        node: node.to_string(),
        text: serde_json::to_string(&dumps).unwrap_or_default(),
        started_unix_ns: now,
        ended_unix_ns: unix_now_ns(),
        ..Default::default()
    }
}

pub(super) fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
