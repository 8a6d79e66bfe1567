//! The pprof profile format as prost messages, declared by hand so the build needs no `protoc`
//! and no build script. Field numbers and types follow the public `profile.proto` spec so files
//! we write are read by `go tool pprof`, Pyroscope, Parca and speedscope; the documentation
//! below is ours.
//!
//! Strings are never stored inline: every string-valued field is an index into
//! [`Profile::string_table`], whose entry 0 must be the empty string. Ids of mappings,
//! locations and functions are non-zero; 0 means "none".

pub mod capture;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod ingest;
pub mod naming;
pub mod otlp;

use std::fmt::Write as _;
use std::io::{Read, Write as _};

/// A whole profile: the value types, the samples, and the tables samples point into.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    /// What each entry of [`Sample::value`] measures, in the same order.
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    /// Object files the locations fall in; ids are referenced by [`Location::mapping_id`].
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    /// Code addresses; ids are referenced by [`Sample::location_id`].
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    /// Functions; ids are referenced by [`Line::function_id`].
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    /// Every string of the profile, referenced by index; index 0 is always "".
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    /// String index of a regex: readers hide frames matching it and everything above them.
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    /// String index of a regex that exempts frames from `drop_frames`.
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    /// When the capture started, ns since the Unix epoch.
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    /// How long the capture lasted, in ns.
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    /// The kind of event between two samples, e.g. cpu/nanoseconds.
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    /// How much of `period_type` one sample stands for.
    #[prost(int64, tag = "12")]
    pub period: i64,
    /// String indices of free-form notes shown by readers.
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    /// String index of the `type` of the sample type readers show first; when 0 readers pick
    /// the last sample type.
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
    /// String index of a URL explaining the profile, for readers that link to docs.
    #[prost(int64, tag = "15")]
    pub doc_url: i64,
}

/// A kind of measured value: `r#type` names it (e.g. "cpu"), `unit` its unit (e.g.
/// "nanoseconds"); both are string indices.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

/// One stack with its measured values and labels.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    /// Location ids, leaf first: `location_id[0]` is where the sample was taken.
    #[prost(uint64, repeated, packed = "true", tag = "1")]
    pub location_id: Vec<u64>,
    /// One value per [`Profile::sample_type`].
    #[prost(int64, repeated, packed = "true", tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

/// A key with either a string value (`str` non-zero) or a numeric one (`num`, optionally with
/// a unit). All strings are string indices.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

/// An object file mapped into the profiled process, and what was resolved for its code.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// First address covered by the mapping.
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    /// First address past the mapping.
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    /// File offset that `memory_start` corresponds to.
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    /// String index of the object's path, or of a pseudo name like `[kernel.kallsyms]`.
    #[prost(int64, tag = "5")]
    pub filename: i64,
    /// String index of the object's build id (GNU build-id in hex for ELF files).
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    /// The flags tell readers which symbol data is already present, so they do not try to
    /// symbolize again.
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

/// A code address and the source lines it resolves to.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// 0 when the address belongs to no known mapping.
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    /// More than one line when functions were inlined here: `line[0]` is the innermost
    /// (inlined) function, the last entry the function that was really called.
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    /// Several addresses were folded into this location by the producer.
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

/// A source position inside a function.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    /// 0 when unknown.
    #[prost(int64, tag = "2")]
    pub line: i64,
    /// 0 when unknown.
    #[prost(int64, tag = "3")]
    pub column: i64,
    /// What kind of frame this line is ([`FrameKind`]), pyrometer's own field: its number is
    /// far outside the spec's, so other readers skip it. 0 (absent): the mapping's file name
    /// tells, by the convention of [`naming`] (`[kernel.kallsyms]`, `[python]`).
    #[prost(enumeration = "FrameKind", tag = "100")]
    pub kind: i32,
}

