//! Attaching uprobe programs: for every process (the GIL probes on an interpreter binary, the
//! preloaded sampler library's probes) or for one process (allocator probes).

use std::collections::HashSet;
use std::path::Path;

use aya::Ebpf;
use aya::programs::UProbe;
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};

use super::{BpfError, Sampler, error_chain};
use crate::os::procs::BinaryKey;

/// Something that attaches uprobe programs (the sampler; tests use a recorder).
pub trait Uprobes {
    /// Attaches `program` at file offset `offset` of the binary at `path`, for every process.
    fn attach_uprobe(&mut self, program: &str, path: &Path, offset: u64) -> Result<(), BpfError>;
    /// [`Uprobes::attach_uprobe`] with an attach cookie (Linux 5.15+) and, for a USDT probe,
    /// the file offset of its semaphore (which the kernel raises while the probe is attached).
    fn attach_uprobe_with(
        &mut self,
        program: &str,
        path: &Path,
        offset: u64,
        cookie: Option<u64>,
        semaphore: Option<u64>,
    ) -> Result<(), BpfError>;
    /// Attaches `program` at `offset` of `path` for process `pid` only, with `cookie`.
    fn attach_process_probe(
        &mut self,
        program: &'static str,
        path: &Path,
        offset: u64,
        cookie: u64,
        pid: u32,
    ) -> Result<(), BpfError>;
    /// Detaches the probes attached for `pid` (it exited).
    fn detach_process_probes(&mut self, pid: u32);
    /// Detaches the probes of `programs` attached for `pid`, leaving its others on.
    fn detach_process_programs(&mut self, pid: u32, programs: &[&str]);
}

/// The copies of one library whose probes are on (known by the file's identity, whatever
/// path reached it), so a copy is probed once however many processes map or ask for it. A
/// copy whose probes failed is tried again when next asked for.
#[derive(Default)]
pub struct ProbedCopies {
    attached: HashSet<BinaryKey>,
}

impl ProbedCopies {
    /// Runs `attach` on the copy at `path` (identified by `key`) unless its probes are on
    /// already.
    pub fn attach<'p>(
        &mut self,
        key: BinaryKey,
        path: &Path,
        probes: &mut (dyn Uprobes + 'p),
        attach: impl FnOnce(&Path, &mut (dyn Uprobes + 'p)) -> Result<(), String>,
    ) -> Result<(), String> {
        if self.attached.contains(&key) {
            return Ok(());
        }
        attach(path, probes)?;
        self.attached.insert(key);
        Ok(())
    }

    /// [`ProbedCopies::attach`] for the library file at `path`, before any process maps it.
    pub fn attach_file<'p>(
        &mut self,
        path: &Path,
        probes: &mut (dyn Uprobes + 'p),
        attach: impl FnOnce(&Path, &mut (dyn Uprobes + 'p)) -> Result<(), String>,
    ) -> Result<(), String> {
        let key = BinaryKey::of_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
        self.attach(key, path, probes, attach)
    }

    /// Copies probed.
    pub fn len(&self) -> usize {
        self.attached.len()
    }
}

/// A loaded uprobe program of the object.
fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe, BpfError> {
    ebpf.program_mut(name)
        .ok_or_else(|| BpfError::Load(format!("program {name} missing from object")))?
        .try_into()
        .map_err(|e| BpfError::Load(error_chain(&e)))
}

/// The programs filter by the target set themselves, so a probe for every process costs
/// the processes that are not targets a trap each; the allocation probes, on functions every
/// process calls, are attached per process.
impl Uprobes for Sampler {
    fn attach_uprobe(&mut self, program: &str, path: &Path, offset: u64) -> Result<(), BpfError> {
        self.attach_uprobe_with(program, path, offset, None, None)
    }

    fn attach_uprobe_with(
        &mut self,
        program: &str,
        path: &Path,
        offset: u64,
        cookie: Option<u64>,
        semaphore: Option<u64>,
    ) -> Result<(), BpfError> {
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie,
            ref_ctr_offset: semaphore,
        };
        uprobe(&mut self.ebpf, program)?
            .attach(point, path, UProbeScope::AllProcesses)
            .map(|_| ())
            .map_err(|e| BpfError::Attach {
                what: format!("uprobe {program} at {}+{offset:#x}", path.display()),
                reason: error_chain(&e),
            })
    }

    fn attach_process_probe(
        &mut self,
        program: &'static str,
        path: &Path,
        offset: u64,
        cookie: u64,
        pid: u32,
    ) -> Result<(), BpfError> {
        let scope = std::num::NonZeroU32::new(pid)
            .map(UProbeScope::OneProcess)
            .ok_or_else(|| BpfError::Attach {
                what: format!("uprobe {program}"),
                reason: "pid 0".into(),
            })?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(cookie),
            ref_ctr_offset: None,
        };
        let link = uprobe(&mut self.ebpf, program)?
            .attach(point, path, scope)
            .map_err(|e| BpfError::Attach {
                what: format!(
                    "uprobe {program} at {}+{offset:#x} for pid {pid}",
                    path.display()
                ),
                reason: error_chain(&e),
            })?;
        self.pid_probes
            .entry(pid)
            .or_default()
            .push((program, link));
        Ok(())
    }

    fn detach_process_probes(&mut self, pid: u32) {
        let links = self.pid_probes.remove(&pid).unwrap_or_default();
        detach_links(&mut self.ebpf, links);
    }

    fn detach_process_programs(&mut self, pid: u32, programs: &[&str]) {
        let Some(links) = self.pid_probes.get_mut(&pid) else {
            return;
        };
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(links)
            .into_iter()
            .partition(|(program, _)| programs.contains(program));
        *links = kept;
        if links.is_empty() {
            self.pid_probes.remove(&pid);
        }
        detach_links(&mut self.ebpf, gone);
    }
}

/// Detaches per-process probe links (a program already gone has nothing to detach).
fn detach_links(ebpf: &mut Ebpf, links: Vec<(&'static str, UProbeLinkId)>) {
    for (program, link) in links {
        if let Ok(prog) = uprobe(ebpf, program) {
            let _ = prog.detach(link);
        }
    }
}

/// Records the probes asked for, for unit tests of what chooses them and when (the kernel's
/// side is tested end to end).
#[cfg(test)]
#[derive(Default)]
pub(crate) struct AskedProbes {
    /// (program, offset) of the probes on a binary for every process.
    pub binary: Vec<(String, u64)>,
    /// (pid, offset) of the probes for one process.
    pub process: Vec<(u32, u64)>,
    /// Pids whose probes of some programs were taken off.
    pub detached: Vec<u32>,
}

#[cfg(test)]
impl Uprobes for AskedProbes {
    fn attach_uprobe(&mut self, program: &str, path: &Path, offset: u64) -> Result<(), BpfError> {
        self.attach_uprobe_with(program, path, offset, None, None)
    }
    fn attach_uprobe_with(
        &mut self,
        program: &str,
        _: &Path,
        offset: u64,
        _: Option<u64>,
        _: Option<u64>,
    ) -> Result<(), BpfError> {
        self.binary.push((program.to_string(), offset));
        Ok(())
    }
    fn attach_process_probe(
        &mut self,
        _: &'static str,
        _: &Path,
        offset: u64,
        _: u64,
        pid: u32,
    ) -> Result<(), BpfError> {
        self.process.push((pid, offset));
        Ok(())
    }
    fn detach_process_probes(&mut self, _: u32) {}
    fn detach_process_programs(&mut self, pid: u32, _: &[&str]) {
        self.detached.push(pid);
    }
}
