//! Turns ring-buffer records into counted raw stacks while the capture runs, and into a
//! symbolized [`Profile`] at the end.
//!
//! Symbolization is deferred: a raw stack is a few addresses, so the capture loop stays cheap
//! and each distinct stack is symbolized once. What cannot wait is the process's memory map,
//! which is read the first time a process is seen (and again when an address falls outside
//! it, e.g. after `dlopen`) so that processes exiting mid-capture are still symbolized.

use std::collections::{HashMap, HashSet};

use pyrometer_ebpf::RawSample;

use crate::bpf::Sampler;
use crate::model::{Frame, FrameKind, LabelValue, Labels, Profile};
use crate::procs::ProcessRegistry;
use crate::symbolize::Symbolizer;

/// One distinct stack of one thread, as the kernel reported it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RawStack {
    pub pid: u32,
    pub tid: u32,
    /// The thread's comm at sample time.
    pub thread: String,
    /// User return addresses, leaf first.
    pub user: Vec<u64>,
    /// Kernel addresses, leaf first.
    pub kernel: Vec<u64>,
}

/// What the capture loop accumulates.
#[derive(Default)]
pub struct Capture {
    pub stacks: HashMap<RawStack, u64>,
    /// Samples read from the ring buffer.
    pub samples: u64,
    /// Records that failed to parse (never expected; counted, not hidden).
    pub bad_records: u64,
    /// Kernel stack ids that were gone from the stack map when read.
    pub missing_kernel_stacks: u64,
    pub pids: HashSet<u32>,
    kernel_stack_cache: HashMap<i32, Vec<u64>>,
}

impl Capture {
    /// Counts one ring-buffer record.
    pub fn ingest(&mut self, bytes: &[u8], sampler: &Sampler, registry: &mut ProcessRegistry) {
        let Ok(sample) = RawSample::parse(bytes) else {
            self.bad_records += 1;
            return;
        };
        let h = sample.header;
        if h.flags & pyrometer_ebpf::SAMPLE_EVENT_EXEC != 0 {
            self.pids.insert(h.pid);
            let _ = registry.exec(h.pid);
            return;
        }
        if self.pids.insert(h.pid) {
            // Best effort: a process that is already gone keeps its samples, unsymbolized.
            let _ = registry.observe(h.pid);
        }
        let user: Vec<u64> = sample.user_frames().collect();
        // Any frame outside the known mappings means the map changed since it was read (the
        // loader mapped libraries after exec, or a dlopen); refresh is rate-limited.
        if user.iter().any(|&a| registry.find(h.pid, a).is_none()) {
            let _ = registry.refresh(h.pid);
        }
        let kernel = if h.kernel_stack_id >= 0 {
            match self.kernel_stack_cache.get(&h.kernel_stack_id) {
                Some(frames) => frames.clone(),
                None => match sampler.kernel_stack(h.kernel_stack_id) {
                    Some(frames) => {
                        self.kernel_stack_cache
                            .insert(h.kernel_stack_id, frames.clone());
                        frames
                    }
                    None => {
                        self.missing_kernel_stacks += 1;
                        Vec::new()
                    }
                },
            }
        } else {
            sample.inline_kernel_frames().collect()
        };
        let key = RawStack {
            pid: h.pid,
            tid: h.tid,
            thread: sample.comm(),
            user,
            kernel,
        };
        *self.stacks.entry(key).or_insert(0) += 1;
        self.samples += 1;
    }

    /// Symbolizes every distinct stack into a CPU profile (`period_ns` per sample).
    pub fn into_profile(
        self,
        registry: &mut ProcessRegistry,
        symbolizer: &mut Symbolizer,
        period_ns: i64,
    ) -> Profile {
        let mut profile = Profile::cpu(period_ns);
        let mut stacks: Vec<(RawStack, u64)> = self.stacks.into_iter().collect();
        // Deterministic output order regardless of hash iteration.
        stacks.sort_by(|a, b| {
            (a.0.pid, a.0.tid, &a.0.user, &a.0.kernel).cmp(&(
                b.0.pid,
                b.0.tid,
                &b.0.user,
                &b.0.kernel,
            ))
        });
        for (raw, count) in stacks {
            let mut frames: Vec<Frame> = symbolizer.kernel(&raw.kernel);
            frames.extend(symbolizer.user(registry, raw.pid, &raw.user));
            if frames.is_empty() {
                frames.push(Frame::named("[no stack]", FrameKind::Unknown));
            }
            let ids: Vec<u32> = frames
                .into_iter()
                .map(|f| profile.intern_frame(f))
                .collect();
            let stack = profile.intern_stack(ids);
            let process = registry
                .get(raw.pid)
                .map(|p| p.comm.clone())
                .unwrap_or_else(|| raw.thread.clone());
            let labels = Labels::new()
                .with("pid", LabelValue::Num(i64::from(raw.pid)))
                .with("tid", LabelValue::Num(i64::from(raw.tid)))
                .with("comm", LabelValue::Str(process))
                .with("thread", LabelValue::Str(raw.thread));
            let n = i64::try_from(count).unwrap_or(i64::MAX);
            profile.add(stack, labels, &[n, n.saturating_mul(period_ns)]);
        }
        profile
    }
}
