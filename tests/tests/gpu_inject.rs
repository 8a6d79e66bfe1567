//! libpyrometer_cupti.so in a process, on the CUPTI stand-in (no GPU here): what it reports of
//! every launch, copy and NVTX range, read back from its dump file (PYROMETER_GPU_DUMP, the same
//! chunks its marker hands the uprobe) with pyrometer's own parser and join. The stand-in plays
//! CUPTI's documented behaviour (tests/fixtures/cupti_standin.c); what only a GPU can show is in
//! docs/src/gpu.md. The end-to-end path through `record` and the agent is in gpu_kernels.rs.

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;

use pyrometer::gpu::channel::{self, GpuEvent, Joiner, Mode, Op, Record, State, Stats};
use pyrometer_e2e::gpu_kernels::{Standin, standin, succeed, truth};
use pyrometer_e2e::scratch;

/// Everything a dump holds, joined (no stacks: no probe ran), with the statuses.
struct Dump {
    events: Vec<GpuEvent<()>>,
    records: Vec<Record>,
    stats: Stats,
}

fn read_dump(path: &Path, pid: u32) -> Dump {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (chunks, err) = channel::split_dump(&bytes);
    assert!(err.is_none(), "dump: {err:?}");
    let mut j: Joiner<()> = Joiner::default();
    let mut events = Vec::new();
    let mut records = Vec::new();
    for c in &chunks {
        records.extend(
            channel::parse(c)
                .expect("the library writes valid chunks")
                .records,
        );
        events.extend(j.chunk(pid, c, 1));
    }
    let stats = j.stats();
    assert_eq!(stats.chunks_refused + stats.chunks_lost, 0, "{stats:?}");
    Dump {
        events,
        records,
        stats,
    }
}

fn run(s: &Standin, cupti: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    succeed(s.workload(cupti, args, env), "the workload")
}

fn last_status(records: &[Record]) -> channel::Status {
    records
        .iter()
        .rev()
        .find_map(|r| match r {
            Record::Status(s) => Some(*s),
            _ => None,
        })
        .expect("a status")
}

fn kernel_name(e: &GpuEvent<()>) -> Option<&str> {
    match &e.op {
        Op::Kernel { name, .. } => Some(name),
        _ => None,
    }
}

/// Device ns and records by kernel name (copies as `memcpy`/`memset`).
fn by_name(events: &[GpuEvent<()>]) -> HashMap<String, (u64, u64)> {
    let mut m: HashMap<String, (u64, u64)> = HashMap::new();
    for e in events {
        let name = match &e.op {
            Op::Kernel { name, .. } => name.to_string(),
            Op::Memcpy { .. } => "memcpy".into(),
            Op::Memset { .. } => "memset".into(),
        };
        let t = m.entry(name).or_default();
        t.0 += e.duration();
        t.1 += 1;
    }
    m
}

