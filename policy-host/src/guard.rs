//! The guard layer: every answer of a Wasm module is validated against host truth; a trap, a
//! deadline or an invalid answer is counted and logged, and the native fallback policy (fed the
//! same events all along) answers that call. Too many faults quarantine the module: the
//! fallback answers from then on until the module is replaced.

use crate::engine::LoadedModule;
use crate::wasm::{CallError, WasmAdmission, WasmEviction, WasmPlacement};
use crate::{HostError, PolicyKind};
// The guard checks answers against the host's index through the SDK's one view of it.
use kvpool_policy_sdk::{
    AdmissionPolicy, Admit, AdmitBatch, Events, EvictionPolicy, IndexView, NodeSet, Params, Pin, PlaceBatch,
    PlacementPolicy, Placements, Tier,
};
use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

/// The chain rule applied to blocks that lose their last copy (see [`cascade`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cascade {
    /// Blocks to remove (every copy), in order: each victim right after its resident
    /// descendants, deepest first, so that no removal ever leaves a child without its parent.
    pub remove: Vec<u64>,
    /// How many of `remove` the policy did not name (descendants taken along).
    pub cascaded: usize,
    /// Victims kept: a resident descendant is excluded (leased, in flight) or hard-pinned, so
    /// removing the victim would strand it.
    pub refused: Vec<u64>,
}

/// The chain rule, for blocks about to lose their last copy (`gone`, in the policy's order;
/// a DRAM victim demoted to SSD keeps a copy and is not in `gone`): a block is never removed
/// while a resident child still needs it, so each victim takes its resident descendants along
/// (cascade), or stays when one of them cannot go (`exclude`, sorted, or hard-pinned).
///
/// Why cascade rather than refuse the answer as a fault: the general algorithms (LRU, ARC,
/// S3-FIFO, SIEVE) do not know chains and would be quarantined for answers that are valid for
/// any flat cache; and a stranded descendant is worth nothing until its parent comes back, at
/// which point the same request would have put the descendant again anyway. The blocks taken
/// along are counted (`cascaded`) and reported to policies as `Removed` events like any other.
pub fn cascade(gone: &[u64], oracle: &dyn IndexView, exclude: &[u64]) -> Cascade {
    let mut out = Cascade::default();
    let mut taken: HashSet<u64> = HashSet::with_capacity(gone.len());
    let named: HashSet<u64> = gone.iter().copied().collect();
    for &v in gone {
        if taken.contains(&v) {
            continue;
        }
        // Subtree of v in pre-order, then reversed: children come before their parents.
        let mut sub = vec![v];
        let mut i = 0;
        let mut blocked = exclude.binary_search(&v).is_ok() || oracle.pin(v) == Pin::Hard;
        while i < sub.len() {
            for c in oracle.resident_children(sub[i]) {
                if taken.contains(&c) {
                    continue;
                }
                if exclude.binary_search(&c).is_ok() || oracle.pin(c) == Pin::Hard {
                    blocked = true;
                }
                sub.push(c);
            }
            if blocked || sub.len() > 1 << 24 {
                break;
            }
            i += 1;
        }
        if blocked {
            out.refused.push(v);
            continue;
        }
        for &b in sub.iter().rev() {
            if taken.insert(b) {
                out.remove.push(b);
                if !named.contains(&b) {
                    out.cascaded += 1;
                }
            }
        }
    }
    out
}

/// Kinds of fault, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    Trap,
    Timeout,
    Invalid,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Trap => "trap",
            FaultKind::Timeout => "timeout",
            FaultKind::Invalid => "invalid",
        }
    }
}

/// What was wrong with an answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("victim {0} has no copy in the tier")]
    UnknownId(u64),
    #[error("victim {0} is excluded (leased or in flight)")]
    Excluded(u64),
    #[error("victim {0} is hard-pinned")]
    Pinned(u64),
    #[error("id {0} appears twice")]
    Duplicate(u64),
    #[error("victims free {freed} of {wanted} bytes while {evictable} were evictable")]
    TooFew { freed: u64, wanted: u64, evictable: u64 },
    #[error("answer has {len} entries, more than the limit {max}")]
    Oversize { len: usize, max: usize },
    #[error("answer has {got} entries, expected {want}")]
    WrongCount { got: usize, want: usize },
    #[error("decision code {0} is neither a tier nor reject")]
    BadDecision(u8),
    #[error("node {0} does not exist")]
    BadNode(u64),
    #[error("node {0} chosen twice for one block")]
    DuplicateNode(u64),
    #[error("tier code {0} does not exist")]
    BadTier(u8),
}

