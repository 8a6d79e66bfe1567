//! Debug files fetched by build id from debuginfod servers (`GET URL/buildid/<id>/debuginfo`,
//! elfutils' protocol), for binaries whose symbols are stripped and whose debug file is not
//! on the machine. Fetches run on workers of their own, never where samples are read: a
//! binary whose file is on its way is named as it would be without it, and once the file has
//! arrived ([`Debuginfod::poll`]) its frames are named again. What was fetched, and what no
//! server has, is kept in an on-disk cache ([`cache`]) shared by `record` and the agent.

pub mod cache;
mod http;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::os::workers::Workers;
pub use cache::{Cached, DEFAULT_CACHE_MAX_BYTES, DebugCache};
pub use http::Limits;

/// The largest debug file fetched unless configured otherwise: 512 MiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 512 << 20;
/// Limits of one download unless configured otherwise.
pub const DEFAULT_LIMITS: Limits = Limits {
    connect: Duration::from_secs(3),
    read: Duration::from_secs(10),
    deadline: Duration::from_secs(120),
    max_bytes: DEFAULT_MAX_FILE_BYTES,
};
/// Downloads at once: each holds a worker for as long as its server takes (at most the
/// deadline).
const FETCH_WORKERS: usize = 2;
/// Build ids whose answer is remembered in memory at most; past it only pending ones stay
/// (the disk cache still answers).
const MAX_KNOWN: usize = 4096;

/// Where to fetch from and where to keep it.
#[derive(Debug, Clone)]
pub struct DebuginfodConfig {
    /// Server base URLs, asked in order.
    pub urls: Vec<String>,
    /// The on-disk cache shared by `record` and the agent.
    pub cache_dir: PathBuf,
    /// The cache's size limit; the least recently used files go first past it.
    pub cache_max_bytes: u64,
    /// Timeouts and the size cap of each download.
    pub limits: Limits,
}

impl DebuginfodConfig {
    /// `urls` with the default cache and limits.
    pub fn new(urls: Vec<String>) -> Self {
        Self {
            urls,
            cache_dir: cache::default_dir(),
            cache_max_bytes: DEFAULT_CACHE_MAX_BYTES,
            limits: DEFAULT_LIMITS,
        }
    }
}

/// Splits server lists as `DEBUGINFOD_URLS` has them (space separated) and checks each
/// URL's scheme and host; empty when no server is named.
pub fn parse_urls<'a>(lists: impl IntoIterator<Item = &'a str>) -> Result<Vec<String>, String> {
    let mut urls = Vec::new();
    for url in lists.into_iter().flat_map(str::split_whitespace) {
        let ok = (url.starts_with("http://") || url.starts_with("https://"))
            && url.parse::<::http::Uri>().is_ok_and(|u| u.host().is_some());
        if !ok {
            return Err(format!(
                "{url:?} is not a debuginfod server URL (http://HOST[:PORT] or https://…)"
            ));
        }
        urls.push(url.trim_end_matches('/').to_string());
    }
    Ok(urls)
}

/// Counts, for `record --stats` and the agent's `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DebuginfodStats {
    /// Downloads tried (one per build id and server asked).
    pub fetches: u64,
    /// Debug files taken from the cache without asking a server.
    pub hits: u64,
    /// Build ids the cache did not have, and a server was asked for.
    pub misses: u64,
    /// Debug files downloaded, checked and stored in the cache.
    pub stored: u64,
    /// Build ids no server has (404 from each).
    pub not_found: u64,
    /// Downloads that failed: timeouts, refused connections, errors, files that were not
    /// the debug file asked for.
    pub failures: u64,
    /// Bytes of debug files downloaded.
    pub bytes: u64,
}

#[derive(Default)]
struct Counters {
    fetches: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    stored: AtomicU64,
    not_found: AtomicU64,
    failures: AtomicU64,
    bytes: AtomicU64,
}

