//! Version 2, one-sided transports: the shared-memory and same-host control channel offers,
//! reservations written one-sidedly (grants, writes, commits), located blocks read one-sidedly,
//! and copies to and from the client's shared buffers.

use super::{ErrorCode, PutItem, PutMode};
use serde::{Deserialize, Serialize};

/// Part of a client's shared buffer: region id (as registered over the shm socket), offset and
/// length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufSlice {
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

/// Where a block's bytes are (or go) on the server: node, registered region, offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    /// Node holding the bytes (0 on a single-node pool).
    pub node: u32,
    /// Registered region of that node (0: its DRAM segment).
    pub region: u32,
    pub offset: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutIntentRequest {
    pub mode: PutMode,
    pub items: Vec<PutItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutDoneRequest {
    /// Reservations to commit, in order.
    pub reservations: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRequest {
    pub lease: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutFromRequest {
    pub mode: PutMode,
    pub items: Vec<PutItem>,
    /// One per item, exactly `items[i].size` bytes long.
    pub sources: Vec<BufSlice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetIntoRequest {
    #[serde(with = "crate::key_list")]
    pub keys: Vec<Vec<u8>>,
    /// One per key: where its value goes; `len` is the room there.
    pub dests: Vec<BufSlice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteRequest {
    pub reservation: u64,
    /// Offset inside the reserved block.
    pub offset: u64,
    /// Exact number of raw bytes that follow the frame.
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    pub lease: u64,
    /// Which block of the lease (index into the `GetLocate` keys).
    pub index: u32,
    pub offset: u64,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalOffer {
    /// Unix socket to connect to (same host).
    pub socket_path: String,
    /// Present this on every socket connection; valid while this QUIC connection lives.
    pub token: Vec<u8>,
    /// Largest request envelope body (frame plus raw bytes) the channel accepts.
    pub max_request: u32,
    /// Largest response envelope body the channel sends; a longer answer is an error.
    pub max_response: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmOffer {
    /// Unix socket to connect to (same host).
    pub socket_path: String,
    /// Present this on the socket; valid once, for this connection only.
    pub token: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// `Ok` (then the other fields are set), or why the item gets no space (`AlreadyExists`,
    /// `Rejected`, `NoSpace`).
    pub status: ErrorCode,
    pub reservation: u64,
    pub location: Location,
    /// The reservation is released unless committed within this many ms.
    pub expires_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutGrant {
    pub grants: Vec<Grant>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocatedItem {
    /// `Ok`, `NotFound`, or `Corrupt`.
    pub status: ErrorCode,
    pub size: u64,
    pub tier: u8,
    pub checksum: u64,
    pub location: Location,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Located {
    /// Name of the lease that keeps these blocks in place (0 when no block was found).
    pub lease: u64,
    /// The lease ends after this many ms, or at `Release`.
    pub lease_ms: u32,
    pub items: Vec<LocatedItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataHeader {
    pub size: u64,
}
