//! pprof (gzipped protobuf) writer and reader.
//!
//! Mapping model: pyrometer symbolizes in the agent and stores module-relative addresses
//! (ELF file offsets for user code, absolute addresses for kernel code), not the virtual
//! addresses of one process. Each mapping therefore spans the whole address space
//! (`memory_start` 0, `memory_limit` u64::MAX, `file_offset` 0), so `Location.address` reads as
//! a file offset within the mapping's object, or as a kernel address for `[kernel.kallsyms]`.
//! One mapping serves every process that loaded the object; its build id identifies it.
//!
//! Frames whose address nothing could name (`FrameKind::Unknown`) become locations without
//! lines, pprof's way of saying "unsymbolized", so its tools show the address.

use std::collections::HashMap;
use std::io::Write;

use pyrometer_proto as pb;

use crate::model::{Frame, FrameKind, LabelValue, Labels, Profile, SampleType};
use crate::output::OutputError;

/// Pseudo file name of the kernel's mapping, as perf and pprof name it.
pub const KERNEL_MAPPING: &str = "[kernel.kallsyms]";
/// Pseudo file name of the mapping of Python frames (functions with source files and lines,
/// no addresses), so a profile read back knows them.
pub const PYTHON_MAPPING: &str = pyrometer_proto::naming::PYTHON_MAPPING;
/// The mapping GPU frames are written under, which tells them apart when read back.
pub const GPU_MAPPING: &str = pyrometer_proto::naming::GPU_MAPPING;

/// Builds the string table: "" at index 0, then strings in order of first use, so the same
/// profile always gives the same table.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    ids: crate::FastMap<String, i64>,
}

impl Strings {
    fn id(&mut self, s: &str) -> i64 {
        if self.table.is_empty() {
            self.table.push(String::new());
            self.ids.insert(String::new(), 0);
        }
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = self.table.len() as i64;
        self.table.push(s.to_string());
        self.ids.insert(s.to_string(), id);
        id
    }
}

type LocationKey = (u64, u64, Vec<(u64, i64, i32)>);

#[derive(Default)]
struct Writer {
    strings: Strings,
    mappings: Vec<pb::Mapping>,
    mapping_ids: crate::FastMap<(String, String), u64>,
    functions: Vec<pb::Function>,
    function_ids: crate::FastMap<(String, String), u64>,
    locations: Vec<pb::Location>,
    location_ids: crate::FastMap<LocationKey, u64>,
}

impl Writer {
    fn value_type(&mut self, t: &SampleType) -> pb::ValueType {
        pb::ValueType {
            r#type: self.strings.id(&t.name),
            unit: self.strings.id(&t.unit),
        }
    }

