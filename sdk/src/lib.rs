//! kvpool policy SDK.
//!
//! A policy is a plain Rust type implementing one of [`EvictionPolicy`], [`AdmissionPolicy`] or
//! [`PlacementPolicy`]. The same type runs natively inside the server (the built-in fallbacks are
//! written this way) and, exported with the SDK's macros, as a sandboxed WebAssembly component.
//!
//! Policies are stateful and event-driven: the host owns the truth about which blocks exist and
//! feeds every change as a batch of [`Events`] (columns of plain numbers, one call per batch),
//! then asks for decisions. A fresh instance rebuilt by replaying the current block set must
//! reach an equivalent state; that is how a hot swap works.

use std::collections::BTreeMap;

// Lets the generated guest bindings name this crate by the same path inside and outside it.
#[cfg(target_arch = "wasm32")]
extern crate self as kvpool_policy_sdk;

/// "No parent" in the `parent` column: the block starts a chain.
pub const NO_PARENT: u64 = u64::MAX;

/// "No block" in the `id` column of a [`EventKind::Missed`] row.
pub const NO_ID: u64 = u64::MAX;

/// "Unknown" in the `depth` column.
pub const NO_DEPTH: u32 = u32::MAX;

/// The key hash hosts put in the `key` columns: xxh3-64 of the key bytes, seeded with the
/// tenant. Stable across evictions, re-puts, restarts and hosts, so a policy can follow a key
/// whose block comes back under a new id. Native only: guests receive hashes, never keys.
#[cfg(not(target_arch = "wasm32"))]
pub fn key_hash(tenant: u32, key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, u64::from(tenant))
}

/// Storage tier of a block copy. Lower is faster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Tier {
    Device = 0,
    Dram = 1,
    Ssd = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Dram, Tier::Ssd];

    pub fn from_u8(v: u8) -> Option<Tier> {
        match v {
            0 => Some(Tier::Device),
            1 => Some(Tier::Dram),
            2 => Some(Tier::Ssd),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Dram => "dram",
            Tier::Ssd => "ssd",
        }
    }
}

/// Pin state of a block. Hard-pinned blocks are never evicted; soft-pinned ones only after
/// every unpinned candidate is gone (the host turns an expired soft pin into `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Pin {
    None = 0,
    Soft = 1,
    Hard = 2,
}

impl Pin {
    pub fn from_u8(v: u8) -> Option<Pin> {
        match v {
            0 => Some(Pin::None),
            1 => Some(Pin::Soft),
            2 => Some(Pin::Hard),
            _ => None,
        }
    }
}

/// What happened to a block copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EventKind {
    /// A copy of the block now lives in `tier` (new block, demotion or promotion).
    Inserted = 0,
    /// The copy in `tier` was read (a `get`; `lookup`/`exists` never produce this).
    Accessed = 1,
    /// The copy in `tier` is gone (evicted, removed, or moved away).
    Removed = 2,
    /// The block's pin changed to `pin` (e.g. a soft pin expired).
    PinChanged = 3,
    /// A read or lookup wanted a key that has no resident block: `id` is [`NO_ID`]; `key`,
    /// `depth` and `parent` (the resident block before it in the chain looked up) say what.
    Missed = 4,
}

impl EventKind {
    pub fn from_u8(v: u8) -> Option<EventKind> {
        match v {
            0 => Some(EventKind::Inserted),
            1 => Some(EventKind::Accessed),
            2 => Some(EventKind::Removed),
            3 => Some(EventKind::PinChanged),
            4 => Some(EventKind::Missed),
            _ => None,
        }
    }
}

/// One event, as a row. Hosts and tests build batches from these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    /// Dense block id, fresh for every put (never reused); [`NO_ID`] on a miss.
    pub id: u64,
    /// Key hash ([`key_hash`]): the same for a key whatever block id it has.
    pub key: u64,
    pub size: u64,
    pub tokens: u32,
    pub tier: Tier,
    /// Parent block id, or [`NO_PARENT`].
    pub parent: u64,
    pub pin: Pin,
    /// Position in the prefix chain (0 for a root), or [`NO_DEPTH`].
    pub depth: u32,
    /// Requests that wanted the key so far, as the host knows: misses of the key before the
    /// put plus reads since (on `Inserted`, `Accessed`), misses remembered (on `Missed`); 0 when
    /// the host does not count. A running total: take the largest seen, do not add.
    pub count: u32,
    /// Host clock in microseconds: when it happened, or in a snapshot the last access.
    pub time: u64,
}

