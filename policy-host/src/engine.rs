//! The one wasmtime `Engine` of a process, module compilation with an on-disk cache, and the
//! per-instance store state (limits, deadline, host imports).

use crate::bindings::{self, admission::AdmissionPre, eviction::EvictionPre, placement::PlacementPre, LogLevel};
use crate::{HostError, PolicyKind};
use kvpool_policy_sdk::Params;
use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine, ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder};

/// How a call is bounded in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deadline {
    /// Epoch interruption: a ticker thread bumps the epoch every `tick`; a call traps after
    /// `ticks` ticks (so after `tick * ticks`, give or take one tick). Cheapest at run time.
    Epoch { tick: Duration, ticks: u64 },
    /// Fuel: a call traps after about this many Wasm operations. Deterministic, ~10-40% slower.
    Fuel(u64),
}

/// Host configuration.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub deadline: Deadline,
    /// Linear memory limit per instance, bytes.
    pub memory_limit: usize,
    /// Longest list a module may return (victim ids, decisions, placements) beyond what the call
    /// itself bounds (decisions and placements must match the request exactly).
    pub max_output: usize,
    /// Where compiled components are cached (`None`: compile every time).
    pub cache_dir: Option<PathBuf>,
    /// Faults in a row that quarantine a module.
    pub max_consecutive_faults: u32,
    /// Faults in total that quarantine a module.
    pub max_total_faults: u32,
    /// Events per `on-events` call when replaying a snapshot (each call has its own deadline).
    pub replay_chunk: usize,
    /// Replay calls carry `replay_chunk` events at once: their deadline is this many times the
    /// per-call one.
    pub replay_deadline_factor: u64,
    /// Log lines a module may emit per call (more are dropped).
    pub log_lines_per_call: u32,
}

impl Default for HostConfig {
    fn default() -> HostConfig {
        HostConfig {
            // A safety net against runaway modules, not a latency target: a policy with a million
            // blocks may rehash a map within one call (tens of ms in Wasm).
            deadline: Deadline::Epoch { tick: Duration::from_millis(1), ticks: 200 },
            memory_limit: 64 << 20,
            max_output: 1 << 20,
            cache_dir: None,
            max_consecutive_faults: 3,
            max_total_faults: 3,
            replay_chunk: 16 * 1024,
            replay_deadline_factor: 10,
            log_lines_per_call: 32,
        }
    }
}

/// Store data of one instance.
pub struct HostState {
    pub(crate) module: Arc<str>,
    pub(crate) params: Vec<(String, String)>,
    pub(crate) limits: Limiter,
    pub(crate) log_budget: u32,
}

impl bindings::HostImports for HostState {
    fn log(&mut self, level: LogLevel, message: String) {
        if self.log_budget == 0 {
            return;
        }
        self.log_budget -= 1;
        // A module cannot flood the server's log with huge lines.
        let mut m = message;
        if m.len() > 1024 {
            let mut cut = 1024;
            while !m.is_char_boundary(cut) {
                cut -= 1;
            }
            m.truncate(cut);
        }
        let module = &*self.module;
        match level {
            LogLevel::Trace => tracing::trace!(target: "kvpool_policy", module, "{m}"),
            LogLevel::Debug => tracing::debug!(target: "kvpool_policy", module, "{m}"),
            LogLevel::Info => tracing::info!(target: "kvpool_policy", module, "{m}"),
            LogLevel::Warn => tracing::warn!(target: "kvpool_policy", module, "{m}"),
            LogLevel::Error => tracing::error!(target: "kvpool_policy", module, "{m}"),
        }
    }

    fn now_us(&mut self) -> u64 {
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
    }

    fn params(&mut self) -> Vec<(String, String)> {
        self.params.clone()
    }
}

impl bindings::wit::Host for HostState {}

struct EngineInner {
    engine: Engine,
    config: HostConfig,
    linker: Linker<HostState>,
    /// Digest of wasmtime version + engine settings: part of every cache key.
    config_key: String,
}

/// The process's policy engine: one wasmtime `Engine` (cheap to clone, shareable).
#[derive(Clone)]
pub struct PolicyEngine {
    inner: Arc<EngineInner>,
}

/// wasmtime version this host is pinned to (part of the cache key).
pub const WASMTIME_VERSION: &str = "48.0.8";

