//! Starting the command `record -- CMD` profiles: held before its `exec` until the kernel
//! filter knows its pid, and, with the allocation sampler library, held again before its
//! `main` until its libraries' tables are loaded.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};

use super::pids::TargetError;

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
    #[cfg(test)]
    pub fn spawn(argv: &[String]) -> Result<Self, TargetError> {
        Self::spawn_holding(argv, &[], None)
    }

    /// Starts `argv` with variables added to its environment, held; with `hold`, the command (not the gate before it)
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
}
