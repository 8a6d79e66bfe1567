//! `pyrometer top` in a real terminal: tmux (a private server per test) runs a shell in which
//! `top` watches `cpu631`, whose leaves do 6:3:1 units of work. The screen is read back with
//! `capture-pane`, keys are typed with `send-keys`, and after `q` or Ctrl-C the terminal must
//! be as it was: the alternate screen left, the cursor shown, the tty settings (`stty -g`)
//! unchanged. Sampling needs root; without it the tmux tests print `skipping: <reason>`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::*;

/// A tmux server of its own (its socket in the test's scratch directory), killed on drop.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    /// A 150×45 session running a plain shell.
    fn start(dir: &Path) -> Option<Tmux> {
        let tmux = Tmux {
            socket: dir.join("tmux.sock"),
        };
        let ok = Command::new("tmux")
            .arg("-S")
            .arg(&tmux.socket)
            .args([
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-x",
                "150",
                "-y",
                "45",
            ])
            .args(["bash", "--norc", "--noprofile"])
            .env("TERM", "xterm-256color")
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            skip(
                "tool:tmux",
                "tmux is not installed or cannot start (cargo xtask test installs it)",
            );
            return None;
        }
        Some(tmux)
    }

    fn cmd(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run tmux");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn type_line(&self, line: &str) {
        self.cmd(&["send-keys", "-l", line]);
        self.cmd(&["send-keys", "Enter"]);
    }

    fn screen(&self) -> String {
        self.cmd(&["capture-pane", "-p"])
    }

    /// tmux's view of the pane: (alternate screen on, cursor visible).
    fn modes(&self) -> (bool, bool) {
        let f = self.cmd(&["display-message", "-p", "#{alternate_on} #{cursor_flag}"]);
        let mut it = f.split_whitespace().map(|v| v == "1");
        (it.next().unwrap_or(false), it.next().unwrap_or(false))
    }

    /// Polls the screen until `done` accepts it, for at most `limit`.
    fn wait_for(&self, limit: Duration, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let s = self.screen();
            if done(&s) || start.elapsed() > limit {
                return s;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .status();
    }
}

/// The workload, killed on drop.
struct Workload(Child);

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The window's sample count from the header (`..., last 30s: 812 samples, ...`).
fn header_samples(screen: &str) -> u64 {
    let header = screen.lines().next().unwrap_or_default();
    header
        .split(" samples,")
        .next()
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The OWN and TOTAL counts of the row whose function column is `function`.
fn row(screen: &str, function: &str) -> Option<(u64, u64)> {
    screen.lines().find_map(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        (cols.len() >= 5 && l.trim_end().ends_with(&format!("  {function}")))
            .then(|| Some((cols[2].parse().ok()?, cols[3].parse().ok()?)))
            .flatten()
    })
}

