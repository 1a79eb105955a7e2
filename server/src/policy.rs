//! The policy manager: loads Wasm modules, swaps them into the store's policy slots without
//! stopping requests, keeps a history for rollback, and persists the active modules in sled so
//! that a restart restores them. It sees the store only through [`PolicySlots`].

use kvpool_core::{Admitter, Evictor, Native, NewSlot, Policies};
use kvpool_policies::registry;
use kvpool_policy_host::{GuardedAdmission, GuardedEviction, GuardedPlacement, HostConfig, ModuleInfo, PolicyEngine};
use kvpool_policy_sdk::{Events, IndexView, Params, Tier};
use kvpool_proto::{codec, PolicyInfo, PolicyKind};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tracing::{info, warn};

/// What the policy manager needs of a store: swap a slot in (snapshot, tap, switch) and look at
/// the active slots.
pub trait PolicySlots: Send + Sync {
    /// Snapshot of the block set for a new policy; events from now on are recorded for it.
    fn begin_swap(&self) -> Events;
    fn abort_swap(&self);
    /// Feed the new occupant the recorded events, then switch atomically.
    fn finish_swap(&self, slot: NewSlot);
    fn with_policies(&self, f: &mut dyn FnMut(&Policies));
}

/// A guarded Wasm eviction module in the core's eviction slot: the guard reads the index
/// through the same [`IndexView`] the slot is given. (A newtype only because neither the slot
/// trait nor the guard is this crate's.)
pub struct WasmEviction(pub GuardedEviction);