/// What a frame is: carried by [`Line::kind`] from the capture to the collector, so frames
/// are told apart by a field, not by their mapping's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum FrameKind {
    /// Not said: the mapping's file name tells (older producers, other tools).
    Unspecified = 0,
    /// Native user-space code of an ELF object.
    Native = 1,
    /// Kernel code.
    Kernel = 2,
    /// A Python function (a CPython frame), named with its file and line.
    Python = 3,
    /// Native code inlined into the next line's function (towards the root).
    Inlined = 4,
    /// JIT code named by a `/tmp/perf-PID.map` file.
    Jit = 5,
    /// A GPU kernel (room for the device side of a launch).
    Gpu = 6,
    /// An asyncio task (room for coroutine stacks).
    AsyncioTask = 7,
    /// Marks a stack cut short: the frames beyond it were not kept.
    Truncated = 8,
    /// Marks a walk that ran out of its budget (instructions, reads) in the kernel, or stands
    /// for the user stack of a process over the budget the profiler spends on one process
    /// (`[budget]`).
    Budget = 9,
}

impl FrameKind {
    /// The kind's name in text dumps and docs: `native`, `kernel`, `python`, ….
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Unspecified => "unspecified",
            FrameKind::Native => "native",
            FrameKind::Kernel => "kernel",
            FrameKind::Python => "python",
            FrameKind::Inlined => "inlined",
            FrameKind::Jit => "jit",
            FrameKind::Gpu => "gpu",
            FrameKind::AsyncioTask => "asyncio_task",
            FrameKind::Truncated => "truncated",
            FrameKind::Budget => "budget",
        }
    }
}

/// A function; all names are string indices.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Human-readable (demangled) name.
    #[prost(int64, tag = "2")]
    pub name: i64,
    /// Name as the linker saw it (mangled), when it differs.
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}

impl Function {
    /// The `system_name` string index to write for a function called `name` (already
    /// readable) whose own index is `name_index`: the name itself, as Go's own profiles do,
    /// except where `go tool pprof` would mangle it. pprof treats a function whose system name
    /// equals its name as not yet demangled and "simplifies" anything with angle brackets as
    /// C++ templates: `<module>`, `<lambda>` and `<genexpr>` became empty names (shown as
    /// `[[python]]`), `<T as Trait>::f` became `::f`. Such names get the empty string (index
    /// 0), which pprof leaves alone.
    pub fn system_name_index(name: &str, name_index: i64) -> i64 {
        if name.starts_with('<') { 0 } else { name_index }
    }
}

impl Profile {
    /// The string at a string-table index, or `None` when the index is out of range (a
    /// corrupt or hand-made profile).
    pub fn str(&self, index: i64) -> Option<&str> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.string_table.get(i))
            .map(String::as_str)
    }
}

/// Files above this size after decompression are refused: a real profile is far smaller, and
/// the cap keeps a hostile or corrupt gzip stream from exhausting memory.
pub const MAX_DECODED_BYTES: u64 = 1 << 30;

