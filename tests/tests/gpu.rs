//! GPU telemetry end to end, on machines without a GPU: pyrometer loads the NVML test double
//! (`fixtures/nvml_testdouble.c`) through its normal NVML path, and the scripted values
//! (two devices, device 0 idle half of every second, device 1 without power readings) must
//! come out in the summary, the CSV, the profile labels, the Chrome trace and the agent's
//! `/metrics`.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use pyrometer_e2e::cluster::{Agent, Collector, free_port, http_get, promtool_check, workload};
use pyrometer_e2e::*;
use serde_json::Value;

const UUID0: &str = "GPU-7e57d0b1-0000-4000-8000-000000000000";
const UUID1: &str = "GPU-7e57d0b1-0000-4000-8000-000000000001";
const GIB: i64 = 1 << 30;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `pyrometer ARGS` with the test double's script in the environment.
fn pyrometer_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(pyrometer_bin())
        .args(args)
        .envs(env.iter().copied())
        .env_remove("PYROMETER_NVML_LIB")
        .output()
        .expect("run pyrometer")
}

/// The summary block of GPU `index`: from its header line to the next device's.
fn device_block(summary: &str, index: u32) -> String {
    let head = format!("GPU {index} GPU-");
    let mut lines = summary.lines().skip_while(|l| !l.starts_with(&head));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no GPU {index} in the summary:\n{summary}"));
    let rest: Vec<&str> = lines.take_while(|l| l.starts_with("  ")).collect();
    format!("{first}\n{}", rest.join("\n"))
}

/// The number after `key` in `text` (e.g. "NOT_SUPPORTED ×" → 15).
fn number_after(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no '{key}' in:\n{text}"));
    let tail = &text[at + key.len()..];
    let end = tail
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(tail.len());
    tail[..end]
        .parse()
        .unwrap_or_else(|_| panic!("no number after '{key}' in:\n{text}"))
}

/// CSV rows as maps from column name to cell.
fn read_csv(path: &Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path:?}: {e}"));
    let mut lines = text.lines();
    let head: Vec<String> = lines
        .next()
        .expect("a header row")
        .split(',')
        .map(str::to_string)
        .collect();
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), head.len(), "ragged row {l}");
            head.iter()
                .cloned()
                .zip(cells.into_iter().map(str::to_string))
                .collect()
        })
        .collect()
}

