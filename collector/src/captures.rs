//! On-demand captures and dumps: requests a client makes for one node, handed to that node's
//! agent when it polls (the agent opens the channel, so no port is open on the node), and
//! their results as the agent uploads them. Everything is bounded: requests running at once
//! per node and per tenant, finished requests kept, the bytes of a result. Finished requests
//! are kept on disk too when the collector has a directory for them
//! ([`crate::capture_files`]), within the same bounds and its retention.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use pyrometer_proto::capture::{
    CaptureRequest, CaptureStatus, Failure, Kind, MAX_DURATION_MS, MAX_FREQUENCY_HZ, MAX_PIDS,
    UploadRequest,
};

use crate::capture_files::{self, SavedCapture};
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
    /// Where finished requests are kept across restarts, and for how long.
    dir: Option<PathBuf>,
    retention: Option<Duration>,
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
    /// The label query the request was made from, if any.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub query: String,
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
    /// Every request made with this one (a query over several nodes makes one per node),
    /// in the answer to its creation.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
}

impl Captures {
    /// Requests that keep their results in `dir` (made if missing) for `retention`, with
    /// those kept there before (stale or unreadable files are dropped and reported through
    /// `warn`).
    pub fn persistent(dir: PathBuf, retention: Duration, warn: &mut dyn FnMut(String)) -> Self {
        let saved = capture_files::load(&dir, retention, MAX_RESULT_BYTES, warn);
        let mut inner = Inner {
            dir: Some(dir),
            retention: Some(retention),
            ..Inner::default()
        };
        for s in saved {
            let Some(status) = s.status else { continue };
            let Some(request) = status.request else {
                continue;
            };
            let state = match status.state.as_str() {
                "done" => State::Done,
                _ => State::Failed,
            };
            // Ids are SECONDS-N: new ones count on from the largest kept.
            if let Some(n) = request.id.rsplit('-').next().and_then(|n| n.parse().ok()) {
                inner.next = inner.next.max(n);
            }
            let id = request.id.clone();
            inner.entries.insert(
                id.clone(),
                Entry {
                    tenant: s.tenant,
                    request,
                    state,
                    reason: status.reason,
                    failure: Failure::try_from(status.failure).unwrap_or(Failure::Internal),
                    created: Instant::now(),
                    created_wall: SystemTime::UNIX_EPOCH + Duration::from_secs(s.created_unix_s),
                    taken: None,
                    result: status.result,
                },
            );
            inner.order.push_back(id);
        }
        inner.trim();
        Self {
            inner: Mutex::new(inner),
            changed: Notify::new(),
        }
    }

    /// Writes finished request `id` to the directory of kept captures, if there is one. Call
    /// off the async workers: a result may be tens of MiB.
    pub fn save(&self, id: &str) -> std::io::Result<()> {
        let (dir, saved) = {
            let inner = self.inner.lock().expect("not poisoned");
            let (Some(dir), Some(e)) = (inner.dir.clone(), inner.entries.get(id)) else {
                return Ok(());
            };
            if !e.finished() {
                return Ok(());
            }
            let saved = SavedCapture {
                tenant: e.tenant.clone(),
                created_unix_s: e
                    .created_wall
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                status: Some(CaptureStatus {
                    request: Some(e.request.clone()),
                    state: e.state.name().into(),
                    reason: e.reason.clone(),
                    failure: e.failure as i32,
                    result: e.result.clone(),
                    members: Vec::new(),
                }),
            };
            (dir, saved)
        };
        capture_files::save(&dir, &saved)?;
        // Dropped from memory while it was written: its file goes too.
        if !self
            .inner
            .lock()
            .expect("not poisoned")
            .entries
            .contains_key(id)
        {
            capture_files::remove(&dir, id);
        }
        Ok(())
    }

    /// Validates `request` and queues it for its node's agent; its id.
    pub fn create(&self, tenant: &str, request: CaptureRequest) -> Result<String, CaptureError> {
        let target = (request.node.clone(), request.pids.clone());
        let mut ids = self.create_many(tenant, request, vec![target])?;
        Ok(ids.remove(0))
    }

