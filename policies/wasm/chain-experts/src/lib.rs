//! The standard `ChainExperts` eviction policy as a Wasm component.
kvpool_policy_sdk::export_eviction!(kvpool_policies::ChainExperts);