/// Fault counters of a module.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub trap: u64,
    pub timeout: u64,
    pub invalid: u64,
    /// Faults since the last good answer.
    pub consecutive: u32,
}

impl FaultCounts {
    pub fn total(&self) -> u64 {
        self.trap + self.timeout + self.invalid
    }
}

/// Module metadata for an admin `list`.
#[derive(Debug, Clone)]
pub struct ModuleInfo {
    pub name: String,
    pub kind: PolicyKind,
    pub sha256: String,
    pub params: Params,
    pub loaded_at: SystemTime,
    pub faults: FaultCounts,
    pub quarantined: bool,
    /// Decision calls answered by the module.
    pub answered: u64,
    /// Decision calls answered by the native fallback.
    pub fallback_answers: u64,
    /// Linear memory of the live instance, bytes (0 when there is none).
    pub memory_bytes: usize,
}

/// Bookkeeping shared by the three guards.
struct GuardState {
    module: LoadedModule,
    faults: FaultCounts,
    quarantined: bool,
    last_fault: Option<(FaultKind, String)>,
    /// The instance was dropped after a trap and must be rebuilt before it answers again.
    needs_rebuild: bool,
    answered: u64,
    fallback_answers: u64,
}

impl GuardState {
    fn new(module: &LoadedModule) -> GuardState {
        GuardState {
            module: module.clone(),
            faults: FaultCounts::default(),
            quarantined: false,
            last_fault: None,
            needs_rebuild: false,
            answered: 0,
            fallback_answers: 0,
        }
    }

    /// Count a fault; returns true when the instance must be dropped (poisoned or quarantined).
    fn fault(&mut self, kind: FaultKind, call: &str, detail: String) -> bool {
        match kind {
            FaultKind::Trap => self.faults.trap += 1,
            FaultKind::Timeout => self.faults.timeout += 1,
            FaultKind::Invalid => self.faults.invalid += 1,
        }
        self.faults.consecutive = self.faults.consecutive.saturating_add(1);
        let module = &*self.module.name;
        tracing::warn!(module, kind = self.module.kind.name(), call, fault = kind.name(), detail = %detail, "policy module fault; native fallback answers");
        self.last_fault = Some((kind, detail));
        let cfg = self.module.engine.config();
        if !self.quarantined
            && (self.faults.consecutive >= cfg.max_consecutive_faults
                || self.faults.total() >= u64::from(cfg.max_total_faults))
        {
            self.quarantined = true;
            tracing::error!(
                module,
                kind = self.module.kind.name(),
                faults = self.faults.total(),
                "policy module quarantined; native fallback answers until it is replaced"
            );
        }
        let poisoned = kind != FaultKind::Invalid;
        if poisoned {
            self.needs_rebuild = true;
        }
        poisoned || self.quarantined
    }

    fn call_fault(&mut self, call: &str, e: CallError) -> bool {
        let kind = match e {
            CallError::Timeout(_) => FaultKind::Timeout,
            CallError::Trap(_) | CallError::Poisoned => FaultKind::Trap,
        };
        self.fault(kind, call, e.to_string())
    }

    fn ok(&mut self) {
        self.faults.consecutive = 0;
        self.answered += 1;
    }

    fn info(&self) -> ModuleInfo {
        let m = &self.module;
        ModuleInfo {
            name: m.name.to_string(),
            kind: m.kind,
            sha256: m.sha256.clone(),
            params: m.params.clone(),
            loaded_at: m.loaded_at,
            faults: self.faults,
            quarantined: self.quarantined,
            answered: self.answered,
            fallback_answers: self.fallback_answers,
            memory_bytes: 0,
        }
    }
}

