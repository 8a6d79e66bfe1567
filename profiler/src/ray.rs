//! Ray labels from process titles. Ray workers retitle themselves per task through
//! setproctitle (`ray::train_step`, `ray::Trainer.step`, `ray::IDLE`), longer than the 15-byte
//! comm and changing as a reused worker runs task after task, so the title is read from
//! `/proc/PID/cmdline` while its samples arrive, not once per process. The job comes from the
//! worker's environment (`RAY_JOB_ID`), which does not change.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How stale a Ray worker's title may be: a task switch is seen within this (plus the ring
/// buffer's delivery delay), which bounds how many samples land under the previous task.
const RAY_REFRESH: Duration = Duration::from_millis(20);
/// Other Python processes are re-read rarely: one may still become a Ray worker (its title is
/// set after start-up) with only its other threads sampled, which a retitle does not rename;
/// but most never do. Other programs are re-read only when their main thread is renamed or
/// a thread's name starts with `ray::` (setproctitle renames the main thread): Ray's workers
/// are Python, and reading `/proc/PID/cmdline` of every sampled process every 2 s was a fifth
/// of the idle agent's time.
const OTHER_REFRESH: Duration = Duration::from_secs(2);
/// Processes remembered at once; beyond it the cache starts over (re-reading is cheap).
const MAX_PROCESSES: usize = 16384;

/// What a Ray worker's title and environment say.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RayLabels {
    /// The title after `ray::`: a task (`train_step`), an actor method (`Trainer.step`) or
    /// `IDLE`.
    pub task: String,
    /// For an actor method, the actor class (`Trainer`).
    pub actor: Option<String>,
    pub job: Option<String>,
}

/// Ray's own helper processes, titled like workers but running no user task.
const SYSTEM_PROCESSES: &[&str] = &["DashboardAgent", "RuntimeEnvAgent"];

/// Parses a `/proc/PID/cmdline` (NUL-separated; setproctitle may pad with NULs or spaces).
pub fn parse_title(cmdline: &[u8], job: Option<String>) -> Option<RayLabels> {
    let first = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    let title = String::from_utf8_lossy(first);
    let rest = title.trim().strip_prefix("ray::")?;
    // Ray may append the arguments after a space; the task name is the first word.
    let task = rest.split_whitespace().next()?.to_string();
    if task.is_empty() || SYSTEM_PROCESSES.contains(&task.as_str()) {
        return None;
    }
    let actor = task
        .split_once('.')
        .map(|(class, _)| class.to_string())
        .filter(|c| !c.is_empty() && !c.starts_with('<'));
    Some(RayLabels { task, actor, job })
}

/// `RAY_JOB_ID` from a `/proc/PID/environ`. Ray's nil id (all `f`: the workers it starts
/// before a driver connects carry it for life) names no job.
pub fn parse_job(environ: &[u8]) -> Option<String> {
    environ
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"RAY_JOB_ID="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .filter(|v| !v.is_empty() && !v.bytes().all(|b| b == b'f' || b == b'F'))
}

struct Entry {
    read_at: Instant,
    labels: Option<Arc<RayLabels>>,
    /// The thread name setproctitle gives this title (its first 15 bytes), kept so a sample
    /// can tell a task switch without formatting anything.
    comm: String,
    job: Option<Option<String>>,
    /// The actor class this worker ran methods of: between calls an actor's title is its
    /// class alone (`ray::Trainer`), which names no method.
    actor: Option<String>,
    /// The main thread's name when the title was last read. The title is set from the main
    /// thread, and a retitle or an exec renames it, so a new name means a new title is likely
    /// (whatever the name is: not every setproctitle writes the title itself there).
    main_comm: String,
}

/// The 15 bytes of `title` the kernel keeps as a thread name (fewer at a UTF-8 boundary).
fn comm_of(title: &str) -> String {
    let mut cut = title.len().min(15);
    while !title.is_char_boundary(cut) {
        cut -= 1;
    }
    title[..cut].to_string()
}

/// Per-process Ray labels, re-read as often as a worker's tasks may change.
pub struct TitleCache {
    proc_root: PathBuf,
    entries: HashMap<u32, Entry>,
}

impl Default for TitleCache {
    fn default() -> Self {
        Self::new(Path::new("/proc"))
    }
}

