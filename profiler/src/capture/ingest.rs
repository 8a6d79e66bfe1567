//! Reading ring-buffer records into the capture: each record is parsed once and counted as
//! what it is (an on-CPU sample, an off-CPU interval, a GIL wait, an allocation or free, an
//! exec), its stack keyed by its frames, thread, labels and span.

use std::collections::HashSet;

use pyrometer_ebpf::RawSample;

use super::{AllocState, Capture, GC_GENERATION_UNKNOWN, PY_ENTRY, RawStack};
use crate::bpf::Sampler;
use crate::os::procs::ProcessRegistry;
use crate::python::tracker::PyTracker;

/// Python threads remembered per capture for naming late.
const MAX_LATE_THREADS: usize = 4096;

impl Capture {
    /// Counts one ring-buffer record.
    pub fn ingest(
        &mut self,
        bytes: &[u8],
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
    ) {
        match RawSample::parse(bytes) {
            Ok(sample) => self.ingest_sample(&sample, sampler, registry, python, false),
            Err(_) => self.bad_records += 1,
        }
    }

    /// Before a record with a stack copy is held for its tables: what counting it would do
    /// first about its process (read a new one's maps, read them again for a frame in no
    /// known mapping), so that the tables it waits for are asked for now. False for a process
    /// that opted out, whose record is counted (as left out) at once.
    pub fn note_held(&mut self, sample: &RawSample, registry: &mut ProcessRegistry) -> bool {
        let pid = sample.header.pid;
        if registry.opted_out(pid) {
            return false;
        }
        if !self.first_sight(pid, registry) {
            let frames: Vec<u64> = sample.user_frames().collect();
            self.refresh_for_unknown(pid, &frames, registry);
        }
        true
    }

    /// Reads a process's maps the first time one of its records is counted, for its tables
    /// to be synced. Whether it was the first time.
    fn first_sight(&mut self, pid: u32, registry: &mut ProcessRegistry) -> bool {
        if !self.pids.insert(pid) {
            return false;
        }
        // Best effort: a process that is already gone keeps its samples, unsymbolized.
        if registry.observe(pid).is_ok() {
            self.maps_changed.push(pid);
        }
        true
    }

    /// Any frame outside the known mappings means the map changed since it was read (the
    /// loader mapped libraries after exec, or a dlopen): it is read again (rate-limited).
    fn refresh_for_unknown(&mut self, pid: u32, frames: &[u64], registry: &mut ProcessRegistry) {
        if frames.iter().any(|&a| registry.find(pid, a).is_none())
            && let Ok(true) = registry.refresh(pid)
        {
            self.maps_changed.push(pid);
        }
    }

    /// Names the record's Python frames now, while the process can still be read.
    fn python_frames(&mut self, sample: &RawSample, python: &mut PyTracker) -> Vec<u32> {
        let pid = sample.header.pid;
        let frames = sample.python_frames();
        let mut out = Vec::with_capacity(frames.len());
        for f in frames {
            self.py_frames_seen += 1;
            let Some(name) = python.resolve(pid, f, sample.header.timestamp_ns) else {
                self.py_unresolved += 1;
                continue;
            };
            let id = self.py_names.intern(name) & !PY_ENTRY;
            out.push(if f.entry { id | PY_ENTRY } else { id });
        }
        if !out.is_empty()
            && !self.py_modules.contains_key(&pid)
            && let Some(m) = python.module(pid)
        {
            self.py_modules.insert(pid, m);
        }
        out
    }

