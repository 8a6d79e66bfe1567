//! Target selection shared by every command: existing pids (with their descendants on
//! request), a command started and held until the kernel filter knows it, or the whole node.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot start {program}: {reason}")]
    Spawn { program: String, reason: String },
}

/// The processes under `proc_root`: each pid and its directory (nothing when it is unreadable).
fn processes(proc_root: &Path) -> impl Iterator<Item = (u32, std::path::PathBuf)> {
    std::fs::read_dir(proc_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((pid, entry.path()))
        })
}

/// The processes whose comm matches `re` and that are not in `known` (which gains them),
/// pyrometer itself excepted.
pub fn new_comm_matches(re: &regex::Regex, known: &mut HashSet<u32>) -> Vec<u32> {
    let me = std::process::id();
    let mut out = Vec::new();
    for (pid, dir) in processes(Path::new("/proc")) {
        if pid == me || known.contains(&pid) {
            continue;
        }
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if re.is_match(comm.trim_end_matches('\n')) {
            known.insert(pid);
            out.push(pid);
        }
    }
    out
}

/// Like [`new_comm_matches`], among `candidates` only (processes the kernel said started,
/// exec'd or renamed themselves): one `comm` read each instead of a scan of `/proc`.
pub fn comm_matches_among(
    re: &regex::Regex,
    candidates: &[u32],
    known: &mut HashSet<u32>,
) -> Vec<u32> {
    let me = std::process::id();
    let mut out = Vec::new();
    let mut path = String::new();
    for &pid in candidates {
        if pid == me || known.contains(&pid) {
            continue;
        }
        use std::fmt::Write as _;
        path.clear();
        let _ = write!(path, "/proc/{pid}/comm");
        let Some(comm) = read_small(&path) else {
            continue;
        };
        if re.is_match(comm.trim_end_matches('\n')) {
            known.insert(pid);
            out.push(pid);
        }
    }
    out
}

/// A small /proc file in one open and one read (`read_to_string` asks for its size first,
/// which /proc files do not have).
fn read_small(path: &str) -> Option<String> {
    use std::io::Read as _;
    let mut buf = [0u8; 64];
    let n = std::fs::File::open(path).ok()?.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Adds the processes whose comm matches `re` and that are not in `known` (which gains them)
/// as targets, pyrometer itself excepted, each after its tables are up to date (unwind tables,
/// the Python walker's registration, allocation probes) so that none of its samples is walked
/// without them: a process that sat idle until now would otherwise lose the Python frames of
/// its first busy ~100 ms, while its first samples wait for the registration they trigger.
/// Returns one message per pid that could not be added. `record`, `top` and the agent call
/// this for every process at first, then, where they can, [`add_comm_matches_among`] the
/// processes the kernel says started, exec'd or renamed themselves (`candidates`), else this
/// again twice a second.
pub fn add_comm_matches(
    sampler: &mut crate::bpf::Sampler,
    tables: &mut crate::tables::Tables,
    registry: &mut crate::procs::ProcessRegistry,
    re: &regex::Regex,
    known: &mut HashSet<u32>,
    follow_children: bool,
) -> Vec<String> {
    let pids = new_comm_matches(re, known);
    add_targets(sampler, tables, registry, pids, follow_children)
}

/// [`add_comm_matches`] among `candidates` only ([`comm_matches_among`]).
pub fn add_comm_matches_among(
    sampler: &mut crate::bpf::Sampler,
    tables: &mut crate::tables::Tables,
    registry: &mut crate::procs::ProcessRegistry,
    re: &regex::Regex,
    candidates: &[u32],
    known: &mut HashSet<u32>,
    follow_children: bool,
) -> Vec<String> {
    let pids = comm_matches_among(re, candidates, known);
    add_targets(sampler, tables, registry, pids, follow_children)
}

fn add_targets(
    sampler: &mut crate::bpf::Sampler,
    tables: &mut crate::tables::Tables,
    registry: &mut crate::procs::ProcessRegistry,
    pids: Vec<u32>,
    follow_children: bool,
) -> Vec<String> {
    let mut errors = Vec::new();
    for pid in pids {
        if let Ok(p) = registry.observe(pid) {
            tables.sync_process(p, sampler);
        }
        if let Err(e) = sampler.add_target(pid, follow_children) {
            errors.push(format!("cannot target pid {pid}: {e}"));
        }
    }
    errors
}

/// True while process `pid` exists, a zombie included: one system call (`kill(pid, 0)`), for
/// sweeps over every tracked process every few seconds, where reading each `/proc/PID/stat`
/// (open, read, close) was a fifth of the idle agent's time. A zombie's entries wait for its
/// reaping; a reused pid is a new process, which the lifecycle events re-sync either way.
pub fn exists(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    // EPERM: it exists, but this process (its capabilities dropped) may not signal it.
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// True while `/proc/PID` exists and the process is not a zombie.
pub fn alive(proc_root: &Path, pid: u32) -> bool {
    match std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")) {
        Ok(stat) => stat_state(&stat).is_some_and(|s| s != 'Z' && s != 'X'),
        Err(_) => false,
    }
}

/// The state letter of `/proc/PID/stat` (after the parenthesised comm, which may hold spaces).
fn stat_state(stat: &str) -> Option<char> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().next()?.chars().next()
}

