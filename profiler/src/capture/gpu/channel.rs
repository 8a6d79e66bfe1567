//! The channel format of `libpyrometer_cupti.so` (`gpu-inject/c/pyrometer_gpu.h` is its
//! definition): chunks of records the library hands to its `pyrometer_gpu_channel` marker, which
//! reach us through the kernel's ring buffer (or a `PYROMETER_GPU_DUMP` file). A profiled process
//! writes these bytes, so nothing here trusts them: every length is checked against the chunk
//! before anything is read or allocated, a chunk that breaks a rule is refused whole (its
//! lengths cannot be trusted past the break), and values are bounded where they are used
//! ([`super::join`]).

/// `"PGPU"` read as a little-endian u32.
pub const MAGIC: u32 = 0x5550_4750;
pub const VERSION: u16 = 1;
/// The most bytes a chunk has, header included (what the uprobe copies).
pub const CHUNK_MAX: usize = 4096;
/// The most bytes of a name a STRING record carries.
pub const NAME_MAX: usize = 2048;
const HEADER_LEN: usize = 16;

const REC_STATUS: u16 = 1;
const REC_STRING: u16 = 2;
const REC_DEVICE: u16 = 3;
const REC_KERNEL: u16 = 4;
const REC_MEMCPY: u16 = 5;
const REC_MEMSET: u16 = 6;
const REC_LAUNCH: u16 = 7;
const REC_ALIAS: u16 = 8;
const REC_CLOCK: u16 = 9;

/// Why a chunk was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("a chunk of {0} bytes (a header takes {HEADER_LEN}, a chunk at most {CHUNK_MAX})")]
    Size(usize),
    #[error("not a channel chunk (magic {0:#010x})")]
    Magic(u32),
    #[error("channel version {0} (this pyrometer reads {VERSION})")]
    Version(u16),
    #[error("a chunk header of {0} bytes")]
    HeaderLen(u16),
    #[error("the chunk says {said} bytes, {got} arrived")]
    Length { said: u32, got: usize },
    #[error("a record at byte {at} of {len} bytes (records are multiples of 8 within the chunk)")]
    RecordLength { at: usize, len: usize },
    #[error("a record at byte {at} of type {kind}: {len} bytes, its type needs {need}")]
    Short {
        at: usize,
        kind: u16,
        len: usize,
        need: usize,
    },
    #[error("a string record at byte {at}: {bytes} bytes of text in {room} bytes, or id 0")]
    String {
        at: usize,
        bytes: usize,
        room: usize,
    },
}

/// The library's mode (`pyro_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    /// The library is CUPTI's only subscriber.
    Single,
    /// Subscribed allowing others, with its own activity buffers (CUPTI 13.2+).
    Shared,
    Other(u16),
}

