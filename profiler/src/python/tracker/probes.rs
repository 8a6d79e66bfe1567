//! Attaching the GIL and garbage-collector uprobes to a registered process's interpreter
//! binary, once per binary; or, with the GIL view on request (the agent's captures), the
//! GIL's to one process while it is asked for.

use super::*;

/// Whether a binary's probes are on (or need not be), or wait for its probe sites, which a
/// worker is finding.
#[derive(Debug, PartialEq, Eq)]
pub enum Attached {
    Done,
    Pending,
}

/// `--gil`: the probe sites of each interpreter binary, and which are attached.
pub(super) struct GilProbes {
    pub(super) debug_dirs: Vec<PathBuf>,
    sites: HashMap<BinaryKey, Result<GilSites, String>>,
    attached: HashSet<BinaryKey>,
    /// On request (the agent's captures): no binary is probed for every process; a
    /// registered process's binary is searched for its sites at once, and its probes are
    /// attached for that process alone while a capture asks for them.
    on_request: Option<OnRequest>,
}

impl GilProbes {
    /// Whether every registered process is probed (`record --gil`), not on request.
    pub(super) fn every_process(&self) -> bool {
        self.on_request.is_none()
    }

    /// Forgets an exited process.
    pub(super) fn forget(&mut self, pid: u32) {
        if let Some(on) = self.on_request.as_mut() {
            on.targets.remove(&pid);
            on.attached.remove(&pid);
        }
    }
}

/// The GIL probes of [`GilProbes::on_request`]: each registered process's interpreter
/// binary, and the processes whose probes are on now.
#[derive(Default)]
struct OnRequest {
    targets: HashMap<u32, ProbeTarget>,
    attached: HashSet<u32>,
}

impl PyTracker {
    /// Probes the GIL of every Python process registered from now on (`record --gil`);
    /// debug files are looked for in `debug_dirs`.
    pub fn enable_gil(&mut self, debug_dirs: Vec<PathBuf>) {
        self.gil = Some(GilProbes {
            debug_dirs,
            sites: HashMap::new(),
            attached: HashSet::new(),
            on_request: None,
        });
    }

    /// Makes the GIL view (once enabled) one a caller turns on per process
    /// ([`PyTracker::attach_gil_to`]) rather than one on for every process registered: the
    /// agent's captures ask for it for their processes and their duration only.
    pub fn gil_on_request(&mut self) {
        if let Some(gil) = self.gil.as_mut() {
            gil.on_request = Some(OnRequest::default());
        }
    }

