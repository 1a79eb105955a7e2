//! Trace replay through a [`ReplayPool`]: the driver a request goes through, kvpool's real policies
//! (native or Wasm) by name, in admission + eviction pairs, and Belady's offline optimum
//! adapted to prefix hits.
//!
//! One request = `lookup` of its chain (hit = longest resident prefix of its `hash_ids`; every
//! absent block is a miss the policies see), `get` of the hit prefix (`Accessed`, leased for
//! the request), then `put` of the rest (admission for all new blocks in one batch, room made
//! with one `victims` call, the chain rules applied; see [`crate::pool`]).

use crate::pool::{trace_key_hash, PoolStats, PutItem, ReplayPool, SimPool};
use crate::trace::{Hits, Request, Trace};
use kvpool_policy_host::{Deadline, HostConfig, LoadedModule, PolicyEngine, PolicyKind, WasmAdmission, WasmEviction};
// The standard policies by name come from the policies crate's one table, which the server's
// built-ins and native fallbacks use too.
use kvpool_policies::registry::{self, RegistryError, DEFAULT_ADMISSION};
use kvpool_policy_sdk::{AdmissionPolicy, EventKind, Events, EvictionPolicy, Params, Tier, NO_PARENT};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Pairs `replay` runs when none are given: every standard eviction policy behind the
/// server's default admission, then the key-history admission filters with the default
/// eviction and with chain-experts.
pub const DEFAULT_PAIRS: [&str; 10] = [
    "lru",
    "leaf-lru",
    "arc",
    "s3fifo",
    "sieve",
    "chain-experts",
    "doorkeeper+leaf-lru",
    "ghost+leaf-lru",
    "doorkeeper+chain-experts",
    "ghost+chain-experts",
];

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("unknown {kind} policy {name:?} (known: {known})")]
    UnknownPolicy { kind: &'static str, name: String, known: String },
    #[error("policy {name} refused its parameters: {message}")]
    Params { name: String, message: String },
    #[error("building the standard Wasm policies: {0}")]
    Build(#[from] kvpool_policy_build::BuildError),
    #[error("Wasm policy {name}: {source}")]
    Host {
        name: String,
        #[source]
        source: kvpool_policy_host::HostError,
    },
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a pair is `admission+eviction` or `eviction`, not {0:?}")]
    BadPair(String),
}

fn unknown(kind: &'static str, name: &str, known: &[&str]) -> SimError {
    SimError::UnknownPolicy { kind, name: name.into(), known: known.join(", ") }
}

impl From<RegistryError> for SimError {
    fn from(e: RegistryError) -> SimError {
        match e {
            RegistryError::Unknown { kind, name, known } => SimError::UnknownPolicy { kind, name, known },
            RegistryError::Params { name, source } => SimError::Params { name, message: source.0 },
        }
    }
}

/// A native standard eviction policy by name ([`registry::eviction`]).
pub fn native_eviction(name: &str, params: &Params) -> Result<Box<dyn EvictionPolicy + Send>, SimError> {
    Ok(registry::eviction(name, params)?)
}

/// A native standard admission policy by name ([`registry::admission`]).
pub fn native_admission(name: &str, params: &Params) -> Result<Box<dyn AdmissionPolicy + Send>, SimError> {
    Ok(registry::admission(name, params)?)
}

/// An admission + eviction pair, written `admission+eviction` (or `eviction` alone for the
/// server's default admission).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub admission: String,
    pub eviction: String,
}

impl Pair {
    pub fn parse(s: &str) -> Result<Pair, SimError> {
        let parts: Vec<&str> = s.split('+').map(str::trim).collect();
        match parts[..] {
            [e] if !e.is_empty() => Ok(Pair { admission: DEFAULT_ADMISSION.into(), eviction: e.into() }),
            [a, e] if !a.is_empty() && !e.is_empty() => Ok(Pair { admission: a.into(), eviction: e.into() }),
            _ => Err(SimError::BadPair(s.into())),
        }
    }

    /// `admission+eviction`.
    pub fn label(&self) -> String {
        format!("{}+{}", self.admission, self.eviction)
    }
}