macro_rules! guard_common {
    ($wasm:ty) => {
        /// Metadata and counters for an admin `list`.
        pub fn info(&self) -> ModuleInfo {
            let mut i = self.st.info();
            i.memory_bytes = self.wasm.as_ref().map_or(0, |w| w.memory_bytes());
            i
        }
        pub fn faults(&self) -> FaultCounts {
            self.st.faults
        }
        pub fn is_quarantined(&self) -> bool {
            self.st.quarantined
        }
        /// The latest fault: kind and a description.
        pub fn last_fault(&self) -> Option<&(FaultKind, String)> {
            self.st.last_fault.as_ref()
        }
        pub fn module(&self) -> &LoadedModule {
            &self.st.module
        }
        /// True when a trap dropped the instance and it was not rebuilt yet.
        pub fn needs_rebuild(&self) -> bool {
            self.st.needs_rebuild && !self.st.quarantined
        }
        /// Instantiate the module again and replay `snapshot` (the current block set) into it,
        /// e.g. off the request path after a trap. A failure counts as a fault.
        pub fn rebuild(&mut self, snapshot: &Events) {
            if self.st.quarantined {
                return;
            }
            self.wasm = None;
            let built = <$wasm>::new(&self.st.module).map_err(|e| CallError::Trap(e.to_string())).and_then(|mut w| {
                w.replay(snapshot)?;
                Ok(w)
            });
            match built {
                Ok(w) => {
                    self.wasm = Some(w);
                    self.st.needs_rebuild = false;
                }
                Err(e) => {
                    self.st.call_fault("rebuild", e);
                }
            }
        }
        /// Feed events to the fallback and the module.
        fn feed(&mut self, events: &Events) {
            self.fallback.on_events(events);
            if let Some(w) = &mut self.wasm {
                if let Err(e) = w.try_on_events(events) {
                    if self.st.call_fault("on-events", e) {
                        self.wasm = None;
                    }
                }
            }
        }
    };
}

/// A Wasm eviction module behind validation, with a native fallback.
pub struct GuardedEviction {
    st: GuardState,
    wasm: Option<WasmEviction>,
    fallback: Box<dyn EvictionPolicy + Send>,
}

impl GuardedEviction {
    /// Instantiate `module`, replay `snapshot` (the current block set) into it and into
    /// `fallback`: everything a swap needs, done off the request path. Events that happen
    /// after the snapshot go through [`GuardedEviction::on_events`] before the switch.
    pub fn new(
        module: &LoadedModule,
        fallback: Box<dyn EvictionPolicy + Send>,
        snapshot: &Events,
    ) -> Result<GuardedEviction, HostError> {
        let (w, fallback) =
            build_both(module, snapshot, fallback, WasmEviction::new, WasmEviction::replay, |f, s| f.on_events(s))?;
        Ok(GuardedEviction { st: GuardState::new(module), wasm: Some(w), fallback })
    }

    guard_common!(WasmEviction);

    /// [`GuardedEviction::new`] for a module still to compile: `load` (compile or cache load)
    /// runs while the fallback replays `snapshot`.
    pub fn prepare(
        load: impl FnOnce() -> Result<LoadedModule, HostError>,
        fallback: Box<dyn EvictionPolicy + Send>,
        snapshot: &Events,
    ) -> Result<GuardedEviction, HostError> {
        let (m, w, fallback) =
            prepare_both(load, snapshot, fallback, WasmEviction::new, WasmEviction::replay, |f, s| f.on_events(s))?;
        Ok(GuardedEviction { st: GuardState::new(&m), wasm: Some(w), fallback })
    }

    pub fn on_events(&mut self, events: &Events) {
        self.feed(events)
    }

