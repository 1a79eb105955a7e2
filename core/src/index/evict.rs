//! Making room: victims validated against the index, eviction with the chain rule, demotions
//! to SSD (or another node), promotions back, and copies found corrupt.

use super::{slot, Index};
use crate::blocks::{CopyHandle, Locator};
use crate::changes::ChangeKind;
use crate::effects::{Dropped, MetaOp};
use kvpool_policy_sdk::{key_hash, Admit, AdmitBatch, AdmitRequest, EventKind, Pin, Tier};
use std::collections::HashSet;
use std::time::Instant;

/// The result of an eviction pass over the index.
#[derive(Debug)]
pub struct Evicted<D> {
    /// DRAM copies to write to the SSD tier; finish each with [`Index::finish_demotion`].
    pub demotions: Vec<(u64, D)>,
    /// Copies to free and files to delete, outside the lock.
    pub dropped: Vec<Dropped<D>>,
    pub meta: Vec<MetaOp>,
    /// Copies that left the tier now (demotions not counted), cascaded ones included.
    pub gone: usize,
    /// Blocks removed by the chain rule: resident descendants of a victim that lost its last
    /// copy, which the policy did not name.
    pub cascaded: usize,
    /// Victims kept by the chain rule: a resident descendant was leased, in flight or
    /// hard-pinned, so removing the victim would have stranded it.
    pub refused: usize,
}

/// How a demotion ended.
#[derive(Debug)]
pub enum Demoted<D> {
    /// The block now lives on SSD; its DRAM copy is to be freed.
    Moved { dram: Option<D>, meta: MetaOp },
    /// No SSD copy could be written: the block was evicted instead.
    Evicted { dropped: Dropped<D>, meta: Option<MetaOp> },
    /// The block was removed or replaced meanwhile: the written copy is garbage.
    Vanished,
}

impl<D: CopyHandle> Index<D> {
    /// Keep the proposed victims that may really go, in order, until `bytes` are covered.
    /// `in_use` says whether a DRAM copy is held by a read (its memory would not come free).
    pub fn valid_victims(
        &self,
        proposed: &[u64],
        tier: Tier,
        bytes: u64,
        exclude: &[u64],
        in_use: impl Fn(&D) -> bool,
    ) -> Vec<u64> {
        let mut freed = 0u64;
        let mut valid = Vec::new();
        for &id in proposed {
            if freed >= bytes {
                break;
            }
            let Some(b) = self.blocks.get(id) else { continue };
            let eligible = match tier {
                Tier::Dram => b.dram().is_some_and(|d| !in_use(&d)),
                Tier::Ssd => b.ssd.is_some(),
                Tier::Device => false,
            };
            if !eligible || b.pin == Pin::Hard || b.moving || exclude.binary_search(&id).is_ok() || valid.contains(&id)
            {
                continue;
            }
            freed += b.size();
            valid.push(id);
        }
        valid
    }

    /// The admission question for DRAM victims: which may go to the SSD tier.
    pub fn demotion_batch(&self, victims: &[u64]) -> AdmitBatch {
        victims
            .iter()
            .filter_map(|&id| self.blocks.get(id).map(|b| (id, b)))
            .map(|(id, b)| AdmitRequest {
                id,
                key: key_hash(b.tenant, self.blocks.key(b)),
                size: b.size(),
                tokens: b.tokens,
                seq_tokens: u64::from(b.seq_tokens),
                tier: Tier::Ssd,
                parent: b.parent,
                depth: b.depth,
            })
            .collect()
    }

    /// Hand DRAM victims out as demotions on a node without an SSD tier too: a cluster
    /// storage node offers them to another node's free DRAM, and evicts those no node takes
    /// with [`Index::evict_untaken`].
    pub fn set_offload(&mut self, on: bool) {
        self.offload = on;
    }

    /// A DRAM victim of a node without SSD that no other node took: its demotion ends, and it
    /// is evicted under the rules of [`Index::evict`] as they stand now (a lease taken while it
    /// was offered keeps it; the chain rule takes its descendants along or keeps it).
    pub fn evict_untaken(&mut self, id: u64, now: Instant) -> Evicted<D> {
        self.moving.remove(&id);
        if let Some(b) = self.blocks.get_mut(id).filter(|b| b.moving) {
            b.moving = false;
            // Counted when its demotion started; the eviction below counts it again.
            let t = b.tenant;
            let c = &mut self.tenant_mut(t).evictions[slot(Tier::Dram)];
            *c = c.saturating_sub(1);
        }
        self.evict_with(&[id], Tier::Dram, &[], now, false)
    }