    /// Attaches the GIL probes to the interpreter binary of `process` (once per binary). The
    /// binary is searched for its sites on a worker; a process whose binary's search has not
    /// come back is attached when it does ([`PyTracker::ready_pids`] names it).
    pub(super) fn attach_gil(
        &mut self,
        process: &Process,
        rt: &PythonRuntime,
        probes: &mut (dyn Uprobes + '_),
    ) {
        let Some(gil) = self.gil.as_mut() else {
            return;
        };
        let pid = process.pid;
        let Some(target) = interpreter_target(process, rt) else {
            return;
        };
        if let Some(on) = gil.on_request.as_mut() {
            // Searched now, so a capture that asks for the GIL attaches at once.
            on.targets.insert(pid, target.clone());
            if self.gil_sites(Some(pid), &target).is_none() {
                self.probes_pending.insert(pid);
            }
            return;
        }
        match self.attach_gil_binary(Some(pid), &target, probes) {
            Ok(Attached::Done) => {
                self.gil_unavailable.remove(&pid);
            }
            Ok(Attached::Pending) => {
                self.probes_pending.insert(pid);
            }
            Err(reason) => {
                self.notices.push(format!(
                    "pid {pid} ({}): GIL view unavailable: {reason}; everything else is recorded",
                    process.comm
                ));
                self.gil_unavailable.insert(pid, reason);
            }
        }
    }

    /// Attaches the GIL probes to an interpreter binary no process maps yet (the command
    /// `record` is about to start), so its first GIL acquisitions are seen. The binary is the
    /// user's own command's: searched here, before it starts.
    pub fn prepare_gil(
        &mut self,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        let target = ProbeTarget::of_file(path)?;
        self.attach_gil_binary(None, &target, probes).map(|_| ())
    }

    /// Attaches the garbage-collector probes to the interpreter binary of `process` (once per
    /// binary), its sites found on a worker as the GIL's are.
    pub(super) fn attach_gc(
        &mut self,
        process: &Process,
        rt: &PythonRuntime,
        probes: &mut (dyn Uprobes + '_),
    ) {
        if self.gc.is_none() {
            return;
        }
        let Some(target) = interpreter_target(process, rt) else {
            return;
        };
        let pid = process.pid;
        let outcome = self.attach_gc_binary(Some(pid), &target, probes);
        let Some(gc) = self.gc.as_mut() else {
            return;
        };
        match outcome {
            Ok(Attached::Done) => {
                gc.unavailable.remove(&pid);
            }
            Ok(Attached::Pending) => {
                self.probes_pending.insert(pid);
            }
            Err(reason) => {
                self.notices.push(format!(
                    "pid {pid} ({}): GC pauses unavailable: {reason}; everything else is recorded",
                    process.comm
                ));
                gc.unavailable.insert(pid, reason);
            }
        }
    }

    /// Attaches the garbage-collector probes to an interpreter binary no process maps yet
    /// (the command `record` is about to start).
    pub fn prepare_gc(
        &mut self,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        let target = ProbeTarget::of_file(path)?;
        self.attach_gc_binary(None, &target, probes).map(|_| ())
    }

    /// `pid`: the process the search is for, which a search that overruns leaves alone for a
    /// while; None searches here, at once.
    pub(super) fn attach_gil_binary(
        &mut self,
        pid: Option<u32>,
        target: &ProbeTarget,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<Attached, String> {
        if self
            .gil
            .as_ref()
            .is_none_or(|g| g.attached.contains(&target.key))
        {
            return Ok(Attached::Done);
        }
        let Some(sites) = self.gil_sites(pid, target) else {
            return Ok(Attached::Pending);
        };
        let sites = sites?;
        let [enter, ret, drop] = crate::bpf::GIL_PROGRAMS;
        let mut attach = |program: &str, offset: u64| {
            probes
                .attach_uprobe(program, &target.path, offset)
                .map_err(|e| e.to_string())
        };
        for &off in &sites.take {
            attach(enter, off)?;
            attach(ret, off)?;
        }
        for &off in &sites.drop {
            attach(drop, off)?;
        }
        if let Some(gil) = self.gil.as_mut() {
            gil.attached.insert(target.key.clone());
        }
        self.gil_binaries.push(sites);
        Ok(Attached::Done)
    }

    /// The GIL's probe sites of `target` (see [`sites_for`]); None while a worker searches.
    fn gil_sites(
        &mut self,
        pid: Option<u32>,
        target: &ProbeTarget,
    ) -> Option<Result<GilSites, String>> {
        let gil = self.gil.as_mut()?;
        let (t, dirs) = (target.clone(), gil.debug_dirs.clone());
        let find = move || {
            let debug = t.debug_file(&dirs);
            gil::find_sites(&t.path, &t.seen, debug.as_ref()).map_err(|e| e.to_string())
        };
        let searches = (&mut self.gil_reads, &mut self.reads);
        sites_for(&mut gil.sites, searches, pid, &target.key, find)
    }

    /// With the GIL view on request ([`PyTracker::gil_on_request`]): attaches the GIL probes
    /// for `pid` alone (a trap in that process only). `Pending` while its binary's sites are
    /// still searched for: ask again. An error says why it has no GIL view.
    pub fn attach_gil_to(
        &mut self,
        pid: u32,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<Attached, String> {
        let Some(on) = self.gil.as_ref().and_then(|g| g.on_request.as_ref()) else {
            return Err("the GIL probes are not loaded".into());
        };
        if on.attached.contains(&pid) {
            return Ok(Attached::Done);
        }
        let target = match on.targets.get(&pid) {
            Some(t) => t.clone(),
            None if self.free_threaded_pid(pid) => {
                return Err("a free-threaded build: its threads take no GIL".into());
            }
            None => return Err("not a Python process the agent has registered".into()),
        };
        let Some(sites) = self.gil_sites(Some(pid), &target) else {
            return Ok(Attached::Pending);
        };
        let sites = sites?;
        let [enter, ret, drop] = crate::bpf::GIL_PROGRAMS;
        let on_sites = sites
            .take
            .iter()
            .flat_map(|&off| [(enter, off), (ret, off)])
            .chain(sites.drop.iter().map(|&off| (drop, off)));
        for (program, off) in on_sites {
            if let Err(e) = probes.attach_process_probe(program, &target.path, off, 0, pid) {
                probes.detach_process_programs(pid, &crate::bpf::GIL_PROGRAMS);
                return Err(e.to_string());
            }
        }
        if let Some(on) = self.gil.as_mut().and_then(|g| g.on_request.as_mut()) {
            on.attached.insert(pid);
        }
        Ok(Attached::Done)
    }

    fn free_threaded_pid(&self, pid: u32) -> bool {
        self.procs.get(&pid).is_some_and(|t| t.layout.free_threaded)
    }

    /// Takes off the probes [`PyTracker::attach_gil_to`] put on for `pid`, also when the
    /// process has exited and been forgotten since (its links are still held).
    pub fn detach_gil_from(&mut self, pid: u32, probes: &mut (dyn Uprobes + '_)) {
        if let Some(on) = self.gil.as_mut().and_then(|g| g.on_request.as_mut()) {
            on.attached.remove(&pid);
        }
        probes.detach_process_programs(pid, &crate::bpf::GIL_PROGRAMS);
    }

    /// Like [`PyTracker::attach_gil_binary`], for the garbage-collector probes.
    fn attach_gc_binary(
        &mut self,
        pid: Option<u32>,
        target: &ProbeTarget,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<Attached, String> {
        let Some(gc) = self.gc.as_mut() else {
            return Ok(Attached::Done);
        };
        if gc.is_attached(&target.key) {
            return Ok(Attached::Done);
        }
        let (t, dirs) = (target.clone(), gc.debug_dirs.clone());
        let find = move || super::super::gc::find_target_sites(&t, &dirs);
        let searches = (&mut self.gc_reads, &mut self.reads);
        let Some(sites) = sites_for(gc.sites_mut(), searches, pid, &target.key, find) else {
            return Ok(Attached::Pending);
        };
        gc.attach_sites(target, sites?, probes)?;
        Ok(Attached::Done)
    }
}

/// A binary's probe sites (or why it has none): as found before, else searched for by `find`,
/// on a worker for `pid` (None while that search runs: `pid` is named by the worker's
/// `ready` once it is back), or here at once without a pid (the user's own command, before
/// it starts). What a search finds is kept.
fn sites_for<T: Clone + Send + 'static>(
    found: &mut HashMap<BinaryKey, Result<T, String>>,
    (searches, reads): (
        &mut OffLoop<BinaryKey, Result<T, String>>,
        &mut ProcessReads,
    ),
    pid: Option<u32>,
    key: &BinaryKey,
    find: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Option<Result<T, String>> {
    if let Some(known) = found.get(key) {
        return Some(known.clone());
    }
    let result = match pid {
        Some(pid) => searches.poll(reads, pid, key, find)?,
        None => find(),
    };
    found.insert(key.clone(), result.clone());
    Some(result)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::bpf::{AskedProbes, GC_PROGRAMS, GIL_PROGRAMS};
    use crate::os::procs::ProcessRegistry;

    /// pyenv's CPython 3.11 waiting on its stdin, once up; None (the skip recorded) without it.
    fn idle_python() -> Option<std::process::Child> {
        crate::python::tests::pyenv_311("import sys\nprint('up', flush=True)\nsys.stdin.read()")
    }

    /// The GIL's and the collector's probe sites (a whole copy of the interpreter binary) are
    /// searched for on a worker: the sync that registers a Python process asks for no probe
    /// while the search runs, and a sync after [`PyTracker::ready_pids`] named the process
    /// attaches them. Turns here wait for nothing, as a turn whose grace has run out.
    #[test]
    fn probe_sites_are_searched_on_a_worker_and_attached_once_found() {
        let Some(mut child) = idle_python() else {
            return;
        };
        let pid = child.id();
        let mut registry = ProcessRegistry::new();
        let mut tracker = PyTracker::new(None);
        tracker.enable_gil(Vec::new());
        tracker.enable_gc(Vec::new());
        let mut asked = AskedProbes::default();
        // The collector's ends are USDT probes or its function's returns, as the build has.
        let [gc_start, gc_done, gc_return] = GC_PROGRAMS;
        let all_on = |asked: &AskedProbes| {
            let on = |p: &str| asked.binary.iter().any(|(q, _)| q == p);
            GIL_PROGRAMS.iter().all(|p| on(p)) && on(gc_start) && (on(gc_done) || on(gc_return))
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut registered_before_probes = false;
        loop {
            tracker.reads().begin_turn(Instant::now());
            let process = registry.observe(pid).expect("the child runs");
            tracker.sync(process, Some(&mut asked));
            registered_before_probes |= tracker.pids().contains(&pid) && asked.binary.is_empty();
            if all_on(&asked) {
                break;
            }
            // The next sync comes when a read the last one started has come back.
            while !tracker.ready_pids().contains(&pid) {
                assert!(
                    Instant::now() < deadline,
                    "probes asked for: {:?}; notices: {:?}",
                    asked.binary,
                    tracker.take_notices()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        assert!(
            registered_before_probes,
            "the registering sync waited for the probe sites"
        );
        let _ = child.kill();
        let _ = child.wait();
    }

    /// With the GIL view on request (the agent's captures), registering a process probes
    /// nothing; asking for its view attaches the probes for that process alone, and they
    /// come off when asked.
    #[test]
    fn on_request_the_gil_probes_go_on_for_one_process_and_come_off() {
        let Some(mut child) = idle_python() else {
            return;
        };
        let pid = child.id();
        let mut registry = ProcessRegistry::new();
        let mut tracker = PyTracker::new(None);
        tracker.enable_gil(Vec::new());
        tracker.gil_on_request();
        let mut asked = AskedProbes::default();
        let deadline = Instant::now() + Duration::from_secs(60);
        let attached = loop {
            tracker.reads().begin_turn(Instant::now());
            let process = registry.observe(pid).expect("the child runs");
            tracker.sync(process, Some(&mut asked));
            match tracker.attach_gil_to(pid, &mut asked) {
                Ok(Attached::Done) => break true,
                Ok(Attached::Pending) => {}
                Err(e) if e.contains("not a Python process") => {}
                Err(e) => panic!("no GIL view: {e}"),
            }
            assert!(Instant::now() < deadline, "the probe sites never came");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(attached);
        assert!(
            asked.binary.is_empty(),
            "probes for every process: {:?}",
            asked.binary
        );
        assert!(
            asked.process.len() >= 3 && asked.process.iter().all(|&(p, _)| p == pid),
            "probes for one process: {:?}",
            asked.process
        );
        // Asked again while on: nothing more.
        let before = asked.process.len();
        assert_eq!(tracker.attach_gil_to(pid, &mut asked), Ok(Attached::Done));
        assert_eq!(asked.process.len(), before);
        tracker.detach_gil_from(pid, &mut asked);
        assert_eq!(asked.detached, vec![pid]);
        // Off: asked again, they go on again.
        assert_eq!(tracker.attach_gil_to(pid, &mut asked), Ok(Attached::Done));
        assert_eq!(asked.process.len(), 2 * before);
        let _ = child.kill();
        let _ = child.wait();
    }
}
