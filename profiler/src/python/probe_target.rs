//! The interpreter binary a process runs, as the GIL and garbage-collector probes need it:
//! openable from here, named as the process maps it, with where its separate debug file may be.

use std::path::{Path, PathBuf};

use super::version::PythonRuntime;
use crate::os::procs::{BinaryKey, Process};

/// An interpreter binary to probe.
#[derive(Clone)]
pub(super) struct ProbeTarget {
    pub key: BinaryKey,
    /// Openable from here.
    pub path: PathBuf,
    dir: Option<PathBuf>,
    /// As the process maps it (for messages and debuglink paths).
    pub seen: String,
    build_id: Option<String>,
    /// Debug dirs of the process's own root (a container's or chroot's), searched first, and
    /// the path as seen inside that root (for debuglink paths).
    root_debug_dirs: Vec<PathBuf>,
    seen_in_root: String,
}

impl ProbeTarget {
    /// A binary no process maps yet.
    pub fn of_file(path: &Path) -> Result<Self, String> {
        Ok(Self {
            key: BinaryKey::of_file(path).map_err(|e| format!("{}: {e}", path.display()))?,
            path: path.to_path_buf(),
            dir: path.parent().map(Path::to_path_buf),
            seen: path.to_string_lossy().into_owned(),
            build_id: crate::os::procs::read_build_id(path),
            root_debug_dirs: Vec::new(),
            seen_in_root: path.to_string_lossy().into_owned(),
        })
    }

    /// Its separate debug file: in the process's own root first, then in `debug_dirs`.
    pub fn debug_file(&self, debug_dirs: &[PathBuf]) -> Option<crate::os::elfsyms::DebugFile> {
        let mut dirs = self.root_debug_dirs.clone();
        dirs.extend_from_slice(debug_dirs);
        crate::symbolize::separate_debug_file(
            &self.path,
            self.dir.as_deref(),
            &self.seen_in_root,
            self.build_id.as_deref(),
            &dirs,
        )
    }
}

/// The interpreter binary `process` maps, to probe.
pub(super) fn interpreter_target(process: &Process, rt: &PythonRuntime) -> Option<ProbeTarget> {
    let binary = process
        .mappings()
        .iter()
        .find(|m| m.path == rt.path)
        .and_then(|m| m.binary().cloned())?;
    Some(ProbeTarget {
        key: binary.key().clone(),
        path: binary.path().to_path_buf(),
        dir: binary.dir().map(Path::to_path_buf),
        seen: rt.path.clone(),
        build_id: binary.build_id().map(str::to_string),
        root_debug_dirs: binary.debug_dirs(&[]),
        seen_in_root: binary.seen_path(&rt.path).to_string(),
    })
}
