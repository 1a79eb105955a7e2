//! The standard `S3Fifo` eviction policy as a Wasm component.
kvpool_policy_sdk::export_eviction!(kvpool_policies::S3Fifo);