/// Where the library stands in its process (`pyro_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Starting,
    On,
    /// Another tool holds CUPTI's only subscription.
    SteppedAside,
    NoCupti,
    CuptiError,
    Other(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Status {
    pub mode: Option<Mode>,
    pub state: Option<State>,
    pub lib_version: u32,
    pub sample_every: u32,
    pub cupti_version: u32,
    pub error: u32,
    /// STRING id of the tool that holds CUPTI, 0 for none.
    pub other: u32,
    /// The process is exiting: nothing follows.
    pub last: bool,
    /// Cumulative counters.
    pub launches: u64,
    pub sampled: u64,
    pub cupti_dropped: u64,
    pub buffers_refused: u64,
    pub notes_dropped: u64,
    pub names_dropped: u64,
    pub records_unknown: u64,
    pub dump_dropped: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StringKind {
    Kernel,
    Nvtx,
    Tool,
    Other(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    pub correlation: u32,
    pub device: u32,
    pub context: u32,
    pub stream: u32,
    pub name: u32,
    pub graph: u32,
    pub launch_type: u32,
    pub start: u64,
    pub end: u64,
    pub grid: [i32; 3],
    pub block: [i32; 3],
}

/// A copy (MEMCPY) or a set (MEMSET, `copy_kind` 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub correlation: u32,
    pub runtime_correlation: u32,
    pub device: u32,
    pub context: u32,
    pub stream: u32,
    pub copy_kind: u8,
    pub src_kind: u8,
    pub dst_kind: u8,
    pub flags: u8,
    pub graph: u32,
    pub bytes: u64,
    pub start: u64,
    pub end: u64,
}

/// What API call a sampled launch was (`pyro_api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    Kernel,
    Cooperative,
    Graph,
    Memcpy,
    Memset,
    Other(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub correlation: u32,
    pub tid: u32,
    pub weight: u32,
    pub api: Api,
    pub domain: u8,
    pub cbid: u32,
    /// STRING id of the open NVTX ranges, 0 for none.
    pub nvtx: u32,
    /// CLOCK_MONOTONIC ns.
    pub time: u64,
}

/// One record of a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Status(Status),
    String {
        id: u32,
        kind: StringKind,
        cut: bool,
        text: String,
    },
    Device {
        device: u32,
        uuid: [u8; 16],
    },
    Kernel(Kernel),
    Memcpy(Copy),
    Memset(Copy),
    Launch(Launch),
    Alias {
        from: u32,
        to: u32,
    },
    Clock {
        cupti: u64,
        monotonic: u64,
    },
    /// A type this pyrometer does not know (a newer library): skipped by its length.
    Unknown(u16),
}

/// A chunk: its sequence number (a gap means lost chunks) and records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub seq: u32,
    pub records: Vec<Record>,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn i32_at(b: &[u8], at: usize) -> i32 {
    u32_at(b, at) as i32
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The bytes each record type needs (its struct's size).
fn needs(kind: u16) -> usize {
    match kind {
        REC_STATUS => 96,
        REC_STRING => 16,
        REC_DEVICE => 32,
        REC_KERNEL => 72,
        REC_MEMCPY | REC_MEMSET => 56,
        REC_LAUNCH => 40,
        REC_ALIAS => 16,
        REC_CLOCK => 24,
        _ => 4,
    }
}

/// Parses one chunk, checking every rule of the format.
pub fn parse(bytes: &[u8]) -> Result<Chunk, ChunkError> {
    if bytes.len() < HEADER_LEN || bytes.len() > CHUNK_MAX {
        return Err(ChunkError::Size(bytes.len()));
    }
    let magic = u32_at(bytes, 0);
    if magic != MAGIC {
        return Err(ChunkError::Magic(magic));
    }
    let version = u16_at(bytes, 4);
    if version != VERSION {
        return Err(ChunkError::Version(version));
    }
    let header_len = u16_at(bytes, 6);
    if usize::from(header_len) != HEADER_LEN {
        return Err(ChunkError::HeaderLen(header_len));
    }
    let seq = u32_at(bytes, 8);
    let said = u32_at(bytes, 12);
    if said as usize != bytes.len() {
        return Err(ChunkError::Length {
            said,
            got: bytes.len(),
        });
    }
    // At most one record per 8 bytes: the vector never outgrows the chunk.
    let mut records = Vec::with_capacity(((bytes.len() - HEADER_LEN) / 8).min(64));
    let mut at = HEADER_LEN;
    while at < bytes.len() {
        if bytes.len() - at < 4 {
            return Err(ChunkError::RecordLength {
                at,
                len: bytes.len() - at,
            });
        }
        let kind = u16_at(bytes, at);
        let len = usize::from(u16_at(bytes, at + 2));
        if len < 8 || !len.is_multiple_of(8) || len > bytes.len() - at {
            return Err(ChunkError::RecordLength { at, len });
        }
        let need = needs(kind);
        if len < need {
            return Err(ChunkError::Short {
                at,
                kind,
                len,
                need,
            });
        }
        records.push(record(&bytes[at..at + len], kind, at)?);
        at += len;
    }
    Ok(Chunk { seq, records })
}

fn record(r: &[u8], kind: u16, at: usize) -> Result<Record, ChunkError> {
    Ok(match kind {
        REC_STATUS => Record::Status(status(r)),
        REC_STRING => {
            let id = u32_at(r, 4);
            let bytes = usize::from(u16_at(r, 12));
            let room = r.len() - 16;
            if id == 0 || bytes > room || bytes > NAME_MAX {
                return Err(ChunkError::String { at, bytes, room });
            }
            Record::String {
                id,
                kind: match u16_at(r, 8) {
                    1 => StringKind::Kernel,
                    2 => StringKind::Nvtx,
                    3 => StringKind::Tool,
                    k => StringKind::Other(k),
                },
                cut: u16_at(r, 10) & 1 != 0,
                text: String::from_utf8_lossy(&r[16..16 + bytes]).into_owned(),
            }
        }
        REC_DEVICE => Record::Device {
            device: u32_at(r, 4),
            uuid: r[8..24].try_into().expect("16 bytes"),
        },
        REC_KERNEL => Record::Kernel(Kernel {
            correlation: u32_at(r, 4),
            device: u32_at(r, 8),
            context: u32_at(r, 12),
            stream: u32_at(r, 16),
            name: u32_at(r, 20),
            graph: u32_at(r, 24),
            launch_type: u32_at(r, 28),
            start: u64_at(r, 32),
            end: u64_at(r, 40),
            grid: [i32_at(r, 48), i32_at(r, 52), i32_at(r, 56)],
            block: [i32_at(r, 60), i32_at(r, 64), i32_at(r, 68)],
        }),
        REC_MEMCPY | REC_MEMSET => {
            let c = Copy {
                correlation: u32_at(r, 4),
                runtime_correlation: u32_at(r, 8),
                device: u32_at(r, 12),
                context: u32_at(r, 16),
                stream: u32_at(r, 20),
                copy_kind: r[24],
                src_kind: r[25],
                dst_kind: r[26],
                flags: r[27],
                graph: u32_at(r, 28),
                bytes: u64_at(r, 32),
                start: u64_at(r, 40),
                end: u64_at(r, 48),
            };
            if kind == REC_MEMCPY {
                Record::Memcpy(c)
            } else {
                Record::Memset(c)
            }
        }
        REC_LAUNCH => Record::Launch(Launch {
            correlation: u32_at(r, 4),
            tid: u32_at(r, 8),
            weight: u32_at(r, 12),
            api: match u16_at(r, 16) {
                1 => Api::Kernel,
                2 => Api::Cooperative,
                3 => Api::Graph,
                4 => Api::Memcpy,
                5 => Api::Memset,
                a => Api::Other(a),
            },
            domain: r[18],
            cbid: u32_at(r, 20),
            nvtx: u32_at(r, 24),
            time: u64_at(r, 32),
        }),
        REC_ALIAS => Record::Alias {
            from: u32_at(r, 4),
            to: u32_at(r, 8),
        },
        REC_CLOCK => Record::Clock {
            cupti: u64_at(r, 8),
            monotonic: u64_at(r, 16),
        },
        other => Record::Unknown(other),
    })
}

fn status(r: &[u8]) -> Status {
    Status {
        mode: Some(match u16_at(r, 4) {
            0 => Mode::Off,
            1 => Mode::Single,
            2 => Mode::Shared,
            m => Mode::Other(m),
        }),
        state: Some(match u16_at(r, 6) {
            0 => State::Starting,
            1 => State::On,
            2 => State::SteppedAside,
            3 => State::NoCupti,
            4 => State::CuptiError,
            s => State::Other(s),
        }),
        lib_version: u32_at(r, 8),
        sample_every: u32_at(r, 12),
        cupti_version: u32_at(r, 16),
        error: u32_at(r, 20),
        other: u32_at(r, 24),
        last: u32_at(r, 28) & 1 != 0,
        launches: u64_at(r, 32),
        sampled: u64_at(r, 40),
        cupti_dropped: u64_at(r, 48),
        buffers_refused: u64_at(r, 56),
        notes_dropped: u64_at(r, 64),
        names_dropped: u64_at(r, 72),
        records_unknown: u64_at(r, 80),
        dump_dropped: u64_at(r, 88),
    }
}

/// Splits a dump file (`PYROMETER_GPU_DUMP`: chunks one after another) into its chunks'
/// bytes; stops, returning what came before, at the first header that does not hold up.
pub fn split_dump(bytes: &[u8]) -> (Vec<&[u8]>, Option<ChunkError>) {
    let mut chunks = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < HEADER_LEN {
            return (chunks, Some(ChunkError::Size(rest.len())));
        }
        let len = u32_at(rest, 12) as usize;
        if !(HEADER_LEN..=CHUNK_MAX).contains(&len) || len > rest.len() {
            return (chunks, Some(ChunkError::Size(len)));
        }
        chunks.push(&rest[..len]);
        at += len;
    }
    (chunks, None)
}

/// A GPU's UUID as NVML writes it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_string(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests;
