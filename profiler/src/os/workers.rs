//! A small pool of threads for work on behalf of a profiled process that may not return in
//! time: a read of a file on a mount that never answers (FUSE), a parse of something huge. The
//! caller waits up to a deadline; a job that overruns keeps its worker (a thread blocked in the
//! kernel cannot be taken back) and the caller is told, so it can back off from that process.
//! With every worker held by a stuck job, new jobs are refused at once: stuck reads cost at
//! most [`Workers::new`]'s count of threads, never the caller.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() + Send>;

/// While set, pools start no thread and run their jobs on the caller's.
static HELD: AtomicBool = AtomicBool::new(false);

/// Makes every pool run its jobs on the caller's thread, without a deadline, until
/// [`release_threads`]: for a process that must have no other thread for a while (the agent,
/// until it has become its unprivileged user: capabilities and credentials are per thread).
pub fn hold_threads() {
    HELD.store(true, Ordering::Release);
}

/// Lets pools start their threads again.
pub fn release_threads() {
    HELD.store(false, Ordering::Release);
}

/// Why a job gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// It was still running at the deadline; it keeps its worker until it returns.
    Overran,
    /// Every worker is held by a job that overran; it was not started.
    Busy,
}

pub struct Workers {
    jobs: Mutex<Option<Sender<Job>>>,
    count: usize,
    started: AtomicUsize,
    /// Workers running a job now.
    busy: Arc<AtomicUsize>,
    queue: Mutex<Option<Arc<Mutex<Receiver<Job>>>>>,
}

impl Workers {
    /// A pool of at most `count` threads (`pyrometer-worker`), started on first use.
    pub fn new(count: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        Self {
            jobs: Mutex::new(Some(tx)),
            count: count.max(1),
            started: AtomicUsize::new(0),
            busy: Arc::new(AtomicUsize::new(0)),
            queue: Mutex::new(Some(Arc::new(Mutex::new(rx)))),
        }
    }

