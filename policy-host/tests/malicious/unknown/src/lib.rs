//! Returns an id that does not exist.
use kvpool_policy_sdk::*;

pub struct Unknown;

impl FromParams for Unknown {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(Unknown)
    }
}

impl EvictionPolicy for Unknown {
    fn on_events(&mut self, _: &Events) {}
    fn victims(&mut self, _: Tier, _: u64, _: &[u64]) -> Vec<u64> {
        vec![u64::MAX - 7]
    }
}

export_eviction!(Unknown);
