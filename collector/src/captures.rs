//! On-demand captures and dumps: requests a client makes for one node, handed to that node's
//! agent when it polls (the agent opens the channel, so no port is open on the node), and
//! their results as the agent uploads them. Everything is in memory and bounded: requests
//! running at once per node and per tenant, finished requests kept, the bytes of a result.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use pyrometer_proto::capture::{
    CaptureRequest, CaptureStatus, Failure, Kind, MAX_DURATION_MS, MAX_FREQUENCY_HZ, MAX_PIDS,
    UploadRequest,
};
use tokio::sync::Notify;

/// An agent that has not polled for this long is offline: requests for its node are refused.
pub const OFFLINE_AFTER: Duration = Duration::from_secs(15);
/// The longest an agent's poll is held open.
pub const MAX_POLL: Duration = Duration::from_secs(10);
/// A request no agent took within this is failed as offline.
const TAKE_WITHIN: Duration = Duration::from_secs(5);
/// A taken request whose result has not come this long after its duration is failed.
const UPLOAD_GRACE: Duration = Duration::from_secs(30);
/// Captures running (or waiting for their agent) at once, per node and per tenant.
pub const MAX_PER_NODE: usize = 1;
pub const MAX_PER_TENANT: usize = 4;
/// Finished requests kept per tenant (the oldest goes first), and their result bytes in all.
const KEEP_FINISHED: usize = 64;
const KEEP_BYTES: usize = 256 << 20;
/// The largest result an agent may upload.
pub const MAX_RESULT_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CaptureError {
    /// The request is malformed or names nothing (HTTP 400/404, CLI exit 2).
    #[error("{0}")]
    Input(String),
    #[error("{0}")]
    NotFound(String),
    /// The node's agent does not poll (HTTP 503).
    #[error("{0}")]
    Offline(String),
    /// Too many at once (HTTP 429).
    #[error("{0}")]
    Busy(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    Running,
    Done,
    Failed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Running => "running",
            State::Done => "done",
            State::Failed => "failed",
        }
    }
}

struct Entry {
    tenant: String,
    request: CaptureRequest,
    state: State,
    reason: String,
    failure: Failure,
    created: Instant,
    created_wall: SystemTime,
    taken: Option<Instant>,
    result: Option<UploadRequest>,
}

impl Entry {
    fn finished(&self) -> bool {
        matches!(self.state, State::Done | State::Failed)
    }

    fn result_bytes(&self) -> usize {
        self.result
            .as_ref()
            .map_or(0, |r| r.pprof.len() + r.chrome.len() + r.text.len())
    }

    fn fail(&mut self, failure: Failure, reason: String) {
        self.state = State::Failed;
        self.failure = failure;
        self.reason = reason;
    }
}

#[derive(Default)]
struct Inner {
    /// (tenant, node) -> when its agent last polled, and polls open now.
    agents: HashMap<(String, String), (Instant, u32)>,
    entries: HashMap<String, Entry>,
    /// Ids in creation order, for listing and for dropping the oldest finished.
    order: VecDeque<String>,
    next: u64,
}

/// The requests and the agents that serve them.
#[derive(Default)]
pub struct Captures {
    inner: Mutex<Inner>,
    /// Woken when a request is made (polls look for theirs) or ends (clients waiting).
    changed: Notify,
}

/// A request's state as the API shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub id: String,
    pub kind: &'static str,
    pub node: String,
    pub pids: Vec<u32>,
    pub duration_ms: u32,
    pub frequency_hz: u32,
    pub gil: bool,
    pub off_cpu: bool,
    pub alloc: bool,
    pub state: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub created_unix_s: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_unix_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_unix_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub samples: Option<u64>,
    /// A dump's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

