//! Ray labels from process titles, against a worker stand-in that retitles itself between two
//! "tasks" as a reused Ray worker does (tests/fixtures/raytitle.c): each task's samples carry
//! its labels, read while the title held, not the process's first title.

use std::collections::HashMap;
use std::process::Command;

use pyrometer_e2e::*;

/// Each sample's labels and function names.
fn samples(p: &pyrometer_proto::Profile) -> Vec<(HashMap<String, String>, Vec<String>, i64)> {
    let s = |i: i64| p.string_table[i as usize].clone();
    let functions: HashMap<u64, String> = p.function.iter().map(|f| (f.id, s(f.name))).collect();
    let locations: HashMap<u64, Vec<String>> = p
        .location
        .iter()
        .map(|l| {
            let names = l
                .line
                .iter()
                .filter_map(|line| functions.get(&line.function_id).cloned())
                .collect();
            (l.id, names)
        })
        .collect();
    p.sample
        .iter()
        .map(|smp| {
            let labels = smp
                .label
                .iter()
                .map(|l| {
                    (
                        s(l.key),
                        if l.str != 0 {
                            s(l.str)
                        } else {
                            l.num.to_string()
                        },
                    )
                })
                .collect();
            let names = smp
                .location_id
                .iter()
                .flat_map(|id| locations.get(id).cloned().unwrap_or_default())
                .collect();
            (labels, names, smp.value[0])
        })
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