struct Shared {
    urls: Vec<String>,
    cache: DebugCache,
    limits: Limits,
    counters: Counters,
    /// The last failure, for one line of the report.
    last_error: Mutex<Option<String>>,
    /// Build ids fetched by this client: found in the cache afterwards, not counted as hits.
    fetched: Mutex<std::collections::HashSet<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    /// Fetched, or found in the cache by a fetch job.
    Arrived,
    /// Nothing, asked again after this.
    Absent(Instant),
}

/// The client. Not shared: the symbolizer owns it and asks it on its own thread.
pub struct Debuginfod {
    shared: Arc<Shared>,
    workers: Workers,
    known: HashMap<String, State>,
    done_tx: Sender<(String, Outcome)>,
    done_rx: Receiver<(String, Outcome)>,
}

impl Debuginfod {
    /// A client; nothing is fetched before the first [`Debuginfod::request`].
    pub fn new(cfg: DebuginfodConfig) -> Self {
        let (done_tx, done_rx) = mpsc::channel();
        Self {
            shared: Arc::new(Shared {
                urls: cfg.urls,
                cache: DebugCache::new(cfg.cache_dir, cfg.cache_max_bytes),
                limits: cfg.limits,
                counters: Counters::default(),
                last_error: Mutex::new(None),
                fetched: Mutex::default(),
            }),
            workers: Workers::new(FETCH_WORKERS),
            known: HashMap::new(),
            done_tx,
            done_rx,
        }
    }

    /// Makes the cache directory, owned by `owner` when given.
    pub fn prepare(&self, owner: Option<(u32, u32)>) -> std::io::Result<()> {
        self.shared.cache.prepare(owner)
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &std::path::Path {
        self.shared.cache.dir()
    }

    /// The cache's debug file of `id`, checked: for a read of a binary that runs on a worker.
    pub fn cache_lookup(&self) -> impl Fn(&str) -> Option<PathBuf> + Send + 'static {
        let shared = self.shared.clone();
        move |id| match shared.cache.lookup(id) {
            Cached::File(path) => {
                let ours = shared.fetched.lock().is_ok_and(|f| f.contains(id));
                if !ours {
                    shared.counters.hits.fetch_add(1, Relaxed);
                }
                Some(path)
            }
            _ => None,
        }
    }

    /// Asks for the debug file of `id` unless it is on its way, arrived, or recently found
    /// absent. Never waits: the answer comes through [`Debuginfod::poll`].
    pub fn request(&mut self, id: &str) {
        if !cache::valid_build_id(id) {
            return;
        }
        match self.known.get(id) {
            Some(State::Pending | State::Arrived) => return,
            Some(State::Absent(until)) if Instant::now() < *until => return,
            _ => {}
        }
        if self.known.len() >= MAX_KNOWN {
            self.known.retain(|_, s| *s == State::Pending);
        }
        let (shared, tx, key) = (self.shared.clone(), self.done_tx.clone(), id.to_string());
        let submitted = self.workers.submit(move || {
            let outcome = fetch(&shared, &key);
            let _ = tx.send((key, outcome));
        });
        // No free worker: asked again at the binary's next read or the next push.
        if submitted.is_ok() {
            self.known.insert(id.to_string(), State::Pending);
        }
    }

    /// The build ids whose debug file has arrived since the last call.
    pub fn poll(&mut self) -> Vec<String> {
        let mut arrived = Vec::new();
        while let Ok((id, outcome)) = self.done_rx.try_recv() {
            self.settle(&id, outcome, &mut arrived);
        }
        arrived
    }

    /// Waits up to `wait` for the downloads under way, returning the build ids that arrived.
    pub fn wait(&mut self, wait: Duration) -> Vec<String> {
        let end = Instant::now() + wait;
        let mut arrived = self.poll();
        while self.pending() > 0 {
            let left = end.saturating_duration_since(Instant::now());
            match self.done_rx.recv_timeout(left) {
                Ok((id, outcome)) => self.settle(&id, outcome, &mut arrived),
                Err(_) => break,
            }
        }
        arrived
    }