impl Captures {
    /// Validates `request` and queues it for its node's agent; its id.
    pub fn create(
        &self,
        tenant: &str,
        mut request: CaptureRequest,
    ) -> Result<String, CaptureError> {
        let dump = request.kind == Kind::Dump as i32;
        if request.node.is_empty() || request.node.len() > 256 {
            return Err(CaptureError::Input("name the node (--node NAME)".into()));
        }
        if request.pids.is_empty() || request.pids.len() > MAX_PIDS {
            return Err(CaptureError::Input(format!(
                "name 1 to {MAX_PIDS} processes (--pid PID)"
            )));
        }
        if request.pids.contains(&0) {
            return Err(CaptureError::Input("pid 0 is not a process".into()));
        }
        if !dump {
            if request.duration_ms == 0 || request.duration_ms > MAX_DURATION_MS {
                return Err(CaptureError::Input(format!(
                    "a capture lasts 1 ms to {} s, not {} ms",
                    MAX_DURATION_MS / 1000,
                    request.duration_ms
                )));
            }
            if request.frequency_hz == 0 || request.frequency_hz > MAX_FREQUENCY_HZ {
                return Err(CaptureError::Input(format!(
                    "a capture samples at 1 to {MAX_FREQUENCY_HZ} Hz, not {}",
                    request.frequency_hz
                )));
            }
        }
        let mut inner = self.inner.lock().expect("not poisoned");
        let now = Instant::now();
        inner.expire(now);
        let key = (tenant.to_string(), request.node.clone());
        match inner.agents.get(&key) {
            None => {
                return Err(CaptureError::NotFound(format!(
                    "no agent serves node '{}': check the name (the agent's --node) and that \
                     its agent pushes to this collector",
                    request.node
                )));
            }
            Some(&(last, open)) if open == 0 && now.duration_since(last) > OFFLINE_AFTER => {
                return Err(CaptureError::Offline(format!(
                    "the agent of node '{}' is offline: no poll for {} s",
                    request.node,
                    now.duration_since(last).as_secs()
                )));
            }
            Some(_) => {}
        }
        if !dump {
            let running = |pred: &dyn Fn(&Entry) -> bool| {
                inner
                    .entries
                    .values()
                    .filter(|e| !e.finished() && e.request.kind == Kind::Capture as i32)
                    .filter(|e| pred(e))
                    .count()
            };
            if running(&|e| e.tenant == tenant && e.request.node == request.node) >= MAX_PER_NODE {
                return Err(CaptureError::Busy(format!(
                    "node '{}' runs a capture already (at most {MAX_PER_NODE} at a time per \
                     node): try again when it ends",
                    request.node
                )));
            }
            if running(&|e| e.tenant == tenant) >= MAX_PER_TENANT {
                return Err(CaptureError::Busy(format!(
                    "{MAX_PER_TENANT} captures of this tenant run already: try again when one ends"
                )));
            }
        }
        inner.next += 1;
        let id = format!(
            "{}-{}",
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            inner.next
        );
        request.id = id.clone();
        inner.entries.insert(
            id.clone(),
            Entry {
                tenant: tenant.to_string(),
                request,
                state: State::Pending,
                reason: String::new(),
                failure: Failure::None,
                created: now,
                created_wall: SystemTime::now(),
                taken: None,
                result: None,
            },
        );
        inner.order.push_back(id.clone());
        inner.trim();
        drop(inner);
        self.changed.notify_waiters();
        Ok(id)
    }

