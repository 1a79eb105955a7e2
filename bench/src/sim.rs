//! In-process cache simulation driving kvpool's real eviction policies (native or Wasm) with the
//! same events the server feeds them, and Belady's offline optimum adapted to prefix hits.
//!
//! One request = lookup of its chain (hit = longest resident prefix of its `hash_ids`), then
//! `Accessed` events for its resident blocks (root to leaf), then, when the cache is full,
//! `victims(Dram, needed, exclude = this request's resident blocks)`, `Removed` events for them,
//! and `Inserted` events (size 1, parent = previous id of the chain) for its missing blocks.

use crate::trace::{Hits, Request, Trace};
use kvpool_policy_host::{Deadline, HostConfig, LoadedModule, PolicyEngine, PolicyKind, WasmEviction};
use kvpool_policy_sdk::{Event, EventKind, Events, EvictionPolicy, FromParams, Params, Tier, NO_PARENT};
use std::cell::Cell;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

/// The standard eviction policies linked natively.
pub const NATIVE: [&str; 5] = ["lru", "leaf-lru", "arc", "s3fifo", "sieve"];

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("unknown native eviction policy {0:?} (known: {known})", known = NATIVE.join(", "))]
    UnknownPolicy(String),
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
}

fn native<P: EvictionPolicy + FromParams + 'static>(
    name: &str,
    params: &Params,
) -> Result<Box<dyn EvictionPolicy>, SimError> {
    P::from_params(params)
        .map(|p| Box::new(p) as Box<dyn EvictionPolicy>)
        .map_err(|e| SimError::Params { name: name.into(), message: e.0 })
}

/// A native standard policy by name.
pub fn native_policy(name: &str, params: &Params) -> Result<Box<dyn EvictionPolicy>, SimError> {
    use kvpool_policies as p;
    match name {
        "lru" => native::<p::Lru>(name, params),
        "leaf-lru" => native::<p::LeafLru>(name, params),
        "arc" => native::<p::Arc>(name, params),
        "s3fifo" => native::<p::S3Fifo>(name, params),
        "sieve" => native::<p::Sieve>(name, params),
        _ => Err(SimError::UnknownPolicy(name.into())),
    }
}

/// Wasm eviction modules, compiled once, instantiated once per run.
pub struct WasmSet {
    engine: PolicyEngine,
    pub modules: Vec<(String, LoadedModule)>,
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

    /// Build the standard policies into `target/policy-components` and load the eviction ones.
    pub fn add_standard(&mut self, params: &Params) -> Result<(), SimError> {
        let out = kvpool_policy_build::repo_root().join("target/policy-components");
        let mut built = kvpool_policy_build::build_standard(&out)?;
        built.retain(|b| b.kind == kvpool_policy_build::PolicyKind::Eviction);
        built.sort_by_key(|b| NATIVE.iter().position(|n| *n == b.name).unwrap_or(usize::MAX));
        for b in built {
            self.add_file(&format!("wasm/{}", b.name), &b.path, params)?;
        }
        Ok(())
    }

    /// Load one eviction component from a file.
    pub fn add_file(&mut self, label: &str, path: &Path, params: &Params) -> Result<(), SimError> {
        let wasm = std::fs::read(path).map_err(|source| SimError::Io { path: path.display().to_string(), source })?;
        let m = self
            .engine
            .load(label, PolicyKind::Eviction, &wasm, params)
            .map_err(|source| SimError::Host { name: label.into(), source })?;
        self.modules.push((label.to_string(), m));
        Ok(())
    }

    pub fn instantiate(&self, i: usize) -> Result<Box<dyn EvictionPolicy>, SimError> {
        let (name, m) = &self.modules[i];
        WasmEviction::new(m)
            .map(|w| Box::new(w) as Box<dyn EvictionPolicy>)
            .map_err(|source| SimError::Host { name: name.clone(), source })
    }
}

/// Label of a `--wasm` file: `wasm/<file stem>`.
pub fn wasm_label(path: &Path) -> String {
    format!("wasm/{}", path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into()))
}

/// A policy given by name: a native standard one (`lru`), `wasm/<standard name>`, or a path to
/// a `.wasm` eviction component.
pub fn policy_by_name(spec: &str, params: &Params) -> Result<Box<dyn EvictionPolicy>, SimError> {
    if spec.ends_with(".wasm") {
        let mut set = WasmSet::new()?;
        set.add_file(&wasm_label(Path::new(spec)), &PathBuf::from(spec), params)?;
        return set.instantiate(0);
    }
    if let Some(name) = spec.strip_prefix("wasm/") {
        let mut set = WasmSet::new()?;
        set.add_standard(params)?;
        let i =
            set.modules.iter().position(|(l, _)| l == spec).ok_or_else(|| SimError::UnknownPolicy(name.to_string()))?;
        return set.instantiate(i);
    }
    native_policy(spec, params)
}

