//! Never returns any victim.
use kvpool_policy_sdk::*;

pub struct Stingy;

impl FromParams for Stingy {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(Stingy)
    }
}

impl EvictionPolicy for Stingy {
    fn on_events(&mut self, _: &Events) {}
    fn victims(&mut self, _: Tier, _: u64, _: &[u64]) -> Vec<u64> {
        log(Level::Info, "keeping everything");
        Vec::new()
    }
}

export_eviction!(Stingy);
