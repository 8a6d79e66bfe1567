//! GPU time by launching stack, end to end without a GPU: `record --gpu-kernels -- python …`
//! runs a training step's GPU work on the CUPTI stand-in (tests/fixtures/cupti_standin.c) with
//! libpyrometer_cupti.so injected the way CUDA injects it; the real kernel probes take the
//! launching stacks, the channel goes through the ring buffer, and the profile must say which
//! Python function launched how much device time, against the workload's own account.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

use pyrometer_e2e::gpu_kernels::{Standin, python, standin, succeed, truth};
use pyrometer_e2e::wait::{wait_for, wait_until};
use pyrometer_e2e::{
    PprofSample, nvml_testdouble, pprof_samples, privileged, pyrometer_bin, read_pprof, scratch,
};

/// How long the agent test waits for each thing it waits for (a busy machine is slow).
const AGENT_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

const PHASES: [&str; 6] = [
    "matmul_phase",
    "conv_phase",
    "elementwise_phase",
    "native_phase",
    "graph_phase",
    "copy_phase",
];

/// `record --gpu-kernels ARGS -o OUT -- python gpu_phases.py WORKLOAD` on the stand-in.
fn record(
    s: &Standin,
    out: &Path,
    args: &[&str],
    workload: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let cache = out.with_extension("cache");
    let mut cmd = Command::new(pyrometer_bin());
    cmd.arg("record")
        .arg("--gpu-kernels")
        .args(args)
        .arg("-o")
        .arg(out)
        .arg("--")
        .arg(python())
        .arg(pyrometer_e2e::python::source("gpu_phases.py"))
        .args(workload)
        .env("GPUWORK_LIB", pyrometer_e2e::fixture("libgpuwork.so"))
        .env("LD_LIBRARY_PATH", &s.cupti)
        // The library `pyrometer` carries, written to a cache directory of this test's.
        .env_remove("PYROMETER_CUPTI_INJECT")
        .env("PYROMETER_CACHE_DIR", &cache)
        // The workload starts launching a second after CUDA's start, and stays a second after
        // its last launch, as a training process does (it imports, builds a model, saves a
        // checkpoint): `record` registers a Python command at its exec, which on a loaded
        // machine can take longer than this workload takes to its first launch, and names
        // Python frames from the live process.
        .env("GPU_PHASES_WAIT", "1")
        .env("GPU_PHASES_LINGER", "1")
        .env_remove("CUDA_INJECTION64_PATH")
        .env_remove("NVTX_INJECTION64_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let result = succeed(cmd, "record");
    let carried: Vec<_> = std::fs::read_dir(&cache)
        .map(|d| {
            d.flatten()
                .map(|e| e.path().join("libpyrometer_cupti.so"))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        carried.iter().any(|p| p.is_file()),
        "record did not write the library it carries into {}",
        cache.display()
    );
    result
}

/// The workload's truth by phase function: (device ns, launches as the profile counts them:
/// kernels, copies and sets, a graph's kernels each).
fn truth_by_phase(t: &serde_json::Value) -> HashMap<&'static str, (f64, f64)> {
    let get = |k: &str, f: &str| t["truth"][k][f].as_f64().unwrap();
    HashMap::from([
        (
            "matmul_phase",
            (get("matmul", "ns"), get("matmul", "launches")),
        ),
        ("conv_phase", (get("conv", "ns"), get("conv", "launches"))),
        (
            "elementwise_phase",
            (get("add", "ns"), get("add", "launches")),
        ),
        (
            "native_phase",
            (get("native", "ns"), get("native", "launches")),
        ),
        (
            "graph_phase",
            (get("graph", "ns"), 3.0 * get("graph", "launches")),
        ),
        (
            "copy_phase",
            (
                get("memcpy", "ns") + get("memset", "ns"),
                get("memcpy", "launches") + get("memset", "launches"),
            ),
        ),
    ])
}

/// gpu_time and gpu_launches by the phase function a sample's stack reaches.
fn by_phase(
    samples: &[PprofSample],
    time: usize,
    launches: usize,
) -> HashMap<&'static str, (f64, f64)> {
    let mut m: HashMap<&'static str, (f64, f64)> = HashMap::new();
    for s in samples {
        if let Some(p) = PHASES.iter().find(|p| s.functions.iter().any(|f| f == *p)) {
            let e = m.entry(p).or_default();
            e.0 += s.values[time] as f64;
            e.1 += s.values[launches] as f64;
        }
    }
    m
}