#[test]
fn gpu_command_summarizes_and_writes_the_series() {
    let dir = scratch("gpu-poll");
    let csv = dir.join("series.csv");
    let lib = nvml_testdouble();
    let out = pyrometer_env(
        &[
            "gpu",
            "--duration",
            "3s",
            "--gpu-interval",
            "200ms",
            "--nvml-lib",
            s(&lib),
            "-o",
            s(&csv),
        ],
        &[("NVML_TESTDOUBLE_PIDS", "4242,4343")],
    );
    assert_ok(&out);
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stderr(&out).contains(&format!("wrote {}", csv.display())));

    let g0 = device_block(&summary, 0);
    assert!(
        g0.contains(UUID0) && g0.contains("NVML Test Double 0"),
        "{g0}"
    );
    assert!(g0.contains("max 80 %"), "{g0}");
    assert!(
        g0.contains("memory used: max 4.00 GiB of 16.00 GiB"),
        "{g0}"
    );
    assert!(g0.contains("power: mean 150.0 W, limit 300.0 W"), "{g0}");
    assert!(g0.contains("temperature: max 65 °C"), "{g0}");
    assert!(
        g0.contains("pid 4242: max 1.00 GiB GPU memory, SM max 40 %"),
        "{g0}"
    );
    assert!(!g0.contains("errors"), "{g0}");
    // Half idle, half at 80 %: the mean is near 40 %.
    let mean0 = number_after(&g0, "utilization: mean ");
    assert!((15.0..=65.0).contains(&mean0), "{g0}");

    let g1 = device_block(&summary, 1);
    assert!(g1.contains(UUID1), "{g1}");
    assert!(g1.contains("max 75 %"), "{g1}");
    assert!(g1.contains("memory used: max 2.00 GiB of 8.00 GiB"), "{g1}");
    assert!(g1.contains("power: mean n/a, limit n/a"), "{g1}");
    assert!(
        g1.contains("pid 4343: max 0.50 GiB GPU memory, SM max 10 %"),
        "{g1}"
    );
    let polls1 = number_after(&g1, "): ");
    assert!(polls1 >= 8.0, "3 s at 200 ms: {g1}");
    assert_eq!(number_after(&g1, "power: NOT_SUPPORTED ×"), polls1, "{g1}");
    assert_eq!(number_after(&g1, "power_limit: NOT_SUPPORTED ×"), polls1);

    let rows = read_csv(&csv);
    let of = |i: &str| -> Vec<&HashMap<String, String>> {
        rows.iter().filter(|r| r["index"] == i).collect()
    };
    let (r0, r1) = (of("0"), of("1"));
    assert_eq!(r0.len() as f64, number_after(&g0, "): "));
    assert_eq!(r1.len() as f64, polls1);
    assert!(r0.iter().all(|r| r["uuid"] == UUID0));
    assert!(r1.iter().all(|r| r["uuid"] == UUID1));
    let utils: std::collections::BTreeSet<&str> =
        r0.iter().map(|r| r["utilization_pct"].as_str()).collect();
    assert_eq!(
        utils,
        ["0", "80"].into(),
        "device 0 alternates between idle and busy"
    );
    assert!(r0.iter().all(|r| r["power_w"] == "150.000"));
    assert!(r0.iter().all(|r| r["memory_total_bytes"] == "17179869184"));
    assert!(r0.iter().all(|r| r["processes"] == "4242:1073741824"));
    assert!(
        r1.iter()
            .all(|r| r["power_w"].is_empty() && r["power_limit_w"].is_empty()),
        "an unsupported field is an empty cell"
    );
    assert!(r1.iter().all(|r| r["sm_clock_mhz"] == "1005"));
    let elapsed: Vec<f64> = r0.iter().map(|r| r["elapsed_s"].parse().unwrap()).collect();
    assert!(elapsed.windows(2).all(|w| w[1] > w[0]), "{elapsed:?}");
}

#[test]
fn a_lost_gpu_is_reported_and_the_others_keep_polling() {
    let dir = scratch("gpu-lost");
    let csv = dir.join("series.csv");
    let out = pyrometer_env(
        &[
            "gpu",
            "--duration",
            "2500ms",
            "--gpu-interval",
            "100ms",
            "--nvml-lib",
            s(&nvml_testdouble()),
            "-o",
            s(&csv),
        ],
        &[("NVML_TESTDOUBLE_LOST_AFTER_MS", "1000")],
    );
    assert_ok(&out);
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    let g1 = device_block(&summary, 1);
    let lost_after = number_after(&g1, "LOST after ");
    assert!((0.8..=1.6).contains(&lost_after), "{g1}");
    assert!(g1.contains("device: GPU_IS_LOST ×1"), "counted once: {g1}");
    // No compute process here: per-process utilization answers NOT_FOUND on every poll, as
    // the real driver does, which is no data rather than a failed call.
    let g0 = device_block(&summary, 0);
    assert!(!g0.contains("errors"), "{g0}");
    let rows = read_csv(&csv);
    let last = |i: &str| {
        rows.iter()
            .filter(|r| r["index"] == i)
            .map(|r| r["elapsed_s"].parse::<f64>().unwrap())
            .fold(0.0, f64::max)
    };
    assert!(last("1") < 1.6, "device 1 is not polled once lost");
    assert!(last("0") > 2.0, "device 0 is polled to the end");
}