/// Wasm modules (eviction and admission), compiled once, instantiated once per run.
pub struct WasmSet {
    engine: PolicyEngine,
    /// (name, kind, module)
    pub modules: Vec<(String, PolicyKind, LoadedModule)>,
}

impl WasmSet {
    pub fn new() -> Result<WasmSet, SimError> {
        let config = HostConfig {
            // Replays hold up to hundreds of thousands of blocks: room and time to match.
            deadline: Deadline::Epoch { tick: Duration::from_millis(1), ticks: 5_000 },
            memory_limit: 1 << 30,
            cache_dir: Some(kvpool_policy_build::repo_root().join("target/policy-cache")),
            ..HostConfig::default()
        };
        let engine = PolicyEngine::new(config).map_err(|source| SimError::Host { name: "engine".into(), source })?;
        Ok(WasmSet { engine, modules: Vec::new() })
    }

    /// Build the standard policies into `target/policy-components` and load the eviction and
    /// admission ones.
    pub fn add_standard(&mut self, params: &Params) -> Result<(), SimError> {
        let out = kvpool_policy_build::repo_root().join("target/policy-components");
        for b in kvpool_policy_build::build_standard(&out)? {
            let kind = match b.kind {
                kvpool_policy_build::PolicyKind::Eviction => PolicyKind::Eviction,
                kvpool_policy_build::PolicyKind::Admission => PolicyKind::Admission,
                kvpool_policy_build::PolicyKind::Placement => continue,
            };
            self.add_file(&b.name, kind, &b.path, params)?;
        }
        Ok(())
    }

    /// Load one component from a file under `name`.
    pub fn add_file(&mut self, name: &str, kind: PolicyKind, path: &Path, params: &Params) -> Result<(), SimError> {
        let wasm = std::fs::read(path).map_err(|source| SimError::Io { path: path.display().to_string(), source })?;
        let m = self
            .engine
            .load(name, kind, &wasm, params)
            .map_err(|source| SimError::Host { name: name.into(), source })?;
        self.modules.retain(|(n, k, _)| !(n == name && *k == kind));
        self.modules.push((name.to_string(), kind, m));
        Ok(())
    }

    fn module(&self, name: &str, kind: PolicyKind) -> Option<&LoadedModule> {
        self.modules.iter().find(|(n, k, _)| n == name && *k == kind).map(|m| &m.2)
    }

    pub fn has(&self, name: &str, kind: PolicyKind) -> bool {
        self.module(name, kind).is_some()
    }

    pub fn eviction(&self, name: &str) -> Result<Box<dyn EvictionPolicy + Send>, SimError> {
        self.eviction_probed(name).map(|(p, _)| p)
    }

    /// An eviction instance, and a cell that follows the size of its linear memory.
    pub fn eviction_probed(&self, name: &str) -> Result<(Box<dyn EvictionPolicy + Send>, MemoryProbe), SimError> {
        let m = self.module(name, PolicyKind::Eviction).ok_or_else(|| unknown("Wasm eviction", name, &[]))?;
        let inner = WasmEviction::new(m).map_err(|source| SimError::Host { name: name.into(), source })?;
        let memory = MemoryProbe::default();
        Ok((Box::new(Probed { inner, memory: memory.clone() }), memory))
    }

    pub fn admission(&self, name: &str) -> Result<Box<dyn AdmissionPolicy + Send>, SimError> {
        let m = self.module(name, PolicyKind::Admission).ok_or_else(|| unknown("Wasm admission", name, &[]))?;
        WasmAdmission::new(m)
            .map(|w| Box::new(w) as Box<dyn AdmissionPolicy + Send>)
            .map_err(|source| SimError::Host { name: name.into(), source })
    }
}

/// A Wasm eviction module that reports how large its linear memory grew.
struct Probed {
    inner: WasmEviction,
    memory: MemoryProbe,
}

impl EvictionPolicy for Probed {
    fn on_events(&mut self, events: &Events) {
        self.inner.on_events(events);
        self.memory.store(self.inner.memory_bytes(), Ordering::Relaxed);
    }
    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.inner.victims(tier, bytes, exclude)
    }
}