fn stat_ppid(stat: &str) -> Option<u32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// Checks that every pid exists, failing on the first that does not.
pub fn check_pids(proc_root: &Path, pids: &[u32]) -> Result<(), TargetError> {
    for &pid in pids {
        if !alive(proc_root, pid) {
            return Err(TargetError::NoSuchProcess(pid));
        }
    }
    Ok(())
}

/// All live descendants of `roots` (not including the roots), from the ppid links in /proc.
pub fn descendants(proc_root: &Path, roots: &[u32]) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (pid, dir) in processes(proc_root) {
        if let Ok(stat) = std::fs::read_to_string(dir.join("stat"))
            && let Some(ppid) = stat_ppid(&stat)
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut seen: HashSet<u32> = roots.iter().copied().collect();
    let mut out = Vec::new();
    let mut queue: Vec<u32> = roots.to_vec();
    while let Some(p) = queue.pop() {
        for &c in children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
            if seen.insert(c) {
                out.push(c);
                queue.push(c);
            }
        }
    }
    out.sort_unstable();
    out
}

/// The descriptor number the command gets its end of the start-up hold socket under.
pub const HOLD_FD: std::os::fd::RawFd = 4;

/// The variable that tells the command its descriptor number (read by
/// `alloc-preload/src/hold.rs`).
pub const HOLD_ENV: &str = "PYROMETER_ALLOC_HOLD";

/// `pyrometer record`'s end of the start-up handshake with the allocation sampler library
/// (`alloc-preload/src/hold.rs`): the library's constructor, which runs once the dynamic
/// loader has mapped the command's libraries and before its `main`, writes a byte and waits
/// for one back, so record can read the mappings and load their unwind tables before the
/// program runs; a command that lives a few milliseconds is then unwound from its first
/// allocation on.
pub struct StartupHold {
    ours: std::os::unix::net::UnixStream,
    theirs: Option<std::os::unix::net::UnixStream>,
}

impl StartupHold {
    pub fn new() -> std::io::Result<Self> {
        // Both ends close on exec; the command's copy is made by dup2 in the child.
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        Ok(Self {
            ours,
            theirs: Some(theirs),
        })
    }

    /// The descriptor to hand to [`HeldChild::spawn_holding`].
    pub fn child_fd(&self) -> Option<std::os::fd::RawFd> {
        self.theirs.as_ref().map(std::os::fd::AsRawFd::as_raw_fd)
    }

    /// After the spawn: the command has its copy, this one goes (so a command that never
    /// loads the library, or exits, shows as the end of the stream).
    pub fn spawned(&mut self) {
        self.theirs = None;
    }

    /// Waits up to `wait` for the library to say the program is about to run. True when it
    /// did; the program then waits for [`StartupHold::release`] (or its own timeout).
    pub fn wait_ready(&mut self, wait: std::time::Duration) -> bool {
        use std::io::Read;
        let _ = self
            .ours
            .set_read_timeout(Some(wait.max(std::time::Duration::from_millis(1))));
        let mut byte = [0u8; 1];
        matches!(self.ours.read(&mut byte), Ok(1))
    }

    /// Lets the program run.
    pub fn release(mut self) {
        let _ = self.ours.write_all(b"g");
    }
}

/// A child started by `-- CMD`, stopped just before `exec` until [`HeldChild::release`]:
/// the gap lets the caller put its pid into the kernel filter, so not one sample of the
/// command (nor of anything it forks) is missed.
pub struct HeldChild {
    child: Child,
    gate: std::fs::File,
}

impl HeldChild {
    pub fn spawn(argv: &[String]) -> Result<Self, TargetError> {
        Self::spawn_with_env(argv, &[])
    }

    /// Like [`HeldChild::spawn`], with variables added to the command's environment.
    pub fn spawn_with_env(
        argv: &[String],
        env: &[(&str, std::ffi::OsString)],
    ) -> Result<Self, TargetError> {
        Self::spawn_holding(argv, env, None)
    }

