//! Delivery: each interval's profile is written to the spool, and a pusher thread sends
//! spooled batches to the collector oldest first, deleting each only once it is acknowledged.
//! The OTLP export, best effort, gets the same profile. The clients of both are made here,
//! where credentials that would cross the network in plain text are refused.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use prost::Message;
use pyrometer_proto::ingest::PushRequest;

use super::export::{self, Exporter};
use super::metrics::AgentMetrics;
use super::push::{self, PushClient};
use super::spool::Spool;
use super::{AgentConfig, Log};
use crate::command::CommandError;
use crate::model::{Labels, Profile};

/// What the sampling loop and the pusher thread share.
pub(super) struct Shared {
    pub(super) spool: Mutex<Spool>,
    pub(super) wake: Condvar,
    pub(super) stop: AtomicBool,
    pub(super) metrics: Arc<AgentMetrics>,
    pub(super) log: Log,
}

impl Shared {
    pub(super) fn update_spool_gauges(&self, spool: &Spool) {
        self.metrics
            .spool_batches
            .store(spool.len() as u64, Relaxed);
        self.metrics.spool_bytes.store(spool.size_bytes(), Relaxed);
    }

    /// Tells the pusher to finish: what it cannot send within [`DRAIN_DEADLINE`] stays
    /// spooled.
    pub(super) fn stop(&self) {
        {
            // Under the lock: the pusher reads the flag under it before it sleeps untimed, so
            // the wake-up cannot fall between its check and its sleep.
            let _spool = self.spool.lock().expect("not poisoned");
            self.stop.store(true, Relaxed);
        }
        self.wake.notify_all();
    }
}

/// Where and when one interval's profile was taken, and where else it goes.
pub(super) struct Batch<'a> {
    pub(super) node: &'a str,
    pub(super) wall: SystemTime,
    pub(super) duration: Duration,
    pub(super) otlp: Option<&'a Exporter>,
    /// Whether it goes to the spool (and the collector): false for an OTLP-only agent.
    pub(super) spool: bool,
}

pub(super) fn spool_batch(
    shared: &Shared,
    batch: Batch<'_>,
    mut profile: Profile,
) -> Result<(), super::spool::SpoolError> {
    let Batch {
        node,
        wall,
        duration,
        otlp,
        spool: to_spool,
    } = batch;
    // Thread ids would multiply the collector's label sets without helping a cluster view;
    // the thread name stays.
    for s in &mut profile.samples {
        s.labels = s
            .labels
            .iter()
            .filter(|(k, _)| *k != "tid")
            .fold(Labels::new(), |l, (k, v)| l.with(k, v.clone()));
    }
    profile.time_nanos = wall
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    profile.duration_nanos = duration.as_nanos() as i64;
    if let Some(exporter) = otlp {
        exporter.export(&profile, node);
    }
    if !to_spool {
        return Ok(());
    }
    let samples: u64 = profile
        .samples
        .iter()
        .map(|s| s.values.first().copied().unwrap_or(0).max(0) as u64)
        .sum();
    let mut spool = shared.spool.lock().expect("not poisoned");
    let seq = spool.next_seq()?;
    let req = PushRequest {
        agent_id: spool.agent_id().to_string(),
        sequence: seq,
        node: node.to_string(),
        profile: Some(crate::output::pprof::to_pprof(&profile)),
    };
    let dropped = spool.add(seq, samples, &req.encode_to_vec())?;
    let m = &shared.metrics;
    m.batches_spooled.fetch_add(1, Relaxed);
    m.batches_dropped.fetch_add(dropped.batches, Relaxed);
    m.samples_dropped.fetch_add(dropped.samples, Relaxed);
    shared.update_spool_gauges(&spool);
    drop(spool);
    shared.wake.notify_all();
    Ok(())
}