    /// The mapping of a frame (0 for frames that belong to no known object), with its flags
    /// widened to cover what this frame carries.
    fn mapping(&mut self, frame: &Frame) -> u64 {
        let file = match (frame.kind, &frame.module) {
            (FrameKind::Kernel, _) => KERNEL_MAPPING,
            // Tasks belong with the Python frames they ran.
            (FrameKind::Python | FrameKind::Task, _) => PYTHON_MAPPING,
            (FrameKind::Gpu, _) => GPU_MAPPING,
            (_, Some(module)) => module.as_str(),
            (_, None) => return 0,
        };
        let build_id = frame.build_id.as_deref().unwrap_or("");
        let key = (file.to_string(), build_id.to_string());
        let id = match self.mapping_ids.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.mappings.len() as u64 + 1;
                let m = pb::Mapping {
                    id,
                    memory_start: 0,
                    memory_limit: u64::MAX,
                    file_offset: 0,
                    filename: self.strings.id(file),
                    build_id: self.strings.id(build_id),
                    ..Default::default()
                };
                self.mappings.push(m);
                self.mapping_ids.insert(key, id);
                id
            }
        };
        let m = &mut self.mappings[id as usize - 1];
        m.has_functions |= frame.kind != FrameKind::Unknown;
        m.has_filenames |= frame.file.is_some();
        m.has_line_numbers |= frame.line.is_some();
        m.has_inline_frames |= frame.inlined;
        id
    }

    fn function(&mut self, frame: &Frame) -> u64 {
        let file = frame.file.as_deref().unwrap_or("");
        let key = (frame.function.clone(), file.to_string());
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let name = self.strings.id(&frame.function);
        let f = pb::Function {
            id,
            name,
            system_name: pb::Function::system_name_index(&frame.function, name),
            filename: self.strings.id(file),
            start_line: 0,
        };
        self.functions.push(f);
        self.function_ids.insert(key, id);
        id
    }

    /// One location for an outer frame and the frames inlined into it (`run`, leaf first).
    fn location(&mut self, run: &[&Frame]) -> u64 {
        let outer = run[run.len() - 1];
        let mapping_id = self.mapping(outer);
        for f in &run[..run.len() - 1] {
            self.mapping(f);
        }
        let lines: Vec<(u64, i64, i32)> = run
            .iter()
            .filter(|f| f.kind != FrameKind::Unknown)
            .map(|f| {
                let kind = wire_kind(f) as i32;
                (self.function(f), f.line.map_or(0, i64::from), kind)
            })
            .collect();
        let key = (mapping_id, outer.address, lines);
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(pb::Location {
            id,
            mapping_id,
            address: outer.address,
            line: key
                .2
                .iter()
                .map(|&(function_id, line, kind)| pb::Line {
                    function_id,
                    line,
                    column: 0,
                    kind,
                })
                .collect(),
            is_folded: false,
        });
        self.location_ids.insert(key, id);
        id
    }

    fn stack(&mut self, frames_leaf_first: &[&Frame]) -> Vec<u64> {
        let mut ids = Vec::new();
        let mut start = 0;
        for (i, f) in frames_leaf_first.iter().enumerate() {
            let last = i + 1 == frames_leaf_first.len();
            if !f.inlined || last {
                ids.push(self.location(&frames_leaf_first[start..=i]));
                start = i + 1;
            }
        }
        ids
    }
}

/// The kind a frame's line carries: what [`pyrometer_proto::naming`] names it by.
fn wire_kind(f: &Frame) -> pb::FrameKind {
    match f.kind {
        FrameKind::Kernel => pb::FrameKind::Kernel,
        FrameKind::Python => pb::FrameKind::Python,
        FrameKind::Jit => pb::FrameKind::Jit,
        FrameKind::Gpu => pb::FrameKind::Gpu,
        FrameKind::Budget => pb::FrameKind::Budget,
        FrameKind::Task => pb::FrameKind::AsyncioTask,
        FrameKind::Native if f.inlined => pb::FrameKind::Inlined,
        FrameKind::Native => pb::FrameKind::Native,
        FrameKind::Unknown => pb::FrameKind::Unspecified,
    }
}

/// The frame kind a line says it is; None when it says nothing this reader has frames for.
fn line_kind(kind: i32) -> Option<FrameKind> {
    match pb::FrameKind::try_from(kind).ok()? {
        pb::FrameKind::Kernel => Some(FrameKind::Kernel),
        pb::FrameKind::Python => Some(FrameKind::Python),
        pb::FrameKind::Jit => Some(FrameKind::Jit),
        pb::FrameKind::Gpu => Some(FrameKind::Gpu),
        pb::FrameKind::Budget => Some(FrameKind::Budget),
        pb::FrameKind::AsyncioTask => Some(FrameKind::Task),
        pb::FrameKind::Native | pb::FrameKind::Inlined => Some(FrameKind::Native),
        _ => None,
    }
}