/// A cache of `capacity` blocks (each of size 1) run by an eviction policy.
pub struct CacheSim {
    policy: Box<dyn EvictionPolicy>,
    capacity: usize,
    resident: HashSet<u64>,
    clock: Rc<Cell<usize>>,
    requests: usize,
    events: Events,
    pub hits: Hits,
    /// Times the policy freed fewer blocks than asked (the missing tail of a request is then
    /// not stored).
    pub shortfalls: u64,
    /// Victim ids that were not resident, were excluded, or were repeated (ignored).
    pub invalid_victims: u64,
    /// Blocks that could not be stored for lack of room.
    pub dropped: u64,
}

impl CacheSim {
    pub fn new(policy: Box<dyn EvictionPolicy>, capacity: usize) -> CacheSim {
        CacheSim::with_clock(policy, capacity, Rc::new(Cell::new(0)))
    }

    /// `clock` is set to the index of the request being served (Belady reads it).
    pub fn with_clock(policy: Box<dyn EvictionPolicy>, capacity: usize, clock: Rc<Cell<usize>>) -> CacheSim {
        CacheSim {
            policy,
            capacity,
            resident: HashSet::new(),
            clock,
            requests: 0,
            events: Events::new(),
            hits: Hits::default(),
            shortfalls: 0,
            invalid_victims: 0,
            dropped: 0,
        }
    }

    /// Serve one request; returns its own hits (also added to `self.hits`).
    pub fn request(&mut self, r: &Request) -> Hits {
        self.clock.set(self.requests);
        self.requests += 1;
        let mut h = Hits::default();
        let mut prefix = true;
        for (i, id) in r.hash_ids.iter().enumerate() {
            let t = r.block_tokens(i);
            h.blocks += 1;
            h.tokens += t;
            prefix &= self.resident.contains(id);
            if prefix {
                h.block_hits += 1;
                h.token_hits += t;
            }
        }
        self.hits.add(&h);

        // Accesses, root to leaf; then the missing blocks (each once).
        let mut seen = HashSet::with_capacity(r.hash_ids.len());
        let mut present = Vec::new();
        let mut missing = Vec::new();
        self.events.clear();
        for (i, &id) in r.hash_ids.iter().enumerate() {
            if !seen.insert(id) {
                continue;
            }
            let parent = if i == 0 { NO_PARENT } else { r.hash_ids[i - 1] };
            if self.resident.contains(&id) {
                present.push(id);
                self.events.push(Event::accessed(id, Tier::Dram));
            } else {
                missing.push((id, parent, r.block_tokens(i)));
            }
        }
        self.policy.on_events(&self.events);
        self.events.clear();

        let mut room = self.capacity.saturating_sub(self.resident.len());
        if missing.len() > room {
            let need = missing.len() - room;
            let mut exclude = present.clone();
            exclude.sort_unstable();
            let victims = self.policy.victims(Tier::Dram, need as u64, &exclude);
            let mut freed = 0;
            for v in victims {
                if exclude.binary_search(&v).is_ok() || !self.resident.remove(&v) {
                    self.invalid_victims += 1;
                    continue;
                }
                self.events.push(Event::removed(v, Tier::Dram));
                freed += 1;
            }
            if freed < need {
                self.shortfalls += 1;
            }
            room += freed;
        }
        let store = missing.len().min(room);
        self.dropped += (missing.len() - store) as u64;
        for &(id, parent, tokens) in &missing[..store] {
            self.resident.insert(id);
            self.events.push(Event::inserted(id, 1, Tier::Dram, parent).with_tokens(tokens as u32));
        }
        self.policy.on_events(&self.events);
        self.events.clear();
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
/// ancestors. It is an offline reference, not a proven optimum for prefix hits.
pub struct Belady {
    /// Request indices at which each block is used, ascending.
    uses: HashMap<u64, Vec<u32>>,
    clock: Rc<Cell<usize>>,
    /// Resident blocks: (next use key, depth, parent).
    resident: HashMap<u64, (u64, u32, u64)>,
    /// Resident children of each block id (the parent may be absent).
    children: HashMap<u64, Vec<u64>>,
    /// (next use, depth, id); the largest goes first.
    order: BTreeSet<(u64, u32, u64)>,
}

/// How the adaptation is described in reports.
pub const BELADY_NOTE: &str = "Belady (offline): evicts the block whose next use is farthest; a block whose parent is not resident counts as never used; ties evict the deepest block first";

impl Belady {
    pub fn new(trace: &Trace, clock: Rc<Cell<usize>>) -> Belady {
        let mut uses: HashMap<u64, Vec<u32>> = HashMap::new();
        for (i, r) in trace.requests.iter().enumerate() {
            for id in &r.hash_ids {
                let v = uses.entry(*id).or_default();
                if v.last() != Some(&(i as u32)) {
                    v.push(i as u32);
                }
            }
        }
        Belady { uses, clock, resident: HashMap::new(), children: HashMap::new(), order: BTreeSet::new() }
    }

    fn next_use(&self, id: u64) -> u64 {
        let now = self.clock.get() as u32;
        self.uses.get(&id).and_then(|v| v.get(v.partition_point(|&u| u <= now))).map_or(u64::MAX, |&u| u64::from(u))
    }

    fn key(&self, id: u64, parent: u64) -> u64 {
        if parent != NO_PARENT && !self.resident.contains_key(&parent) {
            u64::MAX
        } else {
            self.next_use(id)
        }
    }

    fn rekey(&mut self, id: u64) {
        let Some(&(old, depth, parent)) = self.resident.get(&id) else { return };
        let new = self.key(id, parent);
        if new != old {
            self.order.remove(&(old, depth, id));
            self.order.insert((new, depth, id));
            self.resident.insert(id, (new, depth, parent));
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
                    let key = self.key(e.id, e.parent);
                    self.resident.insert(e.id, (key, depth, e.parent));
                    self.order.insert((key, depth, e.id));
                    if e.parent != NO_PARENT {
                        self.children.entry(e.parent).or_default().push(e.id);
                    }
                    self.rekey_children(e.id);
                }
                EventKind::Accessed => self.rekey(e.id),
                EventKind::Removed => {
                    let Some((key, depth, parent)) = self.resident.remove(&e.id) else { continue };
                    self.order.remove(&(key, depth, e.id));
                    if let Some(c) = self.children.get_mut(&parent) {
                        c.retain(|&x| x != e.id);
                        if c.is_empty() {
                            self.children.remove(&parent);
                        }
                    }
                    self.rekey_children(e.id);
                }
                EventKind::PinChanged => {}
            }
        }
    }

