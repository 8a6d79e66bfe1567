//! A small pool of threads for work on behalf of a profiled process that may not return in
//! time: a read of a file on a mount that never answers (FUSE), a parse of something huge. The
//! caller waits up to a deadline; a job that overruns keeps its worker (a thread blocked in the
//! kernel cannot be taken back) and the caller is told, so it can back off from that process.
//! With every worker held by a stuck job, new jobs are refused at once: stuck reads cost at
//! most [`Workers::new`]'s count of threads, never the caller.
//!
//! A loop that must not wait at all (the sampling loop) hands its reads off with
//! [`OffLoop`] instead: the work is started, the loop goes on with what it has, and takes the
//! answer on a later turn, once [`OffLoop::ready`] names the processes that asked.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::os::cpu_budget::CpuBudget;

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

fn held() -> bool {
    HELD.load(Ordering::Acquire)
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
        if held() {
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
        if held() {
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
    /// [`OffLoop::poll`] waits for the answer (up to the deadline) rather than coming back
    /// at once.
    waits: bool,
    /// CPU time each read costs its process; none is started for a process over it.
    budget: Option<CpuBudget>,
    /// Until when [`OffLoop::poll`] may wait for work it has just started (see
    /// [`ProcessReads::begin_turn`]).
    turn_until: Option<Instant>,
}

impl ProcessReads {
    pub fn new(count: usize, deadline: Duration, backoff: Duration) -> Self {
        Self {
            workers: Workers::new(count),
            deadline,
            backoff,
            stalled: HashMap::new(),
            overran: 0,
            waits: false,
            budget: None,
            turn_until: None,
        }
    }

    /// A turn of the loop begins that may wait for work it starts until `until` in all:
    /// most reads take milliseconds, and one taken in the turn that asked for it puts a new
    /// process's tables in place before its first samples are read; a stuck read costs the
    /// loop that much once, then is only looked at.
    pub fn begin_turn(&mut self, until: Instant) {
        self.turn_until = Some(until);
    }

    /// Charges each read's CPU time (on its worker) to its process's budget, and starts
    /// none for a process over it.
    pub fn set_budget(&mut self, budget: CpuBudget) {
        self.budget = Some(budget);
    }

    fn over_budget(&self, pid: u32) -> bool {
        self.budget.as_ref().is_some_and(|b| b.is_over(pid))
    }

    /// Makes [`OffLoop::poll`] wait for the answer, up to the deadline, until set off again:
    /// for a process that does not run yet (a command held before its main), whose tables
    /// should be in place when it starts.
    pub fn set_waiting(&mut self, on: bool) {
        self.waits = on;
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
        if self.is_stalled(pid) || self.over_budget(pid) {
            return None;
        }
        // Its CPU time is charged to `pid` where it runs.
        let budget = self.budget.clone();
        let job = move || crate::os::cpu_budget::charged(budget.as_ref(), pid, job);
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

    /// Starts a read of `pid`'s files on a worker without waiting for it. Not started while
    /// the process is being left alone or no worker is free; run here at once while threads
    /// are held ([`hold_threads`]).
    fn start<T: Send + 'static>(
        &mut self,
        pid: u32,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Started<T> {
        if self.is_stalled(pid) || self.over_budget(pid) {
            return Started::Not;
        }
        // Its CPU time is charged to `pid` where it runs.
        let budget = self.budget.clone();
        let job = move || crate::os::cpu_budget::charged(budget.as_ref(), pid, job);
        if held() {
            return Started::Now(job());
        }
        let (tx, rx) = mpsc::channel();
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let dispatched = self.workers.dispatch(move || {
            let answer = job();
            flag.store(true, Ordering::Release);
            move || {
                let _ = tx.send(answer);
            }
        });
        match dispatched {
            Ok(()) => Started::Later(Ticket {
                pid,
                rx,
                started: Instant::now(),
                done,
                late: false,
                answer: None,
                answered: None,
                waiting: vec![pid],
            }),
            Err(_) => Started::Not,
        }
    }

    /// A read of `pid`'s started at `started` and not done: past the deadline, the process
    /// is left alone (once per read) while the read holds its worker.
    fn check_late(&mut self, ticket: &mut Ticket<impl Sized>) {
        if !ticket.late && ticket.started.elapsed() >= self.deadline {
            ticket.late = true;
            self.overran += 1;
            self.stalled.insert(
                ticket.pid,
                (Instant::now() + self.backoff, ticket.done.clone()),
            );
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

enum Started<T> {
    /// Run on the caller's thread (threads are held).
    Now(T),
    Later(Ticket<T>),
    Not,
}

/// Work handed to a worker, and who waits for its answer.
struct Ticket<T> {
    /// The process it was started for (left alone if it overruns).
    pid: u32,
    rx: Receiver<T>,
    started: Instant,
    done: Arc<AtomicBool>,
    late: bool,
    answer: Option<T>,
    answered: Option<Instant>,
    /// Processes that asked for it and go on without it meanwhile.
    waiting: Vec<u32>,
}

/// Processes waiting for one piece of work at most; past it the others learn of the answer
/// when they ask again (on their next change of maps, or the next retry).
const MAX_WAITING: usize = 1024;
/// An answer nobody came back for (its processes exited) is dropped after this long.
const UNCLAIMED: Duration = Duration::from_secs(30);

/// Work for processes, keyed by what it reads (a binary), that a loop starts and never waits
/// for: [`OffLoop::poll`] hands the answer over once the work is done, and starts it
/// otherwise; [`OffLoop::ready`] names the processes whose answer came, for the loop to
/// bring them up to date. A piece of work runs once however many processes ask for it.
pub struct OffLoop<K, T> {
    work: HashMap<K, Ticket<T>>,
}

impl<K, T> Default for OffLoop<K, T> {
    fn default() -> Self {
        Self {
            work: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Clone, T: Send + 'static> OffLoop<K, T> {
    /// The answer of the work for `key`, when it is done (it is then forgotten: the caller
    /// keeps what it needs). Otherwise None, with the work started on `reads` for `pid`
    /// unless it runs already, the process is being left alone, or no worker is free; `pid`
    /// is then named by a later [`ready`](Self::ready).
    /// While `reads` waits ([`ProcessReads::set_waiting`]), the answer is waited for up to
    /// the deadline instead.
    pub fn poll(
        &mut self,
        reads: &mut ProcessReads,
        pid: u32,
        key: &K,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        if !self.work.contains_key(key) {
            match reads.start(pid, job) {
                Started::Now(v) => return Some(v),
                Started::Later(t) => {
                    self.work.insert(key.clone(), t);
                    return self.take(reads, pid, key, true);
                }
                Started::Not => return None,
            }
        }
        self.take(reads, pid, key, false)
    }

    /// The answer of the work for `key` once it came back (work `fresh`ly started is waited
    /// for what is left of the turn); else `pid` waits for it.
    fn take(&mut self, reads: &mut ProcessReads, pid: u32, key: &K, fresh: bool) -> Option<T> {
        let t = self.work.get_mut(key)?;
        if t.answer.is_none() {
            let turn_left = reads
                .turn_until
                .filter(|_| fresh)
                .map(|until| until.saturating_duration_since(Instant::now()));
            t.answer = if reads.waits && !t.late {
                let left = reads.deadline.saturating_sub(t.started.elapsed());
                t.rx.recv_timeout(left).ok()
            } else if let Some(left) = turn_left.filter(|l| !l.is_zero()) {
                t.rx.recv_timeout(left).ok()
            } else {
                t.rx.try_recv().ok()
            };
        }
        if t.answer.is_some() {
            return self.work.remove(key).and_then(|t| t.answer);
        }
        if !t.waiting.contains(&pid) && t.waiting.len() < MAX_WAITING {
            t.waiting.push(pid);
        }
        reads.check_late(t);
        None
    }

    /// The processes whose work has come back since the last call, for the caller to ask
    /// again. Work past its deadline leaves its process alone for a while
    /// ([`ProcessReads`]); work whose worker ended without an answer is forgotten.
    pub fn ready(&mut self, reads: &mut ProcessReads) -> Vec<u32> {
        let mut out = Vec::new();
        self.work.retain(|_, t| {
            if let Some(at) = t.answered {
                return at.elapsed() < UNCLAIMED;
            }
            match t.rx.try_recv() {
                Ok(v) => {
                    t.answer = Some(v);
                    t.answered = Some(Instant::now());
                    out.append(&mut t.waiting);
                    true
                }
                Err(mpsc::TryRecvError::Empty) => {
                    reads.check_late(t);
                    true
                }
                Err(mpsc::TryRecvError::Disconnected) => {
                    out.append(&mut t.waiting);
                    false
                }
            }
        });
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Whether work for `key` was started and its answer not taken yet.
    pub fn started(&self, key: &K) -> bool {
        self.work.contains_key(key)
    }

    /// Whether some work has not come back yet (stuck work included).
    #[cfg(test)]
    pub fn pending(&self) -> bool {
        self.work.values().any(|t| t.answered.is_none())
    }

    /// Whether work that came back awaits its processes, or work is running that has not
    /// overrun: the loop should look again soon.
    pub fn due_soon(&self) -> bool {
        self.work.values().any(|t| t.answered.is_some() || !t.late)
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

    #[test]
    fn work_handed_off_is_taken_on_a_later_turn_and_a_stuck_one_holds_one_worker() {
        let mut reads = ProcessReads::new(2, Duration::from_millis(100), Duration::ZERO);
        let mut work: OffLoop<&str, u32> = OffLoop::default();
        // Started, not waited for: the caller goes on at once.
        let (release, stuck) = mpsc::channel::<()>();
        let started = Instant::now();
        assert_eq!(
            work.poll(&mut reads, 7, &"stuck", move || {
                let _ = stuck.recv();
                1
            }),
            None
        );
        let (go, gate) = mpsc::channel::<()>();
        let quick = move || {
            let _ = gate.recv();
            2
        };
        assert_eq!(work.poll(&mut reads, 8, &"quick", quick), None);
        // Another process asking for the same work waits with the first, without a second run.
        assert_eq!(work.poll(&mut reads, 9, &"quick", || 99), None);
        assert!(started.elapsed() < Duration::from_millis(100));
        drop(go);
        let until = Instant::now() + Duration::from_secs(10);
        let mut ready = Vec::new();
        while ready.is_empty() {
            assert!(Instant::now() < until, "the quick work never came back");
            ready = work.ready(&mut reads);
            std::thread::yield_now();
        }
        assert_eq!(ready, vec![8, 9]);
        assert_eq!(work.poll(&mut reads, 8, &"quick", || 99), Some(2));
        // Past its deadline, the stuck work leaves its process alone; others go on.
        std::thread::sleep(Duration::from_millis(150));
        assert!(work.ready(&mut reads).is_empty());
        assert!(reads.is_stalled(7));
        assert_eq!(reads.overran(), 1);
        assert!(work.pending() && !work.due_soon());
        let mut other = work.poll(&mut reads, 8, &"other", || 3);
        while other.is_none() {
            assert!(Instant::now() < until, "the other work never came back");
            std::thread::yield_now();
            other = work.poll(&mut reads, 8, &"other", || 99);
        }
        assert_eq!(other, Some(3));
        drop(release);
        while work.ready(&mut reads).is_empty() {
            assert!(Instant::now() < until, "the stuck work never came back");
            std::thread::yield_now();
        }
        assert_eq!(work.poll(&mut reads, 7, &"stuck", || 99), Some(1));
        assert!(!work.pending());
    }

    #[test]
    fn a_waiting_poll_takes_the_answer_or_gives_up_at_the_deadline() {
        let mut reads = ProcessReads::new(2, Duration::from_millis(200), Duration::ZERO);
        let mut work: OffLoop<u8, u32> = OffLoop::default();
        reads.set_waiting(true);
        let slow = || {
            std::thread::sleep(Duration::from_millis(20));
            5
        };
        assert_eq!(work.poll(&mut reads, 1, &0, slow), Some(5));
        let (release, stuck) = mpsc::channel::<()>();
        let started = Instant::now();
        let stuck_job = move || {
            let _ = stuck.recv();
            6
        };
        assert_eq!(work.poll(&mut reads, 2, &1, stuck_job), None);
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(reads.is_stalled(2));
        // Once late, it is not waited for again.
        let started = Instant::now();
        assert_eq!(work.poll(&mut reads, 3, &1, || 7), None);
        assert!(started.elapsed() < Duration::from_millis(100));
        drop(release);
    }

    #[test]
    fn reads_are_charged_to_their_process_and_none_starts_for_one_over_budget() {
        let mut reads = ProcessReads::new(2, Duration::from_secs(5), Duration::ZERO);
        let budget = CpuBudget::new(Duration::from_millis(5));
        reads.set_budget(budget.clone());
        let spin = || {
            let start = crate::os::cpu_budget::thread_cpu();
            while crate::os::cpu_budget::thread_cpu() - start < Duration::from_millis(20) {}
            1
        };
        assert_eq!(reads.run(7, spin), Some(1));
        assert!(budget.is_over(7));
        assert_eq!(reads.run(7, || 2), None, "over budget: not started");
        assert_eq!(reads.run(8, || 3), Some(3), "another process goes on");
        // 20 ms against 5 ms an interval: three intervals pay it off.
        for _ in 0..3 {
            budget.next_interval();
        }
        assert!(budget.is_over(7), "15 ms carried, 10 still to pay");
        assert_eq!(reads.run(7, || 4), None);
        budget.next_interval();
        assert_eq!(reads.run(7, || 5), Some(5), "paid off");
    }

    #[test]
    fn while_threads_are_held_handed_off_work_runs_at_once() {
        let mut reads = ProcessReads::new(1, Duration::from_secs(5), Duration::ZERO);
        let mut work: OffLoop<u8, std::thread::ThreadId> = OffLoop::default();
        hold_threads();
        let ran_on = work.poll(&mut reads, 1, &0, || std::thread::current().id());
        release_threads();
        assert_eq!(ran_on, Some(std::thread::current().id()));
    }

    fn wait_idle(pool: &Workers) {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while pool.busy() > 0 {
            assert!(std::time::Instant::now() < until, "workers never came back");
            std::thread::yield_now();
        }
    }
}