    /// Victims to free `bytes` in `tier`, validated against `oracle`; the fallback answers on
    /// any fault or while quarantined. A module that trapped earlier is rebuilt here from
    /// `oracle.snapshot()` first (at most `max_total_faults` times in its life).
    pub fn victims(&mut self, oracle: &dyn IndexView, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        if self.needs_rebuild() {
            self.rebuild(&oracle.snapshot());
        }
        if let Some(w) = &mut self.wasm {
            match w.try_victims(tier, bytes, exclude) {
                Ok(ids) => match validate_victims(
                    &ids,
                    oracle,
                    tier,
                    bytes,
                    exclude,
                    self.st.module.engine.config().max_output,
                ) {
                    Ok(()) => {
                        self.st.ok();
                        return ids;
                    }
                    Err(why) => {
                        if self.st.fault(FaultKind::Invalid, "victims", why.to_string()) {
                            self.wasm = None;
                        }
                    }
                },
                Err(e) => {
                    if self.st.call_fault("victims", e) {
                        self.wasm = None;
                    }
                }
            }
        }
        self.st.fallback_answers += 1;
        self.fallback.victims(tier, bytes, exclude)
    }
}

/// Instantiate and replay into the module while the native fallback replays on another thread
/// (a swap of a million-block pool spends most of its time here).
fn build_both<W, F: ?Sized + Send>(
    module: &LoadedModule,
    snapshot: &Events,
    fallback: Box<F>,
    new: fn(&LoadedModule) -> Result<W, HostError>,
    replay: fn(&mut W, &Events) -> Result<(), CallError>,
    feed: fn(&mut F, &Events),
) -> Result<(W, Box<F>), HostError> {
    prepare_both(|| Ok(module.clone()), snapshot, fallback, new, replay, feed).map(|(_, w, f)| (w, f))
}

/// [`build_both`] with the module still to load: the native fallback replays the snapshot
/// while the module compiles, so a swap costs the longer of the two, not their sum.
fn prepare_both<W, F: ?Sized + Send>(
    load: impl FnOnce() -> Result<LoadedModule, HostError>,
    snapshot: &Events,
    mut fallback: Box<F>,
    new: fn(&LoadedModule) -> Result<W, HostError>,
    replay: fn(&mut W, &Events) -> Result<(), CallError>,
    feed: fn(&mut F, &Events),
) -> Result<(LoadedModule, W, Box<F>), HostError> {
    let (built, fallback) = std::thread::scope(|scope| {
        let native = scope.spawn(move || {
            feed(&mut fallback, snapshot);
            fallback
        });
        let built = load().and_then(|module| {
            let mut w = new(&module)?;
            replay(&mut w, snapshot).map_err(|e| HostError::Replay { module: module.name.to_string(), source: e })?;
            Ok((module, w))
        });
        let fallback = native.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (built, fallback)
    });
    let (module, w) = built?;
    Ok((module, w, fallback))
}

/// Check a victim list: known copies in the tier, not excluded, not hard-pinned, no duplicates,
/// not oversize, and enough bytes unless the tier has no more to give.
pub fn validate_victims(
    ids: &[u64],
    oracle: &dyn IndexView,
    tier: Tier,
    bytes: u64,
    exclude: &[u64],
    max_output: usize,
) -> Result<(), Invalid> {
    if ids.len() > max_output {
        return Err(Invalid::Oversize { len: ids.len(), max: max_output });
    }
    let mut seen = HashSet::with_capacity(ids.len());
    let mut freed = 0u64;
    for &id in ids {
        if !seen.insert(id) {
            return Err(Invalid::Duplicate(id));
        }
        if exclude.binary_search(&id).is_ok() {
            return Err(Invalid::Excluded(id));
        }
        let Some(size) = oracle.size_in_tier(id, tier) else { return Err(Invalid::UnknownId(id)) };
        if oracle.pin(id) == Pin::Hard {
            return Err(Invalid::Pinned(id));
        }
        freed = freed.saturating_add(size);
    }
    if freed < bytes {
        let evictable = oracle.evictable_bytes(tier, exclude);
        if freed < bytes.min(evictable) {
            return Err(Invalid::TooFew { freed, wanted: bytes, evictable });
        }
    }
    Ok(())
}

/// A Wasm admission module behind validation, with a native fallback.
pub struct GuardedAdmission {
    st: GuardState,
    wasm: Option<WasmAdmission>,
    fallback: Box<dyn AdmissionPolicy + Send>,
}

