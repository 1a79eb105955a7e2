//! The standard `LeafLru` eviction policy as a Wasm component.
kvpool_policy_sdk::export_eviction!(kvpool_policies::LeafLru);
