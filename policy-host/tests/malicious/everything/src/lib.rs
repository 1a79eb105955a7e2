//! Returns every block it was told about, ignoring pins and exclusions.
use kvpool_policy_sdk::*;

pub struct Everything(Vec<u64>);

impl FromParams for Everything {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(Everything(Vec::new()))
    }
}

impl EvictionPolicy for Everything {
    fn on_events(&mut self, e: &Events) {
        for ev in e.iter() {
            if ev.kind == EventKind::Inserted && !self.0.contains(&ev.id) {
                self.0.push(ev.id);
            }
        }
    }
    fn victims(&mut self, _: Tier, _: u64, _: &[u64]) -> Vec<u64> {
        self.0.clone()
    }
}

export_eviction!(Everything);