/// Why bytes could not be decoded as a pprof profile.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("bad gzip data: {0}")]
    Gzip(#[source] std::io::Error),
    #[error("profile is larger than {} MiB once decompressed", MAX_DECODED_BYTES >> 20)]
    TooLarge,
    #[error("bad protobuf data: {0}")]
    Protobuf(#[from] prost::DecodeError),
}

/// Whether `bytes` start with the gzip magic number.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

/// Serializes a profile to the gzipped protobuf that pprof files contain.
pub fn encode_gz(profile: &Profile) -> Vec<u8> {
    let raw = prost::Message::encode_to_vec(profile);
    // GzEncoder writes mtime 0 and no file name, so equal profiles give equal bytes.
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(&raw)
        .and_then(|()| enc.finish())
        .expect("writing to a Vec cannot fail")
}

/// Parses a pprof profile, gzipped (as files usually are) or raw protobuf.
pub fn decode(bytes: &[u8]) -> Result<Profile, DecodeError> {
    if !is_gzip(bytes) {
        return Ok(prost::Message::decode(bytes)?);
    }
    let mut raw = Vec::new();
    // Multi-member: concatenated gzip streams are valid gzip and some tools write them.
    flate2::read::MultiGzDecoder::new(bytes)
        .take(MAX_DECODED_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(DecodeError::Gzip)?;
    if raw.len() as u64 > MAX_DECODED_BYTES {
        return Err(DecodeError::TooLarge);
    }
    Ok(prost::Message::decode(raw.as_slice())?)
}

/// A stable, human-readable rendering of a profile with strings resolved, for golden files
/// and debugging. It prints tables in stored order, so it shows exactly what a writer
/// produced; bad string indices print as `<bad string N>` instead of failing.
pub fn dump_text(p: &Profile) -> String {
    let s = |i: i64| -> String {
        match p.str(i) {
            Some(v) => format!("{v:?}"),
            None => format!("<bad string {i}>"),
        }
    };
    let vt = |v: &ValueType| format!("{}/{}", s(v.r#type), s(v.unit));
    let mut o = String::new();
    // Writing to a String cannot fail; the results are ignored for brevity.
    let _ = writeln!(
        o,
        "sample_types: {}",
        p.sample_type.iter().map(vt).collect::<Vec<_>>().join(" ")
    );
    let _ = writeln!(o, "default_sample_type: {}", s(p.default_sample_type));
    match &p.period_type {
        Some(t) => {
            let _ = writeln!(o, "period: {} {}", p.period, vt(t));
        }
        None => {
            let _ = writeln!(o, "period: {}", p.period);
        }
    }
    let _ = writeln!(o, "time_nanos: {}", p.time_nanos);
    let _ = writeln!(o, "duration_nanos: {}", p.duration_nanos);
    if p.drop_frames != 0 || p.keep_frames != 0 {
        let _ = writeln!(
            o,
            "drop_frames: {} keep_frames: {}",
            s(p.drop_frames),
            s(p.keep_frames)
        );
    }
    if p.doc_url != 0 {
        let _ = writeln!(o, "doc_url: {}", s(p.doc_url));
    }
    for &c in &p.comment {
        let _ = writeln!(o, "comment: {}", s(c));
    }
    let _ = writeln!(o, "mappings:");
    for m in &p.mapping {
        let flags: Vec<&str> = [
            (m.has_functions, "functions"),
            (m.has_filenames, "filenames"),
            (m.has_line_numbers, "line_numbers"),
            (m.has_inline_frames, "inline_frames"),
        ]
        .iter()
        .filter(|(set, _)| *set)
        .map(|&(_, name)| name)
        .collect();
        let _ = writeln!(
            o,
            "  {}: {} build_id={} range={:#x}..{:#x} offset={:#x} has=[{}]",
            m.id,
            s(m.filename),
            s(m.build_id),
            m.memory_start,
            m.memory_limit,
            m.file_offset,
            flags.join(",")
        );
    }
    let _ = writeln!(o, "functions:");
    for f in &p.function {
        let _ = writeln!(
            o,
            "  {}: name={} system_name={} file={} start_line={}",
            f.id,
            s(f.name),
            s(f.system_name),
            s(f.filename),
            f.start_line
        );
    }
    let _ = writeln!(o, "locations:");
    for l in &p.location {
        let _ = writeln!(
            o,
            "  {}: mapping={} address={:#x}{}",
            l.id,
            l.mapping_id,
            l.address,
            if l.is_folded { " folded" } else { "" }
        );
        for line in &l.line {
            let kind = match FrameKind::try_from(line.kind) {
                Ok(FrameKind::Unspecified) => String::new(),
                Ok(k) => format!(" kind={}", k.name()),
                Err(_) => format!(" kind={}", line.kind),
            };
            let _ = writeln!(
                o,
                "    function={} line={} column={}{kind}",
                line.function_id, line.line, line.column
            );
        }
    }
    let _ = writeln!(o, "samples:");
    for smp in &p.sample {
        let values: Vec<String> = smp.value.iter().map(i64::to_string).collect();
        let locs: Vec<String> = smp.location_id.iter().map(u64::to_string).collect();
        let _ = write!(
            o,
            "  values=[{}] locations=[{}]",
            values.join(" "),
            locs.join(" ")
        );
        for l in &smp.label {
            if l.str != 0 {
                let _ = write!(o, " {}={}", s(l.key), s(l.str));
            } else if l.num_unit != 0 {
                let _ = write!(o, " {}={}{}", s(l.key), l.num, s(l.num_unit));
            } else {
                let _ = write!(o, " {}={}", s(l.key), l.num);
            }
        }
        o.push('\n');
    }
    let _ = writeln!(o, "strings: {}", p.string_table.len());
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    fn small() -> Profile {
        Profile {
            sample_type: vec![ValueType { r#type: 1, unit: 2 }],
            sample: vec![Sample {
                location_id: vec![1],
                value: vec![7],
                label: vec![Label {
                    key: 3,
                    num: 42,
                    ..Default::default()
                }],
            }],
            location: vec![Location {
                id: 1,
                address: 0x1234,
                line: vec![Line {
                    function_id: 1,
                    line: 10,
                    column: 0,
                    kind: FrameKind::Python as i32,
                }],
                ..Default::default()
            }],
            function: vec![Function {
                id: 1,
                name: 4,
                system_name: 4,
                ..Default::default()
            }],
            string_table: ["", "samples", "count", "pid", "main"]
                .map(String::from)
                .to_vec(),
            default_sample_type: 1,
            ..Default::default()
        }
    }

    /// Field numbers are the wire contract with other pprof readers; check the bytes of a
    /// message against a hand-encoding from the spec.
    #[test]
    fn field_numbers_match_spec() {
        let vt = ValueType { r#type: 1, unit: 2 };
        assert_eq!(vt.encode_to_vec(), [0x08, 1, 0x10, 2]);
        let s = Sample {
            location_id: vec![1, 2],
            value: vec![3],
            label: vec![],
        };
        // Both repeated scalars must be packed (wire type 2), as proto3 readers expect.
        assert_eq!(s.encode_to_vec(), [0x0a, 2, 1, 2, 0x12, 1, 3]);
        let p = Profile {
            period: 5,
            default_sample_type: 6,
            doc_url: 7,
            comment: vec![8],
            ..Default::default()
        };
        assert_eq!(p.encode_to_vec(), [0x60, 5, 0x6a, 1, 8, 0x70, 6, 0x78, 7]);
        let m = Mapping {
            id: 1,
            has_inline_frames: true,
            ..Default::default()
        };
        assert_eq!(m.encode_to_vec(), [0x08, 1, 0x50, 1]);
        let l = Location {
            is_folded: true,
            ..Default::default()
        };
        assert_eq!(l.encode_to_vec(), [0x28, 1]);
        // pyrometer's own Line field: 100, a varint (key (100 << 3) | 0 in two bytes).
        let line = Line {
            kind: FrameKind::Kernel as i32,
            ..Default::default()
        };
        assert_eq!(line.encode_to_vec(), [0xa0, 0x06, 2]);
        let f = Function {
            start_line: 9,
            ..Default::default()
        };
        assert_eq!(f.encode_to_vec(), [0x28, 9]);
        let lb = Label {
            num_unit: 4,
            ..Default::default()
        };
        assert_eq!(lb.encode_to_vec(), [0x20, 4]);
    }

    #[test]
    fn gz_round_trip_and_raw_accepted() {
        let p = small();
        let gz = encode_gz(&p);
        assert!(is_gzip(&gz));
        assert_eq!(decode(&gz).unwrap(), p);
        assert_eq!(decode(&p.encode_to_vec()).unwrap(), p);
        assert_eq!(encode_gz(&p), gz, "encoding must be deterministic");
    }

    #[test]
    fn corrupt_input_is_an_error() {
        let gz = encode_gz(&small());
        assert!(matches!(
            decode(&gz[..gz.len() / 2]),
            Err(DecodeError::Gzip(_))
        ));
        assert!(matches!(
            decode(&[0x0a, 0xff, 0xff]),
            Err(DecodeError::Protobuf(_))
        ));
    }

    #[test]
    fn dump_resolves_strings_and_survives_bad_indices() {
        let mut p = small();
        let text = dump_text(&p);
        assert!(
            text.contains("sample_types: \"samples\"/\"count\"\n"),
            "{text}"
        );
        assert!(text.contains("default_sample_type: \"samples\"\n"));
        assert!(text.contains("  1: name=\"main\" system_name=\"main\""));
        assert!(text.contains("  values=[7] locations=[1] \"pid\"=42\n"));
        p.function[0].name = 99;
        assert!(dump_text(&p).contains("name=<bad string 99>"));
    }
}