impl PolicyEngine {
    pub fn new(config: HostConfig) -> Result<PolicyEngine, HostError> {
        let mut c = Config::new();
        c.wasm_component_model(true);
        match config.deadline {
            Deadline::Epoch { .. } => {
                c.epoch_interruption(true);
            }
            Deadline::Fuel(_) => {
                c.consume_fuel(true);
            }
        }
        let engine = Engine::new(&c).map_err(HostError::wasm("engine"))?;
        let mut linker = Linker::new(&engine);
        bindings::eviction::Eviction::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(HostError::wasm("linker"))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        let config_key = format!(
            "{}-{:016x}-{}",
            WASMTIME_VERSION,
            h.finish(),
            match config.deadline {
                Deadline::Epoch { .. } => "epoch",
                Deadline::Fuel(_) => "fuel",
            }
        );
        if let Deadline::Epoch { tick, .. } = config.deadline {
            // Ends by itself when the last clone of the engine is dropped.
            let weak = engine.weak();
            let tick = tick.max(Duration::from_micros(100));
            std::thread::Builder::new()
                .name("kvpool-policy-epoch".into())
                .spawn(move || loop {
                    std::thread::sleep(tick);
                    match weak.upgrade() {
                        Some(e) => e.increment_epoch(),
                        None => break,
                    }
                })
                .map_err(|e| HostError::Io { path: "epoch ticker thread".into(), source: e })?;
        }
        Ok(PolicyEngine { inner: Arc::new(EngineInner { engine, config, linker, config_key }) })
    }

    pub fn config(&self) -> &HostConfig {
        &self.inner.config
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Compile (or load from the cache) a component, check that it implements `kind`, and make
    /// it ready to instantiate. Slow (tens of ms to compile): call off the request path.
    pub fn load(&self, name: &str, kind: PolicyKind, wasm: &[u8], params: &Params) -> Result<LoadedModule, HostError> {
        let started = Instant::now();
        let sha256 = hex::encode(Sha256::digest(wasm));
        let (component, from_cache) = self.compile_cached(&sha256, wasm)?;
        let pre = self.inner.linker.instantiate_pre(&component).map_err(HostError::wasm("link"))?;
        let pre = match kind {
            PolicyKind::Eviction => KindPre::Eviction(EvictionPre::new(pre).map_err(HostError::wrong_kind(kind))?),
            PolicyKind::Admission => KindPre::Admission(AdmissionPre::new(pre).map_err(HostError::wrong_kind(kind))?),
            PolicyKind::Placement => KindPre::Placement(PlacementPre::new(pre).map_err(HostError::wrong_kind(kind))?),
        };
        let module = LoadedModule {
            engine: self.clone(),
            name: Arc::from(name),
            kind,
            sha256,
            params: params.clone(),
            loaded_at: SystemTime::now(),
            from_cache,
            load_time: started.elapsed(),
            pre,
        };
        tracing::info!(module = name, kind = kind.name(), sha256 = %module.sha256, from_cache, ms = module.load_time.as_secs_f64() * 1e3, "policy module loaded");
        Ok(module)
    }

    fn cache_path(&self, sha256: &str) -> Option<PathBuf> {
        let dir = self.inner.config.cache_dir.as_ref()?;
        Some(dir.join(format!("{sha256}-{}.cwasm", self.inner.config_key)))
    }

    fn compile_cached(&self, sha256: &str, wasm: &[u8]) -> Result<(Component, bool), HostError> {
        let engine = &self.inner.engine;
        let path = self.cache_path(sha256);
        if let Some(path) = &path {
            if let Some(c) = self.load_cached(path) {
                return Ok((c, true));
            }
        }
        let component = Component::new(engine, wasm).map_err(HostError::wasm("compile"))?;
        if let Some(path) = &path {
            if let Err(e) = store_cached(path, &component) {
                // The cache is an optimisation: a failure to write it is not a load failure.
                tracing::warn!(path = %path.display(), error = %e, "cannot write policy compile cache");
            }
        }
        Ok((component, false))
    }

    fn load_cached(&self, path: &Path) -> Option<Component> {
        let bytes = std::fs::read(path).ok()?;
        let digest = std::fs::read_to_string(sidecar(path)).ok()?;
        // Only artifacts this host wrote (the digest beside it matches) are deserialized:
        // deserialization trusts its input.
        if hex::encode(Sha256::digest(&bytes)) != digest.trim() {
            tracing::warn!(path = %path.display(), "policy compile cache entry does not match its digest; recompiling");
            return None;
        }
        // SAFETY: the file was produced by `Component::serialize` of this host (checked by the
        // digest it wrote beside it), with the engine settings and wasmtime version in its name.
        match unsafe { Component::deserialize(&self.inner.engine, &bytes) } {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "policy compile cache entry unusable; recompiling");
                None
            }
        }
    }

    pub(crate) fn new_store(&self, module: &Arc<str>, params: &Params) -> Store<HostState> {
        let cfg = &self.inner.config;
        let limits = StoreLimitsBuilder::new()
            .memory_size(cfg.memory_limit)
            .trap_on_grow_failure(true)
            .instances(4)
            .tables(4)
            .memories(2)
            .build();
        let state = HostState {
            module: module.clone(),
            params: params.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            limits: Limiter { inner: limits, memory: 0 },
            log_budget: cfg.log_lines_per_call,
        };
        let mut store = Store::new(&self.inner.engine, state);
        store.limiter(|s| &mut s.limits);
        if let Deadline::Epoch { .. } = cfg.deadline {
            store.epoch_deadline_trap();
        }
        store
    }

    /// Arm the per-call deadline (times `factor`) and log budget before entering the guest.
    pub(crate) fn arm(&self, store: &mut Store<HostState>, factor: u64) {
        let cfg = &self.inner.config;
        store.data_mut().log_budget = cfg.log_lines_per_call;
        match cfg.deadline {
            Deadline::Epoch { ticks, .. } => store.set_epoch_deadline(ticks.max(1).saturating_mul(factor)),
            Deadline::Fuel(f) => {
                // Only fails when fuel is not enabled, which the engine config guarantees.
                let _ = store.set_fuel(f.saturating_mul(factor));
            }
        }
    }
}