/// Puts executables first, then shared libraries, then pseudo mappings such as the kernel's,
/// keeping first-use order within each group. pprof tools take the first mapping as the main
/// binary (`File:` in their reports); first-use order would often make that the kernel.
fn order_mappings(
    mappings: &mut [pb::Mapping],
    locations: &mut [pb::Location],
    strings: &[String],
) {
    let rank = |m: &pb::Mapping| {
        let file = strings[m.filename as usize].as_str();
        let name = file.rsplit('/').next().unwrap_or(file);
        if file.is_empty() || file.starts_with('[') {
            2
        } else if name.ends_with(".so") || name.contains(".so.") {
            1
        } else {
            0
        }
    };
    mappings.sort_by_key(rank);
    let mut new_id = vec![0; mappings.len() + 1];
    for (i, m) in mappings.iter_mut().enumerate() {
        new_id[m.id as usize] = i as u64 + 1;
        m.id = i as u64 + 1;
    }
    for l in locations {
        l.mapping_id = new_id[l.mapping_id as usize];
    }
}

/// The unit of a numeric label, for pprof's `num_unit` (`go tool pprof -tags` shows
/// `gpu_memory` in MB, GB rather than raw numbers). Labels not listed have none.
fn label_unit(key: &str) -> Option<&'static str> {
    match key {
        "gpu_memory" => Some("bytes"),
        _ => None,
    }
}

/// Converts a profile to pprof messages, all sample types included.
pub fn to_pprof(profile: &Profile) -> pb::Profile {
    let mut w = Writer::default();
    w.strings.id("");
    let sample_type: Vec<pb::ValueType> = profile
        .sample_types
        .iter()
        .map(|t| w.value_type(t))
        .collect();
    let period_type = profile.period_type.as_ref().map(|t| w.value_type(t));
    let mut stacks: HashMap<u32, Vec<u64>> = HashMap::new();
    let mut sample = Vec::with_capacity(profile.samples.len());
    for s in &profile.samples {
        let location_id = match stacks.get(&s.stack) {
            Some(ids) => ids.clone(),
            None => {
                let frames: Vec<&Frame> = profile.stack_frames(s.stack).collect();
                let ids = w.stack(&frames);
                stacks.insert(s.stack, ids.clone());
                ids
            }
        };
        let label = s
            .labels
            .iter()
            .map(|(k, value)| {
                let key = w.strings.id(k);
                match value {
                    LabelValue::Str(v) => pb::Label {
                        key,
                        str: w.strings.id(v),
                        ..Default::default()
                    },
                    LabelValue::Num(n) => pb::Label {
                        key,
                        num: *n,
                        num_unit: label_unit(k).map_or(0, |u| w.strings.id(u)),
                        ..Default::default()
                    },
                }
            })
            .collect();
        sample.push(pb::Sample {
            location_id,
            value: s.values.clone(),
            label,
        });
    }
    order_mappings(&mut w.mappings, &mut w.locations, &w.strings.table);
    let comment = profile.comments.iter().map(|c| w.strings.id(c)).collect();
    let default_sample_type = profile
        .sample_types
        .get(profile.default_type)
        .map_or(0, |t| w.strings.id(&t.name));
    pb::Profile {
        sample_type,
        sample,
        mapping: w.mappings,
        location: w.locations,
        function: w.functions,
        string_table: w.strings.table,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos: profile.time_nanos,
        duration_nanos: profile.duration_nanos,
        period_type,
        period: profile.period,
        comment,
        default_sample_type,
        doc_url: 0,
    }
}

/// Writes a profile as a gzipped pprof file.
pub fn write_pprof(profile: &Profile, out: &mut dyn Write) -> Result<(), OutputError> {
    out.write_all(&pb::encode_gz(&to_pprof(profile)))?;
    Ok(())
}