impl Event {
    /// The constructors set `key` to the id (tests that do not care about key identity) and
    /// leave depth unknown, count and time 0; hosts set them with the `with_*` methods.
    fn new(kind: EventKind, id: u64, tier: Tier) -> Event {
        Event {
            kind,
            id,
            key: id,
            size: 0,
            tokens: 0,
            tier,
            parent: NO_PARENT,
            pin: Pin::None,
            depth: NO_DEPTH,
            count: 0,
            time: 0,
        }
    }
    pub fn inserted(id: u64, size: u64, tier: Tier, parent: u64) -> Event {
        Event { size, parent, ..Event::new(EventKind::Inserted, id, tier) }
    }
    pub fn accessed(id: u64, tier: Tier) -> Event {
        Event::new(EventKind::Accessed, id, tier)
    }
    pub fn removed(id: u64, tier: Tier) -> Event {
        Event::new(EventKind::Removed, id, tier)
    }
    pub fn pin_changed(id: u64, pin: Pin) -> Event {
        Event { pin, ..Event::new(EventKind::PinChanged, id, Tier::Dram) }
    }
    /// A miss of `key` at chain position `depth`; `parent` is the resident block before it.
    pub fn missed(key: u64, depth: u32, parent: u64) -> Event {
        Event { key, depth, parent, count: 1, ..Event::new(EventKind::Missed, NO_ID, Tier::Dram) }
    }
    pub fn with_tokens(mut self, tokens: u32) -> Event {
        self.tokens = tokens;
        self
    }
    pub fn with_pin(mut self, pin: Pin) -> Event {
        self.pin = pin;
        self
    }
    pub fn with_key(mut self, key: u64) -> Event {
        self.key = key;
        self
    }
    pub fn with_depth(mut self, depth: u32) -> Event {
        self.depth = depth;
        self
    }
    pub fn with_count(mut self, count: u32) -> Event {
        self.count = count;
        self
    }
    pub fn with_time(mut self, time: u64) -> Event {
        self.time = time;
        self
    }
    pub fn with_parent(mut self, parent: u64) -> Event {
        self.parent = parent;
        self
    }
}

/// A batch of events as columns (one `Vec` per field): this is what crosses the Wasm boundary,
/// because columns of plain numbers lower ~25x cheaper than a list of records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Events {
    pub kind: Vec<u8>,
    pub id: Vec<u64>,
    pub key: Vec<u64>,
    pub size: Vec<u64>,
    pub tokens: Vec<u32>,
    pub tier: Vec<u8>,
    pub parent: Vec<u64>,
    pub pin: Vec<u8>,
    pub depth: Vec<u32>,
    pub count: Vec<u32>,
    pub time: Vec<u64>,
}

impl Events {
    pub fn new() -> Events {
        Events::default()
    }

    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn clear(&mut self) {
        self.kind.clear();
        self.id.clear();
        self.key.clear();
        self.size.clear();
        self.tokens.clear();
        self.tier.clear();
        self.parent.clear();
        self.pin.clear();
        self.depth.clear();
        self.count.clear();
        self.time.clear();
    }

    pub fn reserve(&mut self, n: usize) {
        self.kind.reserve(n);
        self.id.reserve(n);
        self.key.reserve(n);
        self.size.reserve(n);
        self.tokens.reserve(n);
        self.tier.reserve(n);
        self.parent.reserve(n);
        self.pin.reserve(n);
        self.depth.reserve(n);
        self.count.reserve(n);
        self.time.reserve(n);
    }

    pub fn push(&mut self, e: Event) {
        self.kind.push(e.kind as u8);
        self.id.push(e.id);
        self.key.push(e.key);
        self.size.push(e.size);
        self.tokens.push(e.tokens);
        self.tier.push(e.tier as u8);
        self.parent.push(e.parent);
        self.pin.push(e.pin as u8);
        self.depth.push(e.depth);
        self.count.push(e.count);
        self.time.push(e.time);
    }