/// Runs `top` on cpu631 in tmux, checks the shares shown and the keys, then ends it with
/// `quit_keys` and checks the terminal was restored.
fn watch_cpu631_and_quit(test: &str, quit_keys: &str) {
    if !privileged() {
        return;
    }
    let dir = scratch(test);
    let Some(tmux) = Tmux::start(&dir) else {
        return;
    };
    let workload = Workload(
        Command::new(fixture("cpu631"))
            .arg("120")
            .stderr(Stdio::null())
            .spawn()
            .expect("start cpu631"),
    );
    let before = dir.join("stty.before");
    let after = dir.join("stty.after");
    tmux.type_line(&format!(
        "stty -g > {}; {} top --pid {} -F 499 --window 30s; stty -g > {}; echo TOP\"\"-EXITED-$?",
        before.display(),
        pyrometer_bin().display(),
        workload.0.id(),
        after.display()
    ));
    // At 499 Hz a busy thread gives ~500 samples a second; on a loaded two-core runner fewer.
    // 400 samples put the 60 % share's standard error at 2.4 pp: ±10 pp is a 4-sigma band.
    let screen = tmux.wait_for(Duration::from_secs(60), |s| header_samples(s) >= 400);
    assert!(header_samples(&screen) >= 400, "too few samples:\n{screen}");
    let (alternate, cursor) = tmux.modes();
    assert!(
        alternate && !cursor,
        "top runs on the alternate screen without a cursor"
    );

    let own = |f: &str| {
        row(&screen, f)
            .unwrap_or_else(|| panic!("no {f} row:\n{screen}"))
            .0
    };
    let leaves = (own("leaf_a") + own("leaf_b") + own("leaf_c")) as f64;
    for (leaf, want) in [("leaf_a", 0.6), ("leaf_b", 0.3), ("leaf_c", 0.1)] {
        let got = own(leaf) as f64 / leaves;
        assert!(
            (got - want).abs() <= 0.10,
            "{leaf}: {:.1} % of the leaves' samples, expected {:.0} % ± 10 pp:\n{screen}",
            got * 100.0,
            want * 100.0
        );
    }
    // `work` runs no code of its own but is on every leaf's stack.
    let (work_own, work_total) = row(&screen, "work").expect("a work row");
    assert!(
        work_own * 20 < work_total,
        "work: own {work_own}, total {work_total}"
    );
    assert!(
        work_total as f64 >= leaves * 0.95,
        "work's total covers its leaves:\n{screen}"
    );

    // 2 sorts by total: a function on every stack (main, work, _start) comes first.
    tmux.cmd(&["send-keys", "2"]);
    let screen = tmux.wait_for(Duration::from_secs(5), |s| s.contains("sort: total"));
    let first = screen
        .lines()
        .skip_while(|l| !l.contains("FUNCTION"))
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let first_total: f64 = first
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        first_total >= 95.0,
        "sorted by total, first row {first:?}:\n{screen}"
    );
    // t splits the rows by thread.
    tmux.cmd(&["send-keys", "t"]);
    let screen = tmux.wait_for(Duration::from_secs(5), |s| s.contains("THREAD"));
    assert!(
        screen
            .lines()
            .any(|l| l.contains("cpu631") && l.ends_with("leaf_a")),
        "by thread:\n{screen}"
    );

    tmux.cmd(&["send-keys", quit_keys]);
    let screen = tmux.wait_for(Duration::from_secs(15), |s| s.contains("TOP-EXITED-"));
    assert!(
        screen.contains("TOP-EXITED-0"),
        "top ends with status 0:\n{screen}"
    );
    let (alternate, cursor) = tmux.modes();
    assert!(!alternate, "the alternate screen was left:\n{screen}");
    assert!(cursor, "the cursor is visible again");
    let before = std::fs::read_to_string(&before).expect("stty before");
    let after = std::fs::read_to_string(&after).expect("stty after");
    assert_eq!(before, after, "the tty settings are as they were");
    drop(workload);
}

#[test]
fn top_shows_the_split_and_restores_the_terminal_on_q() {
    watch_cpu631_and_quit("top-q", "q");
}

#[test]
fn top_restores_the_terminal_on_ctrl_c() {
    watch_cpu631_and_quit("top-ctrl-c", "C-c");
}

/// A 6:3:1 Python fixture running (100,000 rounds: longer than any test) and its path,
/// returned once the interpreter has started and compiled the script: samples of the start-up
/// (imports, the parser), whose stacks have no Python frame yet and so keep their native and
/// kernel frames in every view, stay out of the window.
fn python_workload(
    python: &pyrometer_e2e::python::Interpreter,
    fixture: &str,
) -> (Workload, PathBuf) {
    let script = pyrometer_e2e::python::source(fixture);
    // compile() keeps the script's file name and line numbers, so its frames read as they
    // would under `python SCRIPT`.
    let launcher = "import sys\n\
        path = sys.argv[1]\n\
        code = compile(open(path).read(), path, 'exec')\n\
        sys.argv = sys.argv[1:]\n\
        print('ready', flush=True)\n\
        exec(code, {'__name__': '__main__', '__file__': path})\n";
    let mut child = Command::new(&python.path)
        .args(["-c", launcher])
        .arg(&script)
        .arg("100000")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {fixture}: {e}"));
    let stdout = child.stdout.take().expect("piped stdout");
    let workload = Workload(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("read {fixture}'s first line: {e}"));
    assert_eq!(line.trim(), "ready", "{fixture} did not start");
    (workload, script)
}

/// Python functions, in the `python` view: py631.py's six(), three() and one() do 6:3:1 units
/// of work in unit(), so their total shares split 6:3:1 and unit() has the own time; the
/// view keeps no kernel or interpreter frames.
#[test]
fn top_shows_python_functions() {
    top_python(&pyrometer_e2e::python::Interpreter::pyenv(11));
}

/// The same on the free-threaded 3.13t and 3.14t.
#[test]
fn top_shows_python_functions_3_13t() {
    top_python(&pyrometer_e2e::python::free_threaded(13));
}

#[test]
fn top_shows_python_functions_3_14t() {
    top_python(&pyrometer_e2e::python::free_threaded(14));
}