#[test]
fn every_launch_copy_and_range_is_reported() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-every");
    let dump = dir.join("dump");
    let before = monotonic_ns();
    let out = run(
        &s,
        &s.cupti,
        &["2"],
        &[
            ("PYROMETER_GPU_SAMPLE_EVERY", "1"),
            ("PYROMETER_GPU_DUMP", dump.to_str().unwrap()),
        ],
    );
    let after = monotonic_ns();
    let t = truth(&out);
    let d = read_dump(&dump, 1);
    let st = last_status(&d.records);
    assert!(st.last, "the last status is the exit's");
    assert_eq!(st.state, Some(State::On));
    assert_eq!(
        st.mode,
        Some(Mode::Shared),
        "CUPTI 13.5: subscribed allowing others"
    );
    assert_eq!(st.sample_every, 1);
    let launches: u64 = t["truth"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v["launches"].as_u64().unwrap())
        .sum();
    // Every launch, copy and set call, not cudaGetDevice: graph launches count once each.
    assert_eq!(st.launches, launches, "truth {t}");
    assert_eq!(st.sampled, st.launches);
    assert_eq!(
        (st.cupti_dropped, st.buffers_refused, st.notes_dropped),
        (0, 0, 0)
    );

    let names = by_name(&d.events);
    let want = |phase: &str| {
        (
            t["truth"][phase]["ns"].as_u64().unwrap(),
            t["truth"][phase]["launches"].as_u64().unwrap(),
        )
    };
    let (mm_ns, mm_n) = names["_Z6matmulILi128EEvPKfS1_Pf"];
    let (native_ns, native_n) = want("native");
    assert_eq!(
        (mm_ns, mm_n),
        (want("matmul").0 + native_ns, want("matmul").1 + native_n)
    );
    assert_eq!(names["_Z11conv_kernelPKfPf"], want("conv"));
    assert_eq!(names["_Z7add_onePfi"], want("add"));
    let graph: u64 = ["_Z10graph_headPf", "_Z10graph_bodyPf", "_Z10graph_tailPf"]
        .iter()
        .map(|n| names[*n].0)
        .sum();
    assert_eq!(graph, want("graph").0);
    assert_eq!(names["memcpy"], want("memcpy"));
    assert_eq!(names["memset"], want("memset"));

    // Every record joins its launch (copies by their runtime call's id), conv's with its ranges.
    assert_eq!(
        d.stats.sampled,
        d.stats.kernels + d.stats.copies,
        "{:?}",
        d.stats
    );
    for e in &d.events {
        let sample = e.sample.as_ref().expect("all sampled");
        assert_eq!(sample.weight, 1);
        let conv = kernel_name(e) == Some("_Z11conv_kernelPKfPf");
        assert_eq!(
            sample.nvtx.as_deref(),
            conv.then_some("train/conv"),
            "{:?}",
            e.op
        );
        if let Op::Kernel {
            graph, cooperative, ..
        } = &e.op
        {
            assert_eq!(*cooperative, conv);
            assert_eq!(*graph != 0, kernel_name(e).unwrap().contains("graph"));
        }
        // On CLOCK_MONOTONIC, within the run.
        assert!(
            e.start >= before && e.end <= after,
            "{} {} not in [{before}, {after}]",
            e.start,
            e.end
        );
        assert_eq!(
            e.uuid.map(|u| channel::uuid_string(&u)).as_deref(),
            Some("GPU-7e57d0b1-0000-4000-8000-000000000001")
        );
    }
    // A graph launch's three kernels share its id.
    let graph_ids: HashMap<u32, usize> = d
        .events
        .iter()
        .filter(|e| kernel_name(e).is_some_and(|n| n.contains("graph")))
        .fold(HashMap::new(), |mut m, e| {
            *m.entry(e.correlation).or_default() += 1;
            m
        });
    assert!(graph_ids.values().all(|&n| n == 3), "{graph_ids:?}");
    // The nested driver calls of sampled runtime calls had ids of their own.
    assert!(d.records.iter().any(|r| matches!(r, Record::Alias { .. })));
}

#[test]
fn one_launch_in_n_per_thread_is_sampled() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-sampled");
    let dump = dir.join("dump");
    run(
        &s,
        &s.cupti,
        &["6", "--threads"],
        &[
            ("PYROMETER_GPU_SAMPLE_EVERY", "8"),
            ("PYROMETER_GPU_DUMP", dump.to_str().unwrap()),
        ],
    );
    let d = read_dump(&dump, 1);
    let st = last_status(&d.records);
    let launches: Vec<(u32, u32)> = d
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Launch(l) => Some((l.tid, l.weight)),
            _ => None,
        })
        .collect();
    assert_eq!(launches.len() as u64, st.sampled);
    assert!(launches.iter().all(|&(_, w)| w == 8));
    // Binomial: within 4 sigma of launches / 8.
    let n = st.launches as f64;
    let expect = n / 8.0;
    let sigma = (n * (1.0 / 8.0) * (7.0 / 8.0)).sqrt();
    assert!(
        (st.sampled as f64 - expect).abs() < 4.0 * sigma,
        "{} sampled of {} launches",
        st.sampled,
        st.launches
    );
    // Both workload threads sampled, with their own countdowns.
    let tids: std::collections::HashSet<u32> = launches.iter().map(|l| l.0).collect();
    assert!(tids.len() >= 2, "{tids:?}");
}