impl TitleCache {
    pub fn new(proc_root: &Path) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            entries: HashMap::new(),
        }
    }

    /// The Ray labels of `pid` now, or None when it is not a Ray worker. `thread_comm` is the
    /// name of the sampled thread `tid`: setproctitle sets it too (`ray::train_ste`, 15
    /// bytes), so a process that just became a worker is re-read at once rather than after
    /// OTHER_REFRESH; so is one whose main thread was renamed since the last read. A process
    /// that is not `python` is not re-read on a timer.
    pub fn labels(
        &mut self,
        pid: u32,
        tid: u32,
        thread_comm: &str,
        python: bool,
    ) -> Option<Arc<RayLabels>> {
        let main = tid == pid;
        if let Some(e) = self.entries.get(&pid) {
            let max_age = if main && thread_comm != e.main_comm {
                Duration::ZERO
            } else if e.labels.is_some() {
                // When the thread name no longer matches the title, the worker has moved on
                // to another task.
                if thread_comm.starts_with("ray::") && thread_comm != e.comm {
                    Duration::ZERO
                } else {
                    RAY_REFRESH
                }
            } else if thread_comm.starts_with("ray::") {
                Duration::ZERO
            } else if python {
                OTHER_REFRESH
            } else {
                Duration::MAX
            };
            if e.read_at.elapsed() < max_age {
                return e.labels.clone();
            }
        }
        if self.entries.len() >= MAX_PROCESSES && !self.entries.contains_key(&pid) {
            self.entries.clear();
        }
        let dir = self.proc_root.join(pid.to_string());
        let cmdline = read_capped(&dir.join("cmdline")).unwrap_or_default();
        let entry = self.entries.entry(pid).or_insert(Entry {
            read_at: Instant::now(),
            labels: None,
            comm: String::new(),
            job: None,
            actor: None,
            main_comm: String::new(),
        });
        entry.read_at = Instant::now();
        if main {
            entry.main_comm.replace_range(.., thread_comm);
        }
        // A process that has exited (gone, or a zombie with an empty cmdline) keeps the title
        // it last had: its final samples are often delivered after it is gone. So does one
        // caught rewriting its title (cleared, not yet written). One never read has none.
        if cmdline.first().is_none_or(|&b| b == 0) {
            return entry.labels.clone();
        }
        if !cmdline.starts_with(b"ray::") {
            entry.labels = None;
            return None;
        }
        let job = entry
            .job
            .get_or_insert_with(|| read_capped(&dir.join("environ")).and_then(|e| parse_job(&e)))
            .clone();
        let mut fresh = parse_title(&cmdline, job);
        if let Some(l) = fresh.as_mut() {
            match &l.actor {
                Some(class) => entry.actor = Some(class.clone()),
                None if entry.actor.as_deref() == Some(l.task.as_str()) => {
                    l.actor = entry.actor.clone();
                }
                None => {}
            }
        }
        // Keep the same Arc while the title holds, so equal labels compare cheaply.
        if entry.labels.as_deref() != fresh.as_ref() {
            entry.comm = fresh
                .as_ref()
                .map(|l| comm_of(&format!("ray::{}", l.task)))
                .unwrap_or_default();
            entry.labels = fresh.map(Arc::new);
        }
        entry.labels.clone()
    }

    /// Forgets what `pid`'s title and environment said: it exec'd, so both are new (a sample
    /// of the image before, say the shell that ran it, would otherwise stand for
    /// OTHER_REFRESH).
    pub fn forget(&mut self, pid: u32) {
        self.entries.remove(&pid);
    }
}

