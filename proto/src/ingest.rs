//! What a node agent pushes to the collector, and the collector's answer, as prost messages
//! declared by hand like the pprof ones (no `protoc`). The service is a single unary method at
//! [`PUSH_PATH`]; its equivalent `.proto` is:
//!
//! ```text
//! package pyrometer.ingest.v1;
//! service Ingest { rpc Push(PushRequest) returns (PushReply); }
//! ```

use crate::Profile;

/// The gRPC path of `Ingest.Push`.
pub const PUSH_PATH: &str = "/pyrometer.ingest.v1.Ingest/Push";

/// One interval's profile from one agent.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PushRequest {
    /// Stable for the agent's spool: together with `sequence` it identifies the batch, so a
    /// batch replayed after a lost acknowledgement is stored once.
    #[prost(string, tag = "1")]
    pub agent_id: String,
    /// Increases by one per batch the agent creates.
    #[prost(uint64, tag = "2")]
    pub sequence: u64,
    /// The node the samples come from; the collector stores it as the `node` label.
    #[prost(string, tag = "3")]
    pub node: String,
    /// Samples with their labels (pid, comm, thread, ...); `time_nanos` places the batch in
    /// time.
    #[prost(message, optional, tag = "4")]
    pub profile: Option<Profile>,
}

#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct PushReply {
    /// The batch had been stored before; nothing was added.
    #[prost(bool, tag = "1")]
    pub duplicate: bool,
    /// Sample rows the collector stored from this batch.
    #[prost(uint64, tag = "2")]
    pub samples: u64,
}