/// How long the pusher keeps trying after the agent was told to stop; what is left stays in
/// the spool for the next start.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// The pusher thread: sends the oldest spooled batch, backs off while the collector is away,
/// and drains for [`DRAIN_DEADLINE`] once told to stop.
pub(super) fn pusher(shared: Arc<Shared>, mut client: PushClient) {
    let mut backoff = Duration::from_millis(200);
    let mut stop_at: Option<Instant> = None;
    let mut last_error = String::new();
    loop {
        if shared.stop.load(Relaxed) && stop_at.is_none() {
            stop_at = Some(Instant::now() + DRAIN_DEADLINE);
        }
        if stop_at.is_some_and(|t| Instant::now() >= t) {
            return;
        }
        let next = {
            let mut spool = shared.spool.lock().expect("not poisoned");
            match spool.take_oldest() {
                Ok(Some(n)) => Some(n),
                Ok(None) => {
                    if stop_at.is_some() {
                        return;
                    }
                    // Until a batch is spooled or the agent stops (both notify): a timed
                    // wait woke the agent twice a second for nothing.
                    drop(
                        shared
                            .wake
                            .wait_while(spool, |s| s.is_empty() && !shared.stop.load(Relaxed))
                            .expect("not poisoned"),
                    );
                    None
                }
                Err(e) => {
                    (shared.log)(&e.to_string());
                    None
                }
            }
        };
        let Some((entry, body)) = next else { continue };
        let started = Instant::now();
        let result = client.push(body);
        match result {
            Ok(_) => {
                acknowledged(&shared, &entry, started);
                backoff = Duration::from_millis(200);
                if !last_error.is_empty() {
                    (shared.log)("collector reachable again");
                    last_error.clear();
                }
            }
            Err(e) if e.is_permanent() => {
                // Retrying the same bytes cannot succeed; keeping them would block the spool.
                (shared.log)(&format!("batch {} dropped: {e}", entry.seq));
                let mut spool = shared.spool.lock().expect("not poisoned");
                let _ = spool.acknowledged(entry.seq);
                shared.metrics.batches_dropped.fetch_add(1, Relaxed);
                shared
                    .metrics
                    .samples_dropped
                    .fetch_add(entry.samples, Relaxed);
                shared.update_spool_gauges(&spool);
            }
            Err(e) => {
                failed(&shared, e.to_string(), &mut last_error, backoff);
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// A batch the collector acknowledged leaves the spool.
fn acknowledged(shared: &Shared, entry: &super::spool::Entry, started: Instant) {
    let m = &shared.metrics;
    let mut spool = shared.spool.lock().expect("not poisoned");
    if let Err(e) = spool.acknowledged(entry.seq) {
        (shared.log)(&e.to_string());
    }
    m.push_ns
        .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
    m.batches_pushed.fetch_add(1, Relaxed);
    m.samples_pushed.fetch_add(entry.samples, Relaxed);
    shared.update_spool_gauges(&spool);
}

/// A push failed: the batch stays spooled, and the pusher waits `backoff` (or until told to
/// stop). A new error is said once, at most 100 times in all.
fn failed(shared: &Shared, msg: String, last_error: &mut String, backoff: Duration) {
    static LOGGED: AtomicU64 = AtomicU64::new(0);
    let mut spool = shared.spool.lock().expect("not poisoned");
    spool.release();
    shared.metrics.push_errors.fetch_add(1, Relaxed);
    if msg != *last_error && LOGGED.fetch_add(1, Relaxed) < 100 {
        (shared.log)(&format!("push failed, keeping the batch spooled: {msg}"));
    }
    *last_error = msg;
    shared.update_spool_gauges(&spool);
    let _ = shared
        .wake
        .wait_timeout_while(spool, backoff, |_| !shared.stop.load(Relaxed))
        .expect("not poisoned");
}

/// A client of the collector at `url` with the agent's credentials (token, CA, client
/// certificate).
pub(super) fn collector_client(
    cfg: &AgentConfig,
    url: &str,
    timeout: Duration,
) -> Result<PushClient, push::PushError> {
    PushClient::with_identity(
        url,
        cfg.token.as_deref(),
        cfg.ca.as_deref(),
        cfg.client_identity
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path())),
        timeout,
    )
}

/// The collector's push client and the OTLP endpoint's, checked before anything starts: a
/// token or a client certificate that would cross the network in plain text is refused here.
pub(super) fn clients(
    cfg: &AgentConfig,
) -> Result<(Option<PushClient>, Option<PushClient>), CommandError> {
    let client = cfg
        .collector
        .as_deref()
        .map(|url| {
            push::check_transport(
                url,
                cfg.token.is_some(),
                cfg.client_identity.is_some(),
                cfg.insecure,
            )?;
            collector_client(cfg, url, Duration::from_secs(5))
        })
        .transpose()
        .map_err(|e| CommandError::Input(e.to_string()))?;
    let otlp_client = match &cfg.otlp_endpoint {
        Some(url) => {
            let ca = cfg.ca.as_deref().filter(|_| url.starts_with("https://"));
            Some(
                Exporter::client(url, ca)
                    .map_err(|e| CommandError::Input(export::endpoint_error(e)))?,
            )
        }
        None => None,
    };
    Ok((client, otlp_client))
}