    /// `still_blocked`: an off-CPU record made up for a thread that has not woken yet
    /// ([`Capture::ingest_pending`]), whose interval goes on.
    fn ingest_sample(
        &mut self,
        sample: &RawSample,
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
        still_blocked: bool,
    ) {
        let h = sample.header;
        if let Some(chunk) = sample.gpu_chunk() {
            if let Some(g) = self.gpu.as_mut() {
                g.chunk(h.pid, chunk, h.timestamp_ns);
            }
            return;
        }
        if h.flags & pyrometer_ebpf::SAMPLE_FREE != 0 {
            match sample.moved_to() {
                Some(to) => self.count_move(h.pid, h.aux, to, h.value),
                None => self.count_free(h.pid, h.aux),
            }
            return;
        }
        if h.flags & pyrometer_ebpf::SAMPLE_EVENT_EXEC != 0 {
            self.exec_event(&h, registry);
            return;
        }
        // Before anything of the process is read (its maps, its perf map, its memory).
        if registry.opted_out(h.pid) {
            self.opted_out += 1;
            return;
        }
        if h.comm.starts_with(b"ray::") {
            self.ray_seen = true;
        }
        self.first_sight(h.pid, registry);
        let key = self.stack_key(sample, sampler, registry, python);
        self.count_record(&h, key, registry, still_blocked);
    }

    /// A process exec'd: its old image's allocations and title go; its new one is read now,
    /// or at its next sample when reading is lazy.
    fn exec_event(&mut self, h: &pyrometer_ebpf::SampleHeader, registry: &mut ProcessRegistry) {
        self.forget_allocations(h.pid);
        self.titles.forget(h.pid);
        if self.exec_lazily {
            self.pids.remove(&h.pid);
            registry.forget(h.pid);
            self.execs.push(h.pid);
            return;
        }
        self.pids.insert(h.pid);
        if self
            .maps_read_after_exec
            .get(&h.pid)
            .is_some_and(|&read| h.timestamp_ns <= read)
        {
            return;
        }
        if registry.exec(h.pid).is_ok() {
            self.maps_changed.push(h.pid);
        }
    }

    /// The stack a record counts in: its frames, thread, labels and span.
    fn stack_key(
        &mut self,
        sample: &RawSample,
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
    ) -> RawStack {
        let h = sample.header;
        let mut user: Vec<u64> = sample.user_frames().collect();
        // An allocation's stack is taken at the allocator's return: its innermost address is
        // a return address too, and one byte back names the call (as for the other frames).
        if h.flags & pyrometer_ebpf::SAMPLE_ALLOC != 0
            && let Some(leaf) = user.first_mut()
        {
            *leaf = leaf.saturating_sub(1);
        }
        self.refresh_for_unknown(h.pid, &user, registry);
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
        let comm = sample.comm();
        let is_python = python.module(h.pid).is_some();
        let ray = self.titles.labels(h.pid, h.tid, &comm, is_python);
        // Python threads are labelled with their `threading` name where it can be read.
        let (thread, thread_named) = match python.thread_name(h.pid, h.tid) {
            Some(name) => {
                // Kept here as soon as it is known: the tracker forgets an exited process's
                // names at its next clean-up, which can come before the profile is made.
                if self.unnamed_threads.contains(&(h.pid, h.tid)) {
                    self.late_names
                        .entry((h.pid, h.tid))
                        .or_insert_with(|| name.to_string());
                }
                (name.to_string(), true)
            }
            None => {
                if self.unnamed_threads.len() < MAX_LATE_THREADS && is_python {
                    self.unnamed_threads.insert((h.pid, h.tid));
                    self.awaited_names.insert((h.pid, h.tid));
                }
                (comm, false)
            }
        };
        let py = if h.py_frames > 0 {
            self.python_frames(sample, python)
        } else {
            Vec::new()
        };
        python.refresh_spans(h.pid);
        python.refresh_async(h.pid);
        python.check_free_threaded_gil(h.pid);
        let span = sample.span().map(|s| self.spans.intern(s));
        RawStack {
            pid: h.pid,
            tid: h.tid,
            thread,
            thread_named,
            user,
            kernel,
            ray,
            span,
            python: py,
            complete: h.flags & pyrometer_ebpf::SAMPLE_COMPLETE != 0,
            gc_generation: None,
        }
    }