    /// Validates `request` and queues one copy of it per `(node, pids)` target (what a label
    /// query resolved to), each for its node's agent; their ids, in the targets' order. All
    /// or none: a target that cannot take it refuses the whole request.
    pub fn create_many(
        &self,
        tenant: &str,
        request: CaptureRequest,
        targets: Vec<(String, Vec<u32>)>,
    ) -> Result<Vec<String>, CaptureError> {
        let dump = request.kind == Kind::Dump as i32;
        if targets.is_empty() {
            return Err(CaptureError::Input("name the node (--node NAME)".into()));
        }
        for (node, pids) in &targets {
            check_target(node, pids)?;
        }
        if !dump {
            check_bounds(&request)?;
        }
        let mut inner = self.inner.lock().expect("not poisoned");
        let now = Instant::now();
        inner.expire(now);
        for (node, _) in &targets {
            inner.check_agent(tenant, node, now)?;
        }
        if !dump {
            inner.check_room(tenant, targets.iter().map(|(n, _)| n.as_str()))?;
        }
        let mut ids = Vec::with_capacity(targets.len());
        for (node, pids) in targets {
            inner.next += 1;
            let id = format!(
                "{}-{}",
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                inner.next
            );
            let request = CaptureRequest {
                id: id.clone(),
                node,
                pids,
                ..request.clone()
            };
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
            ids.push(id);
        }
        inner.trim();
        drop(inner);
        self.changed.notify_waiters();
        Ok(ids)
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
                    members: Vec::new(),
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

/// A target's node and pids are named and within bounds.
fn check_target(node: &str, pids: &[u32]) -> Result<(), CaptureError> {
    if node.is_empty() || node.len() > 256 {
        return Err(CaptureError::Input("name the node (--node NAME)".into()));
    }
    if pids.is_empty() || pids.len() > MAX_PIDS {
        return Err(CaptureError::Input(format!(
            "name 1 to {MAX_PIDS} processes (--pid PID)"
        )));
    }
    if pids.contains(&0) {
        return Err(CaptureError::Input("pid 0 is not a process".into()));
    }
    Ok(())
}

/// A capture's duration and frequency are within bounds.
fn check_bounds(request: &CaptureRequest) -> Result<(), CaptureError> {
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
    Ok(())
}

impl Inner {
    /// The node has an agent of the tenant that polls.
    fn check_agent(&self, tenant: &str, node: &str, now: Instant) -> Result<(), CaptureError> {
        match self.agents.get(&(tenant.to_string(), node.to_string())) {
            None => Err(CaptureError::NotFound(format!(
                "no agent serves node '{node}': check the name (the agent's --node) and that \
                 its agent pushes to this collector"
            ))),
            Some(&(last, open)) if open == 0 && now.duration_since(last) > OFFLINE_AFTER => {
                Err(CaptureError::Offline(format!(
                    "the agent of node '{node}' is offline: no poll for {} s",
                    now.duration_since(last).as_secs()
                )))
            }
            Some(_) => Ok(()),
        }
    }

    /// New captures on `nodes` stay within the per-node and per-tenant bounds.
    fn check_room<'a>(
        &self,
        tenant: &str,
        nodes: impl Iterator<Item = &'a str>,
    ) -> Result<(), CaptureError> {
        let running: Vec<&Entry> = self
            .entries
            .values()
            .filter(|e| !e.finished() && e.request.kind == Kind::Capture as i32)
            .filter(|e| e.tenant == tenant)
            .collect();
        let mut added = 0;
        for node in nodes {
            added += 1;
            if running.iter().filter(|e| e.request.node == node).count() >= MAX_PER_NODE {
                return Err(CaptureError::Busy(format!(
                    "node '{node}' runs a capture already (at most {MAX_PER_NODE} at a time per \
                     node): try again when it ends"
                )));
            }
        }
        if running.len() + added > MAX_PER_TENANT {
            return Err(CaptureError::Busy(format!(
                "{MAX_PER_TENANT} captures of this tenant run at once at most ({} run, {added} \
                 asked for): try again when one ends, or narrow the query",
                running.len()
            )));
        }
        Ok(())
    }

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

    /// Drops the oldest finished requests beyond the bounds, and those past the retention.
    fn trim(&mut self) {
        if let Some(retention) = self.retention {
            let now = SystemTime::now();
            let stale: Vec<String> = self
                .entries
                .iter()
                .filter(|(_, e)| {
                    e.finished()
                        && now
                            .duration_since(e.created_wall)
                            .is_ok_and(|age| age > retention)
                })
                .map(|(id, _)| id.clone())
                .collect();
            for id in stale {
                self.drop_entry(&id);
            }
        }
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
            if let Some(id) = self.order.get(at).cloned() {
                self.drop_entry(&id);
            }
        }
    }

    /// Forgets request `id`, and deletes its file.
    fn drop_entry(&mut self, id: &str) {
        self.entries.remove(id);
        self.order.retain(|o| o != id);
        if let Some(dir) = &self.dir {
            capture_files::remove(dir, id);
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
        query: r.query.clone(),
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
        members: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
