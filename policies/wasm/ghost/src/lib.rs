//! The standard `GhostAdmission` admission policy as a Wasm component.
kvpool_policy_sdk::export_admission!(kvpool_policies::GhostAdmission);
