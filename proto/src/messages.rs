//! Every message of protocol version 1. Enum variants and struct fields are encoded in
//! declaration order: append new variants at the end only.

use serde::{Deserialize, Serialize};

/// A request: the first frame on every client-opened bidirectional stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Must be the only request on the connection's first stream.
    Hello(Hello),
    /// Raw value bytes follow the frame, item by item, `size` bytes each.
    Put(PutRequest),
    Get(KeysRequest),
    Lookup(LookupRequest),
    Exists(KeysRequest),
    Remove(RemoveRequest),
    RemoveAll(RemoveAllRequest),
    Stats,
    Ping(Ping),
}

/// Number of request variants this version knows (tags `0..REQUEST_TAGS`).
pub const REQUEST_TAGS: u32 = 9;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u16,
    pub api_key: String,
    /// Free text for logs, e.g. "vllm-connector/0.1".
    pub client_name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PutMode {
    /// Blocks are immutable: an existing key answers `AlreadyExists` and keeps its value.
    Insert,
    /// Replace an existing value (refused with `Leased` while the old one is leased).
    Upsert,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PinSpec {
    None,
    /// Evicted only after every unpinned block; `ttl_ms` 0 means the server default.
    Soft {
        ttl_ms: u64,
    },
    /// Never evicted; only `remove` drops it.
    Hard,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutItem {
    pub key: Vec<u8>,
    /// Exact number of raw bytes that follow for this item.
    pub size: u64,
    /// Key of the previous block of the prefix chain, if any.
    pub parent: Option<Vec<u8>>,
    /// Tokens held by this block.
    pub tokens: u32,
    /// Length in tokens of the prefix this block completes (admission by `store_threshold`).
    pub seq_tokens: u64,
    pub pin: PinSpec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutRequest {
    pub mode: PutMode,
    pub items: Vec<PutItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysRequest {
    pub keys: Vec<Vec<u8>>,
}

/// A prefix chain, root first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    pub chain: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveRequest {
    pub keys: Vec<Vec<u8>>,
    /// Remove even when leased (in-flight readers still finish with the old bytes).
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveAllRequest {
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    pub nonce: u64,
}

/// The first frame the server writes on a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    Hello(HelloOk),
    Put(StatusList),
    /// Raw bytes of every item with status `Ok` follow the frame, in order.
    Get(GetResponse),
    Lookup(LookupResponse),
    Exists(ExistsResponse),
    Remove(StatusList),
    RemoveAll(RemoveAllResponse),
    Stats(StatsReport),
    Pong(Pong),
    Error(ErrorBody),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloOk {
    pub version: u16,
    pub server: String,
    pub tenant: String,
    pub admin: bool,
    pub limits: Limits,
}

/// Limits the server enforces; requests beyond them are refused before anything is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_frame: u32,
    pub max_key_len: u32,
    pub max_value_size: u64,
    pub max_batch: u32,
}

/// One status per item of the request, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusList {
    pub results: Vec<ErrorCode>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetItem {
    /// `Ok`, `NotFound`, or `Corrupt` (checksum failed; the block was dropped, no bytes follow).
    pub status: ErrorCode,
    pub size: u64,
    /// Tier the bytes were served from: 0 device, 1 dram, 2 ssd.
    pub tier: u8,
    /// xxh3-64 of the value, for end-to-end verification by the client.
    pub checksum: u64,
    /// The block is leased to readers for this long from the response.
    pub lease_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetResponse {
    pub items: Vec<GetItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupResponse {
    /// Number of leading blocks of the chain that are resident (in any tier).
    pub resident: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExistsResponse {
    pub present: Vec<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveAllResponse {
    pub removed: u64,
    /// Blocks kept because they were leased (and `force` was false).
    pub skipped: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    pub nonce: u64,
    pub server_time_us: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierStats {
    pub tier: String,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub blocks: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpStats {
    pub op: String,
    pub count: u64,
    pub errors: u64,
    /// Latency percentiles in microseconds, estimated from histogram buckets.
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

/// Pool statistics of the caller's view (blocks and bytes are pool-wide).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsReport {
    pub server: String,
    pub uptime_s: u64,
    pub blocks: u64,
    pub tiers: Vec<TierStats>,
    pub demotions: u64,
    pub promotions: u64,
    pub rejected_puts: u64,
    pub corrupt_blocks: u64,
    pub ops: Vec<OpStats>,
}

/// Status and error codes; the wire value is the declaration index (u32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    Ok,
    Unauthorized,
    UnsupportedVersion,
    Malformed,
    UnknownMessage,
    FrameTooLarge,
    KeyTooLong,
    ValueTooLarge,
    BatchTooLarge,
    NotFound,
    AlreadyExists,
    NoSpace,
    Leased,
    Rejected,
    Corrupt,
    Forbidden,
    Internal,
    Timeout,
    ShuttingDown,
    HelloRequired,
    InvalidArgument,
}

impl ErrorCode {
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Ok => "ok",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::Malformed => "malformed",
            ErrorCode::UnknownMessage => "unknown-message",
            ErrorCode::FrameTooLarge => "frame-too-large",
            ErrorCode::KeyTooLong => "key-too-long",
            ErrorCode::ValueTooLarge => "value-too-large",
            ErrorCode::BatchTooLarge => "batch-too-large",
            ErrorCode::NotFound => "not-found",
            ErrorCode::AlreadyExists => "already-exists",
            ErrorCode::NoSpace => "no-space",
            ErrorCode::Leased => "leased",
            ErrorCode::Rejected => "rejected",
            ErrorCode::Corrupt => "corrupt",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::Internal => "internal",
            ErrorCode::Timeout => "timeout",
            ErrorCode::ShuttingDown => "shutting-down",
            ErrorCode::HelloRequired => "hello-required",
            ErrorCode::InvalidArgument => "invalid-argument",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;

    #[test]
    fn byte_layout_is_stable() {
        // The annotated example in docs/PROTOCOL.md.
        let req = Request::Lookup(LookupRequest { chain: vec![b"a".to_vec(), b"bc".to_vec()] });
        let body = codec::encode(&req).unwrap();
        let expected: Vec<u8> = [
            vec![3, 0, 0, 0],             // tag 3 = Lookup
            vec![2, 0, 0, 0, 0, 0, 0, 0], // 2 keys
            vec![1, 0, 0, 0, 0, 0, 0, 0, b'a'],
            vec![2, 0, 0, 0, 0, 0, 0, 0, b'b', b'c'],
        ]
        .concat();
        assert_eq!(body, expected);
        assert_eq!(codec::decode::<Request>(&body).unwrap(), req);
        assert_eq!(crate::message_tag(&body), Some(3));
    }

    #[test]
    fn huge_claimed_lengths_do_not_allocate() {
        // tag 4 (Exists) then a key count of 2^60: must fail cleanly, not abort.
        let mut body = vec![4, 0, 0, 0];
        body.extend_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(codec::decode::<Request>(&body).is_err());
        let mut trailing = codec::encode(&Request::Stats).unwrap();
        trailing.push(0);
        assert!(codec::decode::<Request>(&trailing).is_err());
    }
}
