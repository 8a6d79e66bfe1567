//! Ray labels from process titles, against a worker stand-in that retitles itself between two
//! "tasks" as a reused Ray worker does (tests/fixtures/raytitle.c): each task's samples carry
//! its labels, read while the title held, not the process's first title.

use std::collections::HashMap;
use std::process::Command;

use pyrometer_e2e::ray_cluster::{self, Cluster};
use pyrometer_e2e::*;

/// Each sample's labels, function names and sample count.
fn samples(p: &pyrometer_proto::Profile) -> Vec<(HashMap<String, String>, Vec<String>, i64)> {
    pprof_samples(p)
        .into_iter()
        .map(|s| (s.labels, s.functions, s.values[0]))
        .collect()
}

#[test]
fn ray_task_labels_follow_the_title_at_sample_time() {
    if !privileged() {
        return;
    }
    let dir = scratch("ray-title");
    let out = dir.join("ray.pb.gz");
    let padding = "x".repeat(64);
    let result = Command::new(pyrometer_bin())
        .args(["record", "-F", "499", "-o", out.to_str().unwrap(), "--"])
        .arg(fixture("raytitle"))
        .args(["4", &padding])
        .env("RAY_JOB_ID", "03000000")
        .output()
        .unwrap();
    assert_ok(&result);
    let p = read_pprof(&out);
    let (mut by_task, mut right, mut total) = (HashMap::<String, i64>::new(), 0i64, 0i64);
    for (labels, names, n) in samples(&p) {
        let in_a = names.iter().any(|f| f == "work_a");
        let in_b = names.iter().any(|f| f == "work_b");
        if !in_a && !in_b {
            continue;
        }
        total += n;
        let task = labels.get("ray_task").cloned().unwrap_or_default();
        assert_eq!(labels.get("ray_job").map(String::as_str), Some("03000000"));
        match task.as_str() {
            "task_a" => {
                assert_eq!(labels.get("ray_actor"), None, "{labels:?}");
                right += if in_a { n } else { 0 };
            }
            "Trainer.step" => {
                assert_eq!(labels.get("ray_actor").map(String::as_str), Some("Trainer"));
                right += if in_b { n } else { 0 };
            }
            other => panic!("unexpected ray_task '{other}': {labels:?}"),
        }
        *by_task.entry(task).or_default() += n;
    }
    assert!(total >= 500, "too few samples: {total}");
    // A task switch is seen within ~20 ms; samples in flight across it may carry the old one.
    let matched = right as f64 / total as f64;
    assert!(
        matched >= 0.9,
        "{:.1} % of samples under their own task: {by_task:?}",
        matched * 100.0
    );
    let a = by_task.get("task_a").copied().unwrap_or(0) as f64 / total as f64;
    assert!(
        (a - 0.75).abs() <= 0.1,
        "task_a holds {:.1} %: {by_task:?}",
        a * 100.0
    );
}

/// Ray labels on an interpreter Ray does not run on here (Debian forky's 3.14 in its chroot):
/// a worker stand-in (fixtures/ray_title.py) titled `ray::Trainer.step`, with its job in its
/// environment; its samples carry the task, actor and job, under its Python function.
#[test]
fn ray_labels_on_forky_3_14() {
    if !privileged() {
        return;
    }
    let python = pyrometer_e2e::python::forky(14);
    if !python.present() {
        return;
    }
    let dir = scratch("ray-forky");
    let out = dir.join("ray.pb.gz");
    let script = pyrometer_e2e::python::source("ray_title.py");
    let result = Command::new(pyrometer_bin())
        .args(["record", "-F", "499", "-o", out.to_str().unwrap(), "--"])
        .arg(&python.path)
        .arg(&script)
        // Long enough that the chrooted interpreter's layout, found through its own root
        // (seconds on a loaded runner), is read well before the end.
        .arg("8")
        .env("RAY_JOB_ID", "05000000")
        .output()
        .unwrap();
    assert_ok(&result);
    let (mut labelled, mut total) = (0, 0);
    for (labels, names, n) in samples(&read_pprof(&out)) {
        if !names.iter().any(|f| f == "step") {
            continue;
        }
        total += n;
        if labels.get("ray_task").map(String::as_str) == Some("Trainer.step")
            && labels.get("ray_actor").map(String::as_str) == Some("Trainer")
            && labels.get("ray_job").map(String::as_str) == Some("05000000")
        {
            labelled += n;
        }
    }
    assert!(total >= 300, "only {total} samples in step()");
    assert!(
        labelled * 100 >= total * 95,
        "{labelled} of {total} samples in step() carry the worker's Ray labels"
    );
}

