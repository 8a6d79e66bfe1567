//! The GPU side of a capture: the kernel's two kinds of GPU records go in (a sampled launch's
//! stack, by the capture's raw stack id; a channel chunk), and the profile's `gpu_time` and
//! `gpu_launches` samples come out: the launching stack with the library's and CUPTI's own
//! frames cut from its leaf, the device work as the leaf frame, and the `gpu`, `stream` and
//! `nvtx` labels.

use std::collections::HashMap;

use super::LIBRARY;
use super::account::{Account, AccountLimits, DeviceId, GpuKey, GpuSlice, GpuSums};
use super::join::{Joiner, Limits, Stats};
use crate::capture::timeline::GpuSpan;
use crate::model::{Frame, FrameKind, LabelValue, Labels, Profile};
use crate::os::procs::ProcessRegistry;

/// The frame of a sampled launch whose stack never arrived.
pub const STACK_LOST: &str = "[launch stack lost]";

/// What a capture keeps of GPU work.
pub struct GpuCapture {
    pub joiner: Joiner<u32>,
    pub account: Account<u32>,
    /// NVML's index of each device UUID (`GPU-…`), for the `gpu` label; empty without NVML.
    pub nvml_index: HashMap<String, u32>,
}

impl GpuCapture {
    /// `slices`: device work kept for a trace (0 without one).
    pub fn new(slices: usize) -> Self {
        GpuCapture {
            joiner: Joiner::new(Limits::default()),
            account: Account::new(AccountLimits {
                slices,
                ..AccountLimits::default()
            }),
            nvml_index: HashMap::new(),
        }
    }

    /// A sampled launch's stack (`stack`: the capture's raw stack id), taken at `timestamp_ns`.
    pub fn launch(&mut self, pid: u32, tid: u32, correlation: u64, stack: u32, timestamp_ns: u64) {
        // CUPTI's ids are 32 bits; the marker passes them widened.
        let Ok(correlation) = u32::try_from(correlation) else {
            return;
        };
        self.joiner
            .stack(pid, tid, correlation, stack, timestamp_ns, timestamp_ns);
    }

    /// A chunk of the library's channel from process `pid`, read at `timestamp_ns`.
    pub fn chunk(&mut self, pid: u32, bytes: &[u8], timestamp_ns: u64) {
        for e in self.joiner.chunk(pid, bytes, timestamp_ns) {
            self.account.add(e);
        }
        self.joiner.expire(timestamp_ns);
    }

    pub fn stats(&self) -> Stats {
        self.joiner.stats()
    }

    /// Adds the joined work to `profile`, whose last two sample types are `gpu_time` and
    /// `gpu_launches`, under the launching stacks of `launch_stacks` (by raw stack id); returns
    /// the device work kept for a trace (`keep_spans`), each linked to its sample.
    pub fn add_to_profile(
        &mut self,
        profile: &mut Profile,
        launch_stacks: &HashMap<u32, LaunchStack>,
        registry: &ProcessRegistry,
        keep_spans: bool,
    ) -> Vec<GpuSpan> {
        let n = profile.sample_types.len();
        let sums = self.account.take_sums();
        let sample_of_key = add_samples(
            profile,
            sums,
            GpuTypes {
                time: n - 2,
                launches: n - 1,
            },
            &self.nvml_index,
            &|id| launch_stacks.get(&id).cloned(),
            &|pid| {
                registry
                    .get(pid)
                    .map(|p| p.comm.clone())
                    .unwrap_or_else(|| format!("pid {pid}"))
            },
        );
        if !keep_spans {
            return Vec::new();
        }
        spans(
            std::mem::take(&mut self.account.slices),
            &sample_of_key,
            &self.nvml_index,
        )
    }
}

/// A launching stack's profile stack and labels, as the CPU samples of the same raw stack got
/// them.
#[derive(Debug, Clone)]
pub struct LaunchStack {
    pub stack: u32,
    pub labels: Labels,
}