/// Name of a `--wasm` file: its file stem.
pub fn wasm_name(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into())
}

/// An eviction policy given by name: a native standard one (`lru`), `wasm/<standard name>`,
/// or a path to a `.wasm` eviction component.
pub fn policy_by_name(spec: &str, params: &Params) -> Result<Box<dyn EvictionPolicy + Send>, SimError> {
    if spec.ends_with(".wasm") {
        let mut set = WasmSet::new()?;
        let name = wasm_name(Path::new(spec));
        set.add_file(&name, PolicyKind::Eviction, &PathBuf::from(spec), params)?;
        return set.eviction(&name);
    }
    if let Some(name) = spec.strip_prefix("wasm/") {
        let mut set = WasmSet::new()?;
        set.add_standard(params)?;
        return set.eviction(name);
    }
    native_eviction(spec, params)
}

/// Size of a Wasm instance's linear memory, as last seen.
pub type MemoryProbe = Arc<AtomicUsize>;

/// The index of the request being served, which offline policies read (atomic so that the
/// policies holding it are `Send`, as the core's slots require).
pub type Clock = Arc<AtomicUsize>;

/// A replay of requests through a [`ReplayPool`].
pub struct CacheSim {
    pool: Box<dyn ReplayPool>,
    clock: Clock,
    requests: usize,
    items: Vec<PutItem>,
    pub hits: Hits,
}

impl CacheSim {
    /// A pool of `capacity` blocks run by `policy` with the default admission (admit all).
    pub fn new(policy: Box<dyn EvictionPolicy + Send>, capacity: usize) -> CacheSim {
        CacheSim::pair(Box::new(kvpool_policies::ThresholdAdmission::new(0)), policy, capacity)
    }

    /// A pool of `capacity` blocks run by an admission + eviction pair.
    pub fn pair(
        admission: Box<dyn AdmissionPolicy + Send>,
        eviction: Box<dyn EvictionPolicy + Send>,
        capacity: usize,
    ) -> CacheSim {
        CacheSim::over(Box::new(SimPool::new(admission, eviction, capacity)), Clock::default())
    }

    /// A replay through any pool; `clock` is set to the index of the request being served
    /// (Belady reads it).
    pub fn over(pool: Box<dyn ReplayPool>, clock: Clock) -> CacheSim {
        CacheSim { pool, clock, requests: 0, items: Vec::new(), hits: Hits::default() }
    }

    /// `policy` run with the default admission; the clock is shared with it.
    pub fn with_clock(policy: Box<dyn EvictionPolicy + Send>, capacity: usize, clock: Clock) -> CacheSim {
        let pool = SimPool::new(Box::new(kvpool_policies::ThresholdAdmission::new(0)), policy, capacity);
        CacheSim::over(Box::new(pool), clock)
    }

    /// An admission + eviction pair where either may read the shared clock (offline policies).
    pub fn pair_with_clock(
        admission: Box<dyn AdmissionPolicy + Send>,
        eviction: Box<dyn EvictionPolicy + Send>,
        capacity: usize,
        clock: Clock,
    ) -> CacheSim {
        CacheSim::over(Box::new(SimPool::new(admission, eviction, capacity)), clock)
    }

    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Serve one request; returns its own hits (also added to `self.hits`).
    pub fn request(&mut self, r: &Request) -> Hits {
        self.clock.store(self.requests, Ordering::Relaxed);
        self.requests += 1;
        // Trace time is in ms; requests of the same ms keep their order by a µs offset.
        let now = r.timestamp.saturating_mul(1000);
        let n = self.pool.lookup(&r.hash_ids, now);
        let mut h = Hits::default();
        for i in 0..r.hash_ids.len() {
            let t = r.block_tokens(i);
            h.blocks += 1;
            h.tokens += t;
            if i < n {
                h.block_hits += 1;
                h.token_hits += t;
            }
        }
        self.hits.add(&h);
        self.pool.get(&r.hash_ids[..n], now);
        self.items.clear();
        let mut seq = 0;
        for (i, &key) in r.hash_ids.iter().enumerate() {
            let tokens = r.block_tokens(i);
            seq += tokens;
            if i >= n {
                self.items.push(PutItem {
                    key,
                    parent: (i > 0).then(|| r.hash_ids[i - 1]),
                    depth: i as u32,
                    tokens: tokens as u32,
                    seq_tokens: seq,
                });
            }
        }
        self.pool.put(&self.items, now);
        self.pool.release();
        h
    }