    /// Runs `job` on a worker and waits up to `deadline` for its answer.
    pub fn run<T: Send + 'static>(
        &self,
        deadline: Duration,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Refused> {
        if HELD.load(Ordering::Acquire) {
            return Ok(job());
        }
        let (tx, rx) = mpsc::channel();
        self.dispatch(move || {
            let answer = job();
            // The worker is free again before its answer is sent: counted busy until after,
            // a caller that got the answer could find every worker busy and be refused.
            move || {
                let _ = tx.send(answer);
            }
        })?;
        match rx.recv_timeout(deadline) {
            Ok(v) => Ok(v),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                Err(Refused::Overran)
            }
        }
    }

    /// Starts `job` on a worker without waiting for it, for work that reports its own way (a
    /// download that answers through a channel). Refused at once when every worker is busy,
    /// and while threads are held: such work never runs on the caller's thread.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), Refused> {
        if HELD.load(Ordering::Acquire) {
            return Err(Refused::Busy);
        }
        self.dispatch(move || {
            job();
            || {}
        })
    }

    /// Queues `job` on a worker counted busy until it returns; what it returns runs after the
    /// worker is counted free.
    fn dispatch<F: FnOnce() + Send + 'static>(
        &self,
        job: impl FnOnce() -> F + Send + 'static,
    ) -> Result<(), Refused> {
        if self.busy.load(Ordering::Acquire) >= self.count {
            return Err(Refused::Busy);
        }
        self.ensure_started();
        let busy = self.busy.clone();
        busy.fetch_add(1, Ordering::AcqRel);
        let wrapped: Job = Box::new(move || {
            let then = job();
            busy.fetch_sub(1, Ordering::AcqRel);
            then();
        });
        let sent = self
            .jobs
            .lock()
            .expect("not poisoned")
            .as_ref()
            .is_some_and(|s| s.send(wrapped).is_ok());
        if !sent {
            self.busy.fetch_sub(1, Ordering::AcqRel);
            return Err(Refused::Busy);
        }
        Ok(())
    }

    /// Workers held by a job now (those that overran among them).
    #[cfg(test)]
    pub fn busy(&self) -> usize {
        self.busy.load(Ordering::Acquire)
    }

    fn ensure_started(&self) {
        while self.started.load(Ordering::Acquire) < self.count {
            let Some(queue) = self.queue.lock().expect("not poisoned").clone() else {
                return;
            };
            if self.started.fetch_add(1, Ordering::AcqRel) >= self.count {
                return;
            }
            let spawned = std::thread::Builder::new()
                .name("pyrometer-worker".into())
                .spawn(move || {
                    loop {
                        let job = queue.lock().expect("not poisoned").recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                });
            if spawned.is_err() {
                self.started.fetch_sub(1, Ordering::AcqRel);
                return;
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Closing the queue ends the idle workers; a stuck one ends when its job returns.
        self.jobs.lock().expect("not poisoned").take();
        self.queue.lock().expect("not poisoned").take();
    }
}

/// Reads of profiled processes' files on a [`Workers`] pool, each process left alone for a
/// while once one of its reads overran: no read of its files is tried again until the backoff
/// has passed and the stuck read has returned, so one process holds at most one worker.
pub struct ProcessReads {
    workers: Workers,
    deadline: Duration,
    backoff: Duration,
    /// Processes whose read overran: until when they are left alone, and whether the read
    /// holding a worker has returned.
    stalled: HashMap<u32, (Instant, Arc<AtomicBool>)>,
    overran: u64,
}

impl ProcessReads {
    pub fn new(count: usize, deadline: Duration, backoff: Duration) -> Self {
        Self {
            workers: Workers::new(count),
            deadline,
            backoff,
            stalled: HashMap::new(),
            overran: 0,
        }
    }

    /// Whether `pid` is being left alone.
    pub fn is_stalled(&self, pid: u32) -> bool {
        self.stalled
            .get(&pid)
            .is_some_and(|(until, done)| Instant::now() < *until || !done.load(Ordering::Acquire))
    }

    /// Runs a read of `pid`'s files on a worker, waiting up to the deadline. None when the
    /// process is being left alone, no worker is free, or the read overran (the process is
    /// then left alone).
    pub fn run<T: Send + 'static>(
        &mut self,
        pid: u32,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        if self.is_stalled(pid) {
            return None;
        }
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let r = self.workers.run(self.deadline, move || {
            let v = job();
            flag.store(true, Ordering::Release);
            v
        });
        match r {
            Ok(v) => Some(v),
            Err(Refused::Busy) => None,
            Err(Refused::Overran) => {
                self.overran += 1;
                self.stalled
                    .insert(pid, (Instant::now() + self.backoff, done));
                None
            }
        }
    }

    /// Reads that overran their deadline so far.
    pub fn overran(&self) -> u64 {
        self.overran
    }

    /// Forgets the processes `alive` says are gone, unless their read still holds a worker.
    pub fn retain(&mut self, alive: impl Fn(u32) -> bool) {
        self.stalled
            .retain(|&pid, (_, done)| alive(pid) || !done.load(Ordering::Acquire));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stuck_job_holds_one_worker_and_the_others_go_on() {
        let pool = Workers::new(2);
        assert_eq!(pool.run(Duration::from_secs(5), || 7), Ok(7));
        // A job that never returns on its own (a read that never answers).
        let (release, stuck) = mpsc::channel::<()>();
        let started = std::time::Instant::now();
        let r = pool.run(Duration::from_millis(100), move || {
            let _ = stuck.recv();
        });
        assert_eq!(r, Err(Refused::Overran));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(pool.busy(), 1);
        assert_eq!(
            pool.run(Duration::from_secs(5), || 8),
            Ok(8),
            "the other worker"
        );
        // A second stuck job takes the last worker; then jobs are refused at once.
        let (release2, stuck2) = mpsc::channel::<()>();
        let r = pool.run(Duration::from_millis(100), move || {
            let _ = stuck2.recv();
        });
        assert_eq!(r, Err(Refused::Overran));
        let started = std::time::Instant::now();
        assert_eq!(pool.run(Duration::from_secs(5), || 9), Err(Refused::Busy));
        assert!(started.elapsed() < Duration::from_millis(100));
        // Once a stuck job returns, its worker serves again.
        drop(release);
        drop(release2);
        wait_idle(&pool);
        assert_eq!(pool.run(Duration::from_secs(5), || 10), Ok(10));
    }

    #[test]
    fn submitted_jobs_run_beside_the_caller_and_are_refused_when_all_are_busy() {
        let pool = Workers::new(1);
        let (release, held) = mpsc::channel::<()>();
        let (done_tx, done) = mpsc::channel();
        let caller = std::thread::current().id();
        let started = std::time::Instant::now();
        pool.submit(move || {
            let _ = held.recv();
            let _ = done_tx.send(std::thread::current().id());
        })
        .unwrap();
        // The caller is not held by the job.
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(pool.submit(|| {}), Err(Refused::Busy));
        drop(release);
        let ran_on = done.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_ne!(ran_on, caller);
        wait_idle(&pool);
        assert_eq!(pool.run(Duration::from_secs(5), || 11), Ok(11));
    }

    #[test]
    fn a_process_whose_read_overran_is_left_alone_and_holds_one_worker() {
        let mut reads = ProcessReads::new(2, Duration::from_millis(100), Duration::ZERO);
        let (release, stuck) = mpsc::channel::<()>();
        assert_eq!(
            reads.run(7, move || {
                let _ = stuck.recv();
            }),
            None
        );
        assert_eq!(reads.overran(), 1);
        // Backoff over, but the stuck read still holds its worker: not tried again.
        assert!(reads.is_stalled(7));
        assert_eq!(reads.run(7, || 1), None);
        assert_eq!(reads.overran(), 1, "not started");
        // Other processes go on.
        assert_eq!(reads.run(8, || 2), Some(2));
        reads.retain(|_| false);
        assert!(reads.is_stalled(7), "kept while its read holds a worker");
        drop(release);
        let until = Instant::now() + Duration::from_secs(10);
        while reads.is_stalled(7) {
            assert!(Instant::now() < until, "the read never came back");
            std::thread::yield_now();
        }
        assert_eq!(reads.run(7, || 3), Some(3));
    }

    fn wait_idle(pool: &Workers) {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while pool.busy() > 0 {
            assert!(std::time::Instant::now() < until, "workers never came back");
            std::thread::yield_now();
        }
    }
}
