//! Raw Wasm instances of each kind: call the guest, classify failures, nothing more. The guard
//! layer ([`crate::guard`]) adds validation and the native fallback.

use crate::bindings::{admission::Admission, eviction::Eviction, placement::Placement, wit};
use crate::engine::{HostState, KindPre, LoadedModule};
use crate::HostError;
use kvpool_policy_sdk::{
    AdmissionPolicy, Admit, AdmitBatch, Events, EvictionPolicy, NodeSet, PlaceBatch, PlacementPolicy, Placements, Tier,
};
use wasmtime::{Store, Trap};

/// Why a guest call produced no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The guest trapped (panic, out of memory, stack overflow, bad access...).
    #[error("trap: {0}")]
    Trap(String),
    /// The per-call deadline (epoch or fuel) ran out.
    #[error("deadline exceeded: {0}")]
    Timeout(String),
    /// The instance trapped earlier and cannot be entered again.
    #[error("instance is poisoned by an earlier trap")]
    Poisoned,
}

fn classify(e: wasmtime::Error) -> CallError {
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt | Trap::OutOfFuel) => CallError::Timeout(format!("{e:#}")),
        _ => CallError::Trap(format!("{e:#}")),
    }
}

fn wit_events(e: &Events) -> wit::Events {
    slice_events(e, 0..e.len())
}

fn slice_events(e: &Events, r: std::ops::Range<usize>) -> wit::Events {
    wit::Events {
        kind: e.kind[r.clone()].to_vec(),
        id: e.id[r.clone()].to_vec(),
        key: e.key[r.clone()].to_vec(),
        size: e.size[r.clone()].to_vec(),
        tokens: e.tokens[r.clone()].to_vec(),
        tier: e.tier[r.clone()].to_vec(),
        parent: e.parent[r.clone()].to_vec(),
        pin: e.pin[r.clone()].to_vec(),
        depth: e.depth[r.clone()].to_vec(),
        count: e.count[r.clone()].to_vec(),
        time: e.time[r].to_vec(),
    }
}

/// State shared by the three kinds: the store and whether a trap poisoned it.
struct Core {
    module: LoadedModule,
    store: Store<HostState>,
    poisoned: bool,
}

impl Core {
    fn new(module: &LoadedModule) -> Core {
        let mut store = module.engine.new_store(&module.name, &module.params);
        // Instantiation runs guest code too (start functions): it needs a deadline as well.
        module.engine.arm(&mut store, 1);
        Core { module: module.clone(), store, poisoned: false }
    }

    /// Run one guest call with a fresh deadline; a failure poisons the instance.
    fn call<R>(&mut self, f: impl FnOnce(&mut Store<HostState>) -> wasmtime::Result<R>) -> Result<R, CallError> {
        self.call_scaled(1, f)
    }

    fn call_scaled<R>(
        &mut self,
        factor: u64,
        f: impl FnOnce(&mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        if self.poisoned {
            return Err(CallError::Poisoned);
        }
        self.module.engine.arm(&mut self.store, factor);
        f(&mut self.store).map_err(|e| {
            self.poisoned = true;
            classify(e)
        })
    }

    fn params(&self) -> Vec<(String, String)> {
        self.module.params.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    fn init_result(&self, r: Result<Result<(), String>, CallError>) -> Result<(), HostError> {
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(msg)) => Err(HostError::Init { module: self.module.name.to_string(), message: msg }),
            Err(e) => Err(HostError::Init { module: self.module.name.to_string(), message: e.to_string() }),
        }
    }

    fn replay(
        &mut self,
        snapshot: &Events,
        mut f: impl FnMut(&mut Store<HostState>, &wit::Events) -> wasmtime::Result<()>,
    ) -> Result<(), CallError> {
        let chunk = self.module.engine.config().replay_chunk.max(1);
        let factor = self.module.engine.config().replay_deadline_factor.max(1);
        let mut at = 0;
        while at < snapshot.len() {
            let end = (at + chunk).min(snapshot.len());
            let part = slice_events(snapshot, at..end);
            self.call_scaled(factor, |s| f(s, &part))?;
            at = end;
        }
        Ok(())
    }
}

macro_rules! common_methods {
    () => {
        pub fn module(&self) -> &LoadedModule {
            &self.core.module
        }
        /// True after a trap: the instance cannot be entered again; make a new one.
        pub fn is_poisoned(&self) -> bool {
            self.core.poisoned
        }
        /// Size the instance's linear memory has grown to, bytes.
        pub fn memory_bytes(&self) -> usize {
            self.core.store.data().limits.memory
        }
        /// Apply a batch of events.
        pub fn try_on_events(&mut self, events: &Events) -> Result<(), CallError> {
            if events.is_empty() {
                return Ok(());
            }
            let inst = &self.inst;
            let ev = wit_events(events);
            self.core.call(|s| inst.call_on_events(s, &ev))
        }
        /// Replay a snapshot of the current block set in chunks of `replay_chunk` events (one
        /// deadline per chunk), e.g. to rebuild state after a swap or a trap.
        pub fn replay(&mut self, snapshot: &Events) -> Result<(), CallError> {
            let inst = &self.inst;
            self.core.replay(snapshot, |s, part| inst.call_on_events(s, part))
        }
    };
}

/// A Wasm eviction policy instance.
pub struct WasmEviction {
    core: Core,
    inst: Eviction,
}

