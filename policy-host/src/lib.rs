//! kvpool's Wasm policy host: wasmtime (component model, no WASI) running eviction, admission
//! and placement modules built with `kvpool-policy-sdk`, sandboxed (per-call epoch or fuel
//! deadline, memory limit), validated and backed by a native fallback policy.
//!
//! Typical use by the server:
//! 1. one [`PolicyEngine`] per process ([`HostConfig`]: deadline, memory limit, cache dir...);
//! 2. off the request path: [`PolicyEngine::load`] (compile or cache load, type check), then
//!    [`GuardedEviction::new`] (instantiate, replay a snapshot of the block set into the module
//!    and its native fallback); apply the events since the snapshot with `on_events`; swap it in;
//! 3. on the request path: `on_events` with batched events, `victims(view, ...)` (the host's [`IndexView`](kvpool_policy_sdk::IndexView)), `admit`,
//!    `place`; [`GuardedEviction::info`] for the admin `list`.

pub mod bindings;
pub mod engine;
pub mod guard;
pub mod wasm;

pub use engine::{Deadline, HostConfig, LoadedModule, PolicyEngine, WASMTIME_VERSION};
pub use guard::{
    cascade, decode_decisions, validate_placements, validate_victims, Cascade, FaultCounts, FaultKind,
    GuardedAdmission, GuardedEviction, GuardedPlacement, Invalid, ModuleInfo,
};
pub use wasm::{CallError, WasmAdmission, WasmEviction, WasmPlacement};

/// Kind of policy (the WIT world a module exports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("wasmtime {what}: {message}")]
    Wasm { what: &'static str, message: String },
    #[error("module does not implement the {} world: {message}", .kind.name())]
    WrongKind { kind: PolicyKind, message: String },
    #[error("module is a {} module, not the kind asked for", .0.name())]
    KindMismatch(PolicyKind),
    #[error("module {module} refused its parameters: {message}")]
    Init { module: String, message: String },
    #[error("module {module} failed while replaying the block set: {source}")]
    Replay {
        module: String,
        #[source]
        source: CallError,
    },
    #[error("io error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl HostError {
    pub(crate) fn wasm(what: &'static str) -> impl FnOnce(wasmtime::Error) -> HostError {
        move |e| HostError::Wasm { what, message: format!("{e:#}") }
    }
    pub(crate) fn wrong_kind(kind: PolicyKind) -> impl FnOnce(wasmtime::Error) -> HostError {
        move |e| HostError::WrongKind { kind, message: format!("{e:#}") }
    }
}

impl PolicyEngine {
    /// Swap step 1 for eviction, off the request path: compile or cache-load `wasm` while the
    /// native `fallback` replays `snapshot`, then instantiate the module and replay `snapshot`
    /// into it. Step 2: feed the events since the snapshot with `on_events`; step 3: switch
    /// (e.g. under the policy lock).
    pub fn prepare_eviction(
        &self,
        name: &str,
        wasm: &[u8],
        params: &kvpool_policy_sdk::Params,
        fallback: Box<dyn kvpool_policy_sdk::EvictionPolicy + Send>,
        snapshot: &kvpool_policy_sdk::Events,
    ) -> Result<GuardedEviction, HostError> {
        GuardedEviction::prepare(|| self.load(name, PolicyKind::Eviction, wasm, params), fallback, snapshot)
    }

    /// [`PolicyEngine::prepare_eviction`] for admission.
    pub fn prepare_admission(
        &self,
        name: &str,
        wasm: &[u8],
        params: &kvpool_policy_sdk::Params,
        fallback: Box<dyn kvpool_policy_sdk::AdmissionPolicy + Send>,
        snapshot: &kvpool_policy_sdk::Events,
    ) -> Result<GuardedAdmission, HostError> {
        GuardedAdmission::prepare(|| self.load(name, PolicyKind::Admission, wasm, params), fallback, snapshot)
    }

    /// [`PolicyEngine::prepare_eviction`] for placement.
    pub fn prepare_placement(
        &self,
        name: &str,
        wasm: &[u8],
        params: &kvpool_policy_sdk::Params,
        fallback: Box<dyn kvpool_policy_sdk::PlacementPolicy + Send>,
        snapshot: &kvpool_policy_sdk::Events,
    ) -> Result<GuardedPlacement, HostError> {
        let m = self.load(name, PolicyKind::Placement, wasm, params)?;
        GuardedPlacement::new(&m, fallback, snapshot)
    }
}

// The server keeps guards behind locks shared by its workers and moves prepared ones across
// threads: they must stay `Send` (and the engine `Send + Sync`).
const _: fn() = || {
    fn send<T: Send>() {}
    fn sync<T: Send + Sync>() {}
    send::<GuardedEviction>();
    send::<GuardedAdmission>();
    send::<GuardedPlacement>();
    sync::<PolicyEngine>();
    sync::<LoadedModule>();
};
