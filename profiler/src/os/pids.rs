//! Facts about processes read from `/proc`: whether one is alive, its descendants, which
//! ones carry a name. Every command's target selection starts here.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use crate::os::proctext;

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
        let Ok(comm) = proctext::read(&dir.join("comm"), proctext::TEXT_CAP) else {
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
    match proctext::read(
        &proc_root.join(pid.to_string()).join("stat"),
        proctext::TEXT_CAP,
    ) {
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
        if let Ok(stat) = proctext::read(&dir.join("stat"), proctext::TEXT_CAP)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

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
