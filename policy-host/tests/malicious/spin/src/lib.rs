//! Never returns: from `victims`, or from `on-events` with `where=events`.
use kvpool_policy_sdk::*;

pub struct Spin(bool);

fn forever() -> ! {
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

impl FromParams for Spin {
    fn from_params(p: &Params) -> Result<Self, ParamError> {
        Ok(Spin(p.get("where") == Some("events")))
    }
}

impl EvictionPolicy for Spin {
    fn on_events(&mut self, _: &Events) {
        if self.0 {
            forever()
        }
    }
    fn victims(&mut self, _: Tier, _: u64, _: &[u64]) -> Vec<u64> {
        forever()
    }
}

export_eviction!(Spin);