impl Evictor for WasmEviction {
    fn on_events(&mut self, events: &Events) {
        self.0.on_events(events)
    }
    fn victims(&mut self, view: &dyn IndexView, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.0.victims(view, tier, bytes, exclude)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Module info of the module in a slot, if a module (not a native built-in) is there.
fn slot_info(p: &Policies, kind: PolicyKind) -> Option<ModuleInfo> {
    match kind {
        PolicyKind::Eviction => p.eviction.as_any().downcast_ref::<WasmEviction>().map(|w| w.0.info()),
        PolicyKind::Admission => p.admission.as_any().downcast_ref::<Native<GuardedAdmission>>().map(|w| w.0.info()),
        PolicyKind::Placement => {
            p.placement.as_ref()?.as_any().downcast_ref::<Native<GuardedPlacement>>().map(|w| w.0.info())
        }
    }
}

/// The built-in policies a store starts with (and returns to after a rollback past the first
/// module): leaf-first LRU eviction, `store_threshold` admission, no placement module.
pub fn builtin_policies(store_threshold: u64) -> Policies {
    Policies::new(builtin_eviction(), builtin_admission(store_threshold))
}

fn builtin_eviction() -> Box<dyn Evictor> {
    Box::new(registry::eviction(registry::DEFAULT_EVICTION, &Params::new()).expect("the default is registered"))
}

fn threshold_params(store_threshold: u64) -> Params {
    Params::from_pairs([("store_threshold", store_threshold.to_string())])
}

fn builtin_admission(store_threshold: u64) -> Box<dyn Admitter> {
    Box::new(
        registry::admission(registry::DEFAULT_ADMISSION, &threshold_params(store_threshold))
            .expect("the default is registered"),
    )
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(transparent)]
    Host(#[from] kvpool_policy_host::HostError),
    #[error("metadata store: {0}")]
    Meta(String),
    #[error("module {0} is not in the module store")]
    MissingModule(String),
    #[error("{0}")]
    Invalid(String),
    #[error("no {0} module is loaded (the built-in is active): nothing to roll back")]
    NothingToRollBack(&'static str),
}

/// One entry of a kind's history, persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ModuleSpec {
    name: String,
    sha256: String,
    params: Vec<(String, String)>,
    loaded_at_ms: u64,
}

fn host_kind(k: PolicyKind) -> kvpool_policy_host::PolicyKind {
    match k {
        PolicyKind::Eviction => kvpool_policy_host::PolicyKind::Eviction,
        PolicyKind::Admission => kvpool_policy_host::PolicyKind::Admission,
        PolicyKind::Placement => kvpool_policy_host::PolicyKind::Placement,
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

const KINDS: [PolicyKind; 3] = [PolicyKind::Eviction, PolicyKind::Admission, PolicyKind::Placement];

pub struct PolicyManager {
    engine: PolicyEngine,
    slots: Arc<dyn PolicySlots>,
    modules: sled::Tree,
    stacks: sled::Tree,
    /// One swap at a time (the store's event tap has one reader).
    swap: tokio::sync::Mutex<()>,
    last_swap_us: parking_lot::Mutex<[u64; 3]>,
    store_threshold: u64,
    /// Longest history kept per kind.
    history: usize,
    /// The module of each kind whose series `/metrics` shows, since its last export.
    exported: parking_lot::Mutex<[Option<String>; 3]>,
}

impl PolicyManager {
    /// `db` keeps the module store and each kind's history.
    pub fn new(
        config: HostConfig,
        slots: Arc<dyn PolicySlots>,
        db: &sled::Db,
        store_threshold: u64,
    ) -> Result<Arc<PolicyManager>, PolicyError> {
        let engine = PolicyEngine::new(config)?;
        let modules = db.open_tree("policy-modules").map_err(|e| PolicyError::Meta(e.to_string()))?;
        let stacks = db.open_tree("policy-stacks").map_err(|e| PolicyError::Meta(e.to_string()))?;
        Ok(Arc::new(PolicyManager {
            engine,
            slots,
            modules,
            stacks,
            swap: tokio::sync::Mutex::new(()),
            last_swap_us: parking_lot::Mutex::new([0; 3]),
            store_threshold,
            history: 16,
            exported: parking_lot::Mutex::new([None, None, None]),
        }))
    }

    fn stack(&self, kind: PolicyKind) -> Vec<ModuleSpec> {
        self.stacks
            .get(kind.name())
            .ok()
            .flatten()
            .and_then(|v| codec::decode::<Vec<ModuleSpec>>(&v).ok())
            .unwrap_or_default()
    }

    fn save_stack(&self, kind: PolicyKind, stack: &[ModuleSpec]) -> Result<(), PolicyError> {
        let bytes = codec::encode(&stack.to_vec()).map_err(|e| PolicyError::Meta(e.to_string()))?;
        self.stacks.insert(kind.name(), bytes).map_err(|e| PolicyError::Meta(e.to_string()))?;
        self.stacks.flush().map_err(|e| PolicyError::Meta(e.to_string()))?;
        Ok(())
    }

    /// Compile, instantiate, replay the block set and swap a module in. All the slow work runs
    /// on a blocking thread; requests keep being answered by the current policy meanwhile.
    pub async fn load(
        self: &Arc<Self>,
        kind: PolicyKind,
        name: &str,
        params: Vec<(String, String)>,
        wasm: Vec<u8>,
    ) -> Result<PolicyInfo, PolicyError> {
        if name.is_empty() || name.len() > 128 {
            return Err(PolicyError::Invalid("module name must be 1 to 128 bytes".into()));
        }
        let _one = self.swap.lock().await;
        let sha = self.activate(kind, name, &params, wasm.clone()).await?;
        self.modules.insert(sha.as_bytes(), wasm).map_err(|e| PolicyError::Meta(e.to_string()))?;
        let mut stack = self.stack(kind);
        stack.push(ModuleSpec { name: name.into(), sha256: sha, params, loaded_at_ms: now_ms() });
        if stack.len() > self.history {
            stack.remove(0);
        }
        self.save_stack(kind, &stack)?;
        Ok(self.active_info(kind))
    }

    async fn activate(
        self: &Arc<Self>,
        kind: PolicyKind,
        name: &str,
        params: &[(String, String)],
        wasm: Vec<u8>,
    ) -> Result<String, PolicyError> {
        let started = Instant::now();
        let me = self.clone();
        let (name, params) = (name.to_string(), Params::from_pairs(params.iter().cloned()));
        let built = tokio::task::spawn_blocking(move || -> Result<(NewSlot, String), PolicyError> {
            let module = me.engine.load(&name, host_kind(kind), &wasm, &params)?;
            let sha = module.sha256().to_string();
            // Snapshot and tap are taken together under the store lock: every event after the
            // snapshot reaches the new module before it decides anything.
            let snapshot = me.slots.begin_swap();
            let none = Params::new();
            let slot = match kind {
                PolicyKind::Eviction => {
                    let fallback = registry::eviction(registry::DEFAULT_EVICTION, &none).expect("registered");
                    GuardedEviction::new(&module, fallback, &snapshot)
                        .map(|g| NewSlot::Eviction(Box::new(WasmEviction(g))))
                }
                PolicyKind::Admission => {
                    let fallback =
                        registry::admission(registry::DEFAULT_ADMISSION, &threshold_params(me.store_threshold))
                            .expect("registered");
                    GuardedAdmission::new(&module, fallback, &snapshot).map(|g| NewSlot::Admission(Box::new(Native(g))))
                }
                PolicyKind::Placement => {
                    let fallback = registry::placement(registry::DEFAULT_PLACEMENT, &none).expect("registered");
                    GuardedPlacement::new(&module, fallback, &snapshot)
                        .map(|g| NewSlot::Placement(Some(Box::new(Native(g)))))
                }
            };
            match slot {
                Ok(s) => Ok((s, sha)),
                Err(e) => {
                    me.slots.abort_swap();
                    Err(e.into())
                }
            }
        })
        .await
        .map_err(|e| PolicyError::Invalid(format!("swap task failed: {e}")))??;
        let (slot, sha) = built;
        self.slots.finish_swap(slot);
        let us = started.elapsed().as_micros() as u64;
        self.last_swap_us.lock()[kind as usize] = us;
        info!(kind = kind.name(), sha256 = %sha, swap_ms = us as f64 / 1e3, "policy module active");
        Ok(sha)
    }

    /// Go back to the module active before the current one (the built-in when there is none).
    pub async fn rollback(self: &Arc<Self>, kind: PolicyKind) -> Result<PolicyInfo, PolicyError> {
        let _one = self.swap.lock().await;
        let mut stack = self.stack(kind);
        if stack.is_empty() {
            return Err(PolicyError::NothingToRollBack(kind.name()));
        }
        stack.pop();
        match stack.last().cloned() {
            Some(prev) => {
                let wasm = self.module_bytes(&prev.sha256)?;
                self.activate(kind, &prev.name, &prev.params, wasm).await?;
            }
            None => self.install_builtin(kind),
        }
        self.save_stack(kind, &stack)?;
        Ok(self.active_info(kind))
    }

    /// Back to the native built-in for a kind, rebuilt from the current block set.
    fn install_builtin(&self, kind: PolicyKind) {
        let snapshot = self.slots.begin_swap();
        let slot = match kind {
            PolicyKind::Eviction => {
                let mut e = builtin_eviction();
                e.on_events(&snapshot);
                NewSlot::Eviction(e)
            }
            PolicyKind::Admission => NewSlot::Admission(builtin_admission(self.store_threshold)),
            PolicyKind::Placement => NewSlot::Placement(None),
        };
        self.slots.finish_swap(slot);
    }

    /// The module in a kind's slot, if one is loaded.
    fn module_info(&self, kind: PolicyKind) -> Option<ModuleInfo> {
        let mut info = None;
        self.slots.with_policies(&mut |p| info = slot_info(p, kind));
        info
    }

    fn module_bytes(&self, sha: &str) -> Result<Vec<u8>, PolicyError> {
        self.modules
            .get(sha.as_bytes())
            .map_err(|e| PolicyError::Meta(e.to_string()))?
            .map(|v| v.to_vec())
            .ok_or_else(|| PolicyError::MissingModule(sha.into()))
    }

    /// Bring back the modules that were active before a restart. A module that no longer loads
    /// is reported and left out (the built-in answers).
    pub async fn restore(self: &Arc<Self>) {
        for kind in KINDS {
            let Some(spec) = self.stack(kind).last().cloned() else { continue };
            let _one = self.swap.lock().await;
            let r = match self.module_bytes(&spec.sha256) {
                Ok(wasm) => self.activate(kind, &spec.name, &spec.params, wasm).await.map(|_| ()),
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => info!(kind = kind.name(), module = %spec.name, "policy module restored"),
                Err(e) => warn!(kind = kind.name(), module = %spec.name, error = %e, "cannot restore policy module"),
            }
        }
    }

    fn builtin_info(&self, kind: PolicyKind, active: bool) -> PolicyInfo {
        let (name, params) = match kind {
            PolicyKind::Eviction => ("builtin:leaf-lru", vec![]),
            PolicyKind::Admission => {
                ("builtin:threshold", vec![("store_threshold".to_string(), self.store_threshold.to_string())])
            }
            PolicyKind::Placement => ("builtin:local", vec![]),
        };
        PolicyInfo {
            kind,
            name: name.into(),
            sha256: String::new(),
            params,
            loaded_at_ms: 0,
            builtin: true,
            active,
            faults_trap: 0,
            faults_timeout: 0,
            faults_invalid: 0,
            quarantined: false,
            answered: 0,
            fallback_answers: 0,
            swap_us: 0,
        }
    }

    pub fn active_info(&self, kind: PolicyKind) -> PolicyInfo {
        match self.module_info(kind) {
            None => self.builtin_info(kind, true),
            Some(m) => PolicyInfo {
                kind,
                name: m.name,
                sha256: m.sha256,
                params: m.params.0.into_iter().collect(),
                loaded_at_ms: m.loaded_at.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
                builtin: false,
                active: true,
                faults_trap: m.faults.trap,
                faults_timeout: m.faults.timeout,
                faults_invalid: m.faults.invalid,
                quarantined: m.quarantined,
                answered: m.answered,
                fallback_answers: m.fallback_answers,
                swap_us: self.last_swap_us.lock()[kind as usize],
            },
        }
    }

    /// Active module of every kind, then the earlier ones of its history (newest first).
    pub fn list(&self) -> Vec<PolicyInfo> {
        let mut out = Vec::new();
        for kind in KINDS {
            out.push(self.active_info(kind));
            let stack = self.stack(kind);
            for spec in stack.iter().rev().skip(1) {
                out.push(PolicyInfo {
                    kind,
                    name: spec.name.clone(),
                    sha256: spec.sha256.clone(),
                    params: spec.params.clone(),
                    loaded_at_ms: spec.loaded_at_ms,
                    active: false,
                    ..self.builtin_info(kind, false)
                });
            }
            if !stack.is_empty() {
                out.push(self.builtin_info(kind, false));
            }
        }
        out
    }

    /// Fault counters and quarantine of each kind's active module, for /metrics. A module no
    /// longer active (rolled back, or replaced) has its series set back to 0: they describe the
    /// active module, and a rolled-back quarantined module is no longer quarantining anything.
    pub fn export_metrics(&self, m: &crate::metrics::Metrics) {
        let mut exported = self.exported.lock();
        for kind in KINDS {
            let info = self.module_info(kind);
            let now = info.as_ref().map(|i| i.name.clone());
            let last = &mut exported[kind as usize];
            if let Some(gone) = last.take().filter(|g| Some(g) != now.as_ref()) {
                for fault in ["trap", "timeout", "invalid"] {
                    m.policy_faults.with_label_values(&[kind.name(), &gone, fault]).set(0);
                }
                m.policy_quarantined.with_label_values(&[kind.name(), &gone]).set(0);
            }
            *last = now;
            if let Some(info) = info {
                for (fault, n) in
                    [("trap", info.faults.trap), ("timeout", info.faults.timeout), ("invalid", info.faults.invalid)]
                {
                    m.policy_faults.with_label_values(&[kind.name(), &info.name, fault]).set(n as i64);
                }
                m.policy_quarantined.with_label_values(&[kind.name(), &info.name]).set(i64::from(info.quarantined));
            }
        }
    }
}
