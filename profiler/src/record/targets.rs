//! What `record` (and `top`) profiles: chosen by the command line, described in messages and
//! file names, and the preparations a command gets before it starts.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::command::CommandError;
use crate::output::OutputFormat;

/// The processes a recording samples.
#[derive(Debug)]
pub enum Targets {
    /// Every process but the idle task and pyrometer itself.
    All,
    /// These processes (with `--subprocesses`, their descendants too).
    Pids(Vec<u32>),
    /// A command started for the recording, and everything it starts.
    Command(Vec<String>),
    /// Processes whose name matches: the regex as given, and anchored.
    Comm(String, regex::Regex),
}

impl Targets {
    /// The targets the arguments name; a usage error when they name none or conflict.
    pub fn from_args(
        all: bool,
        pids: &[u32],
        comm: Option<&str>,
        command: &[String],
    ) -> Result<Targets, CommandError> {
        if all {
            return Ok(Targets::All);
        }
        if !command.is_empty() {
            if !pids.is_empty() {
                return Err(CommandError::Input(
                    "give either --pid or a command after --, not both".into(),
                ));
            }
            return Ok(Targets::Command(command.to_vec()));
        }
        if !pids.is_empty() {
            return Ok(Targets::Pids(pids.to_vec()));
        }
        if let Some(re) = comm {
            let anchored = regex::Regex::new(&format!("^(?:{re})$"))
                .map_err(|e| CommandError::Input(format!("invalid --comm regex '{re}': {e}")))?;
            return Ok(Targets::Comm(re.to_string(), anchored));
        }
        Err(CommandError::Input(
            "nothing to profile: give --pid PID, --comm REGEX, --all, or a command after -- (e.g. pyrometer record -- ./prog)".into(),
        ))
    }

    /// The pids given exist (a process that exited since is named in the error).
    pub fn check(&self) -> Result<(), CommandError> {
        match self {
            Targets::Pids(pids) => crate::os::pids::check_pids(Path::new("/proc"), pids)
                .map_err(|e| CommandError::Input(e.to_string())),
            _ => Ok(()),
        }
    }

    /// Which processes the kernel side samples for these targets.
    pub(crate) fn filter(&self) -> crate::bpf::Filter {
        match self {
            Targets::All => crate::bpf::Filter::All,
            _ => crate::bpf::Filter::Targets,
        }
    }

    /// For the "sampling ..." line.
    pub fn describe(&self) -> String {
        match self {
            Targets::All => "all processes".to_string(),
            Targets::Pids(p) => format!("pid {}", join(p)),
            Targets::Command(c) => c[0].clone(),
            Targets::Comm(re, _) => format!("processes named '{re}'"),
        }
    }

    /// The flame graph's title.
    pub fn title(&self) -> String {
        match self {
            Targets::All => "pyrometer: all processes".to_string(),
            Targets::Pids(p) => format!("pyrometer: pid {}", join(p)),
            Targets::Command(c) => format!("pyrometer: {}", c.join(" ")),
            Targets::Comm(re, _) => format!("pyrometer: --comm '{re}'"),
        }
    }

    /// `pyrometer-<target>-<time>.<ext>`, when no `-o` was given.
    pub fn default_output_name(&self, format: OutputFormat) -> PathBuf {
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let what = match self {
            Targets::All => "all".to_string(),
            Targets::Pids(p) => format!("pid{}", p[0]),
            Targets::Command(c) => Path::new(&c[0])
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "cmd".into()),
            Targets::Comm(re, _) => {
                let name: String = re
                    .chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
                    .collect();
                format!("comm-{name}")
            }
        };
        PathBuf::from(format!("pyrometer-{what}-{stamp}.{}", format.extension()))
    }
}

fn join(pids: &[u32]) -> String {
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Builds the unwind tables a command will need first: its executable, the libraries it
/// names (found as the dynamic loader would: a shared libpython runs the interpreter's first
/// imports, and their first collections, before a later sync could catch up), and the dynamic
/// loader and C library (the ones pyrometer itself maps, which a dynamically linked command on
/// this system maps too).
pub(crate) fn prewarm_command(unwinder: &mut crate::unwinder::Unwinder, exe: Option<&Path>) {
    if let Some(exe) = exe {
        unwinder.prewarm(exe);
        for lib in crate::os::elfsyms::needed_libraries(exe) {
            unwinder.prewarm(&lib);
        }
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut seen = std::collections::HashSet::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let name = Path::new(path)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        if (name.starts_with("libc.so") || name.starts_with("ld-linux")) && seen.insert(path) {
            unwinder.prewarm(Path::new(path));
        }
    }
}

/// The file a command name runs: as given when it has a `/`, else found along `PATH`.
pub(crate) fn command_path(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        Some(PathBuf::from(program))
    } else {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(program))
                .find(|p| p.is_file())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pyenv's interpreter names its libpython (found along its RUNPATH): its table is built
    /// before the command runs, with the executable's.
    #[test]
    fn a_commands_needed_libraries_are_prewarmed() {
        if !crate::os::privileges::may_sample() {
            return;
        }
        let Some(libpython) = crate::python::pyenv_libpython("3.11.7", 11) else {
            return;
        };
        let exe = libpython
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("bin/python3.11");
        let mut sampler = crate::bpf::Sampler::load(&crate::bpf::SamplerConfig::default())
            .expect("load the sampler");
        let maps = sampler.take_unwind_maps().expect("unwind maps");
        let mut unwinder = crate::unwinder::Unwinder::new(maps).expect("unwinder");
        prewarm_command(&mut unwinder, Some(&exe));
        assert!(unwinder.is_prewarmed(&exe));
        assert!(
            unwinder.is_prewarmed(&libpython),
            "{} not prewarmed",
            libpython.display()
        );
    }
}
