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

// The host build has no unsafe code; on wasm32 the bindings wit-bindgen generates in `__wasm`
// need it (and only they may use it).
#![cfg_attr(not(target_arch = "wasm32"), forbid(unsafe_code))]
#![cfg_attr(target_arch = "wasm32", deny(unsafe_code))]

// Lets the generated guest bindings name this crate by the same path inside and outside it.
#[cfg(target_arch = "wasm32")]
extern crate self as kvpool_policy_sdk;

mod admission;
mod events;
mod eviction;
mod params;
mod placement;

pub use admission::{AdmissionPolicy, Admit, AdmitBatch, AdmitRequest, ADMIT_REJECT};
pub use events::{Event, EventKind, Events};
pub use eviction::{EvictionPolicy, IndexView};
pub use params::{ParamError, Params};
pub use placement::{NodeSet, PlaceBatch, PlaceRequest, PlacementPolicy, Placements, NO_NODE};

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
#[allow(unsafe_code)]
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
    fn key_hash_is_xxh3_seeded_by_tenant() {
        assert_eq!(key_hash(0, b"42"), xxhash_rust::xxh3::xxh3_64_with_seed(b"42", 0));
        assert_ne!(key_hash(0, b"42"), key_hash(1, b"42"));
    }
}
