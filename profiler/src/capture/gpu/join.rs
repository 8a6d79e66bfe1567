//! The join: device work (kernel, copy and set records from the channel) meets the stacks the
//! kernel's probe took at the sampled launches, by the process and CUPTI's correlation id of the
//! launching call. A graph launch's kernels all carry the graph launch's id; a copy carries its
//! driver call's id and its runtime call's; a call nested in a sampled one may have sent an
//! ALIAS to the outer call's id. A launch sampled 1 in N stands for N launches (its LAUNCH record
//! says N): [`Sampled::weight`]. Everything about a process is bounded (names, devices, pending
//! launches, chunks a second) and expires; whatever is refused or lost is counted in [`Stats`].
//!
//! The join is generic over the stack handle `S` its caller uses (an interned stack id in
//! `record` and the agent), and pure: time comes in as arguments.

use std::collections::HashMap;
use std::sync::Arc;

use super::channel::{self, Api, Chunk, Mode, Record, State, Status};

/// Bounds on what one process (and all together) may make the join keep.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Processes followed at once.
    pub processes: usize,
    /// Names (kernels, NVTX ranges) per process, and their bytes.
    pub strings: usize,
    /// ... and the bytes of those names.
    pub string_bytes: usize,
    /// Sampled launches, their stacks and aliases waiting for records, per process (each).
    pub pending: usize,
    /// Devices per process.
    pub devices: usize,
    /// Chunks a process may send in one second; the rest are refused, counted.
    pub chunks_per_second: u32,
    /// A record whose device time is longer is refused as nonsense.
    pub max_duration_ns: u64,
    /// How long a sampled launch (or its stack) waits for its records.
    pub pending_ttl_ns: u64,
    /// A process that sent nothing for this long is forgotten.
    pub idle_ttl_ns: u64,
    /// The largest weight a sampled launch may claim.
    pub max_weight: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            processes: 4096,
            strings: 16_384,
            string_bytes: 8 << 20,
            pending: 65_536,
            devices: 64,
            chunks_per_second: 4096,
            max_duration_ns: 3_600_000_000_000,
            pending_ttl_ns: 60_000_000_000,
            idle_ttl_ns: 600_000_000_000,
            max_weight: 1_000_000,
        }
    }
}

/// Counts of what the join saw, refused and lost (cumulative), with the libraries' own counters
/// summed over processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Chunks read.
    pub chunks: u64,
    /// Chunks that broke the format ([`channel::ChunkError`]).
    pub chunks_refused: u64,
    /// Chunks a process sent that never arrived (gaps in its sequence numbers).
    pub chunks_lost: u64,
    /// Chunks over a process's rate.
    pub chunks_rate_limited: u64,
    /// Chunks of processes beyond [`Limits::processes`].
    pub processes_refused: u64,
    /// Records of a type this reader does not know (skipped by their length).
    pub records_unknown: u64,
    /// Records with impossible values (an end before the start, hours long).
    pub records_refused: u64,
    /// Names, devices, launches, stacks or aliases not kept: a bound was reached.
    pub kept_refused: u64,
    /// Kernel records joined.
    pub kernels: u64,
    /// Copy and set records joined.
    pub copies: u64,
    /// Records of sampled launches.
    pub sampled: u64,
    /// ... whose launch stack had not arrived (the probe's sample was lost, or the profiler
    /// attached after the launch).
    pub stacks_missing: u64,
    /// Launch stacks no record claimed before they expired.
    pub stacks_unclaimed: u64,
    /// Launches, copies and sets the libraries saw.
    pub lib_launches: u64,
    /// ... and those whose stack they sampled.
    pub lib_sampled: u64,
    /// Records CUPTI dropped for want of a buffer.
    pub cupti_dropped: u64,
    /// CUPTI's requests for an activity buffer the libraries refused: all were in use.
    pub buffers_refused: u64,
    /// Sampled launches whose LAUNCH record the library could not queue.
    pub notes_dropped: u64,
    /// Names the libraries did not send (their table was full).
    pub names_dropped: u64,
    /// Processes whose library did not record: another tool held CUPTI, no libcupti was
    /// found, CUPTI refused to start.
    pub processes_stood_aside: u64,
    /// ... found no libcupti.
    pub processes_without_cupti: u64,
    /// ... met a CUPTI error.
    pub processes_cupti_error: u64,
}