    pub fn run(&mut self, trace: &Trace, mut tick: impl FnMut()) -> Hits {
        for r in &trace.requests {
            self.request(r);
            tick();
        }
        self.hits
    }
}

/// Belady's MIN adapted to prefix hits, as an [`EvictionPolicy`] that knows the future:
/// it evicts the resident block whose next use is farthest, where a block whose parent is not
/// resident ("orphan": its chain prefix is gone, so it cannot hit until the parent is stored
/// again) counts as never used again, and ties go deepest block first. Since a chain's ids are
/// chained hashes, a parent is used whenever its child is, so this evicts leaves before their
/// ancestors. Blocks are followed by key hash (ids are fresh per put). It admits everything: an
/// offline reference, not a proven optimum for prefix hits.
pub struct Belady {
    /// Request indices at which each key (hash) is used, ascending.
    uses: HashMap<u64, Vec<u32>>,
    clock: Clock,
    /// Resident blocks: (next use key, depth, parent, key hash).
    resident: HashMap<u64, (u64, u32, u64, u64)>,
    /// Resident children of each block id.
    children: HashMap<u64, Vec<u64>>,
    /// (next use, depth, id); the largest goes first.
    order: BTreeSet<(u64, u32, u64)>,
}

/// How the adaptation is described in reports.
pub const BELADY_NOTE: &str = "Belady (offline): evicts the block whose next use is farthest; a block whose parent is not resident counts as never used; ties evict the deepest block first; admits everything";

/// Request indices at which each key (by its policy key hash) is used, ascending.
fn future_uses(trace: &Trace) -> HashMap<u64, Vec<u32>> {
    let mut uses: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut hash_of: HashMap<u64, u64> = HashMap::new();
    for (i, r) in trace.requests.iter().enumerate() {
        for id in &r.hash_ids {
            let h = *hash_of.entry(*id).or_insert_with(|| trace_key_hash(*id));
            let v = uses.entry(h).or_default();
            if v.last() != Some(&(i as u32)) {
                v.push(i as u32);
            }
        }
    }
    uses
}

/// The request index of `key`'s next use after the one being served, or `u64::MAX`.
fn next_use_after(uses: &HashMap<u64, Vec<u32>>, key: u64, now: usize) -> u64 {
    let now = now as u32;
    uses.get(&key).and_then(|v| v.get(v.partition_point(|&u| u <= now))).map_or(u64::MAX, |&u| u64::from(u))
}

/// An admission policy that knows the future: it admits a block exactly when its key will be
/// requested again. Behind an online eviction policy it bounds what any admission filter could
/// add to that policy (the best a perfect reuse predictor could do), which tells whether a hit
/// rate goal is within reach of admission at all.
pub struct OracleAdmission {
    uses: HashMap<u64, Vec<u32>>,
    clock: Clock,
}

/// How the oracle admission is described in reports.
pub const ORACLE_NOTE: &str = "oracle admission (offline): admits a block exactly when its key is requested again later in the trace, evicts with leaf-first LRU: the bound of any admission filter in front of leaf-lru";

impl OracleAdmission {
    pub fn new(trace: &Trace, clock: Clock) -> OracleAdmission {
        OracleAdmission { uses: future_uses(trace), clock }
    }
}

impl AdmissionPolicy for OracleAdmission {
    fn on_events(&mut self, _events: &Events) {}

