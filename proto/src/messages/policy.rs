//! Policy administration (version 1): load, list and roll back policy modules.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyKind {
    Eviction,
    Admission,
    Placement,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Eviction => "eviction",
            PolicyKind::Admission => "admission",
            PolicyKind::Placement => "placement",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        match s {
            "eviction" => Some(PolicyKind::Eviction),
            "admission" => Some(PolicyKind::Admission),
            "placement" => Some(PolicyKind::Placement),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyLoadRequest {
    pub kind: PolicyKind,
    /// Operator-chosen name, shown by `list` and in logs.
    pub name: String,
    /// Module parameters (`--param k=v`).
    pub params: Vec<(String, String)>,
    /// Exact number of component bytes that follow the frame.
    pub module_size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRollbackRequest {
    pub kind: PolicyKind,
}

/// One policy module as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyInfo {
    pub kind: PolicyKind,
    pub name: String,
    /// Hex SHA-256 of the component; empty for a built-in policy.
    pub sha256: String,
    pub params: Vec<(String, String)>,
    /// Wall-clock ms when it was loaded.
    pub loaded_at_ms: u64,
    /// True for the native built-in policy (no module loaded, or after rollback past the first).
    pub builtin: bool,
    /// True when this is the one deciding now.
    pub active: bool,
    pub faults_trap: u64,
    pub faults_timeout: u64,
    pub faults_invalid: u64,
    /// Repeated faults: the native fallback answers until an operator loads another module.
    pub quarantined: bool,
    /// Decision calls answered by the module / by the native fallback.
    pub answered: u64,
    pub fallback_answers: u64,
    /// Time the last swap took (compile or cache load, instantiate, replay), in microseconds.
    pub swap_us: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyListResponse {
    pub policies: Vec<PolicyInfo>,
}