/// A `/proc` file of the process, cut at the untrusted-file layer's cap for process text: its
/// command line and environment are the process's to make as large as it likes.
fn read_capped(path: &std::path::Path) -> Option<Vec<u8>> {
    use crate::os::untrusted::{Kind, UntrustedFile};
    UntrustedFile::open(path, Kind::ProcText)
        .and_then(|f| f.read_bytes())
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn titles_of_tasks_actors_and_idle_workers() {
        let t = parse_title(b"ray::train_step\0\0\0", Some("02000000".into())).unwrap();
        assert_eq!(t.task, "train_step");
        assert_eq!(t.actor, None);
        assert_eq!(t.job.as_deref(), Some("02000000"));
        let t = parse_title(b"ray::Trainer.step          ", None).unwrap();
        assert_eq!(
            (t.task.as_str(), t.actor.as_deref()),
            ("Trainer.step", Some("Trainer"))
        );
        assert_eq!(parse_title(b"ray::IDLE", None).unwrap().task, "IDLE");
        assert_eq!(parse_title(b"python\0-m\0ray", None), None);
        assert_eq!(parse_title(b"ray::", None), None);
        assert_eq!(
            parse_job(b"HOME=/root\0RAY_JOB_ID=01000000\0X=1\0"),
            Some("01000000".into())
        );
        assert_eq!(parse_job(b"HOME=/root\0"), None);
        assert_eq!(parse_job(b"RAY_JOB_ID=ffffffff\0"), None, "the nil job");
        assert_eq!(parse_title(b"ray::DashboardAgent\0", None), None);
        assert_eq!(parse_title(b"ray::RuntimeEnvAgent\0", None), None);
    }

    #[test]
    fn a_retitled_process_is_seen_and_the_job_read_once() {
        let root = std::env::temp_dir().join(format!("pyrometer-ray-{}", std::process::id()));
        let dir = root.join("42");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cmdline"), b"ray::a\0").unwrap();
        std::fs::write(dir.join("environ"), b"RAY_JOB_ID=07000000\0").unwrap();
        let mut cache = TitleCache::new(&root);
        assert_eq!(cache.labels(42, 42, "ray::a", true).unwrap().task, "a");
        std::fs::write(dir.join("cmdline"), b"ray::Actor.m\0").unwrap();
        std::fs::write(dir.join("environ"), b"RAY_JOB_ID=changed\0").unwrap();
        std::thread::sleep(RAY_REFRESH * 2);
        let l = cache.labels(42, 42, "ray::Actor.m", true).unwrap();
        assert_eq!(l.task, "Actor.m");
        assert_eq!(l.job.as_deref(), Some("07000000"));
        // Between method calls the title is the class alone: still that actor.
        std::fs::write(dir.join("cmdline"), b"ray::Actor\0").unwrap();
        let l = cache.labels(42, 42, "ray::Actor", true).unwrap();
        assert_eq!(
            (l.task.as_str(), l.actor.as_deref()),
            ("Actor", Some("Actor"))
        );
        assert_eq!(cache.labels(43, 43, "python3", true), None);
        // A process seen before it became a worker: its new thread name triggers a re-read.
        let dir = root.join("44");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cmdline"), b"python3\0worker.py\0").unwrap();
        assert_eq!(cache.labels(44, 44, "python3", true), None);
        std::fs::write(dir.join("cmdline"), b"ray::f\0").unwrap();
        assert_eq!(
            cache.labels(44, 45, "python3", true),
            None,
            "not re-read within OTHER_REFRESH"
        );
        assert_eq!(cache.labels(44, 44, "ray::f", true).unwrap().task, "f");
        // Its last samples, delivered after it exited, keep the title it last had.
        std::fs::remove_dir_all(&dir).unwrap();
        std::thread::sleep(RAY_REFRESH * 2);
        assert_eq!(cache.labels(44, 44, "ray::f", true).unwrap().task, "f");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_renamed_main_thread_or_an_exec_triggers_a_re_read() {
        let root = std::env::temp_dir().join(format!("pyrometer-ray-main-{}", std::process::id()));
        let dir = root.join("50");
        std::fs::create_dir_all(&dir).unwrap();
        // Sampled as the shell that runs the worker, then as the worker before its retitle.
        std::fs::write(dir.join("cmdline"), b"sh\0-c\0exec worker\0").unwrap();
        std::fs::write(dir.join("environ"), b"X=1\0").unwrap();
        let mut cache = TitleCache::new(&root);
        assert_eq!(cache.labels(50, 50, "sh", true), None);
        std::fs::write(dir.join("cmdline"), b"worker\0").unwrap();
        std::fs::write(dir.join("environ"), b"RAY_JOB_ID=05000000\0").unwrap();
        cache.forget(50);
        assert_eq!(cache.labels(50, 50, "worker", true), None);
        // Its retitle renames the main thread, not necessarily to `ray::...`.
        std::fs::write(dir.join("cmdline"), b"ray::task_a\0").unwrap();
        let l = cache.labels(50, 50, "task_a", true).unwrap();
        assert_eq!(
            (l.task.as_str(), l.job.as_deref()),
            ("task_a", Some("05000000")),
            "the job of the image after exec"
        );
        std::fs::write(dir.join("cmdline"), b"ray::Trainer.step\0").unwrap();
        assert_eq!(
            cache.labels(50, 50, "Trainer.step", true).unwrap().task,
            "Trainer.step"
        );
        // A title caught half-written (cleared) keeps the one before.
        std::fs::write(dir.join("cmdline"), b"\0\0\0\0").unwrap();
        assert_eq!(
            cache.labels(50, 50, "task_b", true).unwrap().task,
            "Trainer.step"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn only_python_processes_are_re_read_on_a_timer() {
        let root = std::env::temp_dir().join(format!("pyrometer-ray-timer-{}", std::process::id()));
        for pid in [60, 61] {
            std::fs::create_dir_all(root.join(pid.to_string())).unwrap();
            std::fs::write(root.join(format!("{pid}/cmdline")), b"prog\0").unwrap();
        }
        let mut cache = TitleCache::new(&root);
        assert_eq!(cache.labels(60, 60, "prog", false), None);
        assert_eq!(cache.labels(61, 61, "prog", true), None);
        for pid in [60, 61] {
            std::fs::write(root.join(format!("{pid}/cmdline")), b"ray::f\0").unwrap();
        }
        std::thread::sleep(OTHER_REFRESH + RAY_REFRESH);
        // Sampled in a thread the retitle did not rename.
        assert_eq!(
            cache.labels(60, 62, "worker", false),
            None,
            "not on a timer"
        );
        assert_eq!(cache.labels(61, 63, "worker", true).unwrap().task, "f");
        // A renamed main thread is re-read whatever the program.
        assert_eq!(cache.labels(60, 60, "f", false).unwrap().task, "f");
        let _ = std::fs::remove_dir_all(&root);
    }
}