#[test]
fn stands_aside_when_another_tool_holds_cupti() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-aside");
    let dump = dir.join("dump");
    let out = run(
        &s,
        &s.cupti,
        &[],
        &[
            ("STANDIN_CUPTI_HELD", "Nsight Systems"),
            ("PYROMETER_GPU_DUMP", dump.to_str().unwrap()),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("are not recorded: CUPTI is held by Nsight Systems"),
        "{stderr}"
    );
    let d = read_dump(&dump, 1);
    assert!(d.events.is_empty());
    let st = last_status(&d.records);
    assert_eq!(st.state, Some(State::SteppedAside));
    assert!(d.records.iter().any(
        |r| matches!(r, Record::String { id, text, .. } if *id == st.other && text == "Nsight Systems")
    ));
}

#[test]
fn an_older_cupti_is_driven_alone_and_its_clock_converted() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-old");
    let dump = dir.join("dump");
    let before = monotonic_ns();
    run(
        &s,
        &s.cupti_old,
        &[],
        &[
            ("PYROMETER_GPU_SAMPLE_EVERY", "1"),
            ("PYROMETER_GPU_DUMP", dump.to_str().unwrap()),
        ],
    );
    let after = monotonic_ns();
    let d = read_dump(&dump, 1);
    let st = last_status(&d.records);
    assert_eq!((st.mode, st.state), (Some(Mode::Single), Some(State::On)));
    assert_eq!(st.cupti_version, 130000);
    assert!(!d.events.is_empty());
    // CUPTI 13.0 here takes no timestamp callback: its clock is CLOCK_REALTIME's, and the
    // CLOCK records bring it onto CLOCK_MONOTONIC (within a clock read's jitter).
    for e in &d.events {
        assert!(
            e.start + 1_000_000 >= before && e.end <= after + 1_000_000,
            "{} not within [{before}, {after}]",
            e.start
        );
    }
}

#[test]
fn a_second_cupti_client_keeps_its_records() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-second");
    let dump = dir.join("dump");
    let out = run(
        &s,
        &s.cupti,
        &["--other-tool"],
        &[("PYROMETER_GPU_DUMP", dump.to_str().unwrap())],
    );
    let t = truth(&out);
    let d = read_dump(&dump, 1);
    // The second client (as torch.profiler subscribes when a profile starts) got in, and got
    // every kernel; so did the library.
    assert_eq!(t["other_tool"]["subscribe"], 0, "{t}");
    assert_eq!(
        t["other_tool"]["kernels"].as_u64().unwrap(),
        d.stats.kernels,
        "{t}"
    );
    assert!(d.stats.kernels > 0);
}

#[test]
fn records_beyond_the_buffers_are_dropped_and_counted() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-drops");
    let dump = dir.join("dump");
    let out = run(
        &s,
        &s.cupti,
        &["--burst", "30000"],
        &[
            ("PYROMETER_GPU_BUFFER_MB", "1"),
            ("PYROMETER_GPU_DUMP", dump.to_str().unwrap()),
        ],
    );
    let t = truth(&out);
    let d = read_dump(&dump, 1);
    let st = last_status(&d.records);
    let launched = t["truth"]["add"]["launches"].as_u64().unwrap();
    assert!(st.buffers_refused > 0 && st.cupti_dropped > 0, "{st:?}");
    // Nothing vanishes unaccounted: what arrived plus what CUPTI dropped is what ran.
    assert_eq!(d.stats.kernels + st.cupti_dropped, launched, "{st:?}");
}

#[test]
fn without_libcupti_the_process_runs_on_and_says_why() {
    let Some(s) = standin() else { return };
    let dir = scratch("gpu-inject-nocupti");
    let dump = dir.join("dump");
    for (lib, want) in [
        (Path::new("/nonexistent/libcupti.so.13"), State::NoCupti),
        // NVIDIA's real libcupti, without a driver or a GPU: CUPTI refuses to start.
        (s.real_cupti.as_path(), State::CuptiError),
    ] {
        let _ = std::fs::remove_file(&dump);
        let out = std::process::Command::new(pyrometer_e2e::gpu_kernels::python())
            .arg("-c")
            .arg(
                "import ctypes,sys; l=ctypes.CDLL(sys.argv[1]); \
                 print(l.InitializeInjection()); print('alive')",
            )
            .arg(&s.library)
            .env("PYROMETER_CUPTI_LIB", lib)
            .env("PYROMETER_GPU_DUMP", &dump)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stdout.contains("alive"), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains("are not recorded"), "{stderr}");
        let d = read_dump(&dump, 1);
        assert_eq!(last_status(&d.records).state, Some(want), "{stderr}");
    }
}

fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}