    /// An agent's poll: the requests waiting for its node, taken (running); waits up to
    /// `wait` for one when there is none.
    pub async fn poll(&self, tenant: &str, node: &str, wait: Duration) -> Vec<CaptureRequest> {
        let key = (tenant.to_string(), node.to_string());
        let deadline = tokio::time::Instant::now() + wait.min(MAX_POLL);
        {
            let mut inner = self.inner.lock().expect("not poisoned");
            let agent = inner
                .agents
                .entry(key.clone())
                .or_insert((Instant::now(), 0));
            agent.0 = Instant::now();
            agent.1 += 1;
        }
        let taken = loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let taken = self.take(tenant, node);
            if !taken.is_empty() {
                break taken;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break Vec::new();
            }
        };
        let mut inner = self.inner.lock().expect("not poisoned");
        if let Some(agent) = inner.agents.get_mut(&key) {
            agent.0 = Instant::now();
            agent.1 = agent.1.saturating_sub(1);
        }
        taken
    }

    fn take(&self, tenant: &str, node: &str) -> Vec<CaptureRequest> {
        let mut inner = self.inner.lock().expect("not poisoned");
        let now = Instant::now();
        let mut out = Vec::new();
        for e in inner.entries.values_mut() {
            if e.state == State::Pending && e.tenant == tenant && e.request.node == node {
                e.state = State::Running;
                e.taken = Some(now);
                out.push(e.request.clone());
            }
        }
        out
    }

    /// An agent's answer. Refused when the request is not its tenant's and node's, or is over.
    pub fn upload(&self, tenant: &str, upload: UploadRequest) -> Result<(), CaptureError> {
        let mut inner = self.inner.lock().expect("not poisoned");
        let e = inner
            .entries
            .get_mut(&upload.id)
            .filter(|e| e.tenant == tenant && e.request.node == upload.node)
            .ok_or_else(|| CaptureError::NotFound(format!("no request {}", upload.id)))?;
        if e.finished() {
            return Err(CaptureError::Input(format!(
                "request {} has ended ({}): {}",
                upload.id,
                e.state.name(),
                e.reason
            )));
        }
        if upload.error.is_empty() {
            e.state = State::Done;
            e.result = Some(upload);
        } else {
            let failure = Failure::try_from(upload.failure).unwrap_or(Failure::Internal);
            e.fail(failure, upload.error);
        }
        inner.trim();
        drop(inner);
        self.changed.notify_waiters();
        Ok(())
    }

    /// A request's status; with `result`, its result's bytes too. `wait` holds the answer
    /// until the request ends.
    pub async fn get(
        &self,
        tenant: &str,
        id: &str,
        wait: Duration,
        result: bool,
    ) -> Result<CaptureStatus, CaptureError> {
        let deadline = tokio::time::Instant::now() + wait.min(Duration::from_secs(70));
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let status = {
                let mut inner = self.inner.lock().expect("not poisoned");
                inner.expire(Instant::now());
                let e = inner
                    .entries
                    .get(id)
                    .filter(|e| e.tenant == tenant)
                    .ok_or_else(|| CaptureError::NotFound(format!("no capture {id}")))?;
                let status = CaptureStatus {
                    request: Some(e.request.clone()),
                    state: e.state.name().into(),
                    reason: e.reason.clone(),
                    failure: e.failure as i32,
                    result: e.result.as_ref().map(|r| {
                        if result {
                            r.clone()
                        } else {
                            UploadRequest {
                                pprof: Vec::new(),
                                chrome: Vec::new(),
                                ..r.clone()
                            }
                        }
                    }),
                };
                if e.finished() {
                    return Ok(status);
                }
                status
            };
            // Woken at least every second, so an agent that never answers is seen to.
            let tick = (tokio::time::Instant::now() + Duration::from_secs(1)).min(deadline);
            if tokio::time::timeout_at(tick, notified).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return Ok(status);
            }
        }
    }

    /// The tenant's requests, newest first.
    pub fn list(&self, tenant: &str) -> Vec<Summary> {
        let mut inner = self.inner.lock().expect("not poisoned");
        inner.expire(Instant::now());
        inner
            .order
            .iter()
            .rev()
            .filter_map(|id| inner.entries.get(id))
            .filter(|e| e.tenant == tenant)
            .map(summary)
            .collect()
    }

    /// One request of the tenant's.
    pub fn summary(&self, tenant: &str, id: &str) -> Option<Summary> {
        let mut inner = self.inner.lock().expect("not poisoned");
        inner.expire(Instant::now());
        inner
            .entries
            .get(id)
            .filter(|e| e.tenant == tenant)
            .map(summary)
    }

    /// A finished capture's result (`chrome`: the timeline, else the pprof), gzipped.
    pub fn result(&self, tenant: &str, id: &str, chrome: bool) -> Option<Vec<u8>> {
        let inner = self.inner.lock().expect("not poisoned");
        let r = inner
            .entries
            .get(id)
            .filter(|e| e.tenant == tenant)?
            .result
            .as_ref()?;
        let bytes = if chrome { &r.chrome } else { &r.pprof };
        (!bytes.is_empty()).then(|| bytes.clone())
    }

    /// Nodes whose agents poll (or polled within [`OFFLINE_AFTER`]), for the UI.
    pub fn nodes(&self, tenant: &str) -> Vec<String> {
        let inner = self.inner.lock().expect("not poisoned");
        let now = Instant::now();
        let mut nodes: Vec<String> = inner
            .agents
            .iter()
            .filter(|((t, _), (last, open))| {
                t == tenant && (*open > 0 || now.duration_since(*last) <= OFFLINE_AFTER)
            })
            .map(|((_, n), _)| n.clone())
            .collect();
        nodes.sort();
        nodes
    }
}