    fn admit(&mut self, batch: &kvpool_policy_sdk::AdmitBatch) -> Vec<kvpool_policy_sdk::Admit> {
        let now = self.clock.load(Ordering::Relaxed);
        batch
            .iter()
            .map(|r| {
                if next_use_after(&self.uses, r.key, now) == u64::MAX {
                    kvpool_policy_sdk::Admit::Reject
                } else {
                    kvpool_policy_sdk::Admit::Into(r.tier)
                }
            })
            .collect()
    }
}

impl Belady {
    pub fn new(trace: &Trace, clock: Clock) -> Belady {
        Belady {
            uses: future_uses(trace),
            clock,
            resident: HashMap::new(),
            children: HashMap::new(),
            order: BTreeSet::new(),
        }
    }

    fn next_use(&self, key: u64) -> u64 {
        next_use_after(&self.uses, key, self.clock.load(Ordering::Relaxed))
    }

    fn key(&self, hash: u64, parent: u64) -> u64 {
        if parent != NO_PARENT && !self.resident.contains_key(&parent) {
            u64::MAX
        } else {
            self.next_use(hash)
        }
    }

    fn rekey(&mut self, id: u64) {
        let Some(&(old, depth, parent, hash)) = self.resident.get(&id) else { return };
        let new = self.key(hash, parent);
        if new != old {
            self.order.remove(&(old, depth, id));
            self.order.insert((new, depth, id));
            self.resident.insert(id, (new, depth, parent, hash));
        }
    }

    fn rekey_children(&mut self, id: u64) {
        for c in self.children.get(&id).cloned().unwrap_or_default() {
            self.rekey(c);
        }
    }
}

impl EvictionPolicy for Belady {
    fn on_events(&mut self, events: &Events) {
        for e in events.iter() {
            match e.kind {
                EventKind::Inserted => {
                    if self.resident.contains_key(&e.id) {
                        self.rekey(e.id);
                        continue;
                    }
                    let depth = self.resident.get(&e.parent).map_or(0, |p| p.1 + 1);
                    let key = self.key(e.key, e.parent);
                    self.resident.insert(e.id, (key, depth, e.parent, e.key));
                    self.order.insert((key, depth, e.id));
                    if e.parent != NO_PARENT {
                        self.children.entry(e.parent).or_default().push(e.id);
                    }
                    self.rekey_children(e.id);
                }
                EventKind::Accessed => self.rekey(e.id),
                EventKind::Removed => {
                    let Some((key, depth, parent, _)) = self.resident.remove(&e.id) else { continue };
                    self.order.remove(&(key, depth, e.id));
                    if let Some(c) = self.children.get_mut(&parent) {
                        c.retain(|&x| x != e.id);
                        if c.is_empty() {
                            self.children.remove(&parent);
                        }
                    }
                    self.rekey_children(e.id);
                }
                EventKind::PinChanged | EventKind::Missed => {}
            }
        }
    }

