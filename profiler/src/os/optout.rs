//! Processes excluded from profiling by their cgroup: a process whose `/proc/PID/cgroup` names
//! a cgroup matching the pattern is not read at all (no maps, no binaries, no perf map, no
//! memory) and its samples are dropped and counted. The cgroup is the kernel's word, not the
//! process's, and names a pod (`pod<UID>` in the kubelet's paths), a container (its id), or a
//! systemd unit or slice (`optout.slice`), so a pod or service is opted out where it runs.

use std::path::Path;

use regex::Regex;

use super::untrusted::{Kind, UntrustedFile};

/// Decisions remembered at most for this many processes (then forgotten all at once).
const MAX_REMEMBERED: usize = 65536;

#[derive(Debug)]
pub struct OptOut {
    pattern: Regex,
    decided: crate::FastMap<u32, bool>,
}

impl OptOut {
    pub fn new(pattern: Regex) -> Self {
        Self {
            pattern,
            decided: Default::default(),
        }
    }

    /// Whether `pid` is opted out. A process whose cgroup cannot be read (gone) is not: there
    /// is nothing left to read of it either.
    pub fn excluded(&mut self, proc_root: &Path, pid: u32) -> bool {
        if let Some(&d) = self.decided.get(&pid) {
            return d;
        }
        if self.decided.len() >= MAX_REMEMBERED {
            self.decided.clear();
        }
        let path = proc_root.join(pid.to_string()).join("cgroup");
        let Ok(text) = UntrustedFile::open(&path, Kind::ProcText).and_then(|f| f.read_text())
        else {
            return false;
        };
        // `ID:CONTROLLERS:PATH` per hierarchy; only the path is matched.
        let d = text
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .any(|p| self.pattern.is_match(p));
        self.decided.insert(pid, d);
        d
    }

    /// Forgets the decision for `pid` (it exec'd, or exited and its pid may come back).
    pub fn forget(&mut self, pid: u32) {
        self.decided.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_cgroup_path_and_remembers() {
        let tmp = crate::symbolize::testutil::TempDir::new("optout");
        let proc_root = tmp.path();
        let write = |pid: u32, text: &str| {
            std::fs::create_dir_all(proc_root.join(pid.to_string())).unwrap();
            std::fs::write(proc_root.join(format!("{pid}/cgroup")), text).unwrap();
        };
        write(
            10,
            "0::/kubepods.slice/kubepods-pod1234_abcd.slice/cri-containerd-ff.scope\n",
        );
        write(11, "0::/system.slice/app.service\n");
        // A controller list that matches is not a path that matches.
        write(12, "4:pod1234:/other\n");
        let mut o = OptOut::new(Regex::new("pod1234").unwrap());
        assert!(o.excluded(proc_root, 10));
        assert!(!o.excluded(proc_root, 11));
        assert!(!o.excluded(proc_root, 12));
        assert!(!o.excluded(proc_root, 13), "gone: nothing to read");
        write(11, "0::/pod1234\n");
        assert!(!o.excluded(proc_root, 11), "remembered");
        o.forget(11);
        assert!(o.excluded(proc_root, 11));
    }
}
