//! Shared frame of the general eviction algorithms (LRU, ARC, S3-FIFO, SIEVE): per-tier
//! algorithm state plus the rules every eviction policy must follow (hard pins never, soft pins
//! only after every unpinned candidate, excluded ids never, stop once enough bytes are chosen).

use crate::hash::{IdMap, IdSet};
use kvpool_policy_sdk::{Event, EventKind, Events, Pin, Tier};
use std::collections::BTreeMap;

/// What the frame answers for a candidate offered by an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Not evictable now (excluded, pinned, already chosen): move past it.
    Skip,
    /// Chosen; more bytes are still needed.
    Take,
    /// Chosen, and that was enough: stop without touching more state.
    TakeLast,
}

/// One tier's ordering. Blocks stay in the structure until the host sends `Removed`.
pub(crate) trait TierOrder: Default {
    fn insert(&mut self, id: u64);
    fn access(&mut self, id: u64);
    fn remove(&mut self, id: u64);
    /// Offer candidates in eviction order until `f` returns `TakeLast` or none is left.
    fn candidates(&mut self, f: &mut dyn FnMut(u64) -> Step);
}

/// Insertion-ordered set with O(log n) removal and move-to-back: the building block of the
/// queues and lists of the algorithms. The front is the oldest.
#[derive(Debug, Default, Clone)]
pub(crate) struct Queue {
    by_seq: BTreeMap<u64, u64>,
    seq_of: IdMap<u64, u64>,
    next: u64,
}

impl Queue {
    pub fn len(&self) -> usize {
        self.seq_of.len()
    }
    pub fn contains(&self, id: u64) -> bool {
        self.seq_of.contains_key(&id)
    }
    pub fn push_back(&mut self, id: u64) {
        self.remove(id);
        self.next += 1;
        self.by_seq.insert(self.next, id);
        self.seq_of.insert(id, self.next);
    }
    pub fn remove(&mut self, id: u64) -> bool {
        match self.seq_of.remove(&id) {
            Some(s) => {
                self.by_seq.remove(&s);
                true
            }
            None => false,
        }
    }
    pub fn pop_front(&mut self) -> Option<u64> {
        let (_, id) = self.by_seq.pop_first()?;
        self.seq_of.remove(&id);
        Some(id)
    }
    /// First (seq, id) strictly after `after` (from the front when `None`).
    pub fn next_after(&self, after: Option<u64>) -> Option<(u64, u64)> {
        match after {
            None => self.by_seq.iter().next(),
            Some(s) => self.by_seq.range(s + 1..).next(),
        }
        .map(|(&s, &id)| (s, id))
    }
}

#[derive(Debug, Clone)]
struct Meta {
    pin: Pin,
    /// Size of the copy in each tier, when resident there.
    size: [Option<u64>; 3],
}

/// An [`EvictionPolicy`](kvpool_policy_sdk::EvictionPolicy) built from one `O` per tier.
#[derive(Debug, Default)]
pub(crate) struct Tiered<O> {
    meta: IdMap<u64, Meta>,
    pub tiers: [O; 3],
}

impl<O: TierOrder> Tiered<O> {
    pub fn on_events(&mut self, events: &Events) {
        for e in events.iter() {
            self.apply(e);
        }
    }

    fn apply(&mut self, e: Event) {
        let t = e.tier as usize;
        match e.kind {
            EventKind::Inserted => {
                let m = self.meta.entry(e.id).or_insert(Meta { pin: e.pin, size: [None; 3] });
                m.pin = e.pin;
                let again = m.size[t].replace(e.size).is_some();
                // A re-insert of a resident copy counts as a use, not as a new block.
                if again {
                    self.tiers[t].access(e.id);
                } else {
                    self.tiers[t].insert(e.id);
                }
            }
            EventKind::Accessed => {
                if self.meta.get(&e.id).is_some_and(|m| m.size[t].is_some()) {
                    self.tiers[t].access(e.id);
                }
            }
            EventKind::Removed => {
                let Some(m) = self.meta.get_mut(&e.id) else { return };
                if m.size[t].take().is_none() {
                    return;
                }
                if m.size.iter().all(Option::is_none) {
                    self.meta.remove(&e.id);
                }
                self.tiers[t].remove(e.id);
            }
            EventKind::PinChanged => {
                if let Some(m) = self.meta.get_mut(&e.id) {
                    m.pin = e.pin;
                }
            }
        }
    }

    pub fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        let t = tier as usize;
        let mut out = Vec::new();
        if bytes == 0 {
            return out;
        }
        let mut freed = 0u64;
        let mut seen: IdSet<u64> = IdSet::default();
        let mut soft = Vec::new();
        let meta = &self.meta;
        self.tiers[t].candidates(&mut |id| {
            if !seen.insert(id) || exclude.binary_search(&id).is_ok() {
                return Step::Skip;
            }
            let Some(m) = meta.get(&id) else { return Step::Skip };
            let Some(size) = m.size[t] else { return Step::Skip };
            match m.pin {
                Pin::Hard => Step::Skip,
                Pin::Soft => {
                    soft.push((id, size));
                    Step::Skip
                }
                Pin::None => {
                    out.push(id);
                    freed = freed.saturating_add(size);
                    if freed >= bytes {
                        Step::TakeLast
                    } else {
                        Step::Take
                    }
                }
            }
        });
        // Soft pins go only when the unpinned ones were not enough, in the algorithm's order.
        for (id, size) in soft {
            if freed >= bytes {
                break;
            }
            out.push(id);
            freed = freed.saturating_add(size);
        }
        out
    }

    pub fn resident(&self, tier: Tier) -> usize {
        self.meta.values().filter(|m| m.size[tier as usize].is_some()).count()
    }
}