impl GuardedAdmission {
    /// See [`GuardedEviction::new`].
    pub fn new(
        module: &LoadedModule,
        fallback: Box<dyn AdmissionPolicy + Send>,
        snapshot: &Events,
    ) -> Result<GuardedAdmission, HostError> {
        let (w, fallback) =
            build_both(module, snapshot, fallback, WasmAdmission::new, WasmAdmission::replay, |f, s| f.on_events(s))?;
        Ok(GuardedAdmission { st: GuardState::new(module), wasm: Some(w), fallback })
    }

    guard_common!(WasmAdmission);

    /// See [`GuardedEviction::prepare`].
    pub fn prepare(
        load: impl FnOnce() -> Result<LoadedModule, HostError>,
        fallback: Box<dyn AdmissionPolicy + Send>,
        snapshot: &Events,
    ) -> Result<GuardedAdmission, HostError> {
        let (m, w, fallback) =
            prepare_both(load, snapshot, fallback, WasmAdmission::new, WasmAdmission::replay, |f, s| f.on_events(s))?;
        Ok(GuardedAdmission { st: GuardState::new(&m), wasm: Some(w), fallback })
    }
}

/// After a trap the instance is re-made with empty state at the next call (admission history
/// cannot be rebuilt from the block set); call `rebuild` to replay a snapshot instead.
impl AdmissionPolicy for GuardedAdmission {
    fn on_events(&mut self, events: &Events) {
        self.feed(events)
    }

    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        if self.needs_rebuild() {
            self.rebuild(&Events::new());
        }
        if let Some(w) = &mut self.wasm {
            match w.try_admit(batch) {
                Ok(codes) => match decode_decisions(&codes, batch.len()) {
                    Ok(d) => {
                        self.st.ok();
                        return d;
                    }
                    Err(why) => {
                        if self.st.fault(FaultKind::Invalid, "admit", why.to_string()) {
                            self.wasm = None;
                        }
                    }
                },
                Err(e) => {
                    if self.st.call_fault("admit", e) {
                        self.wasm = None;
                    }
                }
            }
        }
        self.st.fallback_answers += 1;
        self.fallback.admit(batch)
    }
}

/// Exactly one valid decision per request.
pub fn decode_decisions(codes: &[u8], want: usize) -> Result<Vec<Admit>, Invalid> {
    if codes.len() != want {
        return Err(Invalid::WrongCount { got: codes.len(), want });
    }
    codes.iter().map(|&c| Admit::from_u8(c).ok_or(Invalid::BadDecision(c))).collect()
}

/// A Wasm placement module behind validation, with a native fallback.
pub struct GuardedPlacement {
    st: GuardState,
    wasm: Option<WasmPlacement>,
    fallback: Box<dyn PlacementPolicy + Send>,
}

impl GuardedPlacement {
    /// See [`GuardedEviction::new`].
    pub fn new(
        module: &LoadedModule,
        fallback: Box<dyn PlacementPolicy + Send>,
        snapshot: &Events,
    ) -> Result<GuardedPlacement, HostError> {
        let (w, fallback) =
            build_both(module, snapshot, fallback, WasmPlacement::new, WasmPlacement::replay, |f, s| f.on_events(s))?;
        Ok(GuardedPlacement { st: GuardState::new(module), wasm: Some(w), fallback })
    }

    guard_common!(WasmPlacement);
}

impl PlacementPolicy for GuardedPlacement {
    fn on_events(&mut self, events: &Events) {
        self.feed(events)
    }

    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        if self.needs_rebuild() {
            self.rebuild(&Events::new());
        }
        if let Some(w) = &mut self.wasm {
            match w.try_place(blocks, nodes) {
                Ok(p) => match validate_placements(&p, blocks, nodes) {
                    Ok(()) => {
                        self.st.ok();
                        return p;
                    }
                    Err(why) => {
                        if self.st.fault(FaultKind::Invalid, "place", why.to_string()) {
                            self.wasm = None;
                        }
                    }
                },
                Err(e) => {
                    if self.st.call_fault("place", e) {
                        self.wasm = None;
                    }
                }
            }
        }
        self.st.fallback_answers += 1;
        self.fallback.place(blocks, nodes)
    }
}