impl Inner {
    /// Fails requests no agent took in time, or whose result is overdue.
    fn expire(&mut self, now: Instant) {
        for e in self.entries.values_mut() {
            match (e.state, e.taken) {
                (State::Pending, _) if now.duration_since(e.created) > TAKE_WITHIN => {
                    let reason = format!(
                        "the agent of node '{}' is offline: it did not take the request within {} s",
                        e.request.node,
                        TAKE_WITHIN.as_secs()
                    );
                    e.fail(Failure::Offline, reason);
                }
                (State::Running, Some(taken))
                    if now.duration_since(taken)
                        > Duration::from_millis(u64::from(e.request.duration_ms))
                            + UPLOAD_GRACE =>
                {
                    let reason = format!(
                        "the agent of node '{}' did not return the result",
                        e.request.node
                    );
                    e.fail(Failure::Offline, reason);
                }
                _ => {}
            }
        }
    }

    /// Drops the oldest finished requests beyond the bounds.
    fn trim(&mut self) {
        loop {
            let finished: Vec<&Entry> = self.entries.values().filter(|e| e.finished()).collect();
            let bytes: usize = finished.iter().map(|e| e.result_bytes()).sum();
            let mut per_tenant: HashMap<&str, usize> = HashMap::new();
            for e in &finished {
                *per_tenant.entry(e.tenant.as_str()).or_default() += 1;
            }
            let over_tenant = per_tenant
                .into_iter()
                .find(|&(_, n)| n > KEEP_FINISHED)
                .map(|(t, _)| t.to_string());
            if bytes <= KEEP_BYTES && over_tenant.is_none() {
                return;
            }
            let victim = self.order.iter().position(|id| {
                self.entries.get(id).is_some_and(|e| {
                    e.finished() && over_tenant.as_ref().is_none_or(|t| *t == e.tenant)
                })
            });
            let Some(at) = victim else { return };
            if let Some(id) = self.order.remove(at) {
                self.entries.remove(&id);
            }
        }
    }
}

