//! Attaching the GIL and garbage-collector uprobes to a registered process's interpreter
//! binary, once per binary.

use super::*;

impl PyTracker {
    /// Attaches the GIL probes to the interpreter binary of `process` (once per binary).
    pub(super) fn attach_gil(
        &mut self,
        process: &Process,
        rt: &PythonRuntime,
        probes: &mut (dyn Uprobes + '_),
    ) {
        if self.gil.is_none() {
            return;
        }
        let pid = process.pid;
        let Some(target) = interpreter_target(process, rt) else {
            return;
        };
        match self.attach_gil_binary(&target, probes) {
            Ok(()) => {
                self.gil_unavailable.remove(&pid);
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
    /// `record` is about to start), so its first GIL acquisitions are seen.
    pub fn prepare_gil(
        &mut self,
        path: &Path,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        let target = ProbeTarget::of_file(path)?;
        self.attach_gil_binary(&target, probes)
    }

    /// Attaches the garbage-collector probes to the interpreter binary of `process` (once per
    /// binary).
    pub(super) fn attach_gc(
        &mut self,
        process: &Process,
        rt: &PythonRuntime,
        probes: &mut (dyn Uprobes + '_),
    ) {
        let Some(gc) = self.gc.as_mut() else {
            return;
        };
        let Some(target) = interpreter_target(process, rt) else {
            return;
        };
        let pid = process.pid;
        match gc.attach(&target, probes) {
            Ok(()) => {
                gc.unavailable.remove(&pid);
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
        let Some(gc) = self.gc.as_mut() else {
            return Ok(());
        };
        gc.attach(&ProbeTarget::of_file(path)?, probes)
    }

    pub(super) fn attach_gil_binary(
        &mut self,
        target: &ProbeTarget,
        probes: &mut (dyn Uprobes + '_),
    ) -> Result<(), String> {
        let Some(gil) = self.gil.as_mut() else {
            return Ok(());
        };
        if gil.attached.contains(&target.key) {
            return Ok(());
        }
        let sites = gil
            .sites
            .entry(target.key.clone())
            .or_insert_with(|| {
                let debug = target.debug_file(&gil.debug_dirs);
                gil::find_sites(&target.path, &target.seen, debug.as_deref())
                    .map_err(|e| e.to_string())
            })
            .clone()?;
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
        gil.attached.insert(target.key.clone());
        self.gil_binaries.push(sites);
        Ok(())
    }
}