    /// Append every row of `other`.
    pub fn extend_from(&mut self, other: &Events) {
        self.kind.extend_from_slice(&other.kind);
        self.id.extend_from_slice(&other.id);
        self.key.extend_from_slice(&other.key);
        self.size.extend_from_slice(&other.size);
        self.tokens.extend_from_slice(&other.tokens);
        self.tier.extend_from_slice(&other.tier);
        self.parent.extend_from_slice(&other.parent);
        self.pin.extend_from_slice(&other.pin);
        self.depth.extend_from_slice(&other.depth);
        self.count.extend_from_slice(&other.count);
        self.time.extend_from_slice(&other.time);
    }

    /// True when every column has the same length (a guest should ignore a batch that is not).
    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        [
            self.kind.len(),
            self.key.len(),
            self.size.len(),
            self.tokens.len(),
            self.tier.len(),
            self.parent.len(),
            self.pin.len(),
            self.depth.len(),
            self.count.len(),
            self.time.len(),
        ]
        .iter()
        .all(|&l| l == n)
    }

    /// The row at `i`; `None` for an unknown kind, tier or pin code (or past the end).
    pub fn get(&self, i: usize) -> Option<Event> {
        Some(Event {
            kind: EventKind::from_u8(*self.kind.get(i)?)?,
            id: *self.id.get(i)?,
            key: *self.key.get(i)?,
            size: *self.size.get(i)?,
            tokens: *self.tokens.get(i)?,
            tier: Tier::from_u8(*self.tier.get(i)?)?,
            parent: *self.parent.get(i)?,
            pin: Pin::from_u8(*self.pin.get(i)?)?,
            depth: *self.depth.get(i)?,
            count: *self.count.get(i)?,
            time: *self.time.get(i)?,
        })
    }

    /// Rows of the batch; rows with an unknown kind, tier or pin code are skipped.
    pub fn iter(&self) -> impl Iterator<Item = Event> + '_ {
        let n = if self.is_well_formed() { self.id.len() } else { 0 };
        (0..n).filter_map(move |i| self.get(i))
    }
}

impl FromIterator<Event> for Events {
    fn from_iter<I: IntoIterator<Item = Event>>(iter: I) -> Events {
        let mut ev = Events::new();
        for e in iter {
            ev.push(e);
        }
        ev
    }
}

/// Module parameters (`--param k=v` at load time), with typed getters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Params(pub BTreeMap<String, String>);

/// A parameter that is present but does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError(pub String);

impl std::fmt::Display for ParamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParamError {}

impl Params {
    pub fn new() -> Params {
        Params::default()
    }

    pub fn from_pairs<K: Into<String>, V: Into<String>>(pairs: impl IntoIterator<Item = (K, V)>) -> Params {
        Params(pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub fn get_u64(&self, key: &str, default: u64) -> Result<u64, ParamError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                v.trim().parse().map_err(|_| ParamError(format!("parameter {key}={v:?} is not an unsigned integer")))
            }
        }
    }

    pub fn get_f64(&self, key: &str, default: f64) -> Result<f64, ParamError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() => Ok(x),
                _ => Err(ParamError(format!("parameter {key}={v:?} is not a finite number"))),
            },
        }
    }

    pub fn get_bool(&self, key: &str, default: bool) -> Result<bool, ParamError> {
        match self.get(key).map(str::trim) {
            None => Ok(default),
            Some("true" | "1" | "yes" | "on") => Ok(true),
            Some("false" | "0" | "no" | "off") => Ok(false),
            Some(v) => Err(ParamError(format!("parameter {key}={v:?} is not a boolean"))),
        }
    }
}

/// Eviction: choose which block copies of a tier to drop (or demote) to free space.
pub trait EvictionPolicy {
    /// Apply a batch of events, in order.
    fn on_events(&mut self, events: &Events);

    /// Choose copies resident in `tier` whose sizes add up to at least `bytes`, in the order
    /// they should go. Never return an id in `exclude` (sorted ascending: leased or in-flight
    /// blocks) nor a hard-pinned block. Return fewer bytes only when nothing else is evictable.
    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64>;
}

