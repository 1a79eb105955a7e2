//! The standard `Doorkeeper` admission policy (TinyLFU-style) as a Wasm component.
kvpool_policy_sdk::export_admission!(kvpool_policies::Doorkeeper);