    /// Counts `key` as what the record is: an allocation, a GIL wait, an off-CPU interval or
    /// an on-CPU sample.
    fn count_record(
        &mut self,
        h: &pyrometer_ebpf::SampleHeader,
        key: RawStack,
        registry: &ProcessRegistry,
        still_blocked: bool,
    ) {
        if h.flags & pyrometer_ebpf::SAMPLE_GPU_LAUNCH != 0 {
            // The launching stack: it counts nothing itself; its GPU work is added to it.
            let id = self.entry(key).id;
            if let Some(g) = self.gpu.as_mut() {
                g.launch(h.pid, h.tid, h.aux, id, h.timestamp_ns);
            }
        } else if h.flags & pyrometer_ebpf::SAMPLE_ALLOC != 0 {
            if h.flags & pyrometer_ebpf::SAMPLE_ALLOC_PRELOAD != 0 {
                if self.alloc.is_none()
                    && let Some(mean) = self.alloc_on_preload
                {
                    self.alloc = Some(AllocState::new(mean));
                }
                self.note_preload_mean(h.pid, registry.proc_root());
            }
            let tracked = h.flags & pyrometer_ebpf::SAMPLE_ALLOC_UNTRACKED == 0;
            self.count_sampled(key, h.value, tracked.then_some(h.aux), h.timestamp_ns);
        } else if h.flags & pyrometer_ebpf::SAMPLE_GC != 0 {
            let generation = u8::try_from(h.aux).ok();
            self.count_gc(
                RawStack {
                    gc_generation: Some(generation.unwrap_or(GC_GENERATION_UNKNOWN)),
                    ..key
                },
                h.timestamp_ns,
                h.value,
            );
        } else if h.flags & pyrometer_ebpf::SAMPLE_GIL_WAIT != 0 {
            self.count_gil_wait(key, h.timestamp_ns, h.value);
        } else if h.flags & pyrometer_ebpf::SAMPLE_OFFCPU != 0 {
            let (start, end) = (h.timestamp_ns, h.timestamp_ns.saturating_add(h.value));
            let from = match self.off_cpu_reported.get(&h.tid) {
                Some(&(blocked_at, until, _)) if blocked_at == start => until.max(start),
                _ => start,
            };
            if still_blocked {
                self.off_cpu_reported.insert(h.tid, (start, end, false));
            } else {
                self.off_cpu_reported.remove(&h.tid);
            }
            if end > from {
                self.count_off_cpu(key, from, end - from);
            }
        } else {
            if self.gil {
                let e = self
                    .thread_samples
                    .entry(h.tid)
                    .or_insert_with(|| (h.pid, key.thread.clone(), 0));
                e.2 += 1;
                // The latest name: a Python thread's `threading` name becomes readable
                // once the thread registered.
                if e.1 != key.thread {
                    e.1.clone_from(&key.thread);
                }
            }
            let held = h.flags & pyrometer_ebpf::SAMPLE_GIL_HELD != 0;
            self.count_sample(key, h.timestamp_ns, held);
        }
    }

    /// Counts the intervals of threads still blocked ([`Sampler::pending_off_cpu`]) up to
    /// now, minus what an earlier call reported of the same interval; when the thread wakes,
    /// its record then counts only the rest. Threads no longer blocked are forgotten, which
    /// bounds the map by the kernel's pending map.
    pub fn ingest_pending(
        &mut self,
        pending: &[pyrometer_ebpf::PendingOffCpu],
        sampler: &Sampler,
        registry: &mut ProcessRegistry,
        python: &mut PyTracker,
    ) {
        let samples: Vec<RawSample> = pending.iter().map(|p| p.sample()).collect();
        let blocked: HashSet<u32> = samples.iter().map(|s| s.header.tid).collect();
        // Entries of threads that are not blocked now survive one flush, then go.
        self.off_cpu_reported
            .retain(|tid, (_, _, stale)| blocked.contains(tid) || !std::mem::replace(stale, true));
        for sample in &samples {
            self.ingest_sample(sample, sampler, registry, python, true);
        }
    }
}
