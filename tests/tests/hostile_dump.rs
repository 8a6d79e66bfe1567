//! `dump` beside processes whose files never answer. A Python process whose interpreter runs
//! from a FUSE file system that served Debian's `python3.11` until it stalled: `dump` (and
//! the agent's dump for `dump --collector`) reads that binary for the interpreter's layout,
//! and before a deadline was put on that read it waited for good — the agent's capture
//! requests with it. And a Python process with a thread blocked in a read from such a file
//! system: `dump --native` seizes each thread to read its registers, and that thread never
//! stops. Needs root (FUSE, the agent); Debian's python3.11 missing prints `skipping: …`.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::cluster::{Agent, Collector, collected, free_port};
use pyrometer_e2e::fuse::{StuckFs, StuckRun, stuck_python};
use pyrometer_e2e::wait::wait_until;
use pyrometer_e2e::*;

/// Far past every deadline the dump has: a run still going then is stuck.
const HUNG: Duration = Duration::from_secs(90);

/// A Python process named `NAME` (its comm) spinning in `NAME_spin`, once it said so.
fn spinner(python: &Path, name: &str) -> std::process::Child {
    let script = format!(
        "import ctypes\n\
         ctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n\
         print('named', flush=True)\n\
         def {name}_spin():\n    while True:\n        pass\n\
         {name}_spin()\n"
    );
    let (child, line) = spawn_until_line(Command::new(python).args(["-c", &script]));
    assert_eq!(line, "named");
    child
}

/// A Python process spinning in `stuck_spin` whose binary is served by a stalled FUSE file
/// system under `dir/mnt` ([`stuck_python`]).
fn stuck_spinner(dir: &Path, python: &Path) -> StuckRun {
    let script = "print('stuck', flush=True)\n\
        def stuck_spin():\n    while True:\n        pass\n\
        stuck_spin()\n";
    let (fs, child, line) = stuck_python(dir, python, script);
    assert_eq!(line, "stuck");
    StuckRun {
        fs: Some(fs),
        child,
        agent: None,
    }
}

/// A run of `pyrometer`: its exit status once it exited, its output so far.
struct Ran {
    child: std::process::Child,
    status: Option<std::process::ExitStatus>,
    stdout: String,
    stderr: String,
}

/// `pyrometer ARGS` until it exits or its main thread has (a worker of it blocked in a read
/// that a FUSE server took cannot be interrupted, not even by SIGKILL, and the process ends
/// only with that read); the test fails if neither happens within [`HUNG`].
fn pyrometer_bounded(dir: &Path, args: &[&str]) -> Ran {
    let out_path = dir.join("dump.out");
    let err_path = dir.join("dump.err");
    let mut child = Command::new(pyrometer_bin())
        .args(args)
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("pyrometer");
    let started = Instant::now();
    let main_exited = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
    };
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if main_exited(child.id()) {
            break None;
        }
        assert!(
            started.elapsed() < HUNG,
            "`pyrometer {}` still ran after {HUNG:?}",
            args.join(" ")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("`pyrometer {}`: {:?}", args.join(" "), started.elapsed());
    Ran {
        child,
        status,
        stdout: std::fs::read_to_string(&out_path).unwrap(),
        stderr: std::fs::read_to_string(&err_path).unwrap(),
    }
}

/// A failure in one line that names the stuck binary's read and its pid.
fn assert_stalled_in_one_line(ran: &Ran, pid: u32) {
    let err = &ran.stderr;
    if let Some(status) = ran.status {
        assert!(!status.success(), "the dump of the stuck process: {err}");
    }
    // Through the collector, the request's progress comes first.
    let (progress, failure): (Vec<&str>, Vec<&str>) = err
        .trim()
        .lines()
        .partition(|l| l.ends_with(": pending") || l.ends_with(": running"));
    assert_eq!(failure.len(), 1, "not one line: {err}");
    assert!(progress.len() <= 2, "{err}");
    assert!(
        failure[0].contains(&format!(
            "pid {pid}'s interpreter binary was not read within"
        )),
        "{err}"
    );
}

