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
    /// Admin: load a policy module; its `module_size` bytes of Wasm component follow the frame.
    PolicyLoad(PolicyLoadRequest),
    /// Admin: the active and previous policy modules of every kind.
    PolicyList,
    /// Admin: re-activate the module that was active before the current one (or the built-in).
    PolicyRollback(PolicyRollbackRequest),
    // ---- version 2: one-sided transports --------------------------------------------------
    /// Ask for the same-host shared-memory transport: answered with the Unix socket to connect
    /// to and a one-time token binding that socket connection to this QUIC connection.
    ShmAttach,
    /// Reserve space for blocks whose bytes the client will write one-sidedly (`Write`, or a
    /// transport such as HIXL): answered with a grant (reservation and location) per item.
    PutIntent(PutIntentRequest),
    /// Commit reservations whose bytes are complete.
    PutDone(PutDoneRequest),
    /// Lease blocks for one-sided reads: answered with each block's location.
    GetLocate(KeysRequest),
    /// End a lease early.
    Release(ReleaseRequest),
    /// Put blocks whose bytes the server copies from the client's shared buffers.
    PutFrom(PutFromRequest),
    /// Get blocks into the client's shared buffers (the server copies them there).
    GetInto(GetIntoRequest),
    /// Write bytes into a granted reservation: `size` raw bytes follow the frame.
    Write(WriteRequest),
    /// Read bytes of a located (leased) block: answered with `Data`, then the raw bytes.
    Read(ReadRequest),
    /// Ask for the same-host control channel: answered with the Unix socket on which this
    /// connection's requests may also be sent, and the token that binds a socket to it.
    LocalAttach,
    /// Follow the pool's KV events (copies stored, removed, evicted): answered with a stream of
    /// `Events` frames that lasts until either side ends it.
    Subscribe(SubscribeRequest),
    // ---- version 2: cluster (PROTOCOL.md 11.8) ---------------------------------------------
    /// A storage node joins the master (admin keys only): answered with its node id.
    NodeJoin(NodeJoinRequest),
    /// A storage node's heartbeat: its tier use and the copies it stored or dropped since its
    /// last report (its whole inventory after a join, `reset`).
    NodeReport(NodeReportRequest),
    /// The pool's storage nodes, their tiers, use and liveness.
    Nodes,
    /// Which live storage nodes hold these keys (the caller's tenant): answered with `Routes`.
    Route(KeysRequest),
    /// Which storage nodes should store these new blocks: answered with `Routes`.
    Place(PlaceRequest),
    /// A storage node moves blocks of `tenant` into this node (admin keys only): a `Put` on
    /// behalf of that tenant; raw value bytes follow the frame as for `Put`.
    NodePut(NodePutRequest),
    // ---- version 2: connectors (PROTOCOL.md 11.9) -------------------------------------------
    /// `Lookup` that holds what it counted: the resident leading blocks of the chain are kept
    /// (not evicted, not removed without `force`) until `Release` of the lease, its time, or the
    /// end of the connection. Answered with `LookupLeased`.
    LookupLease(LookupLeaseRequest),
    /// Remove the caller's blocks whose keys start with `prefix` and, when `pattern` is given,
    /// match that regular expression. Answered with `RemoveAll`.
    RemoveMatching(RemoveMatchingRequest),
}