    /// Like [`HeldChild::spawn_with_env`]; with `hold`, the command (not the gate before it)
    /// gets that descriptor as [`HOLD_FD`] and its number in [`HOLD_ENV`], for the
    /// allocation sampler library's start-up handshake (see [`StartupHold`]).
    pub fn spawn_holding(
        argv: &[String],
        env: &[(&str, std::ffi::OsString)],
        hold: Option<std::os::fd::RawFd>,
    ) -> Result<Self, TargetError> {
        let program = argv.first().ok_or_else(|| TargetError::Spawn {
            program: String::new(),
            reason: "empty command".into(),
        })?;
        let spawn_error = |reason: String| TargetError::Spawn {
            program: program.clone(),
            reason,
        };
        let (read_end, write_end) = pipe().map_err(|e| spawn_error(e.to_string()))?;
        let read_fd = std::os::fd::AsRawFd::as_raw_fd(&read_end);
        // std's spawn waits until the child has exec'd, so the child cannot simply block
        // before exec. Instead the child execs a tiny shell that waits on the gate (fd 3) and
        // then execs the command in the same process, keeping the pid we registered.
        let mut cmd = Command::new("/bin/sh");
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        // The hold variable is exported by the gate just before the command's exec, so the
        // gate's own start (it has the sampler library preloaded too) does not hold.
        let export = if hold.is_some() {
            format!("export {HOLD_ENV}={HOLD_FD}; ")
        } else {
            String::new()
        };
        let script = format!("read _ <&3 || exit 125; exec 3<&-; {export}exec \"$@\"");
        cmd.arg("-c").arg(script).arg("pyrometer-gate").args(argv);
        // SAFETY: dup2 is async-signal-safe; it runs in the forked child before exec.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 onto itself keeps FD_CLOEXEC, so clear it explicitly in that case.
                let ok = if read_fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0) == 0
                } else {
                    libc::dup2(read_fd, 3) == 3
                };
                if !ok {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(fd) = hold {
                    // dup2 clears FD_CLOEXEC on the copy; the original keeps it.
                    if libc::dup2(fd, HOLD_FD) != HOLD_FD {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        if which(program).is_none() {
            return Err(spawn_error("command not found".into()));
        }
        let child = cmd.spawn().map_err(|e| spawn_error(e.to_string()))?;
        drop(read_end);
        Ok(Self {
            child,
            gate: write_end,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the child exec the command.
    pub fn release(mut self) -> Child {
        let _ = self.gate.write_all(b"\n");
        self.child
    }
}

/// Resolves a program name the way exec does (a path as is, else through $PATH), so a
/// missing command is reported before anything starts.
fn which(program: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = Path::new(program);
        return executable(p).then(|| p.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| executable(p))
    })
}

fn pipe() -> std::io::Result<(std::fs::File, std::fs::File)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe {
        Ok((
            std::os::fd::FromRawFd::from_raw_fd(fds[0]),
            std::os::fd::FromRawFd::from_raw_fd(fds[1]),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_matches_among_reads_only_the_candidates() {
        let mut child = std::process::Command::new("/bin/sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = child.id();
        // spawn can return before exec has renamed the child (the parent is released when
        // the child drops its old memory, early in exec): on a busy machine the name was still
        // the test thread's once, and the first match below failed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default() != "sleep\n"
        {
            assert!(
                std::time::Instant::now() < deadline,
                "sleep never named itself"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let re = regex::Regex::new("^sleep$").unwrap();
        let mut known = HashSet::new();
        assert!(
            comm_matches_among(&re, &[std::process::id()], &mut known).is_empty(),
            "a candidate that does not match"
        );
        assert_eq!(comm_matches_among(&re, &[1, pid, pid], &mut known), [pid]);
        assert!(known.contains(&pid));
        assert!(
            comm_matches_among(&re, &[pid], &mut known).is_empty(),
            "known already"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        known.clear();
        assert!(
            comm_matches_among(&re, &[pid], &mut known).is_empty(),
            "gone"
        );
    }

    #[test]
    fn stat_fields_survive_odd_comms() {
        let stat = "123 (a b) c) R 45 123 123 0 -1";
        assert_eq!(stat_state(stat), Some('R'));
        assert_eq!(stat_ppid(stat), Some(45));
    }

    #[test]
    fn unknown_pid_is_named() {
        let err = check_pids(Path::new("/proc"), &[u32::MAX - 1]).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("no such process: {}", u32::MAX - 1)
        );
    }

    #[test]
    fn held_child_runs_only_after_release() {
        let dir = std::env::temp_dir().join(format!("pyrometer-held-{}", std::process::id()));
        let marker = dir.with_extension("marker");
        let _ = std::fs::remove_file(&marker);
        let held = HeldChild::spawn(&[
            "sh".into(),
            "-c".into(),
            format!("touch {}", marker.display()),
        ])
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!marker.exists(), "child ran before release");
        let pid = held.pid();
        let mut child = held.release();
        assert_eq!(child.id(), pid);
        assert!(child.wait().unwrap().success());
        assert!(marker.exists());
        let _ = std::fs::remove_file(&marker);
    }

    #[test]
    fn missing_command_is_an_error() {
        let err = HeldChild::spawn(&["/nonexistent/prog".into()])
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            "cannot start /nonexistent/prog: command not found"
        );
    }

    #[test]
    fn finds_descendants() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 5 & wait"])
            .spawn()
            .unwrap();
        // The shell forks when the scheduler gets to it: wait for that, however loaded.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let d = loop {
            let d = descendants(Path::new("/proc"), &[child.id()]);
            if !d.is_empty() || std::time::Instant::now() > deadline {
                break d;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        for &pid in &d {
            // SAFETY: kill(2) of the test's own grandchild.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        child.kill().ok();
        child.wait().ok();
        assert_eq!(d.len(), 1, "{d:?}");
    }
}