/// A host's block index as the host side of a policy sees it: the truth a guard checks an
/// eviction module's answer against, and the warm snapshot a new policy starts from. The node's
/// core implements it; its eviction slots and the Wasm host's guard read it. Guests never see it.
pub trait IndexView {
    /// Size of the copy of `id` resident in `tier`, or `None` when there is none.
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64>;
    /// Current pin of `id` (`Pin::None` for an unknown id).
    fn pin(&self, id: u64) -> Pin;
    /// Bytes that could be freed in `tier` without touching `exclude`d (sorted) or hard-pinned
    /// copies: a module may return fewer bytes than asked only when this is smaller.
    fn evictable_bytes(&self, tier: Tier, exclude: &[u64]) -> u64;
    /// Resident blocks (a copy in any tier) whose parent is `id`: the chain rule's input.
    fn resident_children(&self, id: u64) -> Vec<u64>;
    /// The warm snapshot (see the WIT `events` record): the host's recent misses as `Missed`
    /// events, oldest first, then every block as `Inserted` events with its pin, read count and
    /// last access, least recently used first and parents before children. Used to start a
    /// swapped-in policy and to rebuild a module after a trap.
    fn snapshot(&self) -> Events;
}

/// One block asking to enter a tier; a batch of them is [`AdmitBatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmitRequest {
    /// The fresh id the block gets if it is stored.
    pub id: u64,
    /// Key hash ([`key_hash`]).
    pub key: u64,
    pub size: u64,
    pub tokens: u32,
    /// Length in tokens of the prefix this block completes (vLLM's `store_threshold` input).
    pub seq_tokens: u64,
    /// The tier the host would put it in.
    pub tier: Tier,
    /// A resident block, an earlier row of the same batch, or [`NO_PARENT`].
    pub parent: u64,
    /// Position in the prefix chain, or [`NO_DEPTH`].
    pub depth: u32,
}

impl AdmitRequest {
    /// A request with `key` = `id` and unknown depth (tests); hosts fill every field.
    pub fn new(id: u64, size: u64, tokens: u32, seq_tokens: u64, tier: Tier, parent: u64) -> AdmitRequest {
        AdmitRequest { id, key: id, size, tokens, seq_tokens, tier, parent, depth: NO_DEPTH }
    }
    pub fn with_key(mut self, key: u64) -> AdmitRequest {
        self.key = key;
        self
    }
    pub fn with_depth(mut self, depth: u32) -> AdmitRequest {
        self.depth = depth;
        self
    }
}

/// Admission requests as columns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdmitBatch {
    pub id: Vec<u64>,
    pub key: Vec<u64>,
    pub size: Vec<u64>,
    pub tokens: Vec<u32>,
    pub seq_tokens: Vec<u64>,
    pub tier: Vec<u8>,
    pub parent: Vec<u64>,
    pub depth: Vec<u32>,
}

impl AdmitBatch {
    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn push(&mut self, r: AdmitRequest) {
        self.id.push(r.id);
        self.key.push(r.key);
        self.size.push(r.size);
        self.tokens.push(r.tokens);
        self.seq_tokens.push(r.seq_tokens);
        self.tier.push(r.tier as u8);
        self.parent.push(r.parent);
        self.depth.push(r.depth);
    }

    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        [
            self.key.len(),
            self.size.len(),
            self.tokens.len(),
            self.seq_tokens.len(),
            self.tier.len(),
            self.parent.len(),
            self.depth.len(),
        ]
        .iter()
        .all(|&l| l == n)
    }

    pub fn iter(&self) -> impl Iterator<Item = AdmitRequest> + '_ {
        let n = if self.is_well_formed() { self.id.len() } else { 0 };
        (0..n).map(move |i| AdmitRequest {
            id: self.id[i],
            key: self.key[i],
            size: self.size[i],
            tokens: self.tokens[i],
            seq_tokens: self.seq_tokens[i],
            tier: Tier::from_u8(self.tier[i]).unwrap_or(Tier::Dram),
            parent: self.parent[i],
            depth: self.depth[i],
        })
    }

    /// The host's chain rule for admission: a row whose parent is an earlier row of this batch
    /// that is rejected is rejected too (it could never be hit while its parent is absent).
    /// Hosts apply it to every answer, native or Wasm; returns how many rows it turned down.
    pub fn enforce_chain(&self, decisions: &mut [Admit]) -> usize {
        let n = self.id.len().min(decisions.len());
        let mut turned = 0;
        // Rows are few per put (one chain): a linear look-back is cheaper than a map.
        for i in 0..n {
            if decisions[i] == Admit::Reject {
                continue;
            }
            let p = self.parent[i];
            if p == NO_PARENT {
                continue;
            }
            let parent_rejected =
                (0..i).rev().find(|&j| self.id[j] == p).is_some_and(|j| decisions[j] == Admit::Reject);
            if parent_rejected {
                decisions[i] = Admit::Reject;
                turned += 1;
            }
        }
        turned
    }
}