    fn victims(&mut self, _tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        // Keys are refreshed on every access; a resident block is always in the hit prefix of
        // the requests that use it (the chain rule leaves no resident block behind a gap), so
        // no key goes stale.
        self.order
            .iter()
            .rev()
            .filter(|(_, _, id)| exclude.binary_search(id).is_err())
            .take(bytes as usize)
            .map(|&(_, _, id)| id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::unlimited;

    fn req(ids: &[u64]) -> Request {
        Request { timestamp: 0, input_length: 512 * ids.len() as u64, output_length: 0, hash_ids: ids.to_vec() }
    }

    /// Five requests of 8 blocks in all, hand-checked with a cache of 2 blocks:
    /// r0 [1,2], r1 [3], r2 [1,2], r3 [3], r4 [1,4].
    /// Unlimited: r2 hits 2, r3 hits 1, r4 hits 1 (block 1) => 4 of 8.
    /// LRU: r1 evicts 1 (the chain rule takes its child 2 along) -> {3}; r2 misses, stores 1, 2
    /// evicting 3 -> {1,2}; r3 misses, evicts 1 (and 2 with it) -> {3}; r4 misses => 0.
    /// Belady: r1 evicts 2 (1 and 2 next used at r2, 2 is deeper) -> {1,3}; r2 hits 1, stores 2
    /// evicting 3 (1 is leased) -> {1,2}; r3 misses, evicts 2 (never used again);
    /// r4 hits 1 => 2 of 8 (the best possible when every block is admitted: r2's two hits would
    /// need r1 not to store 3; refusing r2's 2 instead gives 3, see the oracle admission).
    fn tiny() -> Trace {
        Trace::from_requests(vec![req(&[1, 2]), req(&[3]), req(&[1, 2]), req(&[3]), req(&[1, 4])])
    }

    #[test]
    fn hand_checked_unlimited_lru_belady() {
        let t = tiny();
        let u = unlimited(&t);
        assert_eq!((u.block_hits, u.blocks), (4, 8));

        let mut lru = CacheSim::new(native_eviction("lru", &Params::new()).unwrap(), 2);
        let h = lru.run(&t, || {});
        assert_eq!((h.block_hits, h.blocks), (0, 8));
        assert_eq!(lru.stats().cascaded, 2);

        let clock = Clock::default();
        let mut b = CacheSim::with_clock(Box::new(Belady::new(&t, clock.clone())), 2, clock);
        let h = b.run(&t, || {});
        assert_eq!((h.block_hits, h.blocks), (2, 8));
        assert_eq!(b.stats().shortfalls, 0);

        // Unlimited capacity equals the unlimited rate for every policy.
        for name in registry::EVICTION {
            let mut s = CacheSim::new(native_eviction(name, &Params::new()).unwrap(), 1000);
            assert_eq!(s.run(&t, || {}), u, "{name}");
        }
    }

    /// The hand-checked trace with room for 2 blocks: r0 stores 1 and 2 (both used again);
    /// r1 stores 3 (used at r3), leaf-LRU evicting the leaf 2 -> {1,3}; r2 hits 1 and rejects 2
    /// (never used after r2); r3 hits 3; r4 hits 1 and rejects 4 => 3 of 8 with 2 rejected,
    /// one more than Belady, which admits everything (r2 stores 2 over 3).
    #[test]
    fn oracle_admission_admits_exactly_the_reused_blocks() {
        let t = tiny();
        let clock = Clock::default();
        let admission = Box::new(OracleAdmission::new(&t, clock.clone()));
        let eviction = native_eviction("leaf-lru", &Params::new()).unwrap();
        let mut s = CacheSim::pair_with_clock(admission, eviction, 2, clock);
        let h = s.run(&t, || {});
        assert_eq!((h.block_hits, s.stats().rejected), (3, 2), "{:?}", s.stats());
    }

    #[test]
    fn belady_evicts_orphans_first() {
        use kvpool_policy_sdk::Event;
        let clock = Clock::default();
        let t = Trace::from_requests(vec![req(&[1, 2]), req(&[1, 2]), req(&[1, 2])]);
        let mut b = Belady::new(&t, clock);
        let (k1, k2) = (trace_key_hash(1), trace_key_hash(2));
        b.on_events(
            &[
                Event::inserted(10, 1, Tier::Dram, NO_PARENT).with_key(k1),
                Event::inserted(11, 1, Tier::Dram, 10).with_key(k2),
            ]
            .into_iter()
            .collect(),
        );
        // Both next used at request 1: the deeper one goes first.
        assert_eq!(b.victims(Tier::Dram, 1, &[]), vec![11]);
        b.on_events(&[Event::removed(10, Tier::Dram)].into_iter().collect());
        assert_eq!(b.order.iter().next_back().map(|k| k.0), Some(u64::MAX));
        assert_eq!(b.victims(Tier::Dram, 1, &[11]), Vec::<u64>::new());
    }

    #[test]
    fn pairs_parse() {
        assert_eq!(Pair::parse("leaf-lru").unwrap().label(), "threshold+leaf-lru");
        assert_eq!(
            Pair::parse("doorkeeper+arc").unwrap(),
            Pair { admission: "doorkeeper".into(), eviction: "arc".into() }
        );
        assert!(Pair::parse("a+b+c").is_err());
        assert!(Pair::parse("+b").is_err());
    }
}
