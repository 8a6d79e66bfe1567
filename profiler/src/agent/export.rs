//! `agent --otlp-endpoint`: each push interval's profile also goes, in the OpenTelemetry
//! profiles data model, to an OTLP gRPC endpoint (an OpenTelemetry Collector, or any receiver
//! of `ProfilesService/Export`). Best effort beside the collector push: requests wait in a
//! bounded queue for a thread of their own; when the endpoint is slow or away they are dropped
//! and counted, never spooled, so the export can neither block sampling nor grow memory.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use prost::Message;
use pyrometer_proto::otlp::EXPORT_PATH;

use super::Log;
use super::push::{PushClient, PushError};
use crate::model::Profile;
use crate::otlp;

/// Requests waiting for the endpoint at most.
const QUEUE: usize = 8;

#[derive(Default)]
pub(super) struct Counts {
    pub(super) exported: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) dropped: AtomicU64,
}

pub(super) struct Exporter {
    tx: Option<SyncSender<Vec<u8>>>,
    thread: Option<JoinHandle<()>>,
    pub(super) counts: Arc<Counts>,
}

impl Exporter {
    /// The client for `endpoint` (http:// or https://, e.g. http://otel-collector:4317),
    /// checked before the agent starts; [`Exporter::start`] gets it once threads may start.
    pub(super) fn client(endpoint: &str, ca: Option<&Path>) -> Result<PushClient, PushError> {
        Ok(PushClient::new(endpoint, None, ca, Duration::from_secs(5))?.with_path(EXPORT_PATH))
    }

    /// Starts the export thread.
    pub(super) fn start(client: PushClient, endpoint: &str, log: Log) -> std::io::Result<Exporter> {
        let (tx, rx) = sync_channel(QUEUE);
        let counts = Arc::new(Counts::default());
        let thread = {
            let counts = counts.clone();
            let endpoint = endpoint.to_string();
            std::thread::Builder::new()
                .name("otlp-export".into())
                .spawn(move || export_loop(client, rx, &counts, &endpoint, &log))?
        };
        Ok(Exporter {
            tx: Some(tx),
            thread: Some(thread),
            counts,
        })
    }

    /// Queues `profile` (one interval of node `node`, labels as pushed) for export.
    pub(super) fn export(&self, profile: &Profile, node: &str) {
        let proc_root = Path::new("/proc");
        let request = otlp::to_request(profile, node, &|pid| otlp::container_id(proc_root, pid));
        let Some(tx) = &self.tx else { return };
        match tx.try_send(request.encode_to_vec()) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.dropped.fetch_add(1, Relaxed);
            }
        }
    }

    /// Sends what is queued (each request gets the client's timeout) and stops the thread.
    pub(super) fn finish(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The one line `--otlp-endpoint`'s set-up errors say (the client's own name the collector).
pub(super) fn endpoint_error(e: PushError) -> String {
    match e {
        PushError::Url { url, reason } => format!(
            "invalid --otlp-endpoint '{url}': {reason} (expected e.g. http://otel-collector:4317)"
        ),
        other => format!("--otlp-endpoint: {other}"),
    }
}

fn export_loop(
    mut client: PushClient,
    rx: Receiver<Vec<u8>>,
    counts: &Counts,
    endpoint: &str,
    log: &Log,
) {
    let mut failing = false;
    for body in rx {
        match client.call(body) {
            Ok(_) => {
                counts.exported.fetch_add(1, Relaxed);
                if failing {
                    log(&format!("OTLP endpoint {endpoint} reachable again"));
                    failing = false;
                }
            }
            Err(e) => {
                counts.failed.fetch_add(1, Relaxed);
                if !failing {
                    log(&format!("OTLP export to {endpoint} failed (dropped): {e}"));
                    failing = true;
                }
            }
        }
    }
}