/// A real local Ray cluster (ray from the Python registry): two remote task types and an
/// actor method doing 3:2:1 units of pure-Python work on reused workers
/// (fixtures/ray_workload.py). The profile's ray_task/ray_actor/ray_job labels must split
/// the CPU as the workload itself measured it, each under its own Python function.
#[test]
fn real_ray_cluster_tasks_and_actor() {
    if !privileged() {
        return;
    }
    let Some(venv) = ray_cluster::venv() else {
        return;
    };
    let dir = scratch("ray-real");
    let out = dir.join("ray.pb.gz");
    let cluster = Cluster::start(&venv);
    let exposed = cluster.non_loopback_listeners();
    assert!(
        exposed.is_empty(),
        "Ray listens beyond loopback: {exposed:?}"
    );
    // Every Ray worker, those running and those Ray starts later (comm `ray::IDLE`, ...).
    let mut record = Command::new(pyrometer_bin())
        .args([
            "record",
            "--comm",
            "ray::.*",
            "-F",
            "99",
            "-o",
            out.to_str().unwrap(),
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("pyrometer record");
    let stderr_lines = {
        use std::io::BufRead;
        let err = record.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        rx
    };
    let mut log = Vec::new();
    loop {
        let line = stderr_lines
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("pyrometer says it is sampling");
        log.push(line.clone());
        if line.contains("sampling") {
            break;
        }
    }
    let mut driver = Command::new(venv.join("bin/python"));
    driver
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/ray_workload.py"))
        .args(["--rounds", "12"]);
    cluster.driver(&mut driver);
    let workload = driver.output().expect("the Ray driver");
    let exposed = cluster.non_loopback_listeners();
    // SAFETY: plain kill(2) of our child: SIGINT ends the recording and writes the profile.
    unsafe { libc::kill(record.id() as i32, libc::SIGINT) };
    let status = record.wait().unwrap();
    log.extend(stderr_lines.try_iter());
    let text = String::from_utf8_lossy(&workload.stdout).into_owned();
    assert!(
        workload.status.success(),
        "driver failed:\n{text}\n{}",
        String::from_utf8_lossy(&workload.stderr)
    );
    drop(cluster);
    assert!(status.success(), "record: {}", log.join("\n"));
    assert!(
        exposed.is_empty(),
        "Ray listens beyond loopback: {exposed:?}"
    );

    // The workload's own account: job, pids per task type, the CPU split it measured.
    let field = |line: &str, key: &str| -> String {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {line}"))
            .to_string()
    };
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no '{prefix}' line:\n{text}"))
    };
    let job = field(line("ready "), "job_id");
    let split = line("split ");
    let want: HashMap<&str, f64> = [
        ("alpha", field(split, "alpha").parse().unwrap()),
        ("beta", field(split, "beta").parse().unwrap()),
        ("Counter.work", field(split, "actor").parse().unwrap()),
    ]
    .into();
    let pids = |task: &str| -> std::collections::HashSet<String> {
        field(line(&format!("{task} ")), "pids")
            .split(',')
            .map(str::to_string)
            .collect()
    };
    // Reused workers: a task worker ran both task types (waves alternate their order).
    assert!(
        pids("alpha").intersection(&pids("beta")).next().is_some(),
        "no worker ran both tasks:\n{text}"
    );

    let p = read_pprof(&out);
    let mut by_task: HashMap<String, i64> = HashMap::new();
    let (mut right, mut total) = (0i64, 0i64);
    for (labels, names, n) in samples(&p) {
        let Some(task) = labels.get("ray_task") else {
            continue;
        };
        let function = match task.as_str() {
            "alpha" => "alpha_work",
            "beta" => "beta_work",
            "Counter.work" => "actor_work",
            _ => continue,
        };
        // Only the task's own work: the worker's other threads and its Ray plumbing around
        // the call carry the label too.
        let in_work = names.iter().any(|f| f.ends_with("_work"));
        if !in_work {
            continue;
        }
        assert_eq!(labels.get("ray_job"), Some(&job), "{labels:?}");
        if task == "Counter.work" {
            assert_eq!(
                labels.get("ray_actor").map(String::as_str),
                Some("Counter"),
                "{labels:?}"
            );
        } else {
            assert_eq!(labels.get("ray_actor"), None, "{labels:?}");
        }
        total += n;
        if names.iter().any(|f| f == function) {
            right += n;
        }
        *by_task.entry(task.clone()).or_default() += n;
    }
    assert!(
        total >= 300,
        "too few samples in the tasks' work: {total}; {by_task:?}"
    );
    assert!(
        right as f64 >= 0.9 * total as f64,
        "only {right} of {total} samples under their task's own function: {by_task:?}"
    );
    for (task, want) in &want {
        let got = by_task.get(*task).copied().unwrap_or(0) as f64 / total as f64;
        assert!(
            (got - want).abs() <= 0.1,
            "{task}: {:.1} % of the work's samples, the workload measured {:.1} %: {by_task:?}\n{text}",
            got * 100.0,
            want * 100.0
        );
    }
    println!("ray: {by_task:?} against {want:?}");
}
