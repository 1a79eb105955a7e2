//! Version 2, KV events (PROTOCOL.md 11.7): subscriptions and their frames.

use serde::{Deserialize, Serialize};

/// Whose KV events a subscription follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventScope {
    /// The caller's own tenant.
    Tenant,
    /// Every tenant (admin keys only).
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscribeRequest {
    /// First sequence number wanted; `None` for the events after the subscription starts.
    pub from: Option<u64>,
    pub scope: EventScope,
    /// Most events per `Events` frame (0: the server's choice; the server caps it).
    pub max_batch: u32,
}

/// What happened to a copy of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvEventKind {
    /// A copy came into `tier` (put, demotion to SSD, promotion to DRAM).
    Stored,
    /// A client removed the block (remove, remove-all, a replacing upsert), or the server
    /// dropped a copy whose bytes failed their checksum.
    Removed,
    /// The pool let the copy go for room (eviction, the chain rule's cascade, a demotion out
    /// of DRAM).
    Evicted,
}

/// One KV event: a copy of a block came into a tier or left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Position in the server's event log (consecutive, from 1; gaps are other tenants' events).
    pub seq: u64,
    pub kind: KvEventKind,
    /// 0 device, 1 DRAM, 2 SSD.
    pub tier: u8,
    /// The server (node) that holds or held the copy.
    pub node: String,
    pub tenant: String,
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    /// The previous key of the block's prefix chain, as its put named it.
    #[serde(with = "serde_bytes")]
    pub parent: Option<Vec<u8>>,
    /// Value bytes of the block.
    pub size: u64,
    /// Wall clock, ms since the UNIX epoch, when the server logged the event.
    pub time_ms: u64,
}

/// One frame of a subscription.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Identifies this server process's log: sequence numbers of another log id (a restarted
    /// server) mean nothing here.
    pub log_id: u64,
    /// Events the subscriber asked for that were dropped before it read them (it lagged behind
    /// the server's bounded buffer, or asked from before the oldest event held).
    pub lagged: u64,
    /// Sequence number to subscribe `from` to resume right after this frame.
    pub next: u64,
    pub events: Vec<KvEvent>,
}
