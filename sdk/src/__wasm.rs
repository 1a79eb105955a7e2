//! Guest glue (wasm32 only): wit-bindgen bindings for the three worlds, the policy instance of
//! this module, and conversions between WIT columns and SDK types. Used by the export macros.

use crate::{
    AdmissionPolicy, AdmitBatch, Events, EvictionPolicy, FromParams, Level, NodeSet, Params, PlaceBatch,
    PlacementPolicy, Tier,
};
use std::cell::RefCell;

pub use wit_bindgen;

// The runtime path points through this crate so that policy crates need no wit-bindgen
// dependency of their own. Each world's bindings embed a `component-type` section; the
// component builder (kvpool-policy-build) replaces them with the one world the module exports.
#[allow(clippy::too_many_arguments)] // generated ABI shims take one argument per column
pub mod eviction {
    wit_bindgen::generate!({
        path: "../wit",
        world: "eviction",
        pub_export_macro: true,
        export_macro_name: "__export_eviction",
        default_bindings_module: "kvpool_policy_sdk::__wasm::eviction",
        runtime_path: "kvpool_policy_sdk::__wasm::wit_bindgen::rt",
    });
}

#[allow(clippy::too_many_arguments)]
pub mod admission {
    wit_bindgen::generate!({
        path: "../wit",
        world: "admission",
        pub_export_macro: true,
        export_macro_name: "__export_admission",
        default_bindings_module: "kvpool_policy_sdk::__wasm::admission",
        runtime_path: "kvpool_policy_sdk::__wasm::wit_bindgen::rt",
    });
}

#[allow(clippy::too_many_arguments)]
pub mod placement {
    wit_bindgen::generate!({
        path: "../wit",
        world: "placement",
        pub_export_macro: true,
        export_macro_name: "__export_placement",
        default_bindings_module: "kvpool_policy_sdk::__wasm::placement",
        runtime_path: "kvpool_policy_sdk::__wasm::wit_bindgen::rt",
    });
}

use eviction::kvpool::policy::host;

pub fn log(level: Level, message: &str) {
    let l = match level {
        Level::Trace => host::LogLevel::Trace,
        Level::Debug => host::LogLevel::Debug,
        Level::Info => host::LogLevel::Info,
        Level::Warn => host::LogLevel::Warn,
        Level::Error => host::LogLevel::Error,
    };
    host::log(l, message);
}

pub fn now_us() -> u64 {
    host::now_us()
}

// A component instance is single-threaded: one policy value per module, set by `init`.
thread_local! {
    static EVICTION: RefCell<Option<Box<dyn EvictionPolicy>>> = const { RefCell::new(None) };
    static ADMISSION: RefCell<Option<Box<dyn AdmissionPolicy>>> = const { RefCell::new(None) };
    static PLACEMENT: RefCell<Option<Box<dyn PlacementPolicy>>> = const { RefCell::new(None) };
}

fn params(p: Vec<(String, String)>) -> Params {
    Params(p.into_iter().collect())
}

fn not_initialized() -> ! {
    panic!("kvpool policy called before init")
}

macro_rules! events_from {
    ($e:expr) => {{
        let e = $e;
        Events {
            kind: e.kind,
            id: e.id,
            key: e.key,
            size: e.size,
            tokens: e.tokens,
            tier: e.tier,
            parent: e.parent,
            pin: e.pin,
            depth: e.depth,
            count: e.count,
            time: e.time,
        }
    }};
}

pub fn init_eviction<T: EvictionPolicy + FromParams + 'static>(p: Vec<(String, String)>) -> Result<(), String> {
    let policy = T::from_params(&params(p)).map_err(|e| e.0)?;
    EVICTION.with(|s| *s.borrow_mut() = Some(Box::new(policy)));
    Ok(())
}

pub fn eviction_on_events(e: eviction::Events) {
    let events = events_from!(e);
    EVICTION.with(|s| s.borrow_mut().as_mut().unwrap_or_else(|| not_initialized()).on_events(&events));
}

pub fn eviction_victims(tier: u8, bytes: u64, exclude: Vec<u64>) -> Vec<u64> {
    // An unknown tier has no resident copies.
    let Some(tier) = Tier::from_u8(tier) else { return Vec::new() };
    EVICTION.with(|s| s.borrow_mut().as_mut().unwrap_or_else(|| not_initialized()).victims(tier, bytes, &exclude))
}

pub fn init_admission<T: AdmissionPolicy + FromParams + 'static>(p: Vec<(String, String)>) -> Result<(), String> {
    let policy = T::from_params(&params(p)).map_err(|e| e.0)?;
    ADMISSION.with(|s| *s.borrow_mut() = Some(Box::new(policy)));
    Ok(())
}

pub fn admission_on_events(e: admission::Events) {
    let events = events_from!(e);
    ADMISSION.with(|s| s.borrow_mut().as_mut().unwrap_or_else(|| not_initialized()).on_events(&events));
}

pub fn admission_admit(b: admission::AdmitBatch) -> Vec<u8> {
    let batch = AdmitBatch {
        id: b.id,
        key: b.key,
        size: b.size,
        tokens: b.tokens,
        seq_tokens: b.seq_tokens,
        tier: b.tier,
        parent: b.parent,
        depth: b.depth,
    };
    let out = ADMISSION.with(|s| s.borrow_mut().as_mut().unwrap_or_else(|| not_initialized()).admit(&batch));
    out.into_iter().map(|a| a.to_u8()).collect()
}

pub fn init_placement<T: PlacementPolicy + FromParams + 'static>(p: Vec<(String, String)>) -> Result<(), String> {
    let policy = T::from_params(&params(p)).map_err(|e| e.0)?;
    PLACEMENT.with(|s| *s.borrow_mut() = Some(Box::new(policy)));
    Ok(())
}

pub fn placement_on_events(e: placement::Events) {
    let events = events_from!(e);
    PLACEMENT.with(|s| s.borrow_mut().as_mut().unwrap_or_else(|| not_initialized()).on_events(&events));
}

pub fn placement_place(b: placement::PlaceBatch, n: placement::Nodes) -> placement::Placements {
    let blocks = PlaceBatch {
        id: b.id,
        size: b.size,
        tokens: b.tokens,
        parent: b.parent,
        parent_node: b.parent_node,
        tier: b.tier,
        replicas: b.replicas,
        client_node: b.client_node,
    };
    let nodes = NodeSet { id: n.id, free: [n.free_device, n.free_dram, n.free_ssd], load: n.load };
    let out = PLACEMENT.with(|s| s.borrow_mut().as_mut().unwrap_or_else(|| not_initialized()).place(&blocks, &nodes));
    placement::Placements { node: out.node, tier: out.tier }
}