/// Why a pprof profile could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PprofError {
    /// Not protobuf, or not the profile message.
    #[error(transparent)]
    Decode(#[from] pb::DecodeError),
    /// A string index past the string table.
    #[error("string index {index} out of range (the string table has {len} entries)")]
    BadString {
        /// The index.
        index: i64,
        /// The table's length.
        len: usize,
    },
    /// The string table's first entry is not the empty string.
    #[error("string table must start with \"\"")]
    StringTableStart,
    /// Two mappings, functions or locations with one id.
    #[error("{kind} id {id} is used twice")]
    DuplicateId {
        /// `mapping`, `function` or `location`.
        kind: &'static str,
        /// The id.
        id: u64,
    },
    /// A mapping, function or location with id 0.
    #[error("{kind} id 0 is reserved")]
    ZeroId {
        /// `mapping`, `function` or `location`.
        kind: &'static str,
    },
    /// A reference to an id nothing has.
    #[error("{from} refers to unknown {kind} id {id}")]
    UnknownId {
        /// What refers.
        from: &'static str,
        /// What it refers to.
        kind: &'static str,
        /// The id.
        id: u64,
    },
    /// A sample with more or fewer values than there are sample types.
    #[error("sample {index} has {got} values but the profile has {want} sample types")]
    ValueCount {
        /// The sample's position.
        index: usize,
        /// Its values.
        got: usize,
        /// The sample types.
        want: usize,
    },
}

/// Reads a pprof profile, gzipped or raw.
pub fn read_pprof(bytes: &[u8]) -> Result<Profile, PprofError> {
    from_pprof(&pb::decode(bytes)?)
}

/// Whether a mapping file name is the kernel's (perf also writes `[kernel.kallsyms]_text`).
fn is_kernel_mapping(file: &str) -> bool {
    file.starts_with(KERNEL_MAPPING)
}