impl FromIterator<AdmitRequest> for AdmitBatch {
    fn from_iter<I: IntoIterator<Item = AdmitRequest>>(iter: I) -> AdmitBatch {
        let mut b = AdmitBatch::default();
        for r in iter {
            b.push(r);
        }
        b
    }
}

/// An admission decision for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admit {
    /// Keep the block out of the pool.
    Reject,
    /// Store it in this tier (usually the one asked for).
    Into(Tier),
}

/// Admission: decide whether (and where) a new block, or a block being demoted, is stored.
pub trait AdmissionPolicy {
    fn on_events(&mut self, events: &Events);
    /// One decision per request, in order.
    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit>;
}

impl Admit {
    /// Wire code of a decision: the tier code, or [`ADMIT_REJECT`].
    pub fn to_u8(self) -> u8 {
        match self {
            Admit::Reject => ADMIT_REJECT,
            Admit::Into(t) => t as u8,
        }
    }

    /// Decode a wire code; `None` for a code that is neither a tier nor [`ADMIT_REJECT`].
    pub fn from_u8(v: u8) -> Option<Admit> {
        if v == ADMIT_REJECT {
            Some(Admit::Reject)
        } else {
            Tier::from_u8(v).map(Admit::Into)
        }
    }
}

/// Wire code of [`Admit::Reject`] in the `admit` result column.
pub const ADMIT_REJECT: u8 = 255;

/// "No node" in node-id columns (e.g. a root block's `parent_node`).
pub const NO_NODE: u64 = u64::MAX;

/// Blocks to place, as columns, plus how many copies each needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceBatch {
    pub id: Vec<u64>,
    pub size: Vec<u64>,
    pub tokens: Vec<u32>,
    pub parent: Vec<u64>,
    /// Node that holds the parent block ([`NO_NODE`] for a root or an absent parent).
    pub parent_node: Vec<u64>,
    /// Preferred tier code per block.
    pub tier: Vec<u8>,
    /// Copies per block, each on a distinct node; at least 1.
    pub replicas: u32,
    /// The storage node on the host of the client that puts these blocks (an engine's own
    /// node), or [`NO_NODE`] when it has none or the host cannot tell.
    pub client_node: u64,
}

impl Default for PlaceBatch {
    fn default() -> PlaceBatch {
        PlaceBatch {
            id: Vec::new(),
            size: Vec::new(),
            tokens: Vec::new(),
            parent: Vec::new(),
            parent_node: Vec::new(),
            tier: Vec::new(),
            replicas: 1,
            client_node: NO_NODE,
        }
    }
}

/// One block to place (a row of [`PlaceBatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceRequest {
    pub id: u64,
    pub size: u64,
    pub tokens: u32,
    pub parent: u64,
    pub parent_node: u64,
    pub tier: Tier,
}

impl PlaceBatch {
    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn push(&mut self, r: PlaceRequest) {
        self.id.push(r.id);
        self.size.push(r.size);
        self.tokens.push(r.tokens);
        self.parent.push(r.parent);
        self.parent_node.push(r.parent_node);
        self.tier.push(r.tier as u8);
    }

    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        [self.size.len(), self.tokens.len(), self.parent.len(), self.parent_node.len(), self.tier.len()]
            .iter()
            .all(|&l| l == n)
    }

    pub fn iter(&self) -> impl Iterator<Item = PlaceRequest> + '_ {
        let n = if self.is_well_formed() { self.id.len() } else { 0 };
        (0..n).map(move |i| PlaceRequest {
            id: self.id[i],
            size: self.size[i],
            tokens: self.tokens[i],
            parent: self.parent[i],
            parent_node: self.parent_node[i],
            tier: Tier::from_u8(self.tier[i]).unwrap_or(Tier::Dram),
        })
    }

    /// Copies per block a policy must return given `nodes` live nodes: `min(replicas, nodes)`,
    /// at least 1 (0 only when there is no node at all).
    pub fn effective_replicas(&self, nodes: usize) -> usize {
        (self.replicas.max(1) as usize).min(nodes)
    }
}