    fn victims(&mut self, _tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
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
    /// LRU: r1 evicts 1 -> {2,3}; r2 misses at 1 (so 2 does not count), accesses 2, stores 1
    /// evicting 3 -> {1,2}; r3 misses, evicts 2 -> {1,3}; r4 hits 1, stores 4 evicting 3 => 1.
    /// Belady: r1 evicts 2 (1 and 2 next used at r2, 2 is deeper) -> {1,3}; r2 hits 1, stores 2
    /// evicting 3 (1 is this request's) -> {1,2}; r3 misses, evicts 2 (never used again);
    /// r4 hits 1 => 2 of 8 (the best possible here: r2's two hits would need r1 not to store 3).
    fn tiny() -> Trace {
        Trace::from_requests(vec![req(&[1, 2]), req(&[3]), req(&[1, 2]), req(&[3]), req(&[1, 4])])
    }

    #[test]
    fn hand_checked_unlimited_lru_belady() {
        let t = tiny();
        let u = unlimited(&t);
        assert_eq!((u.block_hits, u.blocks), (4, 8));

        let mut lru = CacheSim::new(native_policy("lru", &Params::new()).unwrap(), 2);
        let h = lru.run(&t, || {});
        assert_eq!((h.block_hits, h.blocks), (1, 8));

        let clock = Rc::new(Cell::new(0));
        let mut b = CacheSim::with_clock(Box::new(Belady::new(&t, clock.clone())), 2, clock);
        let h = b.run(&t, || {});
        assert_eq!((h.block_hits, h.blocks), (2, 8));
        assert_eq!(b.shortfalls, 0);

        // Unlimited capacity equals the unlimited rate for every policy.
        for name in NATIVE {
            let mut s = CacheSim::new(native_policy(name, &Params::new()).unwrap(), 1000);
            assert_eq!(s.run(&t, || {}), u, "{name}");
        }
    }

    #[test]
    fn belady_evicts_orphans_first() {
        let clock = Rc::new(Cell::new(0));
        let t = Trace::from_requests(vec![req(&[1, 2]), req(&[1, 2]), req(&[1, 2])]);
        let mut b = Belady::new(&t, clock);
        b.on_events(
            &[Event::inserted(1, 1, Tier::Dram, NO_PARENT), Event::inserted(2, 1, Tier::Dram, 1)].into_iter().collect(),
        );
        // Both next used at request 1: the deeper one goes first.
        assert_eq!(b.victims(Tier::Dram, 1, &[]), vec![2]);
        b.on_events(&[Event::removed(1, Tier::Dram)].into_iter().collect());
        assert_eq!(b.order.iter().next_back().map(|k| k.0), Some(u64::MAX));
        assert_eq!(b.victims(Tier::Dram, 1, &[2]), Vec::<u64>::new());
    }
}