fn type_index(p: &pyrometer_proto::Profile, name: &str) -> usize {
    p.sample_type
        .iter()
        .position(|t| p.string_table[t.r#type as usize] == name)
        .unwrap_or_else(|| panic!("no {name} type"))
}

#[test]
fn every_launch_is_attributed_to_the_python_function_that_made_it() {
    if !privileged() {
        return;
    }
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-kernels-exact");
    let out_path = dir.join("gpu.pb.gz");
    let stats = dir.join("stats.json");
    let nvml = nvml_testdouble();
    let out = record(
        &s,
        &out_path,
        &[
            "--gpu-sample-every",
            "1",
            "--nvml-lib",
            nvml.to_str().unwrap(),
            "--stats",
            stats.to_str().unwrap(),
        ],
        &["4"],
        &[],
    );
    let t = truth(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let p = read_pprof(&out_path);
    let (time, launches) = (type_index(&p, "gpu_time"), type_index(&p, "gpu_launches"));
    assert_eq!(
        p.string_table[p.default_sample_type as usize], "gpu_time",
        "gpu_time is the default type"
    );
    let samples = pprof_samples(&p);
    let gpu: Vec<&PprofSample> = samples.iter().filter(|s| s.values[time] > 0).collect();
    let total: i64 = gpu.iter().map(|s| s.values[time]).sum();
    let want = truth_by_phase(&t);
    let got = by_phase(&samples, time, launches);
    // Every launch sampled: exact, and every bit of device time under its phase.
    for (phase, (ns, n)) in &want {
        assert_eq!(
            got.get(phase).copied().unwrap_or_default(),
            (*ns, *n),
            "{phase}: {stderr}"
        );
    }
    let reached: f64 = got.values().map(|v| v.0).sum();
    assert_eq!(
        reached, total as f64,
        "all kernel time reaches a phase function"
    );

    for s in &gpu {
        let leaf = &s.functions[0];
        // No frame of the library or of CUPTI's stand-in between the launch and its work.
        assert!(
            !s.functions
                .iter()
                .any(|f| f.starts_with("pyrometer_gpu") || f.starts_with("standin_")),
            "{:?}",
            s.functions
        );
        // NVML's index of the device's UUID (the test double's second GPU), not CUDA's 0.
        assert_eq!(
            s.labels.get("gpu").map(String::as_str),
            Some("1"),
            "{:?}",
            s.labels
        );
        let in_phase = |p: &str| s.functions.iter().any(|f| f == p);
        let expect_leaf = if in_phase("matmul_phase") || in_phase("native_phase") {
            "void matmul<128>(float const*, float const*, float*)"
        } else if in_phase("conv_phase") {
            "conv_kernel(float const*, float*)"
        } else if in_phase("elementwise_phase") {
            "add_one(float*, int)"
        } else if in_phase("graph_phase") {
            assert!(leaf.starts_with("graph_"), "{leaf}");
            leaf
        } else {
            assert!(
                ["memcpy HtoD", "memcpy DtoH", "memset"].contains(&leaf.as_str()),
                "{leaf}"
            );
            leaf
        };
        assert_eq!(leaf, expect_leaf);
        // NVTX ranges open at the launch: conv's only.
        assert_eq!(
            s.labels.get("nvtx").map(String::as_str),
            in_phase("conv_phase").then_some("train/conv"),
            "{:?}",
            s.functions
        );
        let stream = s.labels.get("stream").map(String::as_str);
        let want_stream = if in_phase("copy_phase") {
            "4"
        } else if in_phase("graph_phase") {
            "3"
        } else if in_phase("conv_phase") {
            "1"
        } else if in_phase("elementwise_phase") {
            "2"
        } else {
            "0"
        };
        assert_eq!(stream, Some(want_stream), "{:?}", s.functions);
    }
    // The native launches have their C frame under the Python one.
    assert!(
        gpu.iter()
            .any(|s| s.functions.iter().any(|f| f == "gpuwork_native_loop"))
    );

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let k = &json["gpu_kernels"];
    assert_eq!(k["launches"], k["sampled"], "{k}");
    assert_eq!(k["stacks_missing"], 0, "{k}");
    assert_eq!(k["cupti_dropped"], 0, "{k}");
    let dev = &k["devices"][0];
    assert_eq!(dev["gpu"], "1");
    // Streams overlap on the virtual device: busy less than the sum.
    assert!(dev["busy_ns"].as_u64() < dev["summed_ns"].as_u64(), "{k}");
    assert!(
        stderr.contains("pyrometer: GPU kernels (1 in 1 launches per thread sampled):"),
        "{stderr}"
    );
}

#[test]
fn one_in_n_launches_weighted_estimates_each_phase() {
    if !privileged() {
        return;
    }
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-kernels-weights");
    let out_path = dir.join("gpu.pb.gz");
    let out = record(&s, &out_path, &["--gpu-sample-every", "8"], &["16"], &[]);
    let t = truth(&out);
    let p = read_pprof(&out_path);
    let (time, launches) = (type_index(&p, "gpu_time"), type_index(&p, "gpu_launches"));
    let got = by_phase(&pprof_samples(&p), time, launches);
    // With n launches sampled 1 in 8, an estimate's relative error is about sqrt(7/n): 9 % for
    // the 800 of matmul_phase, 3 % for elementwise_phase's 6400; 30 % and 15 % are over 3
    // sigma. The graph's and copies' launches are fewer: only their sum is held.
    for (phase, tol) in [
        ("matmul_phase", 0.30),
        ("conv_phase", 0.25),
        ("elementwise_phase", 0.15),
    ] {
        let (ns, n) = truth_by_phase(&t)[phase];
        let (g_ns, g_n) = got.get(phase).copied().unwrap_or_default();
        assert!(
            (g_ns - ns).abs() / ns < tol && (g_n - n).abs() / n < tol,
            "{phase}: estimated {g_ns} ns, {g_n} launches; truth {ns} ns, {n} launches"
        );
        assert_eq!(g_n % 8.0, 0.0, "each sampled launch weighs 8");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("(1 in 8 launches per thread sampled)"),
        "{stderr}"
    );
}

#[test]
fn record_says_when_the_library_stands_aside_or_loses_records() {
    if !privileged() {
        return;
    }
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-kernels-losses");
    // A tool holds CUPTI: the command runs, the summary names the tool, no GPU samples.
    let out = record(
        &s,
        &dir.join("aside.pb.gz"),
        &[],
        &["1"],
        &[("STANDIN_CUPTI_HELD", "Nsight Systems")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("GPU kernels not recorded: stood aside: CUPTI is held by Nsight Systems"),
        "{stderr}"
    );
    // One 1 MiB activity buffer for a burst: CUPTI drops records, and the summary counts them.
    let stats = dir.join("stats.json");
    let out = record(
        &s,
        &dir.join("drops.pb.gz"),
        &["--stats", stats.to_str().unwrap()],
        &["--burst", "30000"],
        &[("PYROMETER_GPU_BUFFER_MB", "1")],
    );
    let t = truth(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let k = &json["gpu_kernels"];
    let dropped = k["cupti_dropped"].as_u64().unwrap();
    assert!(
        dropped > 0 && stderr.contains("records CUPTI dropped"),
        "{stderr}"
    );
    let kernels = k["devices"][0]["kernels"].as_u64().unwrap();
    assert_eq!(
        kernels + dropped,
        t["truth"]["add"]["launches"].as_u64().unwrap(),
        "{k}"
    );
}

#[test]
fn every_output_shows_gpu_time_and_the_trace_has_a_track_per_stream() {
    if !privileged() {
        return;
    }
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-kernels-outputs");
    let trace = dir.join("gpu.trace.json");
    let out = record(&s, &trace, &["--gpu-sample-every", "2"], &["1"], &[]);
    let t = truth(&out);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let gpu: Vec<&serde_json::Value> = events.iter().filter(|e| e["cat"] == "gpu").collect();
    // Every kernel, copy and set is a slice (a graph launch's three kernels each).
    let records: u64 = ["matmul", "conv", "add", "native", "memcpy", "memset"]
        .iter()
        .map(|k| t["truth"][k]["launches"].as_u64().unwrap())
        .sum::<u64>()
        + 3 * t["truth"]["graph"]["launches"].as_u64().unwrap();
    assert_eq!(gpu.len() as u64, records);
    // One track per stream the workload used (0 to 4), on the GPU's process (NVML's index
    // would be its pid base; without NVML the UUID names it).
    let tracks: std::collections::BTreeSet<i64> =
        gpu.iter().map(|e| e["tid"].as_i64().unwrap()).collect();
    assert_eq!(tracks.len(), 5, "{tracks:?}");
    // Sampled launches name their launching stack and have an arrow from their thread.
    let linked = gpu
        .iter()
        .filter(|e| e["args"].get("stack").is_some())
        .count();
    assert!(
        linked > 0 && linked < gpu.len(),
        "1 in 2 sampled: {linked} of {}",
        gpu.len()
    );
    assert!(
        gpu.iter()
            .any(|e| e["args"]["stack"].as_array().is_some_and(|s| s
                .iter()
                .any(|f| f.as_str().is_some_and(|f| f.starts_with("conv_phase")))))
    );
    let arrows = events.iter().filter(|e| e["cat"] == "gpu_launch").count();
    assert_eq!(arrows, 2 * linked);

    // The flame graph, folded stacks and speedscope of gpu_time, from the pprof.
    let pb = dir.join("gpu.pb.gz");
    record(&s, &pb, &["--gpu-sample-every", "1"], &["1"], &[]);
    for name in ["gpu.folded", "gpu.svg", "gpu.speedscope.json"] {
        let o = pyrometer_e2e::pyrometer(&[
            "report",
            pb.to_str().unwrap(),
            "--type",
            "gpu_time",
            "-o",
            dir.join(name).to_str().unwrap(),
        ]);
        pyrometer_e2e::assert_ok(&o);
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(text.contains("conv_kernel"), "{name}");
        assert!(text.contains("memcpy HtoD"), "{name}");
    }
}

/// The node agent, with no GPU flags, records a process started with the library
/// (CUDA_INJECTION64_PATH set by hand, as a systemd unit or Ray's runtime_env would): its pushes
/// reach the real collector, whose gpu_time by phase function is the workload's own account,
/// launches joined across push intervals; /metrics counts the launches.
#[test]
fn the_agent_pushes_gpu_time_of_processes_started_with_the_library() {
    if !privileged() {
        return;
    }
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-kernels-agent");
    let collector = pyrometer_e2e::cluster::Collector::start(
        &dir.join("store"),
        pyrometer_e2e::cluster::free_port(),
        None,
    );
    let metrics_port = pyrometer_e2e::cluster::free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let mut agent = pyrometer_e2e::cluster::Agent::start_env(
        &dir,
        "gpu-node",
        &collector.url(),
        // The workload only (its CPU samples and its GPU work); GPU work needs no flag.
        &[
            "--comm",
            "gpuagent-py",
            "--metrics-listen",
            &metrics_addr,
            "--no-gpu",
        ],
        &[("PYROMETER_CUPTI_INJECT", s.library.to_str().unwrap())],
    );
    // The agent is up when /metrics answers; its probes went on before that.
    let metrics = || {
        pyrometer_e2e::cluster::http_get(
            std::net::SocketAddr::from(([127, 0, 0, 1], metrics_port)),
            "/metrics",
        )
    };
    wait_until(AGENT_WAIT, "the agent serving /metrics", || {
        metrics().is_some()
    });
    // Named so its samples are told from other tests' workloads (the agent sees every process
    // started with the library).
    let py = dir.join("gpuagent-py");
    std::os::unix::fs::symlink(python(), &py).unwrap();
    // A workload spins in wait_for_go until the agent's CPU samples of it show that function:
    // the agent has found the process and walks its Python frames (as it has a training
    // process by the time the model is built). Then its launches begin.
    let run_once_sampled = |name: &str, args: &[&str], env: &[(&str, &str)]| -> Output {
        let go = dir.join(format!("go-{name}"));
        let mut child = Command::new(&py)
            .arg(pyrometer_e2e::python::source("gpu_phases.py"))
            .args(args)
            .env("GPUWORK_LIB", pyrometer_e2e::fixture("libgpuwork.so"))
            .env("LD_LIBRARY_PATH", &s.cupti)
            .env("CUDA_INJECTION64_PATH", &s.library)
            .env("NVTX_INJECTION64_PATH", &s.library)
            .env("GPU_PHASES_GO", &go)
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let cpu = format!(
            "/api/v1/profile?format=folded&type=samples&query={}&from=now-10m",
            pyrometer_e2e::cluster::enc(&format!(
                "{{node=\"gpu-node\",comm=\"gpuagent-py\",pid=\"{}\"}}",
                child.id()
            ))
        );
        let sampled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_until(
                AGENT_WAIT,
                &format!("the agent sampling the {name} workload's Python frames"),
                || {
                    pyrometer_e2e::cluster::http_get(collector.addr, &cpu)
                        .is_some_and(|(status, body)| status == 200 && body.contains("wait_for_go"))
                },
            )
        }));
        if let Err(e) = sampled {
            let _ = child.kill();
            std::panic::resume_unwind(e);
        }
        std::fs::write(&go, b"").unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let out = run_once_sampled(
        "phases",
        &["4"],
        &[
            ("PYROMETER_GPU_SAMPLE_EVERY", "1"),
            ("GPU_PHASES_LINGER", "1"),
        ],
    );
    let t = truth(&out);
    let want = truth_by_phase(&t);
    let query = pyrometer_e2e::cluster::enc("{node=\"gpu-node\",comm=\"gpuagent-py\"}");
    let path = format!("/api/v1/profile?format=folded&type=gpu_time&query={query}&from=now-10m");
    let by_phase = |folded: &str| -> HashMap<&'static str, f64> {
        let mut m = HashMap::new();
        for line in folded.lines() {
            let Some((stack, v)) = line.rsplit_once(' ') else {
                continue;
            };
            let v: f64 = v.parse().unwrap_or(0.0);
            if let Some(p) = PHASES
                .iter()
                .find(|p| stack.split(';').any(|f| f.split(" (").next() == Some(**p)))
            {
                *m.entry(*p).or_default() += v;
            }
        }
        m
    };
    let complete =
        |m: &HashMap<&'static str, f64>| want.iter().all(|(p, (ns, _))| m.get(p) == Some(ns));
    let folded = wait_for(
        AGENT_WAIT,
        "every phase's gpu_time in the collector",
        || match pyrometer_e2e::cluster::http_get(collector.addr, &path) {
            Some((200, body)) if complete(&by_phase(&body)) => Ok(body),
            other => Err(other),
        },
    );
    let got = by_phase(&folded);
    for (phase, (ns, _)) in &want {
        assert_eq!(got.get(phase), Some(ns), "{phase}:\n{folded}");
    }
    assert!(
        folded.contains("conv_kernel(float const*, float*)"),
        "{folded}"
    );
    let launches: u64 = t["truth"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v["launches"].as_u64().unwrap())
        .sum();
    // The library's counters come with its statuses (every 2 s, and its last at exit), and the
    // agent copies them to /metrics every few seconds: waited for.
    let sampled_line = "pyrometer_agent_gpu_launches_total{sampled=\"true\"} ";
    let sampled_of = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(sampled_line))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let text = wait_for(
        AGENT_WAIT,
        "every sampled launch counted in /metrics",
        || {
            let text = metrics().map(|m| m.1).unwrap_or_default();
            if sampled_of(&text) >= launches {
                Ok(text)
            } else {
                Err(text)
            }
        },
    );
    let sampled = sampled_of(&text);
    assert!(
        sampled >= launches,
        "{sampled} sampled of {launches}:\n{text}"
    );
    // The NVTX ranges are a label the collector selects by.
    let conv = format!(
        "/api/v1/profile?format=folded&type=gpu_time&query={}&from=now-10m",
        pyrometer_e2e::cluster::enc("{node=\"gpu-node\",comm=\"gpuagent-py\",nvtx=\"train/conv\"}")
    );
    let conv = pyrometer_e2e::cluster::http_get(collector.addr, &conv)
        .map(|r| r.1)
        .unwrap_or_default();
    assert_eq!(
        by_phase(&conv).values().sum::<f64>(),
        want["conv_phase"].0,
        "{conv}"
    );

    // A burst beyond a 1 MiB activity buffer (some 3000 records), and a process whose CUPTI
    // another tool holds: the agent counts what was dropped and who did not record (of the
    // processes --comm chooses: the other GPU tests' workloads, which run beside this one with
    // the library too, are not).
    let metric = |text: &str, line: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    run_once_sampled(
        "burst",
        &["--burst", "12000"],
        &[("PYROMETER_GPU_BUFFER_MB", "1"), ("GPU_PHASES_LINGER", "1")],
    );
    run_once_sampled(
        "aside",
        &["--burst", "100"],
        &[
            ("STANDIN_CUPTI_HELD", "Nsight Systems"),
            ("GPU_PHASES_LINGER", "1"),
        ],
    );
    let lost = "pyrometer_agent_gpu_lost_total{reason=\"cupti_dropped\"} ";
    let aside = "pyrometer_agent_gpu_processes_off_total{reason=\"stood_aside\"} ";
    let text = wait_for(
        AGENT_WAIT,
        "dropped records and a process standing aside counted in /metrics",
        || {
            let text = metrics().map(|m| m.1).unwrap_or_default();
            if metric(&text, lost) > 0 && metric(&text, aside) > 0 {
                Ok(text)
            } else {
                Err(text)
            }
        },
    );
    assert!(
        metric(&text, lost) > 0 && metric(&text, aside) == 1,
        "{text}"
    );
    let busy = "pyrometer_agent_gpu_device_seconds_total{gpu=\"GPU-7e57d0b1-0000-4000-8000-000000000001\",time=\"busy\"}";
    assert!(text.contains(busy), "{text}");
    pyrometer_e2e::cluster::promtool_check("agent", &text);
    agent.stop();
}