    /// Evict `victims` from `tier`: DRAM victims admitted to SSD (`decisions`, one per row of
    /// [`Index::demotion_batch`]) start a demotion, as do all DRAM victims of a node without
    /// SSD that offers them to other nodes ([`Index::set_offload`]); the others lose their copy
    /// in `tier`, and blocks left with no copy leave the index. Leased blocks are never dropped
    /// from the pool.
    ///
    /// Chain rule: a victim that loses its last copy takes its resident descendants along (every
    /// copy, deepest first, counted in `cascaded`, `Removed` events for each), since a lookup
    /// stops at the first absent block and they could never be hit; when one of them is leased,
    /// in flight or hard-pinned, the victim stays (counted in `refused`).
    pub fn evict(&mut self, victims: &[u64], tier: Tier, decisions: &[Admit], now: Instant) -> Evicted<D> {
        self.evict_with(victims, tier, decisions, now, true)
    }

    fn evict_with(
        &mut self,
        victims: &[u64],
        tier: Tier,
        decisions: &[Admit],
        now: Instant,
        may_demote: bool,
    ) -> Evicted<D> {
        let mut out =
            Evicted { demotions: Vec::new(), dropped: Vec::new(), meta: Vec::new(), gone: 0, cascaded: 0, refused: 0 };
        let named: HashSet<u64> = victims.iter().copied().collect();
        for (row, &id) in victims.iter().enumerate() {
            let Some(b) = self.blocks.get_mut(id) else { continue };
            if !b.has(tier) || b.moving {
                continue;
            }
            let (tenant, size) = (b.tenant, b.size());
            let demote = may_demote
                && tier == Tier::Dram
                && b.ssd.is_none()
                && if self.has_ssd {
                    decisions.get(row).copied() == Some(Admit::Into(Tier::Ssd))
                } else {
                    self.offload
                };
            if demote {
                b.moving = true;
                out.demotions.push((id, b.dram().expect("has a DRAM copy")));
                self.moving.insert(id);
                self.tenant_mut(tenant).evictions[slot(tier)] += 1;
                continue;
            }
            let other_copy = match tier {
                Tier::Dram => b.ssd.is_some(),
                _ => b.dram.is_some(),
            };
            if !other_copy && self.is_leased(id, now) {
                continue;
            }
            if !other_copy {
                let Some(sub) = self.free_subtree(id, now) else {
                    out.refused += 1;
                    continue;
                };
                for &x in sub.iter().rev() {
                    let b = self.blocks.get(x).expect("in the subtree");
                    let (t, in_tier) = (b.tenant, b.has(tier));
                    let copies = [Tier::Dram, Tier::Ssd].map(|k| b.has(k));
                    for (k, has) in copies.into_iter().enumerate() {
                        if has {
                            self.tenant_mut(t).evictions[k] += 1;
                        }
                    }
                    if in_tier {
                        out.gone += 1;
                    }
                    if !named.contains(&x) {
                        out.cascaded += 1;
                    }
                    let (d, m) = self.drop_block(x, ChangeKind::Evicted).expect("exists");
                    out.dropped.push(d);
                    out.meta.extend(m);
                }
                continue;
            }
            out.gone += 1;
            self.tenant_mut(tenant).evictions[slot(tier)] += 1;
            let (b, key) = self.blocks.get_mut_with_key(id).expect("exists");
            let dropped = match tier {
                Tier::Dram => Dropped { dram: b.dram().inspect(|_| b.dram = None), ssd: None },
                _ => {
                    // The SSD copy was the persisted one.
                    out.meta.push(MetaOp::Remove { tenant, key: key.into() });
                    Dropped { dram: None, ssd: b.ssd.take().map(|f| (f, size)) }
                }
            };
            let ev = b.event(key, id, EventKind::Removed, tier);
            self.note_change(id, ChangeKind::Evicted, tier);
            out.dropped.push(dropped);
            self.copy_removed(tenant, tier, size);
            self.emit(ev);
        }
        out
    }

