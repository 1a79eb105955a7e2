//! Version 2, cluster (PROTOCOL.md 11.8): storage nodes joining and reporting to the master,
//! routes and placements, and node-to-node moves of blocks.

use super::{KvEventKind, PutItem, PutMode};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePutRequest {
    /// The tenant the blocks belong to (by name).
    pub tenant: String,
    pub mode: PutMode,
    pub items: Vec<PutItem>,
}

/// Use of one tier of a storage node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierUse {
    /// 0 device, 1 DRAM, 2 SSD.
    pub tier: u8,
    pub capacity: u64,
    pub used: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeJoinRequest {
    /// Stable name of the node (a restarted node joins under the same name and keeps its id).
    pub name: String,
    /// QUIC address clients connect to (`host:port`).
    pub addr: String,
    /// TLS server name of that address.
    pub server_name: String,
    /// SHA-256 of the node's certificate (DER): clients pin it.
    #[serde(with = "serde_bytes")]
    pub fingerprint: Vec<u8>,
    /// Random per joining process: reports of an older incarnation are refused.
    pub incarnation: u64,
    pub tiers: Vec<TierUse>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeJoined {
    /// The node's id in the pool (from 1).
    pub node: u32,
    /// Report at least this often (ms); the master declares a node dead after a few missed.
    pub report_ms: u32,
}

/// A copy a storage node stored (`Stored`) or no longer holds (`Removed`, `Evicted`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeBlock {
    pub kind: KvEventKind,
    pub tier: u8,
    pub tenant: String,
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    /// The previous key of the block's prefix chain, as its put named it.
    #[serde(with = "serde_bytes")]
    pub parent: Option<Vec<u8>>,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReportRequest {
    pub node: u32,
    pub incarnation: u64,
    /// Forget every copy reported before: `blocks` starts the node's inventory again.
    pub reset: bool,
    pub tiers: Vec<TierUse>,
    pub blocks: Vec<NodeBlock>,
}

/// Blocks to place: the keys, sizes, parents and tokens as a put would name them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaceRequest {
    pub items: Vec<PutItem>,
    /// Copies per block, on distinct nodes (at least 1; capped at the live nodes).
    pub replicas: u32,
}

/// A storage node as the master sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub node: u32,
    pub name: String,
    pub addr: String,
    /// TLS server name and certificate SHA-256 of the node (as in `NodeAddr`).
    pub server_name: String,
    #[serde(with = "serde_bytes")]
    pub fingerprint: Vec<u8>,
    pub live: bool,
    /// Milliseconds since its last report.
    pub silent_ms: u64,
    /// Copies it holds, as reported.
    pub copies: u64,
    pub tiers: Vec<TierUse>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeList {
    pub nodes: Vec<NodeInfo>,
}

/// How to reach a storage node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddr {
    pub node: u32,
    pub addr: String,
    pub server_name: String,
    #[serde(with = "serde_bytes")]
    pub fingerprint: Vec<u8>,
}

/// Per item of the request, the ids of its nodes (best first; empty: none); `nodes` tells how
/// to reach each id named.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routes {
    pub nodes: Vec<NodeAddr>,
    pub items: Vec<Vec<u32>>,
}