/// `effective_replicas` entries per block, each a live node, distinct per block, valid tiers.
pub fn validate_placements(p: &Placements, blocks: &PlaceBatch, nodes: &NodeSet) -> Result<(), Invalid> {
    let r = blocks.effective_replicas(nodes.len());
    let want = blocks.len() * r;
    if p.node.len() != want {
        return Err(Invalid::WrongCount { got: p.node.len(), want });
    }
    if p.tier.len() != want {
        return Err(Invalid::WrongCount { got: p.tier.len(), want });
    }
    let live: HashMap<u64, ()> = nodes.id.iter().map(|&n| (n, ())).collect();
    for (b, chunk) in p.node.chunks(r.max(1)).enumerate() {
        for (k, &n) in chunk.iter().enumerate() {
            if !live.contains_key(&n) {
                return Err(Invalid::BadNode(n));
            }
            if chunk[..k].contains(&n) {
                return Err(Invalid::DuplicateNode(n));
            }
            let t = p.tier[b * r + k];
            if Tier::from_u8(t).is_none() {
                return Err(Invalid::BadTier(t));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{Event, NO_PARENT};
    use std::collections::BTreeMap;

    /// Blocks as id -> (parent, pin); every block resident in DRAM, size 1.
    struct Fake(BTreeMap<u64, (u64, Pin)>);

    impl IndexView for Fake {
        fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64> {
            (tier == Tier::Dram && self.0.contains_key(&id)).then_some(1)
        }
        fn pin(&self, id: u64) -> Pin {
            self.0.get(&id).map_or(Pin::None, |b| b.1)
        }
        fn evictable_bytes(&self, _tier: Tier, exclude: &[u64]) -> u64 {
            self.0.iter().filter(|(id, b)| b.1 != Pin::Hard && exclude.binary_search(id).is_err()).count() as u64
        }
        fn resident_children(&self, id: u64) -> Vec<u64> {
            self.0.iter().filter(|(_, b)| b.0 == id).map(|(&c, _)| c).collect()
        }
        fn snapshot(&self) -> Events {
            self.0.iter().map(|(&id, b)| Event::inserted(id, 1, Tier::Dram, b.0).with_pin(b.1)).collect()
        }
    }

    /// 1 <- 2 <- 3, 2 <- 4 (a fork), 5 alone, 6 <- 7 with 7 hard-pinned.
    fn tree() -> Fake {
        let mut m = BTreeMap::new();
        for (id, parent, pin) in [
            (1, NO_PARENT, Pin::None),
            (2, 1, Pin::None),
            (3, 2, Pin::None),
            (4, 2, Pin::Soft),
            (5, NO_PARENT, Pin::None),
            (6, NO_PARENT, Pin::None),
            (7, 6, Pin::Hard),
        ] {
            m.insert(id, (parent, pin));
        }
        Fake(m)
    }

    #[test]
    fn cascade_takes_descendants_first_and_counts_them() {
        let o = tree();
        let c = cascade(&[2, 5], &o, &[]);
        assert_eq!(c.remove, vec![4, 3, 2, 5]);
        assert_eq!(c.cascaded, 2);
        assert!(c.refused.is_empty());
        // Leaves first, as a prefix-aware policy names them: nothing to add.
        let c = cascade(&[3, 4, 2, 1], &o, &[]);
        assert_eq!((c.remove, c.cascaded), (vec![3, 4, 2, 1], 0));
        // A named descendant later in the list is not counted as cascaded nor removed twice.
        let c = cascade(&[1, 3], &o, &[]);
        assert_eq!((c.remove, c.cascaded), (vec![4, 3, 2, 1], 2));
    }

    #[test]
    fn cascade_refuses_victims_that_would_strand_excluded_or_hard_pinned_blocks() {
        let o = tree();
        let c = cascade(&[1, 6, 5], &o, &[3]);
        assert_eq!(c.refused, vec![1, 6]);
        assert_eq!(c.remove, vec![5]);
        // Without the lease on 3, only the hard pin under 6 holds.
        let c = cascade(&[1, 6], &o, &[]);
        assert_eq!(c.refused, vec![6]);
        assert_eq!(c.remove, vec![4, 3, 2, 1]);
        // An excluded victim itself is refused.
        assert_eq!(cascade(&[5], &o, &[5]).refused, vec![5]);
    }
}
