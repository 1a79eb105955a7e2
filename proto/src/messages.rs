//! Every message of the protocol: the two envelopes (`Request`, `Response`) and the tag counts
//! here, their bodies by concern in the submodules (re-exported, so every message is
//! `kvpool_proto::X`). Enum variants and struct fields are encoded in declaration order: append
//! new variants at the end only.

use serde::{Deserialize, Serialize};

mod bulk;
mod cluster;
mod codes;
mod connector;
mod events;
mod one_sided;
mod policy;
mod v1;

pub use bulk::*;
pub use cluster::*;
pub use codes::*;
pub use connector::*;
pub use events::*;
pub use one_sided::*;
pub use policy::*;
pub use v1::*;

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
    // ---- version 2: the TCP bulk channel (PROTOCOL.md 11.10) ---------------------------------
    /// Ask for a TCP connection that carries this connection's requests (bulk bytes over
    /// TCP): answered with `BulkOffer`, one token per TCP connection.
    BulkAttach(BulkAttachRequest),
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
    /// Answer to `BulkAttach`.
    BulkOffer(BulkOffer),
}

#[cfg(test)]
mod tests;
