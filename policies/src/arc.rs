//! ARC (FAST'03) per tier: T1 holds blocks used once, T2 blocks used again; B1/B2 remember the
//! keys (hashes) recently evicted from each: a key comes back under a fresh block id. A return through B1 grows the target size `p` of T1 (recency
//! pays), a return through B2 shrinks it (frequency pays). Victims come from T1 while T1 is
//! above `p`, else from T2. The cache size `c` is the tier's resident block count, since the
//! host, not the policy, owns capacity; each ghost list is capped at `c`.

use crate::tiered::{Queue, Step, TierOrder, Tiered};
use kvpool_policy_sdk::{Events, EvictionPolicy, FromParams, ParamError, Params, Tier};

#[derive(Debug, Default)]
pub(crate) struct ArcOrder {
    t1: Queue,
    t2: Queue,
    b1: Queue,
    b2: Queue,
    /// Target number of T1 blocks.
    p: usize,
}

impl ArcOrder {
    fn c(&self) -> usize {
        (self.t1.len() + self.t2.len()).max(1)
    }
}

impl TierOrder for ArcOrder {
    fn insert(&mut self, id: u64, key: u64) {
        if self.b1.remove(key) {
            let delta = (self.b2.len() / self.b1.len().max(1)).max(1);
            self.p = (self.p + delta).min(self.c());
            self.t2.push_back(id);
        } else if self.b2.remove(key) {
            let delta = (self.b1.len() / self.b2.len().max(1)).max(1);
            self.p = self.p.saturating_sub(delta);
            self.t2.push_back(id);
        } else {
            self.t1.push_back(id);
        }
    }
    fn access(&mut self, id: u64) {
        if self.t1.remove(id) {
            self.t2.push_back(id);
        } else {
            self.t2.touch(id);
        }
    }
    fn remove(&mut self, id: u64, key: u64) {
        if self.t1.remove(id) {
            self.b1.push_back(key);
        } else if self.t2.remove(id) {
            self.b2.push_back(key);
        }
        let c = self.c();
        while self.b1.len() > c {
            self.b1.pop_front();
        }
        while self.b2.len() > c {
            self.b2.pop_front();
        }
    }
    fn reserve(&mut self, n: usize) {
        self.t1.reserve(n);
    }
    fn candidates(&mut self, f: &mut dyn FnMut(u64) -> Step) {
        self.t1.rewind();
        self.t2.rewind();
        // T1 blocks not yet offered in this call.
        let mut t1_left = self.t1.len();
        loop {
            let n1 = self.t1.at_cursor();
            let n2 = self.t2.at_cursor();
            let from_t1 = match (n1, n2) {
                (None, None) => return,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(_), Some(_)) => t1_left > self.p,
            };
            let id = if from_t1 { n1 } else { n2 }.expect("checked");
            if from_t1 {
                self.t1.advance();
                t1_left -= 1;
            } else {
                self.t2.advance();
            }
            if f(id) == Step::TakeLast {
                return;
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Arc {
    inner: Tiered<ArcOrder>,
}

impl Arc {
    pub fn new() -> Arc {
        Arc::default()
    }
    /// Current target size of T1 in `tier` (for tests and metrics).
    pub fn target_t1(&self, tier: Tier) -> usize {
        self.inner.tiers[tier as usize].p
    }
}

impl FromParams for Arc {
    fn from_params(_: &Params) -> Result<Arc, ParamError> {
        Ok(Arc::new())
    }
}

impl EvictionPolicy for Arc {
    fn on_events(&mut self, events: &Events) {
        self.inner.on_events(events)
    }
    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.inner.victims(tier, bytes, exclude)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{Event, NO_PARENT};

    fn evs(e: impl IntoIterator<Item = Event>) -> Events {
        e.into_iter().collect()
    }

    #[test]
    fn recency_first_then_frequency_and_ghost_adaptation() {
        let mut p = Arc::new();
        p.on_events(&evs((1..=4).map(|i| Event::inserted(i, 10, Tier::Dram, NO_PARENT))));
        p.on_events(&evs([Event::accessed(1, Tier::Dram), Event::accessed(2, Tier::Dram)]));
        // T1 = [3, 4], T2 = [1, 2], p = 0: T1 goes first (LRU within it).
        assert_eq!(p.victims(Tier::Dram, 30, &[]), vec![3, 4, 1]);
        // Evict 3 (to B1) and bring its key back under a fresh id: p grows, and it is in T2.
        p.on_events(&evs([Event::removed(3, Tier::Dram)]));
        p.on_events(&evs([Event::inserted(30, 10, Tier::Dram, NO_PARENT).with_key(3)]));
        assert_eq!(p.target_t1(Tier::Dram), 1);
        // T1 = [4] is not above p = 1, so T2's LRU (1) goes first.
        assert_eq!(p.victims(Tier::Dram, 20, &[]), vec![1, 2]);
        // Evict 1 (to B2) and bring its key back: p shrinks to 0 again.
        p.on_events(&evs([Event::removed(1, Tier::Dram), Event::inserted(10, 10, Tier::Dram, NO_PARENT).with_key(1)]));
        assert_eq!(p.target_t1(Tier::Dram), 0);
        assert_eq!(p.victims(Tier::Dram, 10, &[4]), vec![2]);
    }
}
