//! The bodies of the version 1 requests and answers: hello, put, get, lookup, exists, remove,
//! stats and ping (the policy administration messages are in `policy`).

use super::ErrorCode;
use serde::{Deserialize, Serialize};

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
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    /// Exact number of raw bytes that follow for this item.
    pub size: u64,
    /// Key of the previous block of the prefix chain, if any.
    #[serde(with = "serde_bytes")]
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
    #[serde(with = "crate::key_list")]
    pub keys: Vec<Vec<u8>>,
}

/// A prefix chain, root first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    #[serde(with = "crate::key_list")]
    pub chain: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveRequest {
    #[serde(with = "crate::key_list")]
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
