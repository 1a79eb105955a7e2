//! Leaf-first LRU eviction: within a tier, blocks with no child resident in that tier go first,
//! least recently used first; soft-pinned blocks only after every unpinned one; hard-pinned never.
//!
//! Why leaf-first: a block is useless without its ancestors, so evicting a chain's root strands
//! every descendant; evicting from the tail keeps the longest reusable prefixes.

use crate::leaves::Leaves;
use kvpool_policy_sdk::{Events, EvictionPolicy, ParamError, Params, Tier};

/// One ordering class: leaf-first LRU is [`Leaves`] ranked by last access alone.
#[derive(Debug)]
pub struct LeafLru {
    leaves: Leaves,
}

impl Default for LeafLru {
    fn default() -> LeafLru {
        LeafLru { leaves: Leaves::new(1) }
    }
}

impl LeafLru {
    pub fn new() -> LeafLru {
        LeafLru::default()
    }

    /// Leaf-first LRU takes no parameters; unknown ones are ignored.
    pub fn with_params(_params: &Params) -> Result<LeafLru, ParamError> {
        Ok(LeafLru::new())
    }

    pub fn resident(&self, tier: Tier) -> usize {
        self.leaves.resident(tier)
    }
}

impl EvictionPolicy for LeafLru {
    fn on_events(&mut self, events: &Events) {
        // Bulk loads (a replayed snapshot) grow the map once instead of rehashing as they go.
        if events.len() >= 4096 {
            self.leaves.reserve(events.len());
        }
        for e in events.iter() {
            self.leaves.apply(&e, |_| 0);
        }
    }

    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.leaves.victims(tier, bytes, exclude, |_, tick| tick, |_| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{Event, Pin, NO_PARENT};

    fn ev(list: &[Event]) -> Events {
        list.iter().copied().collect()
    }

    #[test]
    fn leaves_go_before_older_ancestors() {
        let mut p = LeafLru::new();
        // chain 1 <- 2 <- 3 inserted in order, so 1 is the oldest
        p.on_events(&ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, 1),
            Event::inserted(3, 10, Tier::Dram, 2),
            Event::inserted(4, 10, Tier::Dram, NO_PARENT),
        ]));
        // Oldest leaf is 3 (4 is newer): evict 3, then its parent 2 becomes a leaf older than 4.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![3]);
        assert_eq!(p.victims(Tier::Dram, 30, &[]), vec![3, 2, 1]);
        assert_eq!(p.victims(Tier::Dram, 40, &[]), vec![3, 2, 1, 4]);
    }

    #[test]
    fn access_refreshes_and_exclude_and_pins_are_respected() {
        let mut p = LeafLru::new();
        p.on_events(&ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Soft),
            Event::inserted(3, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Hard),
            Event::inserted(4, 10, Tier::Dram, NO_PARENT),
            Event::accessed(1, Tier::Dram),
        ]));
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![4]);
        assert_eq!(p.victims(Tier::Dram, 10, &[4]), vec![1]);
        // soft pin last, hard pin never
        assert_eq!(p.victims(Tier::Dram, 100, &[]), vec![4, 1, 2]);
        p.on_events(&ev(&[Event::pin_changed(2, Pin::None)]));
        assert_eq!(p.victims(Tier::Dram, 100, &[]), vec![2, 4, 1]);
    }

    #[test]
    fn tiers_are_independent() {
        let mut p = LeafLru::new();
        p.on_events(&ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, 1),
            Event::inserted(1, 10, Tier::Ssd, NO_PARENT),
            Event::removed(2, Tier::Dram),
        ]));
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![1]);
        assert_eq!(p.victims(Tier::Ssd, 10, &[]), vec![1]);
        p.on_events(&ev(&[Event::removed(1, Tier::Dram)]));
        assert!(p.victims(Tier::Dram, 10, &[]).is_empty());
        assert_eq!(p.resident(Tier::Ssd), 1);
    }
}