/// Where the GPU values go in a profile's samples.
#[derive(Debug, Clone, Copy)]
pub struct GpuTypes {
    pub time: usize,
    pub launches: usize,
}

/// Adds the GPU samples of `sums` to `profile`. `launch_stack` gives a raw stack id's profile
/// stack and labels; `comm` a process's command name (for samples whose stack was lost).
/// Returns each key's sample index in the profile.
pub fn add_samples(
    profile: &mut Profile,
    sums: HashMap<GpuKey<u32>, GpuSums>,
    types: GpuTypes,
    nvml_index: &HashMap<String, u32>,
    launch_stack: &dyn Fn(u32) -> Option<LaunchStack>,
    comm: &dyn Fn(u32) -> String,
) -> HashMap<GpuKey<u32>, u32> {
    let mut index_of = HashMap::with_capacity(sums.len());
    let mut sums: Vec<(GpuKey<u32>, GpuSums)> = sums.into_iter().collect();
    // Deterministic output.
    sums.sort_by(|a, b| {
        (
            a.0.pid, a.0.stack, &a.0.leaf, a.0.device, a.0.stream, &a.0.nvtx,
        )
            .cmp(&(
                b.0.pid, b.0.stack, &b.0.leaf, b.0.device, b.0.stream, &b.0.nvtx,
            ))
    });
    let mut leaves: HashMap<super::account::Leaf, u32> = HashMap::new();
    for (key, s) in sums {
        let leaf = *leaves
            .entry(key.leaf.clone())
            .or_insert_with(|| profile.intern_frame(Frame::named(key.leaf.name(), FrameKind::Gpu)));
        let found = key.stack.and_then(launch_stack);
        let (mut frames, mut labels) = match found {
            Some(l) => (launching_frames(profile, l.stack), l.labels),
            None => (
                vec![profile.intern_frame(Frame::named(STACK_LOST, FrameKind::Unknown))],
                Labels::new()
                    .with("pid", LabelValue::Num(i64::from(key.pid)))
                    .with("comm", LabelValue::Str(comm(key.pid))),
            ),
        };
        frames.insert(0, leaf);
        let stack = profile.intern_stack(frames);
        labels.set("gpu", LabelValue::Str(device_label(key.device, nvml_index)));
        labels.set("stream", LabelValue::Str(key.stream.to_string()));
        if let Some(n) = &key.nvtx {
            labels.set("nvtx", LabelValue::Str(n.to_string()));
        }
        let mut values = vec![0i64; profile.sample_types.len()];
        values[types.time] = s.time_ns.round() as i64;
        values[types.launches] = s.launches.round() as i64;
        let index = profile.add(stack, labels, &values);
        index_of.insert(key, u32::try_from(index).unwrap_or(u32::MAX));
    }
    index_of
}

/// The account's slices as the timeline's GPU spans, each sampled one pointing at its profile
/// sample.
pub fn spans(
    slices: Vec<GpuSlice<u32>>,
    sample_of: &HashMap<GpuKey<u32>, u32>,
    nvml_index: &HashMap<String, u32>,
) -> Vec<GpuSpan> {
    let mut names: HashMap<super::account::Leaf, String> = HashMap::new();
    slices
        .into_iter()
        .map(|s| GpuSpan {
            device: s.device.label(nvml_index),
            pid: s.pid,
            stream: s.stream,
            start_ns: s.start,
            end_ns: s.end,
            name: names
                .entry(s.leaf.clone())
                .or_insert_with(|| s.leaf.name())
                .clone(),
            correlation: s.correlation,
            sample: s.key.as_ref().and_then(|k| sample_of.get(k)).copied(),
            launch: s.tid.zip(s.launched),
        })
        .collect()
}

fn device_label(device: DeviceId, nvml_index: &HashMap<String, u32>) -> String {
    device.label(nvml_index)
}