fn summary(e: &Entry) -> Summary {
    let r = &e.request;
    Summary {
        id: r.id.clone(),
        kind: if r.kind == Kind::Dump as i32 {
            "dump"
        } else {
            "capture"
        },
        node: r.node.clone(),
        pids: r.pids.clone(),
        duration_ms: r.duration_ms,
        frequency_hz: r.frequency_hz,
        gil: r.gil,
        off_cpu: r.off_cpu,
        alloc: r.alloc,
        state: e.state.name(),
        reason: e.reason.clone(),
        created_unix_s: e
            .created_wall
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        started_unix_ns: e.result.as_ref().map(|r| r.started_unix_ns),
        ended_unix_ns: e.result.as_ref().map(|r| r.ended_unix_ns),
        samples: e.result.as_ref().map(|r| r.samples),
        text: e
            .result
            .as_ref()
            .filter(|r| !r.text.is_empty())
            .map(|r| r.text.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(node: &str, pid: u32) -> CaptureRequest {
        CaptureRequest {
            node: node.into(),
            pids: vec![pid],
            duration_ms: 1000,
            frequency_hz: 99,
            ..Default::default()
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A request reaches its node's agent only, runs once, and ends with the upload; the
    /// other tenant neither sees nor answers it.
    #[test]
    fn a_request_goes_to_its_node_and_ends_with_the_upload() {
        let rt = rt();
        let c = Captures::default();
        rt.block_on(c.poll("", "b", Duration::ZERO));
        rt.block_on(c.poll("", "a", Duration::ZERO));
        let id = c.create("", request("b", 42)).unwrap();
        assert!(rt.block_on(c.poll("", "a", Duration::ZERO)).is_empty());
        assert!(rt.block_on(c.poll("other", "b", Duration::ZERO)).is_empty());
        let got = rt.block_on(c.poll("", "b", Duration::ZERO));
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].id.as_str(), got[0].pids.as_slice()),
            (id.as_str(), &[42][..])
        );
        assert!(
            rt.block_on(c.poll("", "b", Duration::ZERO)).is_empty(),
            "taken once"
        );
        assert_eq!(c.summary("", &id).unwrap().state, "running");
        assert!(c.summary("other", &id).is_none());
        let upload = UploadRequest {
            id: id.clone(),
            node: "b".into(),
            pprof: vec![1, 2, 3],
            samples: 7,
            ..Default::default()
        };
        assert!(c.upload("other", upload.clone()).is_err());
        assert!(
            c.upload(
                "",
                UploadRequest {
                    node: "a".into(),
                    ..upload.clone()
                }
            )
            .is_err(),
            "another node's agent cannot answer it"
        );
        c.upload("", upload.clone()).unwrap();
        assert_eq!(c.summary("", &id).unwrap().state, "done");
        assert_eq!(c.result("", &id, false), Some(vec![1, 2, 3]));
        assert!(c.upload("", upload).is_err(), "answered once");
    }

    /// A waiting poll is answered as soon as a request comes, not at its end.
    #[test]
    fn a_waiting_poll_is_answered_at_once() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let c = std::sync::Arc::new(Captures::default());
        rt.block_on(c.poll("", "b", Duration::ZERO));
        let poller = c.clone();
        let started = Instant::now();
        let polled = rt.spawn(async move { poller.poll("", "b", Duration::from_secs(10)).await });
        std::thread::sleep(Duration::from_millis(100));
        c.create("", request("b", 1)).unwrap();
        let got = rt.block_on(polled).unwrap();
        assert_eq!(got.len(), 1);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    /// Bad requests, unknown nodes and busy nodes are refused with their reason.
    #[test]
    fn requests_are_bounded_and_refused_with_a_reason() {
        let rt = rt();
        let c = Captures::default();
        rt.block_on(c.poll("", "b", Duration::ZERO));
        let err = |r| c.create("", r).unwrap_err();
        assert!(matches!(err(request("z", 1)), CaptureError::NotFound(m) if m.contains("'z'")));
        assert!(matches!(
            err(CaptureRequest { duration_ms: 61_000, ..request("b", 1) }),
            CaptureError::Input(m) if m.contains("60 s")
        ));
        assert!(matches!(
            err(CaptureRequest { frequency_hz: 1000, ..request("b", 1) }),
            CaptureError::Input(m) if m.contains("999")
        ));
        assert!(matches!(err(request("b", 0)), CaptureError::Input(_)));
        c.create("", request("b", 1)).unwrap();
        assert!(matches!(err(request("b", 2)), CaptureError::Busy(m) if m.contains("at most 1")));
        // A dump is not a capture: it passes beside one.
        let dump = CaptureRequest {
            kind: Kind::Dump as i32,
            duration_ms: 0,
            ..request("b", 2)
        };
        c.create("", dump).unwrap();
    }

    /// A request its agent never takes fails as offline.
    #[test]
    fn a_request_not_taken_fails_as_offline() {
        let rt = rt();
        let c = Captures::default();
        rt.block_on(c.poll("", "b", Duration::ZERO));
        let id = c.create("", request("b", 1)).unwrap();
        let mut inner = c.inner.lock().unwrap();
        inner.expire(Instant::now() + TAKE_WITHIN + Duration::from_secs(1));
        let e = &inner.entries[&id];
        assert_eq!((e.state, e.failure), (State::Failed, Failure::Offline));
        assert!(e.reason.contains("offline"), "{}", e.reason);
    }
}
