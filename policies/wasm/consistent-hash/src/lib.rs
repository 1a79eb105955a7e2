//! The standard `ConsistentHash` placement policy as a Wasm component.
kvpool_policy_sdk::export_placement!(kvpool_policies::ConsistentHash);
