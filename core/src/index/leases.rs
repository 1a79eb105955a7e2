//! What keeps a block from leaving: leases of gets, holds of lookups, demotions in flight
//! and soft pins until they expire.

use super::Index;
use crate::blocks::CopyHandle;
use kvpool_policy_sdk::{Event, Pin, Tier};
use std::time::Instant;

impl<D: CopyHandle> Index<D> {
    /// A lease on block `id` runs past `now`.
    pub(super) fn is_leased(&self, id: u64, now: Instant) -> bool {
        self.leases.get(&id).is_some_and(|until| *until > now) || self.holds.contains_key(&id)
    }

    /// [`Index::lookup`], and a hold on the resident leading blocks it counted: they stay
    /// leased until [`Index::unhold`] of the returned ids (whose holder must call it exactly once).
    pub fn lookup_hold(&mut self, tenant: u32, chain: &[Vec<u8>], wall_us: u64) -> (usize, Vec<u64>) {
        let hit = self.lookup(tenant, chain, wall_us);
        let ids: Vec<u64> =
            chain[..hit].iter().map(|k| self.blocks.id_of(tenant, k).expect("counted as resident")).collect();
        for &id in &ids {
            *self.holds.entry(id).or_insert(0) += 1;
        }
        (hit, ids)
    }

    /// Let go of one hold on each of `ids` (blocks removed since are skipped).
    pub fn unhold(&mut self, ids: &[u64]) {
        for id in ids {
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.holds.entry(*id) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// Number of blocks held now.
    pub fn held(&self) -> usize {
        self.holds.len()
    }

    // ---- eviction -----------------------------------------------------------------------

    /// Blocks an eviction of `tier` must not touch. A lease promises that the block stays
    /// readable, not where: with an SSD tier, a leased DRAM copy may still leave DRAM (demoted,
    /// or dropped when an SSD copy exists); the in-flight bytes are protected by the handle.
    pub fn excluded(&mut self, now: Instant, tier: Tier) -> Vec<u64> {
        self.leases.retain(|_, until| *until > now);
        let mut ex: Vec<u64> = if tier == Tier::Dram && self.has_ssd {
            Vec::new()
        } else {
            self.leases.keys().chain(self.holds.keys()).copied().collect()
        };
        ex.extend(self.moving.iter().copied());
        ex.sort_unstable();
        ex.dedup();
        ex
    }

    /// Soft pins whose time is up become no pin.
    pub fn expire_soft_pins(&mut self, wall_ms: u64) {
        while let Some(&(until, id)) = self.soft_pins.first() {
            if until > wall_ms {
                break;
            }
            self.soft_pins.pop_first();
            self.pin_until.remove(&id);
            if let Some(b) = self.blocks.get_mut(id) {
                b.pin = Pin::None;
                self.emit(Event::pin_changed(id, Pin::None));
            }
        }
    }
}
