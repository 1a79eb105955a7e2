//! Allocates 1 GiB when asked for victims.
use kvpool_policy_sdk::*;

pub struct Hog;

impl FromParams for Hog {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(Hog)
    }
}

impl EvictionPolicy for Hog {
    fn on_events(&mut self, _: &Events) {}
    fn victims(&mut self, _: Tier, _: u64, _: &[u64]) -> Vec<u64> {
        let v = vec![7u8; 1 << 30];
        vec![std::hint::black_box(&v)[12345] as u64]
    }
}

export_eviction!(Hog);
