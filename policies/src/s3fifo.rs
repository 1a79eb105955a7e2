//! S3-FIFO (SOSP'23) per tier: a small FIFO (10% of resident blocks by default) that new blocks
//! enter, a main FIFO, and a ghost FIFO of recently evicted keys (hashes: a key comes back
//! under a fresh block id). A block leaving the small FIFO
//! moves to main if it was used since insertion, else it is evicted and its id remembered in the
//! ghost; a block whose id is in the ghost goes straight to main when it comes back. Main is a
//! FIFO with reinsertion while a 2-bit use counter lasts.

use crate::hash::IdMap;
use crate::tiered::{Queue, Step, TierOrder, Tiered};
use kvpool_policy_sdk::{Events, EvictionPolicy, FromParams, ParamError, Params, Tier};

#[derive(Debug, Clone, Copy)]
struct Conf {
    /// Small FIFO share of resident blocks, in percent.
    small_pct: u64,
    /// Ghost capacity as a percentage of resident blocks (keys only, so cheap).
    ghost_pct: u64,
    /// Uses needed in the small FIFO to be moved to main.
    move_threshold: u8,
}

impl Default for Conf {
    fn default() -> Conf {
        Conf { small_pct: 10, ghost_pct: 100, move_threshold: 1 }
    }
}

#[derive(Debug, Default)]
pub(crate) struct S3FifoOrder {
    conf: Conf,
    small: Queue,
    main: Queue,
    ghost: Queue,
    freq: IdMap<u64, u8>,
}

impl S3FifoOrder {
    fn resident(&self) -> usize {
        self.small.len() + self.main.len()
    }
    fn small_target(&self) -> usize {
        (self.resident() as u64 * self.conf.small_pct / 100) as usize
    }
    fn ghost_cap(&self) -> usize {
        ((self.resident() as u64 * self.conf.ghost_pct / 100) as usize).max(1)
    }
}

impl TierOrder for S3FifoOrder {
    fn insert(&mut self, id: u64, key: u64) {
        self.freq.insert(id, 0);
        if self.ghost.remove(key) {
            self.main.push_back(id);
        } else {
            self.small.push_back(id);
        }
    }
    fn access(&mut self, id: u64) {
        if let Some(f) = self.freq.get_mut(&id) {
            *f = (*f + 1).min(3);
        }
    }
    fn remove(&mut self, id: u64, key: u64) {
        self.freq.remove(&id);
        if self.small.remove(id) {
            // Left while still on probation: remember its key, so a quick return goes to main.
            self.ghost.push_back(key);
            while self.ghost.len() > self.ghost_cap() {
                self.ghost.pop_front();
            }
        } else {
            self.main.remove(id);
        }
    }
    fn reserve(&mut self, n: usize) {
        self.small.reserve(n);
        self.freq.reserve(n);
    }
    fn candidates(&mut self, f: &mut dyn FnMut(u64) -> Step) {
        self.small.rewind();
        self.main.rewind();
        // Blocks of the small FIFO still there after this call's offers and moves.
        let mut small_left = self.small.len();
        let target = self.small_target();
        // Each main block is revisited at most 4 times (counter 3..0): bounded work.
        loop {
            let s_next = self.small.at_cursor();
            let m_next = self.main.at_cursor();
            let from_small = match (s_next, m_next) {
                (None, None) => return,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(_), Some(_)) => small_left > target,
            };
            if from_small {
                let id = s_next.expect("checked");
                self.small.advance();
                small_left -= 1;
                let uses = self.freq.get(&id).copied().unwrap_or(0);
                if uses >= self.conf.move_threshold {
                    self.small.remove(id);
                    self.main.push_back(id);
                    self.freq.insert(id, 0);
                    continue;
                }
                if f(id) == Step::TakeLast {
                    return;
                }
            } else {
                let id = m_next.expect("checked");
                self.main.advance();
                let uses = self.freq.get(&id).copied().unwrap_or(0);
                if uses > 0 {
                    self.freq.insert(id, uses - 1);
                    self.main.push_back(id);
                    continue;
                }
                if f(id) == Step::TakeLast {
                    return;
                }
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct S3Fifo {
    inner: Tiered<S3FifoOrder>,
}

impl S3Fifo {
    pub fn new() -> S3Fifo {
        S3Fifo::default()
    }
}

impl FromParams for S3Fifo {
    /// `small_pct` (default 10), `ghost_pct` (default 100), `move_threshold` (default 1).
    fn from_params(p: &Params) -> Result<S3Fifo, ParamError> {
        let conf = Conf {
            small_pct: p.get_u64("small_pct", 10)?.clamp(1, 90),
            ghost_pct: p.get_u64("ghost_pct", 100)?.min(1000),
            move_threshold: p.get_u64("move_threshold", 1)?.clamp(1, 3) as u8,
        };
        let mut s = S3Fifo::new();
        for t in &mut s.inner.tiers {
            t.conf = conf;
        }
        Ok(s)
    }
}

impl EvictionPolicy for S3Fifo {
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

    fn one(e: Event) -> Events {
        [e].into_iter().collect()
    }

    #[test]
    fn one_hit_wonders_go_first_and_ghosts_return_to_main() {
        let mut p = S3Fifo::new();
        // 10 blocks: small target = 1.
        p.on_events(&(1..=10).map(|i| Event::inserted(i, 10, Tier::Dram, NO_PARENT)).collect());
        p.on_events(&one(Event::accessed(1, Tier::Dram)));
        // 1 was used: it moves to main; 2 is the oldest unused block in small.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![2]);
        p.on_events(&one(Event::removed(2, Tier::Dram)));
        // 2 is a ghost now: its key put again under a fresh id goes to main (behind 1).
        p.on_events(&one(Event::inserted(20, 10, Tier::Dram, NO_PARENT).with_key(2)));
        assert_eq!(p.victims(Tier::Dram, 30, &[]), vec![3, 4, 5]);
        // Excluding 3 moves on to 4.
        assert_eq!(p.victims(Tier::Dram, 10, &[3]), vec![4]);
    }

    #[test]
    fn main_reinserts_used_blocks() {
        let mut p = S3Fifo::from_params(&Params::from_pairs([("small_pct", "1")])).unwrap();
        p.on_events(&(1..=4).map(|i| Event::inserted(i, 10, Tier::Dram, NO_PARENT)).collect());
        p.on_events(&(1..=4).map(|i| Event::accessed(i, Tier::Dram)).collect());
        // All used: small (target 0) moves 1..4 to main with counter 0, main is FIFO: 1 goes.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![1]);
        p.on_events(&one(Event::accessed(1, Tier::Dram)));
        // 1 gets a second chance, 2 goes.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![2]);
        assert_eq!(p.victims(Tier::Dram, 40, &[]), vec![2, 3, 4, 1]);
    }
}
