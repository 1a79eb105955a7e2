//! Returns `n` ids (default 10 million).
use kvpool_policy_sdk::*;

pub struct Flood(u64);

impl FromParams for Flood {
    fn from_params(p: &Params) -> Result<Self, ParamError> {
        Ok(Flood(p.get_u64("n", 10_000_000)?))
    }
}

impl EvictionPolicy for Flood {
    fn on_events(&mut self, _: &Events) {}
    fn victims(&mut self, _: Tier, _: u64, _: &[u64]) -> Vec<u64> {
        (0..self.0).collect()
    }
}

export_eviction!(Flood);