/// What the device did, one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A kernel.
    Kernel {
        /// As CUPTI names it (mangled).
        name: Arc<str>,
        /// Its grid, in blocks.
        grid: [i32; 3],
        /// Its blocks, in threads.
        block: [i32; 3],
        /// CUDA graph id, 0 when not in a graph.
        graph: u32,
        /// A cooperative launch.
        cooperative: bool,
    },
    /// A copy.
    Memcpy {
        /// CUPTI's copy kind (1 HtoD, 2 DtoH, 8 DtoD, ...).
        kind: u8,
        /// Bytes copied.
        bytes: u64,
    },
    /// A set (memset).
    Memset {
        /// Bytes set.
        bytes: u64,
    },
}

/// The sampled launch a record belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampled<S> {
    /// Launches this one stands for.
    pub weight: u32,
    /// The launching thread's stack; None when it never arrived ([`Stats::stacks_missing`]).
    pub stack: Option<S>,
    pub tid: Option<u32>,
    /// The NVTX ranges open at the launch, outermost first, '/'-joined.
    pub nvtx: Option<Arc<str>>,
    pub api: Option<Api>,
    /// When the probe took the stack (CLOCK_MONOTONIC ns).
    pub launched: Option<u64>,
}

/// One record, joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuEvent<S> {
    /// The process the record came from.
    pub pid: u32,
    /// What the device did.
    pub op: Op,
    /// CUDA's ordinal in the process (renumbered by CUDA_VISIBLE_DEVICES).
    pub device: u32,
    /// The device's UUID, when CUPTI reported it.
    pub uuid: Option<[u8; 16]>,
    /// CUPTI's stream id.
    pub stream: u32,
    /// When the device started it, CLOCK_MONOTONIC ns.
    pub start: u64,
    /// ... and when it ended.
    pub end: u64,
    /// CUPTI's correlation id of the launching call.
    pub correlation: u32,
    /// None: the launch was not sampled; the record counts in totals, with no stack.
    pub sample: Option<Sampled<S>>,
}

impl<S> GpuEvent<S> {
    /// Device time, ns.
    pub fn duration(&self) -> u64 {
        self.end - self.start
    }
}

/// What a process's library last said of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessStatus {
    pub state: Option<State>,
    pub mode: Option<Mode>,
    pub sample_every: u32,
    pub cupti_version: u32,
    pub error: u32,
    /// The tool holding CUPTI, when the library stood aside.
    pub other_tool: Option<String>,
    pub ended: bool,
}

struct Note {
    weight: u32,
    tid: u32,
    nvtx: u32,
    api: Api,
    arrived: u64,
    claimed: bool,
}

struct StackEntry<S> {
    stack: S,
    tid: u32,
    launched: u64,
    arrived: u64,
    claimed: bool,
}

struct Process<S> {
    strings: HashMap<u32, Arc<str>>,
    string_bytes: usize,
    devices: HashMap<u32, [u8; 16]>,
    notes: HashMap<u32, Note>,
    stacks: HashMap<u32, StackEntry<S>>,
    aliases: HashMap<u32, (u32, u64)>,
    /// CLOCK_MONOTONIC minus CUPTI's clock.
    offset: i128,
    status: Option<Status>,
    next_seq: Option<u32>,
    window_start: u64,
    window_chunks: u32,
    last_seen: u64,
}

impl<S> Process<S> {
    fn new(now: u64) -> Self {
        Process {
            strings: HashMap::new(),
            string_bytes: 0,
            devices: HashMap::new(),
            notes: HashMap::new(),
            stacks: HashMap::new(),
            aliases: HashMap::new(),
            offset: 0,
            status: None,
            next_seq: None,
            window_start: now,
            window_chunks: 0,
            last_seen: now,
        }
    }

    fn sample_every(&self) -> u32 {
        self.status.map_or(1, |s| s.sample_every.max(1))
    }
}

/// The join's state over all processes.
pub struct Joiner<S> {
    limits: Limits,
    procs: HashMap<u32, Process<S>>,
    stats: Stats,
}

impl<S: Clone> Default for Joiner<S> {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

impl<S: Clone> Joiner<S> {
    /// A join that keeps no more than `limits`.
    pub fn new(limits: Limits) -> Self {
        Joiner {
            limits,
            procs: HashMap::new(),
            stats: Stats::default(),
        }
    }

