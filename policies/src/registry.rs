//! Every standard policy by the name its Wasm component is built under: the one list behind the
//! server's built-ins, the policy manager's native fallbacks and the benchmark's simulator.

use crate as p;
use kvpool_policy_sdk::{AdmissionPolicy, EvictionPolicy, FromParams, ParamError, Params, PlacementPolicy};

/// Standard eviction policies.
pub const EVICTION: [&str; 6] = ["lru", "leaf-lru", "arc", "s3fifo", "sieve", "chain-experts"];
/// Standard admission policies.
pub const ADMISSION: [&str; 5] = ["threshold", "seen-twice", "size-range", "doorkeeper", "ghost"];
/// Standard placement policies.
pub const PLACEMENT: [&str; 3] = ["consistent-hash", "least-loaded", "prefix-affinity"];

/// What a server runs when no module is loaded, and what answers for a module that faults.
pub const DEFAULT_EVICTION: &str = "leaf-lru";
/// The default admission: `store_threshold` (parameter of the same name, 0 admits all).
pub const DEFAULT_ADMISSION: &str = "threshold";
/// The fallback of a placement module.
pub const DEFAULT_PLACEMENT: &str = "least-loaded";

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("no standard {kind} policy is called {name:?} (known: {known})")]
    Unknown { kind: &'static str, name: String, known: String },
    #[error("policy {name}: {source}")]
    Params {
        name: String,
        #[source]
        source: ParamError,
    },
}

fn build<P: FromParams, B>(name: &str, params: &Params, boxed: impl FnOnce(P) -> B) -> Result<B, RegistryError> {
    P::from_params(params).map(boxed).map_err(|source| RegistryError::Params { name: name.into(), source })
}

fn unknown<T>(kind: &'static str, name: &str, known: &[&str]) -> Result<T, RegistryError> {
    Err(RegistryError::Unknown { kind, name: name.into(), known: known.join(", ") })
}

/// A standard eviction policy, native.
pub fn eviction(name: &str, params: &Params) -> Result<Box<dyn EvictionPolicy + Send>, RegistryError> {
    fn b<P: EvictionPolicy + Send + 'static>(x: P) -> Box<dyn EvictionPolicy + Send> {
        Box::new(x)
    }
    match name {
        "lru" => build(name, params, b::<p::Lru>),
        "leaf-lru" => build(name, params, b::<p::LeafLru>),
        "arc" => build(name, params, b::<p::Arc>),
        "s3fifo" => build(name, params, b::<p::S3Fifo>),
        "sieve" => build(name, params, b::<p::Sieve>),
        "chain-experts" => build(name, params, b::<p::ChainExperts>),
        _ => unknown("eviction", name, &EVICTION),
    }
}

/// A standard admission policy, native.
pub fn admission(name: &str, params: &Params) -> Result<Box<dyn AdmissionPolicy + Send>, RegistryError> {
    fn b<P: AdmissionPolicy + Send + 'static>(x: P) -> Box<dyn AdmissionPolicy + Send> {
        Box::new(x)
    }
    match name {
        "threshold" => build(name, params, b::<p::ThresholdAdmission>),
        "seen-twice" => build(name, params, b::<p::SeenTwice>),
        "size-range" => build(name, params, b::<p::SizeRange>),
        "doorkeeper" => build(name, params, b::<p::Doorkeeper>),
        "ghost" => build(name, params, b::<p::GhostAdmission>),
        _ => unknown("admission", name, &ADMISSION),
    }
}

/// A standard placement policy, native.
pub fn placement(name: &str, params: &Params) -> Result<Box<dyn PlacementPolicy + Send>, RegistryError> {
    fn b<P: PlacementPolicy + Send + 'static>(x: P) -> Box<dyn PlacementPolicy + Send> {
        Box::new(x)
    }
    match name {
        "consistent-hash" => build(name, params, b::<p::ConsistentHash>),
        "least-loaded" => build(name, params, b::<p::LeastLoaded>),
        "prefix-affinity" => build(name, params, b::<p::PrefixAffinity>),
        _ => unknown("placement", name, &PLACEMENT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_name_builds_and_others_do_not() {
        let none = Params::new();
        for n in EVICTION {
            eviction(n, &none).unwrap();
        }
        for n in ADMISSION {
            admission(n, &none).unwrap();
        }
        for n in PLACEMENT {
            placement(n, &none).unwrap();
        }
        assert!(matches!(eviction("fifo", &none), Err(RegistryError::Unknown { .. })));
        let bad = Params::from_pairs([("store_threshold", "many")]);
        assert!(matches!(admission(DEFAULT_ADMISSION, &bad), Err(RegistryError::Params { .. })));
    }

    #[test]
    fn every_standard_component_is_registered() {
        // policies/wasm holds one crate per standard component: the registry must know each.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("wasm");
        let none = Params::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            if !entry.file_type().unwrap().is_dir() {
                continue;
            }
            let name = entry.file_name().into_string().unwrap();
            let known =
                eviction(&name, &none).is_ok() || admission(&name, &none).is_ok() || placement(&name, &none).is_ok();
            assert!(known, "component {name} is not in the registry");
        }
    }
}
