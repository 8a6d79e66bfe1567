//! Golden-file tests: the fixture profile written by each writer (folded, pprof, speedscope,
//! and the Chrome trace of a fixture timeline) must match the files in
//! `profiler/tests/golden/` byte for byte, so any change to an output shows up in review.
//!
//! After an intended change, regenerate the files and review the diff:
//!
//! ```text
//! PYROMETER_BLESS=1 cargo test -p pyrometer --lib golden
//! ```
//!
//! With `PYROMETER_FIXTURE_PPROF=/some/file.pb.gz` the pprof test also writes the fixture's
//! pprof bytes there, for checking with other readers (`go tool pprof -top /some/file.pb.gz`).

use std::path::PathBuf;

use crate::output::{OutputFormat, fixture, write};

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn check_golden(name: &str, actual: &str) {
    let path = golden_path(name);
    if std::env::var_os("PYROMETER_BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read golden file {}: {e}; run with PYROMETER_BLESS=1 to create it",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "{} differs from the output; if the change is intended, rerun with PYROMETER_BLESS=1 \
         and review the diff.\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}

fn render(format: OutputFormat, type_index: usize) -> Vec<u8> {
    let mut out = Vec::new();
    write(&fixture::profile(), format, type_index, "fixture", &mut out).unwrap();
    out
}

#[test]
fn golden_folded() {
    let samples = String::from_utf8(render(OutputFormat::Folded, 0)).unwrap();
    check_golden("fixture.samples.folded", &samples);
    let cpu = String::from_utf8(render(OutputFormat::Folded, 1)).unwrap();
    check_golden("fixture.cpu.folded", &cpu);
}

#[test]
fn golden_pprof() {
    let bytes = render(OutputFormat::Pprof, 0);
    if let Some(path) = std::env::var_os("PYROMETER_FIXTURE_PPROF") {
        std::fs::write(path, &bytes).unwrap();
    }
    let decoded = pyrometer_proto::decode(&bytes).unwrap();
    check_golden("fixture.pprof.txt", &pyrometer_proto::dump_text(&decoded));
}

#[test]
fn golden_speedscope() {
    let doc = crate::output::speedscope::to_speedscope(&fixture::profile(), 0, "fixture").unwrap();
    check_golden(
        "fixture.speedscope.json",
        &(serde_json::to_string_pretty(&doc).unwrap() + "\n"),
    );
}

#[test]
fn golden_chrome_trace() {
    let p = fixture::profile();
    let doc = crate::output::chrome::to_chrome_trace(&p, &fixture::timeline(&p)).unwrap();
    check_golden(
        "fixture.trace.json",
        &(serde_json::to_string_pretty(&doc).unwrap() + "\n"),
    );
}

/// The fixture as `record --gpu` leaves it: ray::Train (pid 200) on GPU 0, and two GPUs'
/// series, the second without power readings.
fn gpu_fixture() -> (crate::model::Profile, crate::capture::Timeline) {
    use crate::gpu::{self, DeviceInfo, DeviceSample, Field, GpuState, ProcessSample};
    let mut p = fixture::profile();
    let mut t = fixture::timeline(&p);
    let devices = (0..2)
        .map(|index| DeviceInfo {
            index,
            uuid: format!("GPU-00000000-0000-0000-0000-00000000000{index}"),
            name: format!("Fixture GPU {index}"),
            lost_at_ns: None,
        })
        .collect();
    let mut st = GpuState::new(devices, 100, t.origin_ns);
    for k in 0..3u64 {
        for index in 0..2u32 {
            let mut s = DeviceSample {
                index,
                timestamp_ns: t.origin_ns + k * 500_000_000,
                unix_ms: 1_700_000_000_000 + k * 500,
                values: [None; 12],
                processes: Vec::new(),
            };
            s.set(
                Field::Utilization,
                Some(if k == 1 {
                    0
                } else {
                    90 - 40 * u64::from(index)
                }),
            );
            s.set(Field::MemoryUtilization, Some(10 * k));
            s.set(Field::MemoryUsed, Some((k + 1) << 30));
            if index == 0 {
                s.set(Field::Power, Some(100_000 + 25_000 * k));
                s.processes.push(ProcessSample {
                    pid: 200,
                    used_memory: Some(3 << 29),
                    sm_util: Some(50),
                    mem_util: Some(10),
                });
            }
            st.push(s);
        }
    }
    gpu::label_profile(&mut p, &gpu::gpus_by_pid(&st.process_usage()));
    t.counters = st.counter_tracks();
    (p, t)
}

#[test]
fn golden_gpu_pprof_and_chrome_trace() {
    let (p, t) = gpu_fixture();
    let mut bytes = Vec::new();
    write(&p, OutputFormat::Pprof, 0, "fixture", &mut bytes).unwrap();
    let decoded = pyrometer_proto::decode(&bytes).unwrap();
    check_golden(
        "fixture.gpu.pprof.txt",
        &pyrometer_proto::dump_text(&decoded),
    );
    let doc = crate::output::chrome::to_chrome_trace(&p, &t).unwrap();
    check_golden(
        "fixture.gpu.trace.json",
        &(serde_json::to_string_pretty(&doc).unwrap() + "\n"),
    );
}