    /// Its counts so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    fn process(&mut self, pid: u32, now: u64) -> Option<&mut Process<S>> {
        if !self.procs.contains_key(&pid) && self.procs.len() >= self.limits.processes {
            return None;
        }
        let p = self.procs.entry(pid).or_insert_with(|| Process::new(now));
        p.last_seen = now;
        Some(p)
    }

    /// The stack the probe took at a sampled launch (`correlation` from the marker's argument)
    /// at `launched` (the record's kernel time).
    pub fn stack(
        &mut self,
        pid: u32,
        tid: u32,
        correlation: u32,
        stack: S,
        launched: u64,
        now: u64,
    ) {
        let limit = self.limits.pending;
        let Some(p) = self.process(pid, now) else {
            self.stats.processes_refused += 1;
            return;
        };
        if p.stacks.len() >= limit && !p.stacks.contains_key(&correlation) {
            self.stats.kept_refused += 1;
            return;
        }
        p.stacks.insert(
            correlation,
            StackEntry {
                stack,
                tid,
                launched,
                arrived: now,
                claimed: false,
            },
        );
    }

    /// A chunk from process `pid`, as the ring buffer delivered it; returns the device work it
    /// held, joined.
    pub fn chunk(&mut self, pid: u32, bytes: &[u8], now: u64) -> Vec<GpuEvent<S>> {
        self.stats.chunks += 1;
        let chunk = match channel::parse(bytes) {
            Ok(c) => c,
            Err(_) => {
                self.stats.chunks_refused += 1;
                return Vec::new();
            }
        };
        let limits = self.limits;
        let Some(p) = self.process(pid, now) else {
            self.stats.processes_refused += 1;
            return Vec::new();
        };
        if now.saturating_sub(p.window_start) >= 1_000_000_000 {
            p.window_start = now;
            p.window_chunks = 0;
        }
        p.window_chunks += 1;
        if p.window_chunks > limits.chunks_per_second {
            self.stats.chunks_rate_limited += 1;
            return Vec::new();
        }
        let mut lost = 0;
        if let Some(want) = p.next_seq
            && chunk.seq > want
            && chunk.seq - want < 1 << 24
        {
            lost = u64::from(chunk.seq - want);
        }
        p.next_seq = Some(chunk.seq.wrapping_add(1));
        self.stats.chunks_lost += lost;
        self.records(pid, chunk, now)
    }

    fn records(&mut self, pid: u32, chunk: Chunk, now: u64) -> Vec<GpuEvent<S>> {
        let mut events = Vec::new();
        for record in chunk.records {
            match record {
                Record::Status(s) => self.status(pid, s),
                Record::String { id, text, .. } => self.string(pid, id, text),
                Record::Device { device, uuid } => {
                    let limit = self.limits.devices;
                    let p = self.procs.get_mut(&pid).expect("made by chunk");
                    if p.devices.len() < limit || p.devices.contains_key(&device) {
                        p.devices.insert(device, uuid);
                    } else {
                        self.stats.kept_refused += 1;
                    }
                }
                Record::Launch(l) => {
                    let max_weight = self.limits.max_weight;
                    let limit = self.limits.pending;
                    let p = self.procs.get_mut(&pid).expect("made by chunk");
                    if p.notes.len() >= limit && !p.notes.contains_key(&l.correlation) {
                        self.stats.kept_refused += 1;
                        continue;
                    }
                    p.notes.insert(
                        l.correlation,
                        Note {
                            weight: l.weight.clamp(1, max_weight),
                            tid: l.tid,
                            nvtx: l.nvtx,
                            api: l.api,
                            arrived: now,
                            claimed: false,
                        },
                    );
                }
                Record::Alias { from, to } => {
                    let limit = self.limits.pending;
                    let p = self.procs.get_mut(&pid).expect("made by chunk");
                    if from != to && (p.aliases.len() < limit || p.aliases.contains_key(&from)) {
                        p.aliases.insert(from, (to, now));
                    } else {
                        self.stats.kept_refused += 1;
                    }
                }
                Record::Clock { cupti, monotonic } => {
                    let p = self.procs.get_mut(&pid).expect("made by chunk");
                    p.offset = i128::from(monotonic) - i128::from(cupti);
                }
                Record::Kernel(k) => {
                    self.stats.kernels += 1;
                    let p = self.procs.get(&pid).expect("made by chunk");
                    let name = p
                        .strings
                        .get(&k.name)
                        .cloned()
                        .unwrap_or_else(|| Arc::from(format!("<kernel #{}>", k.name)));
                    let op = Op::Kernel {
                        name,
                        grid: k.grid,
                        block: k.block,
                        graph: k.graph,
                        cooperative: k.launch_type != 0,
                    };
                    let keys = [k.correlation, 0];
                    if let Some(e) =
                        self.event(pid, op, (k.device, k.stream), (k.start, k.end), keys)
                    {
                        events.push(e);
                    }
                }
                Record::Memcpy(c) => events.extend(self.copy(pid, c, false)),
                Record::Memset(c) => events.extend(self.copy(pid, c, true)),
                Record::Unknown(_) => self.stats.records_unknown += 1,
            }
        }
        events
    }

