//! Version 2, connector requests (PROTOCOL.md 11.9): leased lookups and removal by pattern.

use serde::{Deserialize, Serialize};

/// A prefix chain (root first) to count and hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupLeaseRequest {
    #[serde(with = "crate::key_list")]
    pub chain: Vec<Vec<u8>>,
    /// How long to hold the blocks, in ms (0: the server's lease time; capped at
    /// [`MAX_HOLD_MS`]).
    pub ttl_ms: u32,
}

/// Longest hold a `LookupLease` may ask for.
pub const MAX_HOLD_MS: u32 = 60_000;

/// Answer to `LookupLease`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupLeased {
    /// Number of leading blocks of the chain that are resident (in any tier).
    pub resident: u32,
    /// Name of the hold on those blocks (0 when none is resident: nothing to release).
    pub lease: u64,
    /// The hold lasts this long from the answer unless released earlier.
    pub lease_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveMatchingRequest {
    /// Keys must start with these bytes (empty: every key).
    #[serde(with = "serde_bytes")]
    pub prefix: Vec<u8>,
    /// A regular expression (Rust `regex` syntax, matched against the key's bytes, anywhere
    /// unless anchored) that keys must also match.
    pub pattern: Option<String>,
    /// Remove held and leased blocks too.
    pub force: bool,
}