/// A launching stack's frames without its innermost ones in the library and in CUPTI (the
/// marker and the callback CUPTI made): the stack starts at the launch call.
fn launching_frames(profile: &Profile, stack: u32) -> Vec<u32> {
    let ids = profile.stacks.get(stack);
    let ours = |id: &u32| {
        profile.frames.get(*id).module.as_deref().is_some_and(|m| {
            let base = m.rsplit('/').next().unwrap_or(m);
            base == LIBRARY || base.starts_with("libcupti.so")
        })
    };
    let cut = ids.iter().take_while(|id| ours(id)).count();
    ids[cut..].to_vec()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::capture::gpu::account::Leaf;
    use crate::model::SampleType;

    #[test]
    fn gpu_samples_sit_on_the_launching_stack_with_the_work_as_leaf() {
        let mut p = Profile::new(vec![
            SampleType::new("samples", "count"),
            SampleType::new("gpu_time", "nanoseconds"),
            SampleType::new("gpu_launches", "count"),
        ]);
        let frame = |name: &str, module: Option<&str>| Frame {
            module: module.map(str::to_string),
            ..Frame::named(name, FrameKind::Native)
        };
        let ids: Vec<u32> = [
            frame("pyrometer_gpu_launch", Some("/x/libpyrometer_cupti.so")),
            frame("cupti_internal", Some("/y/libcupti.so.13")),
            frame("cudaLaunchKernel", Some("/z/libcudart.so.13")),
            Frame::named("matmul_phase", FrameKind::Python),
        ]
        .into_iter()
        .map(|f| p.intern_frame(f))
        .collect();
        let launch = p.intern_stack(ids);
        let mut uuid = [0u8; 16];
        uuid[15] = 1;
        let key = |stack, nvtx: Option<&str>| GpuKey {
            pid: 7,
            tid: Some(8),
            stack,
            leaf: Leaf::Kernel(Arc::from("_Z6matmulv")),
            device: DeviceId::Uuid(uuid),
            stream: 13,
            nvtx: nvtx.map(Arc::from),
        };
        let sums: HashMap<GpuKey<u32>, GpuSums> = [
            (
                key(Some(5), Some("train/step")),
                GpuSums {
                    time_ns: 6400.0,
                    launches: 64.0,
                },
            ),
            (
                key(None, None),
                GpuSums {
                    time_ns: 100.0,
                    launches: 1.0,
                },
            ),
        ]
        .into();
        let nvml: HashMap<String, u32> =
            [("GPU-00000000-0000-0000-0000-000000000001".to_string(), 2)].into();
        add_samples(
            &mut p,
            sums,
            GpuTypes {
                time: 1,
                launches: 2,
            },
            &nvml,
            &|id| {
                (id == 5).then(|| LaunchStack {
                    stack: launch,
                    labels: Labels::new().with("pid", LabelValue::Num(7)),
                })
            },
            &|_| "python3".to_string(),
        );
        assert_eq!(p.total(1), 6500);
        assert_eq!(p.total(2), 65);
        let s = p
            .samples
            .iter()
            .find(|s| s.values[1] == 6400)
            .expect("the sampled stack");
        let names: Vec<&str> = p.stack_frames(s.stack).map(|f| &*f.function).collect();
        assert_eq!(names, ["matmul()", "cudaLaunchKernel", "matmul_phase"]);
        assert_eq!(p.stack_frames(s.stack).next().unwrap().kind, FrameKind::Gpu);
        assert_eq!(s.labels.get("gpu"), Some(&LabelValue::Str("2".into())));
        assert_eq!(s.labels.get("stream"), Some(&LabelValue::Str("13".into())));
        assert_eq!(
            s.labels.get("nvtx"),
            Some(&LabelValue::Str("train/step".into()))
        );
        let lost = p.samples.iter().find(|s| s.values[1] == 100).unwrap();
        let names: Vec<&str> = p.stack_frames(lost.stack).map(|f| &*f.function).collect();
        assert_eq!(names, ["matmul()", STACK_LOST]);
        assert_eq!(
            lost.labels.get("comm"),
            Some(&LabelValue::Str("python3".into()))
        );
    }
}