    fn copy(&mut self, pid: u32, c: channel::Copy, set: bool) -> Option<GpuEvent<S>> {
        self.stats.copies += 1;
        let op = if set {
            Op::Memset { bytes: c.bytes }
        } else {
            Op::Memcpy {
                kind: c.copy_kind,
                bytes: c.bytes,
            }
        };
        let keys = [c.correlation, c.runtime_correlation];
        self.event(pid, op, (c.device, c.stream), (c.start, c.end), keys)
    }

    fn status(&mut self, pid: u32, s: Status) {
        let p = self.procs.get_mut(&pid).expect("made by chunk");
        let old = p.status.unwrap_or_default();
        // Cumulative counters: a smaller value is a new library (a restart), counted whole.
        let delta = |new: u64, old: u64| if new >= old { new - old } else { new };
        let st = &mut self.stats;
        st.lib_launches += delta(s.launches, old.launches);
        st.lib_sampled += delta(s.sampled, old.sampled);
        st.cupti_dropped += delta(s.cupti_dropped, old.cupti_dropped);
        st.buffers_refused += delta(s.buffers_refused, old.buffers_refused);
        st.notes_dropped += delta(s.notes_dropped, old.notes_dropped);
        st.names_dropped += delta(s.names_dropped, old.names_dropped);
        // Each process once, at its first status in that state.
        if p.status.is_none_or(|o| o.state != s.state) {
            match s.state {
                Some(State::SteppedAside) => st.processes_stood_aside += 1,
                Some(State::NoCupti) => st.processes_without_cupti += 1,
                Some(State::CuptiError) => st.processes_cupti_error += 1,
                _ => {}
            }
        }
        p.status = Some(s);
    }

    fn string(&mut self, pid: u32, id: u32, text: String) {
        let limits = self.limits;
        let p = self.procs.get_mut(&pid).expect("made by chunk");
        if let Some(old) = p.strings.get(&id) {
            if **old == *text {
                return;
            }
            p.string_bytes -= old.len();
        } else if p.strings.len() >= limits.strings {
            self.stats.kept_refused += 1;
            return;
        }
        if p.string_bytes + text.len() > limits.string_bytes {
            p.strings.remove(&id);
            self.stats.kept_refused += 1;
            return;
        }
        p.string_bytes += text.len();
        p.strings.insert(id, Arc::from(text));
    }

    /// Joins one device record: its times onto CLOCK_MONOTONIC, its sampled launch (by its
    /// correlation ids, then their aliases) if any.
    fn event(
        &mut self,
        pid: u32,
        op: Op,
        (device, stream): (u32, u32),
        (start, end): (u64, u64),
        keys: [u32; 2],
    ) -> Option<GpuEvent<S>> {
        if end < start || end - start > self.limits.max_duration_ns {
            self.stats.records_refused += 1;
            return None;
        }
        let p = self.procs.get_mut(&pid).expect("made by chunk");
        let to_monotonic =
            |t: u64| (i128::from(t) + p.offset).clamp(0, i128::from(u64::MAX)) as u64;
        let (start, end) = (to_monotonic(start), to_monotonic(end));
        let key = keys
            .into_iter()
            .filter(|&k| k != 0)
            .flat_map(|k| [Some(k), p.aliases.get(&k).map(|a| a.0)])
            .flatten()
            .find(|k| p.notes.contains_key(k) || p.stacks.contains_key(k));
        let sample = key.map(|k| {
            let every = p.sample_every();
            let note = p.notes.get_mut(&k);
            let (weight, nvtx, api, note_tid) = match note {
                Some(n) => {
                    n.claimed = true;
                    (n.weight, n.nvtx, Some(n.api), Some(n.tid))
                }
                None => (every, 0, None, None),
            };
            let stack = p.stacks.get_mut(&k).map(|s| {
                s.claimed = true;
                (s.stack.clone(), s.tid, s.launched)
            });
            Sampled {
                weight,
                tid: stack.as_ref().map(|s| s.1).or(note_tid),
                launched: stack.as_ref().map(|s| s.2),
                stack: stack.map(|s| s.0),
                nvtx: (nvtx != 0).then(|| p.strings.get(&nvtx).cloned()).flatten(),
                api,
            }
        });
        if let Some(s) = &sample {
            self.stats.sampled += 1;
            if s.stack.is_none() {
                self.stats.stacks_missing += 1;
            }
        }
        Some(GpuEvent {
            pid,
            op,
            device,
            uuid: p.devices.get(&device).copied(),
            stream,
            start,
            end,
            correlation: keys[0],
            sample,
        })
    }