/// Whether a mapping file name is a perf JIT map (`/tmp/perf-PID.map`).
fn is_jit_mapping(file: &str) -> bool {
    let name = file.rsplit('/').next().unwrap_or(file);
    name.strip_prefix("perf-")
        .and_then(|rest| rest.strip_suffix(".map"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// Ids that must be non-zero and unique, mapped to their index.
fn index_ids(
    kind: &'static str,
    ids: impl Iterator<Item = u64>,
) -> Result<HashMap<u64, usize>, PprofError> {
    let mut map = HashMap::new();
    for (i, id) in ids.enumerate() {
        if id == 0 {
            return Err(PprofError::ZeroId { kind });
        }
        if map.insert(id, i).is_some() {
            return Err(PprofError::DuplicateId { kind, id });
        }
    }
    Ok(map)
}

/// Converts pprof messages to a profile. Each location expands to one frame per line, the
/// inlined ones first and marked `inlined`; a location without lines becomes an unknown frame.
pub fn from_pprof(p: &pb::Profile) -> Result<Profile, PprofError> {
    if p.string_table.first().is_some_and(|s| !s.is_empty()) {
        return Err(PprofError::StringTableStart);
    }
    let s = |index: i64| -> Result<&str, PprofError> {
        // Index 0 is "" even in a profile whose table is empty (nothing named).
        if index == 0 {
            return Ok("");
        }
        p.str(index).ok_or(PprofError::BadString {
            index,
            len: p.string_table.len(),
        })
    };
    let opt = |index: i64| -> Result<Option<String>, PprofError> {
        s(index).map(|v| (!v.is_empty()).then(|| v.to_string()))
    };
    let vt = |t: &pb::ValueType| -> Result<SampleType, PprofError> {
        Ok(SampleType::new(s(t.r#type)?, s(t.unit)?))
    };

    let sample_types = p
        .sample_type
        .iter()
        .map(vt)
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Profile::new(sample_types);
    let default_name = s(p.default_sample_type)?;
    out.default_type = out
        .sample_types
        .iter()
        .position(|t| !default_name.is_empty() && t.name == default_name)
        // pprof's rule when no default is named: the last sample type.
        .unwrap_or(out.sample_types.len().saturating_sub(1));
    out.period_type = p.period_type.as_ref().map(vt).transpose()?;
    out.period = p.period;
    out.time_nanos = p.time_nanos;
    out.duration_nanos = p.duration_nanos;
    out.comments = p
        .comment
        .iter()
        .map(|&c| s(c).map(String::from))
        .collect::<Result<_, _>>()?;

    let mappings = index_ids("mapping", p.mapping.iter().map(|m| m.id))?;
    let functions = index_ids("function", p.function.iter().map(|f| f.id))?;
    let locations = index_ids("location", p.location.iter().map(|l| l.id))?;

    // Frames of each location (leaf first), interned once however many samples use it.
    let mut location_frames: Vec<Vec<u32>> = Vec::with_capacity(p.location.len());
    for loc in &p.location {
        let (module, build_id) = if loc.mapping_id == 0 {
            (None, None)
        } else {
            let &i = mappings.get(&loc.mapping_id).ok_or(PprofError::UnknownId {
                from: "location",
                kind: "mapping",
                id: loc.mapping_id,
            })?;
            (opt(p.mapping[i].filename)?, opt(p.mapping[i].build_id)?)
        };
        let module_kind = match module.as_deref() {
            Some(m) if is_kernel_mapping(m) => FrameKind::Kernel,
            Some(m) if is_jit_mapping(m) => FrameKind::Jit,
            Some(PYTHON_MAPPING) => FrameKind::Python,
            Some(GPU_MAPPING) => FrameKind::Gpu,
            _ => FrameKind::Native,
        };
        let module =
            module.filter(|_| module_kind != FrameKind::Python && module_kind != FrameKind::Gpu);
        let base = Frame {
            module,
            build_id,
            address: loc.address,
            ..Frame::named("[unknown]", FrameKind::Unknown)
        };
        let mut ids = Vec::with_capacity(loc.line.len().max(1));
        for (n, line) in loc.line.iter().enumerate() {
            let &fi = functions
                .get(&line.function_id)
                .ok_or(PprofError::UnknownId {
                    from: "location",
                    kind: "function",
                    id: line.function_id,
                })?;
            let f = &p.function[fi];
            let mut name = s(f.name)?;
            if name.is_empty() {
                name = s(f.system_name)?;
            }
            // The line says what it is; files that do not (older ones, other tools') are
            // read by their mapping's name.
            let mut kind = line_kind(line.kind).unwrap_or(module_kind);
            // Profiles converted from folded stacks mark kernel frames only by this suffix.
            if let Some(stripped) = name.strip_suffix(crate::output::folded::KERNEL_SUFFIX) {
                name = stripped;
                kind = FrameKind::Kernel;
            }
            let frame = Frame {
                function: if name.is_empty() { "[unknown]" } else { name }.to_string(),
                file: opt(f.filename)?,
                line: u32::try_from(line.line).ok().filter(|&l| l > 0),
                kind,
                inlined: n + 1 < loc.line.len(),
                module: base
                    .module
                    .clone()
                    .filter(|_| !matches!(kind, FrameKind::Python | FrameKind::Task)),
                ..base.clone()
            };
            ids.push(out.intern_frame(frame));
        }
        if ids.is_empty() {
            ids.push(out.intern_frame(base));
        }
        location_frames.push(ids);
    }

    let want = out.sample_types.len();
    for (index, smp) in p.sample.iter().enumerate() {
        if smp.value.len() != want {
            return Err(PprofError::ValueCount {
                index,
                got: smp.value.len(),
                want,
            });
        }
        let mut stack = Vec::with_capacity(smp.location_id.len());
        for id in &smp.location_id {
            let &li = locations.get(id).ok_or(PprofError::UnknownId {
                from: "sample",
                kind: "location",
                id: *id,
            })?;
            stack.extend_from_slice(&location_frames[li]);
        }
        let mut labels = Labels::new();
        for l in &smp.label {
            let value = if l.str != 0 {
                LabelValue::Str(s(l.str)?.to_string())
            } else {
                LabelValue::Num(l.num)
            };
            labels.set(s(l.key)?, value);
        }
        let stack = out.intern_stack(stack);
        out.add(stack, labels, &smp.value);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