impl FromIterator<PlaceRequest> for PlaceBatch {
    fn from_iter<I: IntoIterator<Item = PlaceRequest>>(iter: I) -> PlaceBatch {
        let mut b = PlaceBatch::default();
        for r in iter {
            b.push(r);
        }
        b
    }
}

/// Live storage nodes as columns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSet {
    pub id: Vec<u64>,
    /// Free bytes per tier, indexed by `Tier as usize`.
    pub free: [Vec<u64>; 3],
    /// Relative load; lower is less busy.
    pub load: Vec<u32>,
}

impl NodeSet {
    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn push(&mut self, id: u64, free: [u64; 3], load: u32) {
        self.id.push(id);
        for (col, f) in self.free.iter_mut().zip(free) {
            col.push(f);
        }
        self.load.push(load);
    }

    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        self.free.iter().all(|c| c.len() == n) && self.load.len() == n
    }

    /// Free bytes of node at index `i` in `tier` (0 for a malformed set).
    pub fn free_at(&self, i: usize, tier: Tier) -> u64 {
        self.free[tier as usize].get(i).copied().unwrap_or(0)
    }

    /// Tier to use on node `i` for a block of `size` preferring `want`: `want` when it has room,
    /// else the next slower tier with room, else `want` (the host evicts to make room).
    pub fn fit_tier(&self, i: usize, want: Tier, size: u64) -> Tier {
        Tier::ALL.iter().copied().filter(|&t| t >= want).find(|&t| self.free_at(i, t) >= size).unwrap_or(want)
    }
}

/// Placement answer: block `i` owns entries `[i*r, (i+1)*r)` of both columns, where
/// `r = PlaceBatch::effective_replicas(nodes.len())`; the nodes of one block are distinct.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placements {
    pub node: Vec<u64>,
    pub tier: Vec<u8>,
}

impl Placements {
    pub fn push(&mut self, node: u64, tier: Tier) {
        self.node.push(node);
        self.tier.push(tier as u8);
    }
}

/// Placement: choose the storage node (and tier) of new blocks and their replicas.
pub trait PlacementPolicy {
    /// Apply a batch of events (most placement policies need none).
    fn on_events(&mut self, _events: &Events) {}
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements;
}

/// Construction from load-time parameters; the Wasm export macros call this from `init`.
/// Unknown parameters should be ignored so that one parameter set can serve several policies.
pub trait FromParams: Sized {
    fn from_params(params: &Params) -> Result<Self, ParamError>;
}

/// Log levels of [`log`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// Log a line through the host (tagged with the module's name). Natively this is a no-op:
/// the SDK has no logging dependency, and native policies log with their host's own logger.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    __wasm::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    let _ = (level, message);
}

/// Microseconds since the Unix epoch, from the host clock.
pub fn now_us() -> u64 {
    #[cfg(target_arch = "wasm32")]
    return __wasm::now_us();
    #[cfg(not(target_arch = "wasm32"))]
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod __wasm;

/// Export an [`EvictionPolicy`] + [`FromParams`] type as the module's `eviction` world.
/// Expands to nothing on native targets, so a policy crate also builds and tests natively.
#[macro_export]
macro_rules! export_eviction {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __KvpoolExport;
            impl $crate::__wasm::eviction::Guest for __KvpoolExport {
                fn init(
                    params: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), ::std::string::String> {
                    $crate::__wasm::init_eviction::<$t>(params)
                }
                fn on_events(events: $crate::__wasm::eviction::Events) {
                    $crate::__wasm::eviction_on_events(events)
                }
                fn victims(tier: u8, bytes: u64, exclude: ::std::vec::Vec<u64>) -> ::std::vec::Vec<u64> {
                    $crate::__wasm::eviction_victims(tier, bytes, exclude)
                }
            }
    $crate::__export_eviction_impl!(__KvpoolExport with_types_in $crate::__wasm::eviction);
        };
    };
}

/// Export an [`AdmissionPolicy`] + [`FromParams`] type as the module's `admission` world.
#[macro_export]
macro_rules! export_admission {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __KvpoolExport;
            impl $crate::__wasm::admission::Guest for __KvpoolExport {
                fn init(
                    params: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), ::std::string::String> {
                    $crate::__wasm::init_admission::<$t>(params)
                }
                fn on_events(events: $crate::__wasm::admission::Events) {
                    $crate::__wasm::admission_on_events(events)
                }
                fn admit(batch: $crate::__wasm::admission::AdmitBatch) -> ::std::vec::Vec<u8> {
                    $crate::__wasm::admission_admit(batch)
                }
            }
    $crate::__export_admission_impl!(__KvpoolExport with_types_in $crate::__wasm::admission);
        };
    };
}