/// `StoreLimits` plus the size the instance's memory has reached (for metrics and `list`).
pub(crate) struct Limiter {
    inner: StoreLimits,
    pub(crate) memory: usize,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let ok = self.inner.memory_growing(current, desired, maximum)?;
        if ok {
            self.memory = self.memory.max(desired);
        }
        Ok(ok)
    }
    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.memory_grow_failed(error)
    }
    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }
    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.table_grow_failed(error)
    }
    fn instances(&self) -> usize {
        self.inner.instances()
    }
    fn tables(&self) -> usize {
        self.inner.tables()
    }
    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

fn sidecar(path: &Path) -> PathBuf {
    path.with_extension("cwasm.sha256")
}

fn store_cached(path: &Path, component: &Component) -> Result<(), HostError> {
    let io = |e| HostError::Io { path: path.display().to_string(), source: e };
    let bytes = component.serialize().map_err(HostError::wasm("serialize"))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    // Write both files under temporary names, then rename: a reader never sees half a file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &bytes).map_err(io)?;
    let tmp_sum = path.with_extension(format!("sumtmp{}", std::process::id()));
    std::fs::write(&tmp_sum, hex::encode(Sha256::digest(&bytes))).map_err(io)?;
    std::fs::rename(&tmp_sum, sidecar(path)).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

#[derive(Clone)]
pub(crate) enum KindPre {
    Eviction(EvictionPre<HostState>),
    Admission(AdmissionPre<HostState>),
    Placement(PlacementPre<HostState>),
}

/// A compiled, linked and type-checked module, ready to instantiate (cheaply, many times).
#[derive(Clone)]
pub struct LoadedModule {
    pub(crate) engine: PolicyEngine,
    pub(crate) name: Arc<str>,
    pub(crate) kind: PolicyKind,
    pub(crate) sha256: String,
    pub(crate) params: Params,
    pub(crate) loaded_at: SystemTime,
    pub(crate) from_cache: bool,
    pub(crate) load_time: Duration,
    pub(crate) pre: KindPre,
}

impl LoadedModule {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }
    /// Hex sha256 of the component bytes.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
    pub fn params(&self) -> &Params {
        &self.params
    }
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }
    /// Whether the compiled code came from the disk cache.
    pub fn from_cache(&self) -> bool {
        self.from_cache
    }
    /// Compile (or cache load) + link time.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }
}