impl WasmEviction {
    /// Instantiate `module` (an eviction module) and call its `init` with the module params.
    pub fn new(module: &LoadedModule) -> Result<WasmEviction, HostError> {
        let KindPre::Eviction(pre) = &module.pre else { return Err(HostError::KindMismatch(module.kind)) };
        let mut core = Core::new(module);
        let inst = pre.instantiate(&mut core.store).map_err(HostError::wasm("instantiate"))?;
        let params = core.params();
        let r = core.call(|s| inst.call_init(s, &params));
        core.init_result(r)?;
        Ok(WasmEviction { core, inst })
    }

    common_methods!();

    /// Ask the guest for victims; the answer is not validated here.
    pub fn try_victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Result<Vec<u64>, CallError> {
        let inst = &self.inst;
        self.core.call(|s| inst.call_victims(s, tier as u8, bytes, exclude))
    }
}

/// Unguarded use (tests, benchmarks): a failed call is logged and answers nothing.
impl EvictionPolicy for WasmEviction {
    fn on_events(&mut self, events: &Events) {
        if let Err(e) = self.try_on_events(events) {
            tracing::warn!(module = %self.core.module.name, error = %e, "policy on-events failed");
        }
    }
    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.try_victims(tier, bytes, exclude).unwrap_or_else(|e| {
            tracing::warn!(module = %self.core.module.name, error = %e, "policy victims failed");
            Vec::new()
        })
    }
}

/// A Wasm admission policy instance.
pub struct WasmAdmission {
    core: Core,
    inst: Admission,
}

impl WasmAdmission {
    pub fn new(module: &LoadedModule) -> Result<WasmAdmission, HostError> {
        let KindPre::Admission(pre) = &module.pre else { return Err(HostError::KindMismatch(module.kind)) };
        let mut core = Core::new(module);
        let inst = pre.instantiate(&mut core.store).map_err(HostError::wasm("instantiate"))?;
        let params = core.params();
        let r = core.call(|s| inst.call_init(s, &params));
        core.init_result(r)?;
        Ok(WasmAdmission { core, inst })
    }

    common_methods!();

    /// Raw decision codes (tier code or `ADMIT_REJECT`), not validated here.
    pub fn try_admit(&mut self, batch: &AdmitBatch) -> Result<Vec<u8>, CallError> {
        let b = wit::AdmitBatch {
            id: batch.id.clone(),
            key: batch.key.clone(),
            size: batch.size.clone(),
            tokens: batch.tokens.clone(),
            seq_tokens: batch.seq_tokens.clone(),
            tier: batch.tier.clone(),
            parent: batch.parent.clone(),
            depth: batch.depth.clone(),
        };
        let inst = &self.inst;
        self.core.call(|s| inst.call_admit(s, &b))
    }
}

impl AdmissionPolicy for WasmAdmission {
    fn on_events(&mut self, events: &Events) {
        if let Err(e) = self.try_on_events(events) {
            tracing::warn!(module = %self.core.module.name, error = %e, "policy on-events failed");
        }
    }
    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        match self.try_admit(batch) {
            Ok(codes) => codes.into_iter().map(|c| Admit::from_u8(c).unwrap_or(Admit::Reject)).collect(),
            Err(e) => {
                tracing::warn!(module = %self.core.module.name, error = %e, "policy admit failed");
                Vec::new()
            }
        }
    }
}

/// A Wasm placement policy instance.
pub struct WasmPlacement {
    core: Core,
    inst: Placement,
}

impl WasmPlacement {
    pub fn new(module: &LoadedModule) -> Result<WasmPlacement, HostError> {
        let KindPre::Placement(pre) = &module.pre else { return Err(HostError::KindMismatch(module.kind)) };
        let mut core = Core::new(module);
        let inst = pre.instantiate(&mut core.store).map_err(HostError::wasm("instantiate"))?;
        let params = core.params();
        let r = core.call(|s| inst.call_init(s, &params));
        core.init_result(r)?;
        Ok(WasmPlacement { core, inst })
    }

    common_methods!();

    pub fn try_place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Result<Placements, CallError> {
        let b = wit::PlaceBatch {
            id: blocks.id.clone(),
            size: blocks.size.clone(),
            tokens: blocks.tokens.clone(),
            parent: blocks.parent.clone(),
            parent_node: blocks.parent_node.clone(),
            tier: blocks.tier.clone(),
            replicas: blocks.replicas,
            client_node: blocks.client_node,
        };
        let n = wit::Nodes {
            id: nodes.id.clone(),
            free_device: nodes.free[0].clone(),
            free_dram: nodes.free[1].clone(),
            free_ssd: nodes.free[2].clone(),
            load: nodes.load.clone(),
        };
        let inst = &self.inst;
        let p = self.core.call(|s| inst.call_place(s, &b, &n))?;
        Ok(Placements { node: p.node, tier: p.tier })
    }
}

impl PlacementPolicy for WasmPlacement {
    fn on_events(&mut self, events: &Events) {
        if let Err(e) = self.try_on_events(events) {
            tracing::warn!(module = %self.core.module.name, error = %e, "policy on-events failed");
        }
    }
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        self.try_place(blocks, nodes).unwrap_or_else(|e| {
            tracing::warn!(module = %self.core.module.name, error = %e, "policy place failed");
            Placements::default()
        })
    }
}