/// Export a [`PlacementPolicy`] + [`FromParams`] type as the module's `placement` world.
#[macro_export]
macro_rules! export_placement {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __KvpoolExport;
            impl $crate::__wasm::placement::Guest for __KvpoolExport {
                fn init(
                    params: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), ::std::string::String> {
                    $crate::__wasm::init_placement::<$t>(params)
                }
                fn on_events(events: $crate::__wasm::placement::Events) {
                    $crate::__wasm::placement_on_events(events)
                }
                fn place(
                    blocks: $crate::__wasm::placement::PlaceBatch,
                    nodes: $crate::__wasm::placement::Nodes,
                ) -> $crate::__wasm::placement::Placements {
                    $crate::__wasm::placement_place(blocks, nodes)
                }
            }
    $crate::__export_placement_impl!(__KvpoolExport with_types_in $crate::__wasm::placement);
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admit_codes_round_trip() {
        for a in [Admit::Reject, Admit::Into(Tier::Device), Admit::Into(Tier::Dram), Admit::Into(Tier::Ssd)] {
            assert_eq!(Admit::from_u8(a.to_u8()), Some(a));
        }
        assert_eq!(Admit::from_u8(7), None);
    }

    #[test]
    fn placement_columns() {
        let mut nodes = NodeSet::default();
        nodes.push(9, [0, 50, 1000], 1);
        nodes.push(8, [0, 500, 1000], 2);
        assert!(nodes.is_well_formed());
        assert_eq!(nodes.fit_tier(0, Tier::Dram, 100), Tier::Ssd);
        assert_eq!(nodes.fit_tier(1, Tier::Dram, 100), Tier::Dram);
        assert_eq!(nodes.fit_tier(0, Tier::Dram, 5000), Tier::Dram);
        let mut b: PlaceBatch =
            [PlaceRequest { id: 1, size: 1, tokens: 1, parent: NO_PARENT, parent_node: NO_NODE, tier: Tier::Dram }]
                .into_iter()
                .collect();
        assert_eq!(b.effective_replicas(2), 1);
        b.replicas = 3;
        assert_eq!(b.effective_replicas(2), 2);
        b.replicas = 0;
        assert_eq!(b.effective_replicas(2), 1);
        assert_eq!(b.effective_replicas(0), 0);
    }

    #[test]
    fn chain_rule_rejects_children_of_rejected_rows() {
        // Chain 10 <- 11 <- 12 in one put, 13 a child of the resident block 5, 14 a root.
        let b: AdmitBatch = [
            AdmitRequest::new(10, 1, 1, 1, Tier::Dram, NO_PARENT),
            AdmitRequest::new(11, 1, 1, 2, Tier::Dram, 10),
            AdmitRequest::new(12, 1, 1, 3, Tier::Dram, 11),
            AdmitRequest::new(13, 1, 1, 2, Tier::Dram, 5),
            AdmitRequest::new(14, 1, 1, 1, Tier::Dram, NO_PARENT),
        ]
        .into_iter()
        .collect();
        let mut d = vec![
            Admit::Into(Tier::Dram),
            Admit::Reject,
            Admit::Into(Tier::Dram),
            Admit::Into(Tier::Dram),
            Admit::Reject,
        ];
        assert_eq!(b.enforce_chain(&mut d), 1);
        assert_eq!(d, [Admit::Into(Tier::Dram), Admit::Reject, Admit::Reject, Admit::Into(Tier::Dram), Admit::Reject]);
    }

    #[test]
    fn key_hash_is_xxh3_seeded_by_tenant() {
        assert_eq!(key_hash(0, b"42"), xxhash_rust::xxh3::xxh3_64_with_seed(b"42", 0));
        assert_ne!(key_hash(0, b"42"), key_hash(1, b"42"));
    }

    #[test]
    fn malformed_columns_yield_no_rows() {
        let mut e: Events = [Event::inserted(1, 1, Tier::Dram, NO_PARENT)].into_iter().collect();
        assert_eq!(e.iter().count(), 1);
        e.pin.push(0);
        assert_eq!(e.iter().count(), 0);
    }
}