/// Number of request variants this version knows (tags `0..REQUEST_TAGS`).
pub const REQUEST_TAGS: u32 = 31;

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
/// Requests of version 1 (tags `0..V1_REQUEST_TAGS`); later tags need a version 2 hello.
pub const V1_REQUEST_TAGS: u32 = 12;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyKind {
    Eviction,
    Admission,
    Placement,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Eviction => "eviction",
            PolicyKind::Admission => "admission",
            PolicyKind::Placement => "placement",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        match s {
            "eviction" => Some(PolicyKind::Eviction),
            "admission" => Some(PolicyKind::Admission),
            "placement" => Some(PolicyKind::Placement),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyLoadRequest {
    pub kind: PolicyKind,
    /// Operator-chosen name, shown by `list` and in logs.
    pub name: String,
    /// Module parameters (`--param k=v`).
    pub params: Vec<(String, String)>,
    /// Exact number of component bytes that follow the frame.
    pub module_size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRollbackRequest {
    pub kind: PolicyKind,
}

/// One policy module as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyInfo {
    pub kind: PolicyKind,
    pub name: String,
    /// Hex SHA-256 of the component; empty for a built-in policy.
    pub sha256: String,
    pub params: Vec<(String, String)>,
    /// Wall-clock ms when it was loaded.
    pub loaded_at_ms: u64,
    /// True for the native built-in policy (no module loaded, or after rollback past the first).
    pub builtin: bool,
    /// True when this is the one deciding now.
    pub active: bool,
    pub faults_trap: u64,
    pub faults_timeout: u64,
    pub faults_invalid: u64,
    /// Repeated faults: the native fallback answers until an operator loads another module.
    pub quarantined: bool,
    /// Decision calls answered by the module / by the native fallback.
    pub answered: u64,
    pub fallback_answers: u64,
    /// Time the last swap took (compile or cache load, instantiate, replay), in microseconds.
    pub swap_us: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyListResponse {
    pub policies: Vec<PolicyInfo>,
}

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
    /// Answer to `PolicyLoad` and `PolicyRollback`: the module now active for that kind.
    Policy(PolicyInfo),
    PolicyList(PolicyListResponse),
    // ---- version 2 ------------------------------------------------------------------------
    /// Answer to `ShmAttach`.
    ShmOffer(ShmOffer),
    /// Answer to `PutIntent`: one grant per item.
    PutGrant(PutGrant),
    /// Answer to `GetLocate`.
    Located(Located),
    /// Answer to `Release` and `Write`: done.
    Done,
    /// Answer to `Read`: `size` raw bytes follow the frame.
    Data(DataHeader),
    /// Answer to `GetInto`: per key, the value was copied into its buffer (`Ok`) or not; no raw
    /// bytes follow.
    Filled(GetResponse),
    /// Answer to `LocalAttach`.
    LocalOffer(LocalOffer),
    /// The frames of a `Subscribe` stream.
    Events(EventBatch),
    /// Answer to `NodeJoin`.
    NodeJoined(NodeJoined),
    /// Answer to `Nodes`.
    NodeList(NodeList),
    /// Answer to `Route` and `Place`.
    Routes(Routes),
    /// Answer to `LookupLease`.
    LookupLeased(LookupLeased),
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
    /// A policy module failed to load (not a component, wrong world, refused its parameters,
    /// trapped while its state was rebuilt).
    PolicyError,
    /// The server does not offer what was asked (a transport it lacks, a version 2 request on
    /// a version 1 connection).
    Unsupported,
    /// The reservation or lease named does not exist (expired, released, committed, or never
    /// granted to this connection).
    Expired,
    /// This master does not lead the cluster (another master does; etcd names it): ask the
    /// leader.
    NotLeader,
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
            ErrorCode::PolicyError => "policy-error",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Expired => "expired",
            ErrorCode::NotLeader => "not-leader",
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
    fn dump(text: &str) -> Vec<u8> {
        crate::parse_hex_dump(text).unwrap()
    }

    #[test]
    fn documented_hello_and_put_example() {
        // Copied verbatim into docs/PROTOCOL.md ("Annotated example"); keep the two identical.
        let hello = crate::frame::encode_frame(&Request::Hello(Hello {
            version: 1,
            api_key: "secret".into(),
            client_name: "demo".into(),
        }))
        .unwrap();
        assert_eq!(
            hello,
            dump(
                "
                20 00 00 00                 # frame length: 32-byte body
                00 00 00 00                 # Request tag 0 = Hello
                01 00                       # version: u16 1
                06 00 00 00 00 00 00 00     # api_key: length 6
                73 65 63 72 65 74           #   \"secret\"
                04 00 00 00 00 00 00 00     # client_name: length 4
                64 65 6d 6f                 #   \"demo\"
                "
            )
        );

        let hello_ok = crate::frame::encode_frame(&Response::Hello(HelloOk {
            version: 1,
            server: "kvpool".into(),
            tenant: "default".into(),
            admin: true,
            limits: Limits { max_frame: 4 << 20, max_key_len: 1024, max_value_size: 64 << 20, max_batch: 1024 },
        }))
        .unwrap();
        assert_eq!(
            hello_ok,
            dump(
                "
                38 00 00 00                 # frame length: 56-byte body
                00 00 00 00                 # Response tag 0 = Hello (HelloOk)
                01 00                       # version: u16 1
                06 00 00 00 00 00 00 00     # server: length 6
                6b 76 70 6f 6f 6c           #   \"kvpool\"
                07 00 00 00 00 00 00 00     # tenant: length 7
                64 65 66 61 75 6c 74        #   \"default\"
                01                          # admin: true
                00 00 40 00                 # limits.max_frame: u32 4194304
                00 04 00 00                 # limits.max_key_len: u32 1024
                00 00 00 04 00 00 00 00     # limits.max_value_size: u64 67108864
                00 04 00 00                 # limits.max_batch: u32 1024
                "
            )
        );

        let put = crate::frame::encode_frame(&Request::Put(PutRequest {
            mode: PutMode::Insert,
            items: vec![PutItem {
                key: b"blk-0".to_vec(),
                size: 5,
                parent: None,
                tokens: 16,
                seq_tokens: 16,
                pin: PinSpec::None,
            }],
        }))
        .unwrap();
        let mut stream = put.clone();
        stream.extend_from_slice(b"hello");
        assert_eq!(
            stream,
            dump(
                "
                36 00 00 00                 # frame length: 54-byte body
                01 00 00 00                 # Request tag 1 = Put
                00 00 00 00                 # mode: PutMode tag 0 = Insert
                01 00 00 00 00 00 00 00     # items: 1 item
                05 00 00 00 00 00 00 00     #   key: length 5
                62 6c 6b 2d 30              #     \"blk-0\"
                05 00 00 00 00 00 00 00     #   size: u64 5
                00                          #   parent: None
                10 00 00 00                 #   tokens: u32 16
                10 00 00 00 00 00 00 00     #   seq_tokens: u64 16
                00 00 00 00                 #   pin: PinSpec tag 0 = None
                68 65 6c 6c 6f              # raw value bytes (not framed): \"hello\"
                "
            )
        );

        let put_ok = crate::frame::encode_frame(&Response::Put(StatusList { results: vec![ErrorCode::Ok] })).unwrap();
        assert_eq!(
            put_ok,
            dump(
                "
                10 00 00 00                 # frame length: 16-byte body
                01 00 00 00                 # Response tag 1 = Put (StatusList)
                01 00 00 00 00 00 00 00     # results: 1 status
                00 00 00 00                 #   ErrorCode 0 = Ok
                "
            )
        );
    }

    /// The hex dumps of a section of docs/PROTOCOL.md, in order: every ``` block under the heading.
    fn doc_dumps(heading: &str) -> Vec<Vec<u8>> {
        doc_blocks(heading).into_iter().map(dump).collect()
    }

    /// The fenced blocks of a section of PROTOCOL.md.
    #[test]
    fn documented_cluster_messages() {
        let blocks = doc_blocks("### 11.8 Cluster");
        assert_eq!(blocks.len(), 3, "notation, request, answer");
        let route = Request::Route(KeysRequest { keys: vec![b"k1".to_vec()] });
        assert_eq!(dump(blocks[1]), crate::frame::encode_frame(&route).unwrap());
        let routes = Response::Routes(Routes {
            nodes: vec![NodeAddr {
                node: 2,
                addr: "10.0.0.2:7100".into(),
                server_name: "s".into(),
                fingerprint: vec![0xab; 32],
            }],
            items: vec![vec![2]],
        });
        assert_eq!(dump(blocks[2]), crate::frame::encode_frame(&routes).unwrap());
        assert_eq!(codec::encode(&ErrorCode::NotLeader).unwrap(), vec![24, 0, 0, 0]);
        assert_eq!(
            crate::message_tag(&codec::encode(&Request::Place(PlaceRequest { items: vec![], replicas: 1 })).unwrap()),
            Some(27)
        );
    }

    #[test]
    fn documented_connector_messages() {
        let blocks = doc_blocks("### 11.9 Connector requests");
        assert_eq!(blocks.len(), 3, "notation, request, answer");
        let ask = Request::LookupLease(LookupLeaseRequest { chain: vec![b"k1".to_vec()], ttl_ms: 5000 });
        assert_eq!(dump(blocks[1]), crate::frame::encode_frame(&ask).unwrap());
        let answer = Response::LookupLeased(LookupLeased { resident: 1, lease: 7, lease_ms: 5000 });
        assert_eq!(dump(blocks[2]), crate::frame::encode_frame(&answer).unwrap());
        let rm = Request::RemoveMatching(RemoveMatchingRequest { prefix: vec![], pattern: None, force: false });
        assert_eq!(crate::message_tag(&codec::encode(&rm).unwrap()), Some(30));
        assert_eq!(REQUEST_TAGS, 31);
    }

    fn doc_blocks(heading: &str) -> Vec<&'static str> {
        let doc = include_str!("../../docs/PROTOCOL.md");
        let start = doc.find(heading).expect("section in PROTOCOL.md");
        let section = &doc[start..];
        let rest = &section[heading.len()..];
        // A subsection ends at the next heading of its level or above.
        let next = if heading.starts_with("### ") {
            [rest.find("\n## "), rest.find("\n### ")].into_iter().flatten().min()
        } else {
            rest.find("\n## ")
        };
        let end = next.map_or(section.len(), |e| e + heading.len());
        section[..end].split("```").skip(1).step_by(2).collect()
    }

    #[test]
    fn documented_v2_examples() {
        let dumps = doc_dumps("### 11.5 Annotated example (version 2)");
        assert_eq!(dumps.len(), 3);
        assert_eq!(dumps[0], crate::frame::encode_frame(&Request::ShmAttach).unwrap());
        let offer = Response::ShmOffer(ShmOffer { socket_path: "/s".into(), token: vec![1, 2] });
        assert_eq!(dumps[1], crate::frame::encode_frame(&offer).unwrap());
        let put = Request::PutFrom(PutFromRequest {
            mode: PutMode::Insert,
            items: vec![PutItem {
                key: b"k1".to_vec(),
                size: 3,
                parent: None,
                tokens: 0,
                seq_tokens: 0,
                pin: PinSpec::None,
            }],
            sources: vec![BufSlice { region: 1, offset: 4096, len: 3 }],
        });
        assert_eq!(dumps[2], crate::frame::encode_frame(&put).unwrap());
        // The tags the tables give.
        assert_eq!(
            crate::message_tag(
                &codec::encode(&Request::Read(ReadRequest { lease: 0, index: 0, offset: 0, size: 0 })).unwrap()
            ),
            Some(20)
        );
        assert_eq!(REQUEST_TAGS, 31);
        assert_eq!(codec::encode(&Response::Done).unwrap(), vec![15, 0, 0, 0]);
        assert_eq!(codec::encode(&ErrorCode::Expired).unwrap(), vec![23, 0, 0, 0]);
    }

    #[test]
    fn documented_kv_events() {
        let blocks = doc_blocks("### 11.7 KV events");
        // The first block of the section is the message notation, not bytes.
        assert_eq!(blocks.len(), 3);
        let (request, frame) = (dump(blocks[1]), dump(blocks[2]));
        let sub = Request::Subscribe(SubscribeRequest { from: Some(1), scope: EventScope::Tenant, max_batch: 0 });
        assert_eq!(request, crate::frame::encode_frame(&sub).unwrap());
        let batch = Response::Events(EventBatch {
            log_id: 0x0102_0304_0506_0708,
            lagged: 0,
            next: 3,
            events: vec![KvEvent {
                seq: 2,
                kind: KvEventKind::Stored,
                tier: 1,
                node: "n1".into(),
                tenant: "t".into(),
                key: b"b".to_vec(),
                parent: Some(b"a".to_vec()),
                size: 2,
                time_ms: 1000,
            }],
        });
        assert_eq!(frame, crate::frame::encode_frame(&batch).unwrap());
    }

    #[test]
    fn documented_encoding_rules() {
        // Option: u8 0/1 then the value; bool: u8; unit variant: tag only; f64: IEEE LE.
        let parent = PutItem {
            key: vec![1],
            size: 0,
            parent: Some(vec![2]),
            tokens: 0,
            seq_tokens: 0,
            pin: PinSpec::Soft { ttl_ms: 7 },
        };
        let b = codec::encode(&parent).unwrap();
        assert_eq!(&b[17..27], &[1, 1, 0, 0, 0, 0, 0, 0, 0, 2]);
        assert_eq!(&b[b.len() - 12..], &[1, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(codec::encode(&Request::Stats).unwrap(), vec![7, 0, 0, 0]);
        assert_eq!(codec::encode(&RemoveAllRequest { force: true }).unwrap(), vec![1]);
        assert_eq!(codec::encode(&1.5f64).unwrap(), 1.5f64.to_le_bytes().to_vec());
        assert_eq!(codec::encode(&ErrorCode::InvalidArgument).unwrap(), vec![20, 0, 0, 0]);
        assert_eq!(
            codec::encode(&Response::Error(ErrorBody { code: ErrorCode::NotFound, message: String::new() })).unwrap(),
            vec![9, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
    }
}