    /// Forgets sampled launches, stacks and aliases older than the limits allow (counting the
    /// stacks nothing claimed), and processes silent for longer.
    pub fn expire(&mut self, now: u64) {
        let ttl = self.limits.pending_ttl_ns;
        let idle = self.limits.idle_ttl_ns;
        let mut unclaimed = 0;
        self.procs.retain(|_, p| {
            let old = |t: u64| now.saturating_sub(t) > ttl;
            p.notes.retain(|_, n| !old(n.arrived));
            p.stacks.retain(|_, s| {
                let keep = !old(s.arrived);
                if !keep && !s.claimed {
                    unclaimed += 1;
                }
                keep
            });
            p.aliases.retain(|_, a| !old(a.1));
            now.saturating_sub(p.last_seen) <= idle
        });
        self.stats.stacks_unclaimed += unclaimed;
    }

    /// The launch stacks still waiting for their records, given to a new owner: `f` maps each
    /// to the new owner's handle (None forgets it). The agent's capture of one push interval
    /// hands them to the next's, whose stack ids differ.
    pub fn remap_stacks<T>(self, mut f: impl FnMut(&S) -> Option<T>) -> Joiner<T> {
        let procs = self
            .procs
            .into_iter()
            .map(|(pid, p)| {
                let stacks = p
                    .stacks
                    .into_iter()
                    .filter_map(|(c, e)| {
                        let stack = f(&e.stack)?;
                        Some((
                            c,
                            StackEntry {
                                stack,
                                tid: e.tid,
                                launched: e.launched,
                                arrived: e.arrived,
                                claimed: e.claimed,
                            },
                        ))
                    })
                    .collect();
                let q = Process {
                    strings: p.strings,
                    string_bytes: p.string_bytes,
                    devices: p.devices,
                    notes: p.notes,
                    stacks,
                    aliases: p.aliases,
                    offset: p.offset,
                    status: p.status,
                    next_seq: p.next_seq,
                    window_start: p.window_start,
                    window_chunks: p.window_chunks,
                    last_seen: p.last_seen,
                };
                (pid, q)
            })
            .collect();
        Joiner {
            limits: self.limits,
            procs,
            stats: self.stats,
        }
    }

    /// The stack handles waiting for records.
    pub fn pending_stacks(&self) -> impl Iterator<Item = &S> {
        self.procs
            .values()
            .flat_map(|p| p.stacks.values().map(|e| &e.stack))
    }

    /// What each process's library said of itself last.
    pub fn statuses(&self) -> Vec<(u32, ProcessStatus)> {
        let mut out: Vec<(u32, ProcessStatus)> = self
            .procs
            .iter()
            .filter_map(|(&pid, p)| {
                let s = p.status?;
                Some((
                    pid,
                    ProcessStatus {
                        state: s.state,
                        mode: s.mode,
                        sample_every: s.sample_every,
                        cupti_version: s.cupti_version,
                        error: s.error,
                        other_tool: (s.other != 0)
                            .then(|| p.strings.get(&s.other).map(|t| t.to_string()))
                            .flatten(),
                        ended: s.last,
                    },
                ))
            })
            .collect();
        out.sort_by_key(|(pid, _)| *pid);
        out
    }

    /// The name of a process's device `device` as the `gpu` label wants it: its UUID when
    /// CUPTI reported one.
    pub fn device_uuid(&self, pid: u32, device: u32) -> Option<[u8; 16]> {
        self.procs.get(&pid)?.devices.get(&device).copied()
    }
}

#[cfg(test)]
mod tests;