    fn settle(&mut self, id: &str, outcome: Outcome, arrived: &mut Vec<String>) {
        let state = match outcome {
            Outcome::Arrived => {
                arrived.push(id.to_string());
                State::Arrived
            }
            Outcome::Missing => State::Absent(Instant::now() + cache::MISSING_TTL),
            Outcome::Failed => State::Absent(Instant::now() + cache::FAILED_TTL),
        };
        self.known.insert(id.to_string(), state);
    }

    /// Downloads under way.
    pub fn pending(&self) -> usize {
        self.known
            .values()
            .filter(|s| **s == State::Pending)
            .count()
    }

    /// The counts so far.
    pub fn stats(&self) -> DebuginfodStats {
        let c = &self.shared.counters;
        DebuginfodStats {
            fetches: c.fetches.load(Relaxed),
            hits: c.hits.load(Relaxed),
            misses: c.misses.load(Relaxed),
            stored: c.stored.load(Relaxed),
            not_found: c.not_found.load(Relaxed),
            failures: c.failures.load(Relaxed),
            bytes: c.bytes.load(Relaxed),
        }
    }

    /// The last download's failure, if one failed.
    pub fn last_error(&self) -> Option<String> {
        self.shared.last_error.lock().ok()?.clone()
    }
}

/// How one build id's fetch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The debug file is in the cache now.
    Arrived,
    /// No server has it.
    Missing,
    /// Some server could not be asked.
    Failed,
}

/// One build id: the cache first (another process may have fetched it meanwhile), then each
/// server in order.
fn fetch(shared: &Shared, id: &str) -> Outcome {
    let c = &shared.counters;
    match shared.cache.lookup(id) {
        Cached::File(_) => return Outcome::Arrived,
        // Remembered on disk (by this process or another); asked again when that expires.
        Cached::Absent => return Outcome::Failed,
        Cached::Unknown => {}
    }
    c.misses.fetch_add(1, Relaxed);
    let mut failed = false;
    for base in &shared.urls {
        let url = format!("{base}/buildid/{id}/debuginfo");
        c.fetches.fetch_add(1, Relaxed);
        let outcome = shared.cache.temp(id).map_err(|e| {
            format!(
                "cannot write to the cache {}: {e}",
                shared.cache.dir().display()
            )
        });
        let outcome = outcome.and_then(|(temp, mut file)| {
            let got = http::get(&url, &mut file, shared.limits);
            drop(file);
            match got {
                Ok(http::Got::Stored(n)) => {
                    c.bytes.fetch_add(n, Relaxed);
                    shared.cache.commit(id, &temp).map(Some)
                }
                Ok(http::Got::NotFound) => {
                    let _ = std::fs::remove_file(&temp);
                    Ok(None)
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&temp);
                    Err(e)
                }
            }
        });
        match outcome {
            Ok(Some(_)) => {
                c.stored.fetch_add(1, Relaxed);
                if let Ok(mut f) = shared.fetched.lock() {
                    if f.len() >= MAX_KNOWN {
                        f.clear();
                    }
                    f.insert(id.to_string());
                }
                return Outcome::Arrived;
            }
            Ok(None) => {}
            Err(e) => {
                failed = true;
                c.failures.fetch_add(1, Relaxed);
                if let Ok(mut last) = shared.last_error.lock() {
                    *last = Some(format!("{url}: {e}"));
                }
            }
        }
    }
    if !failed {
        c.not_found.fetch_add(1, Relaxed);
    }
    shared.cache.mark(id, !failed);
    if failed {
        Outcome::Failed
    } else {
        Outcome::Missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_lists_split_as_debuginfod_urls() {
        let urls = parse_urls(["http://a:8002/ https://b.example", "http://[::1]:1"]).unwrap();
        assert_eq!(
            urls,
            ["http://a:8002", "https://b.example", "http://[::1]:1"]
        );
        assert!(parse_urls(["ftp://a"]).is_err());
        assert!(parse_urls(["a.example"]).is_err());
        assert!(parse_urls([""]).unwrap().is_empty());
    }
}
