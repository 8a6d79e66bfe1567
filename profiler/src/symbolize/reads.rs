//! The symbolizer's reads of a process's files (perf maps, build-ids, ELF layouts, the copies
//! blazesym reads), each on a worker with a deadline. The agent bounds how long a push waits
//! for them in all ([`Symbolizer::wait_for_reads_until`]); a read still running then keeps
//! its answer under its [`ReadKey`] for the next time it is asked for.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::Symbolizer;
use crate::os::procs::{Binary, BinaryKey};
use crate::os::workers::ProcessReads;

/// Threads reading a process's files (perf maps, build-ids, ELF layouts, the copies blazesym
/// reads); each read stuck past its deadline holds one until it returns.
const READ_WORKERS: usize = 4;
/// How long a read may take (a 16 MiB perf map read and parsed, a debug file's symbol
/// tables and DWARF copied, on a busy machine).
const READ_DEADLINE: Duration = Duration::from_secs(2);
/// How long a process whose read overran is left alone, at least: no read of its files is
/// tried again before then, nor while the stuck one still holds its worker.
const READ_BACKOFF: Duration = Duration::from_secs(60);

/// What a read on a worker is for: a read still running when its caller stopped waiting
/// keeps its answer under this key for the next time it is asked for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum ReadKey {
    PerfMap(u32),
    BuildId(PathBuf),
    Layout(BinaryKey),
    /// The file's copy for blazesym, with its DWARF or without.
    Copy(PathBuf, bool),
}

/// A read's answer, of whichever type its [`ReadKey`] says.
pub(super) type Answer = Box<dyn std::any::Any + Send>;

/// The symbolizer's pool: each read waited for up to its deadline, until the caller says
/// otherwise ([`Symbolizer::wait_for_reads_until`]).
pub(super) fn pool() -> ProcessReads {
    let mut reads = ProcessReads::new(READ_WORKERS, READ_DEADLINE, READ_BACKOFF);
    reads.set_waiting(true);
    reads
}

impl Symbolizer {
    /// The binary's build-id, read on a worker the first time; None while it cannot be
    /// read in time (the process is then left alone for a while).
    pub(super) fn build_id(
        &mut self,
        pid: u32,
        b: &std::sync::Arc<Binary>,
    ) -> Option<Option<String>> {
        if let Some(id) = b.known_build_id() {
            return Some(id.map(str::to_string));
        }
        let path = b.path().to_path_buf();
        let key = ReadKey::BuildId(path.clone());
        let id = self.off_loop(pid, key, move || crate::os::procs::read_build_id(&path))?;
        Some(b.set_build_id(id).map(str::to_string))
    }

    /// Runs `job`, a read for `pid`, on a worker, and waits for its answer: up to the read's
    /// deadline, or what is left of the push's share ([`Symbolizer::wait_for_reads_until`]).
    /// None while it runs past that (its answer is kept under `key` for the next ask), while
    /// the process is left alone, or when no worker is free.
    pub(super) fn off_loop<T: Send + 'static>(
        &mut self,
        pid: u32,
        key: ReadKey,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let running = self.pending.started(&key);
        let answer = self.pending.poll(&mut self.reads, pid, &key, move || {
            Box::new(job()) as Answer
        });
        self.stats.stalled_reads = self.reads.overran();
        if !running && answer.is_none() && self.pending.started(&key) {
            self.stats.deferred_reads += 1;
        }
        answer.and_then(|a| a.downcast::<T>().ok()).map(|a| *a)
    }

    /// From now on waits for reads until `until` in all, rather than each up to its deadline:
    /// the agent calls it before each push, so that files that answer slowly (a FUSE mount a
    /// process controls) cannot hold a push back by more than that, however many there are.
    /// A read still running then goes on, and its answer is used the next time it is asked
    /// for; the frames it would have named are module and offset in this push.
    pub fn wait_for_reads_until(&mut self, until: Instant) {
        self.reads.set_waiting(false);
        self.reads.begin_turn(until);
    }
}
