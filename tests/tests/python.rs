//! `pyrometer dump` against every CPython on the machine: the pyenv builds 3.8–3.13
//! (`--enable-shared`, libpython3.X.so), Debian's static python3.11, forky's 3.14 and 3.15 and
//! the free-threaded 3.13t and 3.14t (no GIL: their spinner holds none). Each runs
//! fixtures/dump_threads.py, whose main thread spins in `spin()` holding the GIL while a thread
//! named "blocker" (OS) / "waiter-α" (`threading`) waits forever in `wait_forever()` on
//! `lock.acquire()`. A missing interpreter prints `skipping: …`. No root needed: the target is
//! our own child.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

use pyrometer_e2e::python::pyenv;
use pyrometer_e2e::wait::{wait_for, wait_until};
use pyrometer_e2e::*;
use serde_json::Value;

/// The spinners would compete for the machine's two cores; one at a time keeps states stable.
static SERIAL: Mutex<()> = Mutex::new(());

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/dump_threads.py")
}

/// 1-based line of the first line of the script containing `needle`.
fn line_of(needle: &str) -> u64 {
    let text = std::fs::read_to_string(script()).unwrap();
    text.lines().position(|l| l.contains(needle)).unwrap() as u64 + 1
}

/// A child process whose stdout lines arrive on a channel; killed on drop.
struct Target {
    child: Child,
    lines: Receiver<String>,
}

