//! Panics when asked for victims.
use kvpool_policy_sdk::*;

pub struct Panicky;

impl FromParams for Panicky {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(Panicky)
    }
}

impl EvictionPolicy for Panicky {
    fn on_events(&mut self, _: &Events) {}
    fn victims(&mut self, _: Tier, bytes: u64, _: &[u64]) -> Vec<u64> {
        panic!("no victims for {bytes} bytes today")
    }
}

export_eviction!(Panicky);