fn top_python(python: &pyrometer_e2e::python::Interpreter) {
    if !privileged() || !python.present() {
        return;
    }
    let dir = scratch(&format!("top-python-{}", python.label));
    let Some(tmux) = Tmux::start(&dir) else {
        return;
    };
    let (workload, script) = python_workload(python, "py631.py");
    tmux.type_line(&format!(
        "{} top --pid {} -F 499 --window 30s --frames python",
        pyrometer_bin().display(),
        workload.0.id(),
    ));
    let screen = tmux.wait_for(Duration::from_secs(60), |s| header_samples(s) >= 400);
    let samples = header_samples(&screen);
    assert!(samples >= 400, "too few samples:\n{screen}");
    let file = script.display();
    let total = |f: &str| {
        row(&screen, &format!("{f} ({file})"))
            .unwrap_or_else(|| panic!("no {f} row:\n{screen}"))
            .1
    };
    let calls = (total("six") + total("three") + total("one")) as f64;
    for (f, want) in [("six", 0.6), ("three", 0.3), ("one", 0.1)] {
        let got = total(f) as f64 / calls;
        assert!(
            (got - want).abs() <= 0.10,
            "{f}: {:.1} % of the calls' samples, expected {:.0} % ± 10 pp:\n{screen}",
            got * 100.0,
            want * 100.0
        );
    }
    let (unit_own, _) = row(&screen, &format!("unit ({file})")).expect("a unit row");
    assert!(
        unit_own as f64 >= 0.8 * samples as f64,
        "unit() runs the loop: own {unit_own} of {samples}:\n{screen}"
    );
    assert!(
        !screen.contains("[k]") && !screen.contains("_PyEval_EvalFrameDefault"),
        "the python view keeps Python frames only:\n{screen}"
    );
    tmux.cmd(&["send-keys", "q"]);
    drop(workload);
}

/// `top --async`: asyncio task frames are rows of their own (`[task] NAME`), whose totals
/// split as the work their tasks do (fixtures/py_async631.py: 6:3:1 under six-task,
/// three_worker and one-task), and the root task `main` is on every stack that runs a task.
#[test]
fn top_shows_asyncio_tasks() {
    let python = pyrometer_e2e::python::Interpreter::pyenv(12);
    if !privileged() || !python.present() {
        return;
    }
    let dir = scratch("top-async");
    let Some(tmux) = Tmux::start(&dir) else {
        return;
    };
    let (workload, _) = python_workload(&python, "py_async631.py");
    // A TaskGroup's place in a running process is found with a back-off after top starts
    // (20 ms doubling, so seconds on a loaded machine); until then its tasks lack the root
    // task above them. A 3 s window, sorted by total (task frames run no code of their own),
    // is read until the root is over the tasks, for at most a minute.
    tmux.type_line(&format!(
        "{} top --pid {} -F 499 --window 3s --frames python --async",
        pyrometer_bin().display(),
        workload.0.id(),
    ));
    tmux.wait_for(Duration::from_secs(60), |s| header_samples(s) >= 400);
    tmux.cmd(&["send-keys", "2"]);
    let total = |screen: &str, task: &str| row(screen, &format!("[task] {task}")).map(|r| r.1);
    let tasks = |screen: &str| -> Option<u64> {
        Some(
            total(screen, "six-task")?
                + total(screen, "three_worker")?
                + total(screen, "one-task")?,
        )
    };
    let rooted = |s: &str| {
        s.contains("sort: total")
            && header_samples(s) >= 400
            && tasks(s)
                .zip(total(s, "main"))
                .is_some_and(|(t, m)| m as f64 >= 0.95 * t as f64)
    };
    let screen = tmux.wait_for(Duration::from_secs(60), rooted);
    assert!(
        rooted(&screen),
        "[task] main is not over the tasks' stacks (or too few samples):\n{screen}"
    );
    let of = |task: &str| total(&screen, task).expect("a task row");
    let all = tasks(&screen).expect("task rows") as f64;
    for (task, want) in [("six-task", 0.6), ("three_worker", 0.3), ("one-task", 0.1)] {
        let got = of(task) as f64 / all;
        assert!(
            (got - want).abs() <= 0.10,
            "{task}: {:.1} % of the tasks' samples, expected {:.0} % ± 10 pp:\n{screen}",
            got * 100.0,
            want * 100.0
        );
    }
    tmux.cmd(&["send-keys", "q"]);
    drop(workload);
}

/// Without a terminal on stdout there is nothing to draw on: a one-line error and exit 2,
/// before anything is loaded (so this needs no privileges).
#[test]
fn top_refuses_when_stdout_is_not_a_terminal() {
    let out = Command::new(pyrometer_bin())
        .args(["top", "--pid", &std::process::id().to_string()])
        .stdin(Stdio::null())
        .output()
        .expect("run pyrometer");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("stdout is not a terminal") && err.contains("pyrometer record"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(out.stdout.is_empty());
}
