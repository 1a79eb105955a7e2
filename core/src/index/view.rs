//! What the index shows others: the warm snapshot policies start from, the inventory and
//! block descriptions routers get, and the view a policy's guard checks answers against.

use super::Index;
use crate::blocks::{CopyHandle, Stamp};
use crate::changes::{Change, ChangeKind};
use crate::table::slot_of;
use kvpool_policy_sdk::{Event, EventKind, Events, IndexView, Pin, Tier, NO_PARENT};

impl<D: CopyHandle> Index<D> {
    // ---- policy snapshot ----------------------------------------------------------------

    /// Block `id` described as a change of its DRAM copy (tenant, key, parent key, size), for a
    /// host that moves the block elsewhere.
    pub fn describe(&self, id: u64) -> Option<Change> {
        self.blocks.get(id).map(|_| self.change_of(id, ChangeKind::Stored, Tier::Dram))
    }

    /// Every copy the index holds, as `Stored` changes (tenant, key, parent key, tier, size):
    /// what a storage node announces to a master that does not know it yet.
    pub fn inventory(&self) -> Vec<Change> {
        let mut out = Vec::with_capacity(self.blocks.len());
        for (id, b) in self.blocks.iter() {
            for tier in [Tier::Dram, Tier::Ssd] {
                if b.has(tier) {
                    out.push(self.change_of(id, ChangeKind::Stored, tier));
                }
            }
        }
        out
    }

    /// The warm snapshot a new policy starts from: the recent misses the index remembers as
    /// `Missed` events, oldest first (with the count of each key's remembered misses), then the
    /// block set as `Inserted` events, one per copy, least recently used first, every parent
    /// before its children (so a policy that tracks chains sees consistent links), each with
    /// its key hash, depth, count of requests and last access.
    pub fn snapshot(&self) -> Events {
        let blocks = &self.blocks;
        let mut ev = Events::new();
        ev.reserve(blocks.len() + self.misses.log.len());
        for &(hash, depth, parent, time) in &self.misses.log {
            // The parent a miss named may have gone since: name only resident ones.
            let parent = if blocks.contains(parent) { parent } else { NO_PARENT };
            let count = self.misses.count(hash).max(1);
            ev.push(Event::missed(hash, depth, parent).with_count(count).with_time(time));
        }
        // Walk by slot: a scratch array marks the blocks already sent.
        // Recovered blocks are stamped with their records' times: they come first, in that
        // order, then ids.
        let mut order: Vec<(Stamp, u64, usize)> =
            blocks.iter().map(|(id, b)| (b.stamp, id, slot_of(id) as usize)).collect();
        order.sort_unstable();
        let mut done = vec![false; blocks.slot_bound()];
        let mut stack = Vec::new();
        for (.., s) in order {
            let mut cur = s;
            while !done[cur] {
                stack.push(cur);
                let p = blocks.at_slot(cur).expect("a block's slot").parent;
                if p == NO_PARENT || stack.len() > blocks.len() {
                    break;
                }
                match blocks.slot(p) {
                    Some(ps) => cur = ps,
                    None => break,
                }
            }
            while let Some(x) = stack.pop() {
                if std::mem::replace(&mut done[x], true) {
                    continue;
                }
                let b = blocks.at_slot(x).expect("stacked");
                let id = blocks.id_at(x as u32).expect("stacked");
                if b.ssd.is_some() {
                    ev.push(b.event(blocks.key(b), id, EventKind::Inserted, Tier::Ssd).with_time(b.stamp.us()));
                }
                if b.dram.is_some() {
                    ev.push(b.event(blocks.key(b), id, EventKind::Inserted, Tier::Dram).with_time(b.stamp.us()));
                }
            }
        }
        ev
    }
}

impl<D: CopyHandle> IndexView for Index<D> {
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64> {
        let b = self.blocks.get(id)?;
        b.has(tier).then_some(b.size())
    }

    fn pin(&self, id: u64) -> Pin {
        self.blocks.get(id).map_or(Pin::None, |b| b.pin)
    }

    fn evictable_bytes(&self, tier: Tier, exclude: &[u64]) -> u64 {
        self.blocks
            .iter()
            .filter(|(id, b)| b.pin != Pin::Hard && exclude.binary_search(id).is_err() && b.has(tier))
            .map(|(_, b)| b.size())
            .sum()
    }

    fn resident_children(&self, id: u64) -> Vec<u64> {
        self.blocks.get(id).map(|b| self.kids_of(id, b).collect()).unwrap_or_default()
    }

    fn snapshot(&self) -> Events {
        Index::snapshot(self)
    }
}