/// `dump --collector`: the agent's dump of the stuck process fails in one line, and the
/// agent still answers the next dump (of a normal process) and the stuck one's again (left
/// alone now, so at once).
#[test]
fn the_agents_dump_of_a_process_with_a_stuck_binary_fails_in_one_line_and_the_next_answers() {
    if !privileged() {
        return;
    }
    let py = pyrometer_e2e::python::debian();
    if !py.present() {
        return;
    }
    let dir = scratch("hostile-dump-agent");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let url = collector.url();
    let mut steady = spinner(&py.path, "steadydump");
    let mut run = stuck_spinner(&dir, &py.path);
    let stuck_pid = run.child.id();
    let agent = Agent::start(
        &dir,
        "stuck-dump",
        &url,
        &["--comm", "^steadydump$", "--no-gpu"],
    );
    run.agent = Some(agent);
    // The agent polls for requests once it pushes.
    wait_until(
        Duration::from_secs(60),
        "the steady process's samples at the collector",
        || collected(&collector, "stuck-dump", "").contains("steadydump_spin"),
    );
    let dump = |pid: u32| {
        let pid = pid.to_string();
        pyrometer_bounded(
            &dir,
            &[
                "dump",
                "--collector",
                &url,
                "--node",
                "stuck-dump",
                "--pid",
                &pid,
            ],
        )
    };
    assert_stalled_in_one_line(&dump(stuck_pid), stuck_pid);
    let out = dump(steady.id());
    assert!(
        out.status.is_some_and(|s| s.success()),
        "the steady process's dump: {}",
        out.stderr
    );
    assert!(out.stdout.contains("steadydump_spin"), "{}", out.stdout);
    assert_stalled_in_one_line(&dump(stuck_pid), stuck_pid);
    let taken = run.fs.as_ref().map_or(0, StuckFs::reads);
    assert!(taken >= 1, "the stalled file was never read");
    let _ = steady.kill();
    let _ = steady.wait();
    drop(run);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dump --pid`: the stuck process's dump fails in one line instead of waiting for good.
#[test]
fn a_dump_of_a_process_with_a_stuck_binary_fails_in_one_line() {
    if !privileged() {
        return;
    }
    let py = pyrometer_e2e::python::debian();
    if !py.present() {
        return;
    }
    let dir = scratch("hostile-dump-local");
    let mut run = stuck_spinner(&dir, &py.path);
    let pid = run.child.id();
    let mut out = pyrometer_bounded(&dir, &["dump", "--pid", &pid.to_string()]);
    assert_stalled_in_one_line(&out, pid);
    // Its worker's read ends with the file system's connection; the process with it.
    run.release();
    let status = out.status.unwrap_or_else(|| out.child.wait().unwrap());
    assert_eq!(status.code(), Some(2), "{}", out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dump --native`: a thread blocked in a read that never answers does not stop for its
/// registers; it is given up on after its wait (its Python frames shown, with the reason its
/// native frames are not), and the other thread is dumped without such a line.
#[test]
fn dump_native_gives_up_on_a_thread_that_does_not_stop() {
    if !privileged() {
        return;
    }
    let py = pyrometer_e2e::python::debian();
    if !py.present() {
        return;
    }
    let dir = scratch("hostile-dump-native");
    let data = dir.join("data.bin");
    std::fs::write(&data, vec![7u8; 1 << 16]).unwrap();
    std::fs::create_dir_all(dir.join("mnt")).unwrap();
    let fs = StuckFs::serving(&dir.join("mnt"), &data);
    let script = "import sys, threading\n\
        def stuck_reader(path):\n    with open(path, 'rb') as f:\n        f.read()\n\
        def main_spin():\n    while True:\n        pass\n\
        print('ready', flush=True)\n\
        sys.stdin.readline()\n\
        threading.Thread(target=stuck_reader, args=(sys.argv[1],), daemon=True).start()\n\
        main_spin()\n";
    let (mut child, line) = spawn_until_line(
        Command::new(&py.path)
            .args(["-c", script])
            .arg(dir.join("mnt/data.bin"))
            .stdin(Stdio::piped()),
    );
    assert_eq!(line, "ready");
    fs.stall();
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    wait_until(
        Duration::from_secs(30),
        "the reader thread's read at the file system",
        || fs.reads() >= 1,
    );
    let pid = child.id();
    let mut run = StuckRun {
        fs: Some(fs),
        child,
        agent: None,
    };
    // The thread is in the read (its Python frame says so) before the dump.
    wait_until(Duration::from_secs(30), "stuck_reader in a dump", || {
        let out = pyrometer(&["dump", "--pid", &pid.to_string()]);
        String::from_utf8_lossy(&out.stdout).contains("stuck_reader")
    });
    let out = pyrometer_bounded(&dir, &["dump", "--native", "--pid", &pid.to_string()]);
    assert!(out.status.is_some_and(|s| s.success()), "{}", out.stderr);
    let text = out.stdout;
    println!("{text}");
    let threads: Vec<&str> = text.split("\nThread ").skip(1).collect();
    let reader = threads
        .iter()
        .find(|t| t.contains("stuck_reader"))
        .unwrap_or_else(|| panic!("no thread in stuck_reader:\n{text}"));
    assert!(
        reader.contains(
            "(native frames unavailable: cannot read its registers: it did not stop within 500 ms"
        ),
        "the reader thread:\n{reader}"
    );
    let main = threads
        .iter()
        .find(|t| t.contains("main_spin"))
        .unwrap_or_else(|| panic!("no thread in main_spin:\n{text}"));
    assert!(
        !main.contains("native frames unavailable"),
        "the main thread:\n{main}"
    );
    // Still seized, never stopped: the process runs on after the dump exited.
    let before = pyrometer_e2e::wait::cpu_time(pid).unwrap();
    wait_until(
        Duration::from_secs(30),
        "the process's CPU time to grow",
        || pyrometer_e2e::wait::cpu_time(pid).is_some_and(|t| t > before),
    );
    run.release();
    let _ = std::fs::remove_dir_all(&dir);
}