    /// A demotion finished: `written` is the SSD locator of the copy, or `None` when there was
    /// no room or the write failed (the block is then simply evicted).
    /// The record's time becomes the write's (`wall_ms`): recovery gives a contested extent to
    /// the newest record.
    pub fn finish_demotion(&mut self, id: u64, written: Option<u64>, wall_ms: u64) -> Demoted<D> {
        self.moving.remove(&id);
        let Some(b) = self.blocks.get_mut(id).filter(|b| b.moving) else {
            return Demoted::Vanished;
        };
        b.moving = false;
        let (b, key) = self.blocks.get_mut_with_key(id).expect("present");
        let Some(file) = written else {
            return match self.drop_block(id, ChangeKind::Evicted) {
                Some((dropped, meta)) => Demoted::Evicted { dropped, meta },
                None => Demoted::Vanished,
            };
        };
        let (tenant, size) = (b.tenant, b.size());
        let dram = b.dram();
        b.dram = None;
        b.ssd = Locator::some(file);
        let removed = b.event(key, id, EventKind::Removed, Tier::Dram);
        let inserted = b.event(key, id, EventKind::Inserted, Tier::Ssd);
        let key = Box::from(key);
        // The new copy first: a router never sees the block absent while it moves.
        self.note_change(id, ChangeKind::Stored, Tier::Ssd);
        self.note_change(id, ChangeKind::Evicted, Tier::Dram);
        let meta = MetaOp::Put { tenant, key, record: self.record_of(id, wall_ms) };
        self.copy_removed(tenant, Tier::Dram, size);
        self.copy_added(tenant, Tier::Ssd, size);
        self.tenant_mut(tenant).demotions += 1;
        // The policies too hear of the SSD copy first: told of the DRAM copy's removal first,
        // a block with no other copy would leave their trees and come back without its
        // children (a demoted parent would then pass for a leaf of the SSD tier).
        self.emit(inserted);
        self.emit(removed);
        Demoted::Moved { dram, meta }
    }

    /// An SSD copy was read back into DRAM: keep the DRAM copy when the block still has that
    /// SSD copy and no DRAM copy. `Err` gives the copy back (nothing changed).
    pub fn install_promoted(&mut self, id: u64, locator: u64, copy: D) -> Result<(), D> {
        let Some((b, key)) =
            self.blocks.get_mut_with_key(id).filter(|(b, _)| b.dram.is_none() && b.ssd.get() == Some(locator))
        else {
            return Err(copy);
        };
        b.dram = Some(copy.keep());
        let (tenant, size) = (b.tenant, b.size());
        let ev = b.event(key, id, EventKind::Inserted, Tier::Dram);
        self.note_change(id, ChangeKind::Stored, Tier::Dram);
        self.copy_added(tenant, Tier::Dram, size);
        self.tenant_mut(tenant).promotions += 1;
        self.emit(ev);
        Ok(())
    }

    /// Drop an SSD copy whose bytes cannot be trusted (read error or checksum mismatch); the
    /// block goes with it unless it still has a DRAM copy. Never served again.
    /// Count a block of `tenant` found corrupt outside the index's sight (its DRAM bytes
    /// failed their checksum on the way out); the caller removes it.
    pub fn note_corrupt(&mut self, tenant: u32) {
        self.tenant_mut(tenant).corrupt += 1;
    }

    pub fn drop_corrupt(&mut self, id: u64, locator: u64) -> Option<(Dropped<D>, Option<MetaOp>)> {
        let b = self.blocks.get_mut(id).filter(|b| b.ssd.get() == Some(locator))?;
        let (tenant, size) = (b.tenant, b.size());
        self.tenant_mut(tenant).corrupt += 1;
        let (b, key) = self.blocks.get_mut_with_key(id).expect("exists");
        if b.dram.is_none() {
            return self.drop_block(id, ChangeKind::Removed);
        }
        b.ssd = Locator::NONE;
        let ev = b.event(key, id, EventKind::Removed, Tier::Ssd);
        let meta = MetaOp::Remove { tenant, key: key.into() };
        self.note_change(id, ChangeKind::Removed, Tier::Ssd);
        self.copy_removed(tenant, Tier::Ssd, size);
        self.emit(ev);
        Some((Dropped { dram: None, ssd: Some((locator, size)) }, Some(meta)))
    }
}
