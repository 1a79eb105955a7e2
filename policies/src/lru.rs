//! Plain LRU per tier (no prefix awareness): the least recently inserted or accessed copy goes
//! first. Pins and exclusions follow the common rules of [`crate::tiered`].

use crate::tiered::{Queue, Step, TierOrder, Tiered};
use kvpool_policy_sdk::{Events, EvictionPolicy, FromParams, ParamError, Params, Tier};

#[derive(Debug, Default)]
pub(crate) struct LruOrder {
    q: Queue,
}

impl TierOrder for LruOrder {
    fn insert(&mut self, id: u64, _key: u64) {
        self.q.push_back(id);
    }
    fn access(&mut self, id: u64) {
        self.q.touch(id);
    }
    fn remove(&mut self, id: u64, _key: u64) {
        self.q.remove(id);
    }
    fn reserve(&mut self, n: usize) {
        self.q.reserve(n);
    }
    fn candidates(&mut self, f: &mut dyn FnMut(u64) -> Step) {
        self.q.rewind();
        while let Some(id) = self.q.at_cursor() {
            self.q.advance();
            if f(id) == Step::TakeLast {
                return;
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Lru(Tiered<LruOrder>);

impl Lru {
    pub fn new() -> Lru {
        Lru::default()
    }
    pub fn resident(&self, tier: Tier) -> usize {
        self.0.resident(tier)
    }
}

impl FromParams for Lru {
    fn from_params(_: &Params) -> Result<Lru, ParamError> {
        Ok(Lru::new())
    }
}

impl EvictionPolicy for Lru {
    fn on_events(&mut self, events: &Events) {
        self.0.on_events(events)
    }
    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.0.victims(tier, bytes, exclude)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{Event, Pin, NO_PARENT};

    #[test]
    fn lru_order_access_pins_exclude() {
        let mut p = Lru::new();
        let ev: Events = [
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, 1),
            Event::inserted(3, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Soft),
            Event::inserted(4, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Hard),
            Event::inserted(5, 10, Tier::Dram, NO_PARENT),
            Event::accessed(1, Tier::Dram),
        ]
        .into_iter()
        .collect();
        p.on_events(&ev);
        // Not prefix-aware: 2 goes before its parent 1 only because 1 was used since.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![2]);
        assert_eq!(p.victims(Tier::Dram, 25, &[]), vec![2, 5, 1]);
        assert_eq!(p.victims(Tier::Dram, 20, &[2]), vec![5, 1]);
        assert_eq!(p.victims(Tier::Dram, 1000, &[]), vec![2, 5, 1, 3]);
        assert!(p.victims(Tier::Ssd, 10, &[]).is_empty());
        assert!(p.victims(Tier::Dram, 0, &[]).is_empty());
        p.on_events(&[Event::removed(2, Tier::Dram)].into_iter().collect());
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![5]);
        assert_eq!(p.resident(Tier::Dram), 4);
    }
}
