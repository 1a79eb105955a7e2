//! SIEVE (NSDI'24): one FIFO per tier, a visited bit per block and a hand that moves from the
//! oldest block toward the newest, clearing visited bits and stopping at the first unvisited
//! block, which goes. New blocks enter at the newest end; an access only sets the bit.

use crate::hash::IdSet;
use crate::tiered::{Queue, Step, TierOrder, Tiered};
use kvpool_policy_sdk::{Events, EvictionPolicy, FromParams, ParamError, Params, Tier};

#[derive(Debug, Default)]
pub(crate) struct SieveOrder {
    q: Queue,
    visited: IdSet<u64>,
}

impl TierOrder for SieveOrder {
    fn insert(&mut self, id: u64, _key: u64) {
        self.visited.remove(&id);
        self.q.push_back(id);
    }
    fn access(&mut self, id: u64) {
        if self.q.contains(id) {
            self.visited.insert(id);
        }
    }
    fn remove(&mut self, id: u64, _key: u64) {
        self.q.remove(id);
        self.visited.remove(&id);
    }
    fn reserve(&mut self, n: usize) {
        self.q.reserve(n);
    }
    fn candidates(&mut self, f: &mut dyn FnMut(u64) -> Step) {
        // Two full turns: the first may only clear bits; a third could offer nothing new.
        let mut budget = 2 * self.q.len() + 1;
        // The hand is the queue's cursor: the next block to examine, kept in place by the queue
        // as blocks come and go (the front until the first call).
        while budget > 0 && self.q.len() > 0 {
            budget -= 1;
            let id = match self.q.at_cursor() {
                Some(id) => id,
                None => {
                    self.q.rewind();
                    match self.q.at_cursor() {
                        Some(id) => id,
                        None => break,
                    }
                }
            };
            self.q.advance();
            if self.visited.remove(&id) {
                continue;
            }
            match f(id) {
                Step::Skip => {}
                // The chosen block leaves at its `Removed` event; the hand moves past it.
                Step::Take => {}
                Step::TakeLast => return,
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Sieve(Tiered<SieveOrder>);

impl Sieve {
    pub fn new() -> Sieve {
        Sieve::default()
    }
}

impl FromParams for Sieve {
    fn from_params(_: &Params) -> Result<Sieve, ParamError> {
        Ok(Sieve::new())
    }
}

impl EvictionPolicy for Sieve {
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
    use kvpool_policy_sdk::{Event, NO_PARENT};

    fn ins(ids: &[u64]) -> Events {
        ids.iter().map(|&i| Event::inserted(i, 10, Tier::Dram, NO_PARENT)).collect()
    }

    #[test]
    fn visited_blocks_survive_one_pass() {
        let mut p = Sieve::new();
        p.on_events(&ins(&[1, 2, 3, 4]));
        p.on_events(&[Event::accessed(1, Tier::Dram), Event::accessed(3, Tier::Dram)].into_iter().collect());
        // hand starts at 1 (visited: cleared), 2 goes.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![2]);
        p.on_events(&[Event::removed(2, Tier::Dram)].into_iter().collect());
        // hand continues at 3 (visited: cleared), 4 goes; then wraps to 1 (bit now clear).
        assert_eq!(p.victims(Tier::Dram, 20, &[]), vec![4, 1]);
        p.on_events(&[Event::removed(4, Tier::Dram), Event::removed(1, Tier::Dram)].into_iter().collect());
        p.on_events(&ins(&[5]));
        // hand wrapped to 3 (bit cleared in the previous pass): 3 goes, not the new 5.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![3]);
    }

    #[test]
    fn all_visited_still_yields_and_exclude_is_skipped() {
        let mut p = Sieve::new();
        p.on_events(&ins(&[1, 2, 3]));
        p.on_events(&[1, 2, 3].iter().map(|&i| Event::accessed(i, Tier::Dram)).collect());
        assert_eq!(p.victims(Tier::Dram, 10, &[1]), vec![2]);
        assert_eq!(p.victims(Tier::Dram, 100, &[]), vec![3, 1, 2]);
    }
}