impl Target {
    fn start(python: &Path, args: &[&str]) -> Target {
        let mut child = Command::new(python)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start python");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Target { child, lines }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn wait_for(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(e) => panic!("no '{prefix}' line from the target: {e}"),
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn thread_named(dump: &Value, pred: impl Fn(&Value) -> bool) -> Option<&Value> {
    dump["threads"].as_array()?.iter().find(|t| pred(t))
}

/// Dumps until both threads show their steady states (the spinner briefly gives up the GIL
/// around its tick's write, the blocker says it is ready just before it blocks), at most a
/// few times; returns the text and the JSON dump.
/// A free-threaded build has no GIL: its spinner runs without holding one.
fn dump_until_settled(pid: u32, free_threaded: bool) -> (String, Value) {
    let running = if free_threaded {
        "(running): "
    } else {
        "(running, holds GIL)"
    };
    let mut last = None;
    for _ in 0..10 {
        let text = pyrometer(&["dump", "--pid", &pid.to_string()]);
        assert_ok(&text);
        let json = pyrometer(&["dump", "--pid", &pid.to_string(), "--format", "json"]);
        assert_ok(&json);
        let value: Value = serde_json::from_slice(&json.stdout).expect("dump JSON");
        let text = String::from_utf8(text.stdout).unwrap();
        let main_ok = thread_named(&value, |t| t["tid"] == pid).is_some_and(|t| {
            t["state"] == "running"
                && t["holds_gil"] == !free_threaded
                && t["frames"][0]["function"] == "spin"
        });
        // The blocker reports "ready" just before it blocks on its lock.
        let blocker_ok = thread_named(&value, |t| t["name"] == "blocker")
            .is_some_and(|t| t["state"] == "blocked");
        let text_ok = text.contains(running) && text.contains("(blocked: futex wait");
        if main_ok && blocker_ok && text_ok {
            return (text, value);
        }
        last = Some((text, value));
        std::thread::sleep(Duration::from_millis(100));
    }
    last.unwrap()
}

fn check_version(label: &str, python: &Path, minor: u32) {
    if !python.exists() {
        skip(
            &pyrometer_e2e::python::capability(label),
            format!("{label}: {} is missing", python.display()),
        );
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let target = Target::start(python, &[script().to_str().unwrap()]);
    target.wait_for("ready");
    let pid = target.pid();
    let free_threaded = label.ends_with('t');
    let (text, dump) = dump_until_settled(pid, free_threaded);
    println!("{label}:\n{text}");

    assert!(
        text.contains(&format!("Process {pid}: ")) && text.contains(&format!("Python v3.{minor}")),
        "{label}: header:\n{text}"
    );
    assert_eq!(dump["pid"], pid);
    assert!(
        dump["version"]
            .as_str()
            .unwrap()
            .starts_with(&format!("3.{minor}"))
    );

    let file_ok = |f: &Value| {
        f["file"]
            .as_str()
            .is_some_and(|p| p.ends_with("dump_threads.py"))
    };

    // The spinner: the main thread (tid == pid), holding the GIL in spin(), <module> below.
    let main = thread_named(&dump, |t| t["tid"] == pid)
        .unwrap_or_else(|| panic!("{label}: no main thread:\n{text}"));
    let frames = main["frames"].as_array().unwrap();
    assert_eq!(frames[0]["function"], "spin", "{label}:\n{text}");
    assert!(file_ok(&frames[0]), "{label}:\n{text}");
    let line = frames[0]["line"].as_u64().unwrap();
    let (first, last) = (
        line_of("def spin():") + 1,
        line_of("next_tick = time.monotonic() + 0.2"),
    );
    assert!(
        (first..=last).contains(&line),
        "{label}: spin line {line} not in {first}..={last}"
    );
    let bottom = frames.last().unwrap();
    assert_eq!(bottom["function"], "<module>", "{label}:\n{text}");
    assert_eq!(
        bottom["line"].as_u64(),
        Some(line_of("# MODULE_LINE")),
        "{label}:\n{text}"
    );
    assert_eq!(main["state"], "running", "{label}:\n{text}");
    assert_eq!(main["holds_gil"], !free_threaded, "{label}:\n{text}");
    assert_eq!(main["python_name"], "MainThread", "{label}:\n{text}");
    let state = if free_threaded {
        "running"
    } else {
        "running, holds GIL"
    };
    assert!(
        text.contains(&format!("Thread {pid} ({state}): \"MainThread\"\n")),
        "{label}: the threading name, not the OS one:\n{text}"
    );

    // The blocker: its OS name and its threading name, in wait_forever() on the exact acquire
    // line, sleeping in a futex that is not the GIL's.
    let blocker = thread_named(&dump, |t| t["name"] == "blocker")
        .unwrap_or_else(|| panic!("{label}: no blocker:\n{text}"));
    assert_eq!(blocker["python_name"], "waiter-α", "{label}:\n{text}");
    assert!(
        text.contains(&format!("Thread {} (blocked: futex wait", blocker["tid"]))
            && text.contains("): \"waiter-α\"\n    wait_forever ("),
        "{label}:\n{text}"
    );
    assert!(!text.contains("\"blocker\""), "{label}:\n{text}");
    let top = &blocker["frames"][0];
    assert_eq!(top["function"], "wait_forever", "{label}:\n{text}");
    assert!(file_ok(top), "{label}:\n{text}");
    assert_eq!(
        top["line"].as_u64(),
        Some(line_of("# WAIT_LINE")),
        "{label}:\n{text}"
    );
    assert_eq!(blocker["state"], "blocked", "{label}:\n{text}");
    assert_eq!(blocker["holds_gil"], false, "{label}:\n{text}");
    assert!(
        blocker["reason"]
            .as_str()
            .is_some_and(|r| r.contains("futex")),
        "{label}:\n{text}"
    );
    assert!(
        text.contains("Thread ") && text.contains("(blocked: futex wait"),
        "{label}:\n{text}"
    );
    assert!(
        text.contains("    wait_forever (") && text.contains("    <module> ("),
        "{label}:\n{text}"
    );

    // Never stopped: it is not in a stopped state and keeps ticking after the dumps.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let state = stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap();
    assert!(
        state != 'T' && state != 't',
        "{label}: target is stopped ({state})"
    );
    let before = target.wait_for("tick");
    let after = target.wait_for("tick");
    assert_ne!(before, after);
}

#[test]
fn dump_python_3_8() {
    check_version("3.8", &pyenv("3.8.18"), 8);
}

#[test]
fn dump_python_3_9() {
    check_version("3.9", &pyenv("3.9.18"), 9);
}

#[test]
fn dump_python_3_10() {
    check_version("3.10", &pyenv("3.10.13"), 10);
}

#[test]
fn dump_python_3_11() {
    check_version("3.11", &pyenv("3.11.7"), 11);
}

#[test]
fn dump_python_3_12() {
    check_version("3.12", &pyenv("3.12.1"), 12);
}

#[test]
fn dump_python_3_13() {
    check_version("3.13", &pyenv("3.13.0"), 13);
}

/// Debian forky's 3.14 in its chroot: the layout comes from its `_Py_DebugOffsets`.
#[test]
fn dump_forky_python_3_14() {
    let python = pyrometer_e2e::python::forky(14);
    if python.present() {
        check_version(&python.label, &python.path, 14);
    }
}

/// Debian forky's 3.15 in its chroot.
#[test]
fn dump_forky_python_3_15() {
    let python = pyrometer_e2e::python::forky(15);
    if python.present() {
        check_version(&python.label, &python.path, 15);
    }
}

/// Free-threaded 3.13t: the layout, a larger object header included, from its description;
/// `threading`'s names through that header; no GIL held.
#[test]
fn dump_python_3_13t() {
    let python = pyrometer_e2e::python::free_threaded(13);
    if python.present() {
        check_version(&python.label, &python.path, 13);
    }
}

/// Free-threaded 3.14t.
#[test]
fn dump_python_3_14t() {
    let python = pyrometer_e2e::python::free_threaded(14);
    if python.present() {
        check_version(&python.label, &python.path, 14);
    }
}

/// Static, stripped: the runtime is found through the executable's exported symbols.
#[test]
fn dump_debian_python_3_11() {
    check_version("Debian 3.11", Path::new("/usr/bin/python3.11"), 11);
}

/// Two spinners: whenever one holds the GIL the other sleeps on the GIL's condition variable,
/// which dump must tell apart from the blocker's lock. Both GIL homes are covered: inside
/// `_PyRuntime` (3.8–3.11) and behind the interpreter's pointer (3.12+).
#[test]
fn gil_waiter_is_told_apart() {
    let mut ran = 0;
    for (version, minor) in [
        ("3.8.18", 8),
        ("3.11.7", 11),
        ("3.12.1", 12),
        ("3.13.0", 13),
    ] {
        let python = pyenv(version);
        if !python.exists() {
            skip(
                &format!("python:3.{minor}"),
                format!("3.{minor}: {} is missing", python.display()),
            );
            continue;
        }
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let target = Target::start(&python, &[script().to_str().unwrap(), "contend"]);
        target.wait_for("ready");
        let pid = target.pid().to_string();
        let what = format!("3.{minor}: a thread seen waiting for the GIL");
        let waiter = wait_for(Duration::from_secs(30), &what, || {
            let out = pyrometer(&["dump", "--pid", &pid, "--format", "json"]);
            assert_ok(&out);
            let dump: Value = serde_json::from_slice(&out.stdout).unwrap();
            let threads = dump["threads"].as_array().unwrap();
            let waiting = threads.iter().find(|t| t["state"] == "waiting_for_gil");
            let holder = threads.iter().find(|t| t["holds_gil"] == true);
            assert!(threads.iter().filter(|t| t["holds_gil"] == true).count() <= 1);
            let (Some(w), Some(h)) = (waiting, holder) else {
                return Err(());
            };
            assert_ne!(w["tid"], h["tid"]);
            assert_eq!(w["holds_gil"], false);
            let blocker = threads.iter().find(|t| t["name"] == "blocker").unwrap();
            assert_eq!(blocker["state"], "blocked");
            Ok(w["name"].as_str().unwrap_or("?").to_string())
        });
        println!("3.{minor}: {waiter} waits for the GIL");
        ran += 1;
    }
    assert!(ran > 0, "no interpreter to check was present");
}

fn assert_fails(out: &std::process::Output, code: i32, message: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    assert!(err.contains(message), "expected '{message}' in: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
}

#[test]
fn old_versions_are_refused() {
    let mut ran = 0;
    for (version, minor) in [("3.6.15", 6), ("3.7.16", 7)] {
        let python = pyenv(version);
        if !python.exists() {
            skip(
                &format!("python:3.{minor}"),
                format!("3.{minor}: {} is missing", python.display()),
            );
            continue;
        }
        let target = Target::start(
            &python,
            &[
                "-c",
                "print('ready', flush=True)\nimport time\ntime.sleep(60)",
            ],
        );
        target.wait_for("ready");
        let out = pyrometer(&["dump", "--pid", &target.pid().to_string()]);
        assert_fails(&out, 2, &format!("Python 3.{minor}"));
        assert_fails(&out, 2, "is not supported by dump (3.8 and newer are)");
        ran += 1;
    }
    assert!(ran > 0, "no old interpreter to check was present");
}

#[test]
fn non_python_and_missing_processes() {
    let out = pyrometer(&["dump", "--pid", "4000000"]);
    assert_fails(&out, 2, "no such process: 4000000");
    let mut sleep = Command::new("sleep").arg("60").spawn().expect("sleep");
    // The loader must have mapped its libraries before the maps are read.
    let maps = format!("/proc/{}/maps", sleep.id());
    wait_until(Duration::from_secs(30), "sleep's C library mapped", || {
        std::fs::read_to_string(&maps).is_ok_and(|m| m.contains("libc.so"))
    });
    let out = pyrometer(&["dump", "--pid", &sleep.id().to_string()]);
    let _ = sleep.kill();
    let _ = sleep.wait();
    assert_fails(
        &out,
        2,
        "(sleep) is not a Python process: no libpython or python executable mapped",
    );
}

/// Another user's process: one line naming the missing privilege, exit 3 (README "Exit codes").
#[test]
fn missing_privileges() {
    let python = pyenv("3.11.7");
    let setpriv = Command::new("setpriv").arg("--version").output();
    // SAFETY: geteuid has no preconditions.
    let missing = if unsafe { libc::geteuid() } != 0 {
        Some((
            "root",
            "dumping a process as another user needs root".to_string(),
        ))
    } else if setpriv.is_err() {
        Some((
            "tool:setpriv",
            "setpriv (util-linux) is not installed".into(),
        ))
    } else if !python.exists() {
        Some(("python:3.11", format!("{} is missing", python.display())))
    } else {
        None
    };
    if let Some((capability, reason)) = missing {
        skip(capability, reason);
        return;
    }
    let target = Target::start(
        &python,
        &[
            "-c",
            "print('ready', flush=True)\nimport time\ntime.sleep(60)",
        ],
    );
    target.wait_for("ready");
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(pyrometer_bin())
        .args(["dump", "--pid", &target.pid().to_string()])
        .output()
        .expect("run setpriv");
    assert_fails(
        &out,
        3,
        "permission denied (run as its user or as root, or grant CAP_SYS_PTRACE)",
    );
}

/// A process in its own pid namespace (a container's view): the interpreter's thread ids are
/// the namespace's (the main thread is 1), dump reports the host's.
#[test]
fn pid_namespace() {
    let python = pyenv("3.12.1");
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let missing = if !root {
        Some(("root", "a pid namespace needs root".to_string()))
    } else if Command::new("unshare").arg("--version").output().is_err() {
        Some((
            "tool:unshare",
            "unshare (util-linux) is not installed".into(),
        ))
    } else if !python.exists() {
        Some(("python:3.12", format!("{} is missing", python.display())))
    } else {
        None
    };
    if let Some((capability, reason)) = missing {
        skip(capability, reason);
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let unshare = Path::new("/usr/bin/unshare");
    let script = script();
    let target = Target::start(
        unshare,
        &[
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            python.to_str().unwrap(),
            script.to_str().unwrap(),
        ],
    );
    target.wait_for("ready");
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", target.pid())).unwrap();
    let pid: u32 = children.split_whitespace().next().unwrap().parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains(&format!("NSpid:\t{pid}\t1")), "{status}");
    let (text, dump) = dump_until_settled(pid, false);
    let main = thread_named(&dump, |t| t["tid"] == pid).unwrap_or_else(|| panic!("{text}"));
    assert_eq!(main["frames"][0]["function"], "spin", "{text}");
    let blocker =
        thread_named(&dump, |t| t["name"] == "blocker").unwrap_or_else(|| panic!("{text}"));
    assert_eq!(blocker["state"], "blocked", "{text}");
    assert_eq!(blocker["python_name"], "waiter-α", "{text}");
    assert_eq!(main["python_name"], "MainThread", "{text}");
    assert!(std::path::Path::new(&format!("/proc/{pid}/task/{}", blocker["tid"])).exists());
}

/// `dump --native`: the blocked thread's libc frames (the futex wait of its lock) sit above
/// the Python line that blocked, and the process runs on afterwards.
#[test]
fn dump_native_frames() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip(
            "root",
            "reading another process's registers needs root (ptrace)",
        );
        return;
    }
    let mut ran = 0;
    for (label, python) in [
        ("3.8", pyenv("3.8.18")),
        ("3.11", pyenv("3.11.7")),
        ("3.13", pyenv("3.13.0")),
        ("Debian 3.11", PathBuf::from("/usr/bin/python3.11")),
    ] {
        if !python.exists() {
            skip(
                &pyrometer_e2e::python::capability(label),
                format!("{label}: {} is missing", python.display()),
            );
            continue;
        }
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let target = Target::start(&python, &[script().to_str().unwrap()]);
        target.wait_for("ready");
        let pid = target.pid().to_string();
        let out = pyrometer(&["dump", "--pid", &pid, "--native", "--format", "json"]);
        assert_ok(&out);
        let dump: Value = serde_json::from_slice(&out.stdout).unwrap();
        let blocker = thread_named(&dump, |t| t["name"] == "blocker")
            .unwrap_or_else(|| panic!("{label}: no blocker: {dump}"));
        let frames = blocker["frames"].as_array().unwrap();
        let python_at = frames
            .iter()
            .position(|f| f["function"] == "wait_forever")
            .unwrap_or_else(|| panic!("{label}: no wait_forever: {blocker}"));
        assert_eq!(frames[python_at]["native"], false);
        assert_eq!(
            frames[python_at]["line"].as_u64(),
            Some(line_of("# WAIT_LINE")),
            "{label}: {blocker}"
        );
        let natives = &frames[..python_at];
        assert!(
            !natives.is_empty() && natives.iter().all(|f| f["native"] == true),
            "{label}: native frames above the Python line: {blocker}"
        );
        assert!(
            natives.iter().any(|f| f["function"]
                .as_str()
                .is_some_and(|n| n.contains("futex") || n.contains("sem_wait"))),
            "{label}: the lock's wait: {blocker}"
        );
        // Stopped only for the read: it ticks on.
        let before = target.wait_for("tick");
        let after = target.wait_for("tick");
        assert_ne!(before, after);
        println!(
            "{label}: {} native frames above wait_forever",
            natives.len()
        );
        ran += 1;
    }
    assert!(ran > 0, "no interpreter to check was present");
}

/// A static interpreter under another name (a renamed or embedding binary: neither its name
/// nor a mapped libpython says Python) is read for its runtime when the user chooses the
/// process, by pid, by name or as the command, as `dump` reads it: its samples carry Python
/// frames, six() ahead of three() ahead of one(). Node-wide, only interpreters named so are
/// read.
#[test]
fn a_renamed_static_interpreter_chosen_by_pid_or_name_has_python_frames() {
    if !privileged() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("renamed-interpreter");
    let exe = dir.join("renamed-interp");
    copy_executable(Path::new("/usr/bin/python3.11"), &exe);
    let script = pyrometer_e2e::python::source("py631.py");
    let as_command = dir.join("as-command.folded");
    let o = Command::new(pyrometer_bin())
        .args(["record", "-F", "199", "-f", "folded", "-o"])
        .arg(&as_command)
        .arg("--")
        .arg(&exe)
        .arg(&script)
        .arg("150")
        .env("PYTHONHOME", "/usr")
        .output()
        .expect("run pyrometer record");
    assert_ok(&o);
    check_renamed(&std::fs::read_to_string(&as_command).unwrap(), "--");
    for by_pid in [true, false] {
        let mut child = Command::new(&exe)
            .arg(&script)
            .arg("100000")
            .env("PYTHONHOME", "/usr")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the renamed interpreter");
        let out = dir.join(format!("by-pid-{by_pid}.folded"));
        let pid = child.id().to_string();
        let target = if by_pid {
            ["--pid", pid.as_str()]
        } else {
            ["--comm", "renamed-interp"]
        };
        let o = pyrometer(&[
            "record",
            target[0],
            target[1],
            "-d",
            "3s",
            "-F",
            "199",
            "-f",
            "folded",
            "-o",
            out.to_str().unwrap(),
        ]);
        let _ = child.kill();
        let _ = child.wait();
        assert_ok(&o);
        check_renamed(&std::fs::read_to_string(&out).unwrap(), target[0]);
    }
}

/// Python frames in ≥ 90 % of the samples of py631.py, six() ahead of three() ahead of one().
fn check_renamed(folded: &str, chosen_by: &str) {
    let total: u64 = folded
        .lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    let counts = folded_counts(folded, &["six", "three", "one"]);
    let (six, three, one) = (counts[0], counts[1], counts[2]);
    assert!(
        (six + three + one) * 10 >= total * 9,
        "chosen by {chosen_by}: {} of {total} samples in six/three/one:\n{folded}",
        six + three + one
    );
    assert!(
        six > three && three > one,
        "chosen by {chosen_by}: six {six}, three {three}, one {one}"
    );
}
