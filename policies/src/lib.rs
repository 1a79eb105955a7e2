//! kvpool's standard policies, as plain Rust types implementing the SDK traits.
//!
//! The server links these natively as its built-in policies (and as the fallback when a Wasm
//! module faults); the same types are exported as Wasm components for hot swap
//! (`policies/wasm/<name>`, built by `kvpool-policy-build`).

#![forbid(unsafe_code)]

pub mod admission;
pub mod arc;
pub mod experts;
pub mod filters;
mod ghosts;
pub mod hash;
pub mod leaf_lru;
mod leaves;
pub mod lru;
mod nodes;
pub mod placement;
pub mod registry;
pub mod s3fifo;
pub mod sieve;
pub mod threshold;
mod tiered;

pub use admission::{SeenTwice, SizeRange};
pub use arc::Arc;
pub use experts::ChainExperts;
pub use filters::{Doorkeeper, GhostAdmission};
pub use leaf_lru::LeafLru;
pub use lru::Lru;
pub use placement::{ConsistentHash, LeastLoaded, PrefixAffinity};
pub use s3fifo::S3Fifo;
pub use sieve::Sieve;
pub use threshold::ThresholdAdmission;

use kvpool_policy_sdk::{FromParams, ParamError, Params};

impl FromParams for LeafLru {
    fn from_params(p: &Params) -> Result<LeafLru, ParamError> {
        LeafLru::with_params(p)
    }
}

impl FromParams for ThresholdAdmission {
    fn from_params(p: &Params) -> Result<ThresholdAdmission, ParamError> {
        ThresholdAdmission::with_params(p)
    }
}
