//! On-demand captures and dumps through the collector, as prost messages declared by hand
//! like [`crate::ingest`]. Agents open the channel (no port on the node): they long-poll
//! `Captures.Poll` for the requests of their node and answer with `Captures.Upload`, over
//! the connection, TLS and credentials of their pushes. The CLI asks through
//! `Captures.Create` and follows with `Captures.Get`. Its equivalent `.proto`:
//!
//! ```text
//! package pyrometer.capture.v1;
//! service Captures {
//!   rpc Poll(PollRequest) returns (PollReply);          // agents
//!   rpc Upload(UploadRequest) returns (UploadReply);    // agents
//!   rpc Create(CaptureRequest) returns (CaptureStatus); // clients
//!   rpc Get(GetRequest) returns (CaptureStatus);        // clients
//! }
//! ```

/// The gRPC path of `Captures.Poll`.
pub const POLL_PATH: &str = "/pyrometer.capture.v1.Captures/Poll";
/// The gRPC path of `Captures.Upload`.
pub const UPLOAD_PATH: &str = "/pyrometer.capture.v1.Captures/Upload";
/// The gRPC path of `Captures.Create`.
pub const CREATE_PATH: &str = "/pyrometer.capture.v1.Captures/Create";
/// The gRPC path of `Captures.Get`.
pub const GET_PATH: &str = "/pyrometer.capture.v1.Captures/Get";

/// The longest a capture may run.
pub const MAX_DURATION_MS: u32 = 60_000;
/// The highest sampling frequency a capture may ask for.
pub const MAX_FREQUENCY_HZ: u32 = 999;
/// Processes one capture may target.
pub const MAX_PIDS: usize = 64;

/// What a capture request asks an agent to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Kind {
    /// Sample the targets for `duration_ms` at `frequency_hz`.
    Capture = 0,
    /// Print every thread's stack of the targets once.
    Dump = 1,
}

/// One request, as a client makes it and as the agent of its node receives it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CaptureRequest {
    /// Set by the collector.
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub node: String,
    #[prost(uint32, repeated, tag = "3")]
    pub pids: Vec<u32>,
    #[prost(uint32, tag = "4")]
    pub duration_ms: u32,
    #[prost(uint32, tag = "5")]
    pub frequency_hz: u32,
    #[prost(bool, tag = "6")]
    pub gil: bool,
    #[prost(bool, tag = "7")]
    pub off_cpu: bool,
    #[prost(bool, tag = "8")]
    pub alloc: bool,
    #[prost(enumeration = "Kind", tag = "9")]
    pub kind: i32,
    /// Label matchers (`{ray_actor="Trainer"}`) in place of `node` and `pids`: the collector
    /// resolves them against recent pushes and makes one request per node that matches.
    #[prost(string, tag = "10")]
    pub query: String,
    /// A dump's native frames too, read without stopping a thread: from the registers the
    /// kernel shows for a thread blocked in a system call, or one perf sample of a running
    /// one.
    #[prost(bool, tag = "11")]
    pub native: bool,
}

/// An agent's poll: the node it serves; the collector answers when a request for it comes,
/// or after `wait_ms` with none.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PollRequest {
    #[prost(string, tag = "1")]
    pub node: String,
    #[prost(uint32, tag = "2")]
    pub wait_ms: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PollReply {
    #[prost(message, repeated, tag = "1")]
    pub requests: Vec<CaptureRequest>,
}

/// Why a request failed, for the client's exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Failure {
    None = 0,
    /// The request names something that is not there (a pid, a node): exit 2.
    Input = 1,
    /// The kernel or the agent's loaded programs cannot do it: exit 3.
    Kernel = 2,
    /// The node's agent does not answer.
    Offline = 3,
    /// Anything else.
    Internal = 4,
}

/// An agent's answer to one request: its result, or why there is none.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UploadRequest {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub node: String,
    /// Empty when it worked.
    #[prost(string, tag = "3")]
    pub error: String,
    #[prost(enumeration = "Failure", tag = "4")]
    pub failure: i32,
    /// The profile, gzipped pprof, with the capture's own period.
    #[prost(bytes = "vec", tag = "5")]
    pub pprof: Vec<u8>,
    /// The per-sample timeline as a Chrome trace (JSON, gzipped).
    #[prost(bytes = "vec", tag = "6")]
    pub chrome: Vec<u8>,
    /// Wall-clock start and end of the burst, ns since the Unix epoch.
    #[prost(uint64, tag = "7")]
    pub started_unix_ns: u64,
    #[prost(uint64, tag = "8")]
    pub ended_unix_ns: u64,
    /// On-CPU samples of the burst.
    #[prost(uint64, tag = "9")]
    pub samples: u64,
    /// A dump's text (JSON), or a capture's GIL table (`--gil`).
    #[prost(string, tag = "10")]
    pub text: String,
    /// The wall-clock time of the timeline's zero, ns since the Unix epoch: its
    /// CLOCK_MONOTONIC origin plus the node's monotonic-to-wall offset, so timelines of
    /// several nodes line up.
    #[prost(uint64, tag = "11")]
    pub origin_unix_ns: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct UploadReply {}

/// A client's look at a request: `wait_ms` holds the answer until the request ends (or
/// that long); `result` asks for the result's bytes with it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetRequest {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(uint32, tag = "2")]
    pub wait_ms: u32,
    #[prost(bool, tag = "3")]
    pub result: bool,
}

/// A request's state, and its result once done (when asked for).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CaptureStatus {
    #[prost(message, optional, tag = "1")]
    pub request: Option<CaptureRequest>,
    /// `pending`, `running`, `done` or `failed`.
    #[prost(string, tag = "2")]
    pub state: String,
    #[prost(string, tag = "3")]
    pub reason: String,
    #[prost(enumeration = "Failure", tag = "4")]
    pub failure: i32,
    /// Present when done and asked for.
    #[prost(message, optional, tag = "5")]
    pub result: Option<UploadRequest>,
    /// The ids of every request one `Create` made, this one first: a query matching
    /// processes on several nodes makes one per node.
    #[prost(string, repeated, tag = "6")]
    pub members: Vec<String>,
}