#[test]
fn without_nvml_gpu_says_so_and_fails_and_bad_input_is_one_line() {
    let dir = scratch("gpu-none");
    let csv = dir.join("x.csv");
    let missing = dir.join("libnvidia-ml.so.1");
    let out = pyrometer_env(
        &[
            "gpu",
            "--duration",
            "1s",
            "--nvml-lib",
            s(&missing),
            "-o",
            s(&csv),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    let line = format!("pyrometer: GPU source off: {} not found", missing.display());
    assert!(err.lines().any(|l| l == line), "{err}");
    assert!(err.contains("--nvml-lib"), "says what to do: {err}");
    assert!(!csv.exists(), "nothing is left behind");

    // The default library, on a machine without the driver.
    let out = pyrometer_env(&["gpu", "--duration", "1s", "-o", s(&csv)], &[]);
    if out.status.success() {
        skip(
            "no-nvml",
            "the default-library check: this machine has NVML",
        );
    } else {
        let err = stderr(&out);
        assert!(
            err.lines()
                .any(|l| l == "pyrometer: GPU source off: libnvidia-ml.so.1 not found"),
            "{err}"
        );
    }

    for (args, wanted) in [
        (
            vec!["gpu", "--gpu-interval", "5ms"],
            "too short: use 20ms or more",
        ),
        (vec!["gpu", "--gpu-interval", "fast"], "invalid duration"),
        (
            vec!["gpu", "-o", "/nonexistent-dir/x.csv"],
            "cannot write /nonexistent-dir/x.csv",
        ),
        (
            vec!["record", "--gpu-interval", "1s", "--", "true"],
            "go with --gpu",
        ),
    ] {
        let out = pyrometer_env(&args, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(wanted), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn record_without_nvml_still_records() {
    if !privileged() {
        return;
    }
    let dir = scratch("gpu-record-none");
    let svg = dir.join("out.svg");
    let missing = dir.join("no-libnvidia-ml.so.1");
    let out = pyrometer_env(
        &[
            "record",
            "--gpu",
            "--nvml-lib",
            s(&missing),
            "-o",
            s(&svg),
            "--",
            s(&fixture("cpu631")),
            "1",
        ],
        &[],
    );
    assert_ok(&out);
    let err = stderr(&out);
    let line = format!("pyrometer: GPU source off: {} not found", missing.display());
    assert_eq!(err.lines().filter(|l| *l == line).count(), 1, "{err}");
    assert!(std::fs::metadata(&svg).unwrap().len() > 0);
    assert!(!err.contains("GPUs, polled"), "{err}");
}

fn label<'a>(p: &'a pyrometer_proto::Profile, l: &pyrometer_proto::Label) -> (&'a str, String) {
    let st = |i: i64| p.string_table[i as usize].as_str();
    let value = if l.str != 0 {
        st(l.str).to_string()
    } else {
        format!("{}{}", l.num, st(l.num_unit))
    };
    (st(l.key), value)
}

#[test]
fn record_gpu_labels_gpu_processes_and_summarizes_idle_time() {
    if !privileged() {
        return;
    }
    let dir = scratch("gpu-record");
    let pprof = dir.join("out.pb.gz");
    let stats = dir.join("stats.json");
    let me = std::process::id().to_string();
    // Device 0 runs the recorded command; device 1 this test process, which is not profiled.
    let pids = format!("child,{me}");
    let env = [("NVML_TESTDOUBLE_PIDS", pids.as_str())];
    let lib = nvml_testdouble();
    let out = pyrometer_env(
        &[
            "record",
            "--gpu",
            "--gpu-interval",
            "200ms",
            "--nvml-lib",
            s(&lib),
            "-o",
            s(&pprof),
            "--stats",
            s(&stats),
            "--",
            s(&fixture("cpu631")),
            "4",
        ],
        &env,
    );
    assert_ok(&out);
    let err = stderr(&out);

    let p = read_pprof(&pprof);
    let pids: std::collections::BTreeSet<String> = p
        .sample
        .iter()
        .flat_map(|smp| smp.label.iter().map(|l| label(&p, l)))
        .filter(|(k, _)| *k == "pid")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(pids.len(), 1, "one process profiled: {pids:?}");
    let child = pids.into_iter().next().unwrap();
    for smp in &p.sample {
        let labels: HashMap<&str, String> = smp.label.iter().map(|l| label(&p, l)).collect();
        assert_eq!(
            labels.get("gpu").map(String::as_str),
            Some("0"),
            "{labels:?}"
        );
        assert_eq!(
            labels.get("gpu_memory"),
            Some(&format!("{GIB}bytes")),
            "{labels:?}"
        );
    }

    let g0 = device_block(&err, 0);
    let g1 = device_block(&err, 1);
    assert!(
        g0.contains(&format!("pid {child}: max 1.00 GiB GPU memory")),
        "{g0}"
    );
    assert!(!g1.contains(&format!("pid {me}:")), "not profiled: {g1}");
    // Device 0 is idle half of every second while cpu631 spins throughout.
    let idle0 = number_after(&g0, "idle while on-CPU: ");
    assert!((25.0..=75.0).contains(&idle0), "{g0}");
    let on_cpu = number_after(&g0, " % of ");
    // cpu631 spins for 4 s; a loaded machine may starve it for a while.
    assert!((2.0..=4.8).contains(&on_cpu), "{g0}");
    assert_eq!(number_after(&g1, "idle while on-CPU: "), 0.0, "{g1}");
    assert!(g1.contains("power: NOT_SUPPORTED ×"), "{g1}");
    // --stats has the same numbers as JSON.
    let stats: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    let gpus = stats["gpus"].as_array().expect("gpus in --stats");
    assert_eq!(gpus[0]["uuid"], UUID0);
    let share = gpus[0]["idle_while_on_cpu_share"].as_f64().unwrap();
    assert!((share * 100.0 - idle0).abs() < 0.06, "{share} vs {idle0}");
    assert_eq!(gpus[1]["idle_while_on_cpu_share"], 0.0);
    assert_eq!(gpus[1]["power_mean_w"], Value::Null);
    assert_eq!(gpus[0]["processes"][0]["max_memory_bytes"], GIB);

    // The same recording as a Chrome trace: counter tracks for both devices.
    let trace = dir.join("out.trace.json");
    let out = pyrometer_env(
        &[
            "record",
            "--gpu",
            "--gpu-interval",
            "200ms",
            "--nvml-lib",
            s(&lib),
            "-o",
            s(&trace),
            "--",
            s(&fixture("cpu631")),
            "2",
        ],
        &env,
    );
    assert_ok(&out);
    let doc: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let process_names: HashMap<i64, &str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_i64().unwrap(),
                e["args"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    let track_pid = |uuid: &str| {
        *process_names
            .iter()
            .find(|(_, n)| n.contains(uuid))
            .unwrap_or_else(|| panic!("no track process for {uuid}: {process_names:?}"))
            .0
    };
    let (t0, t1) = (track_pid(UUID0), track_pid(UUID1));
    let counters = |pid: i64, name: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["ph"] == "C" && e["pid"] == pid && e["name"] == name)
            .collect()
    };
    let util0: Vec<f64> = counters(t0, "GPU utilization")
        .iter()
        .map(|e| e["args"]["gpu_%"].as_f64().unwrap())
        .collect();
    assert!(util0.len() >= 6, "{util0:?}");
    assert!(util0.contains(&0.0) && util0.contains(&80.0), "{util0:?}");
    assert!(!counters(t1, "GPU utilization").is_empty());
    assert!(
        counters(t0, "GPU memory used")
            .iter()
            .all(|e| e["args"]["bytes"] == 4.0 * GIB as f64)
    );
    assert!(
        counters(t0, "GPU power")
            .iter()
            .all(|e| e["args"]["watts"] == 150.0)
    );
    assert!(
        counters(t1, "GPU power").is_empty(),
        "device 1 has no power"
    );
    // The counters share the samples' clock: they fall within the recording.
    let last_slice_end = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap())
        .fold(0.0, f64::max);
    for e in counters(t0, "GPU utilization") {
        let ts = e["ts"].as_f64().unwrap();
        assert!((0.0..=last_slice_end + 500_000.0).contains(&ts), "{e}");
    }
}

/// The value of the series `name{labels}` in Prometheus text.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn agent_serves_gpu_gauges_and_labels_pushed_profiles() {
    if !privileged() {
        return;
    }
    if Command::new("promtool").arg("--version").output().is_err() {
        skip(
            "tool:promtool",
            "promtool not installed (cargo xtask test installs Debian's prometheus)",
        );
        return;
    }
    let dir = scratch("gpu-agent");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let mut load = workload(&dir, "wl-gpu", 60);
    let pids = format!("{},{}", load.id(), std::process::id());
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let lib = nvml_testdouble();
    let mut agent = Agent::start_env(
        &dir,
        "node-gpu",
        &collector.url(),
        &[
            "--comm",
            "^wl-gpu$",
            "--metrics-listen",
            &listen,
            "--nvml-lib",
            s(&lib),
            "--gpu-interval",
            "200ms",
        ],
        &[("NVML_TESTDOUBLE_PIDS", &pids)],
    );
    let addr = listen.parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        std::thread::sleep(Duration::from_millis(500));
        let Some((200, text)) = http_get(addr, "/metrics") else {
            assert!(Instant::now() < deadline, "agent never served /metrics");
            continue;
        };
        let pushed = metric(&text, "pyrometer_agent_samples_pushed_total").unwrap_or(0.0);
        if pushed > 0.0 || Instant::now() >= deadline {
            break text;
        }
    };
    let stats = agent.stop();
    let _ = load.kill();
    let _ = load.wait();
    promtool_check("agent", &text);

    let d0 = format!("gpu_uuid=\"{UUID0}\",gpu_index=\"0\"");
    let d1 = format!("gpu_uuid=\"{UUID1}\",gpu_index=\"1\"");
    let get = |name: &str, labels: &str| {
        metric(&text, &format!("{name}{{{labels}}}"))
            .unwrap_or_else(|| panic!("no {name}{{{labels}}} in\n{text}"))
    };
    let u0 = get("pyrometer_gpu_utilization_ratio", &d0);
    assert!(u0 == 0.0 || u0 == 0.8, "{u0}");
    let u1 = get("pyrometer_gpu_utilization_ratio", &d1);
    assert!(u1 == 0.25 || u1 == 0.75, "{u1}");
    assert_eq!(
        get("pyrometer_gpu_memory_used_bytes", &d0),
        4.0 * GIB as f64
    );
    assert_eq!(
        get("pyrometer_gpu_memory_total_bytes", &d1),
        8.0 * GIB as f64
    );
    assert_eq!(get("pyrometer_gpu_sm_clock_hertz", &d0), 1.41e9);
    assert_eq!(get("pyrometer_gpu_memory_clock_hertz", &d1), 8.77e8);
    assert_eq!(get("pyrometer_gpu_power_watts", &d0), 150.0);
    assert_eq!(get("pyrometer_gpu_power_limit_watts", &d0), 300.0);
    assert_eq!(get("pyrometer_gpu_temperature_celsius", &d1), 50.0);
    assert_eq!(
        get("pyrometer_gpu_pcie_rx_bytes_per_second", &d0),
        2000.0 * 1024.0
    );
    assert_eq!(get("pyrometer_gpu_lost", &d1), 0.0);
    assert!(
        metric(&text, &format!("pyrometer_gpu_power_watts{{{d1}}}")).is_none(),
        "device 1 has no power reading"
    );
    assert!(
        get(
            "pyrometer_gpu_errors_total",
            &format!("{d1},field=\"power\",error=\"NOT_SUPPORTED\"")
        ) >= 1.0
    );
    let wl = format!("{d0},pid=\"{}\"", load.id());
    assert_eq!(
        get("pyrometer_gpu_process_memory_used_bytes", &wl),
        GIB as f64
    );
    assert_eq!(get("pyrometer_gpu_process_sm_utilization_ratio", &wl), 0.4);
    let idle = get(
        "pyrometer_gpu_throttle_reasons",
        &format!("{d0},reason=\"gpu_idle\""),
    );
    let capped = get(
        "pyrometer_gpu_throttle_reasons",
        &format!("{d0},reason=\"sw_power_cap\""),
    );
    assert_eq!(idle + capped, 1.0, "exactly one of the scripted reasons");

    // The pushed profiles carry the workload's GPU.
    assert!(stats["samples_pushed"].as_i64().unwrap() > 0, "{stats}");
    let values = collector.get_json("/api/v1/label/gpu/values");
    assert_eq!(values["values"], serde_json::json!(["0"]), "{values}");
    let memory = collector.get_json("/api/v1/label/gpu_memory/values");
    assert_eq!(
        memory["values"],
        serde_json::json!([GIB.to_string()]),
        "{memory}"
    );
}
