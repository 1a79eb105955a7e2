//! Room in the tiers: reserving an extent (evicting to make room), eviction itself, demotion of
//! DRAM victims to SSD (or to another node's DRAM first), and the background watermark sweep.

use super::dram::PinnedBlock;
use super::tier::{Medium, SsdExtent};
use super::{wall_ms, Store};
use kvpool_core::Demoted;
use kvpool_policy_sdk::{Admit, Tier};
use std::time::Instant;
use tokio::sync::Notify;
use tracing::warn;

impl Store {
    /// An extent of `len` bytes in tier `m`, evicting from it to make room. With a `deadline`,
    /// eviction goes on while it frees anything, and then a tier whose space comes back on its
    /// own (DRAM: reads in flight end) is waited on until the deadline. Without one, it gives up
    /// after a few rounds of eviction that freed nothing usable.
    pub(super) async fn reserve_in<M: Medium>(
        &self,
        m: &M,
        len: u64,
        deadline: Option<tokio::time::Instant>,
    ) -> Option<M::Extent> {
        let mut rounds = 0;
        loop {
            let notified = m.freed().map(Notify::notified);
            tokio::pin!(notified);
            if let Some(n) = notified.as_mut().as_pin_mut() {
                n.enable();
            }
            if let Some(e) = m.reserve(len) {
                return Some(e);
            }
            // Free at least this block's room (more when fragmentation defeats the first round).
            let need = m.footprint(len).max(m.capacity() / 64);
            rounds += 1;
            if (deadline.is_some() || rounds <= 4) && Box::pin(self.evict(m.tier(), need)).await > 0 {
                if m.persistent() {
                    // Evicted space comes back once the removal of its records is durable.
                    self.meta.barrier().await;
                }
                continue;
            }
            match (notified.as_pin_mut(), deadline) {
                (Some(n), Some(d)) => {
                    if tokio::time::timeout_at(d, n).await.is_err() {
                        return None;
                    }
                }
                _ => return None,
            }
        }
    }

    /// Free at least `bytes` of `tier` (DRAM copies are demoted to SSD when the SSD tier and
    /// the admission policy take them). Returns the number of copies that left the tier.
    pub async fn evict(&self, tier: Tier, bytes: u64) -> usize {
        let now = Instant::now();
        let has_ssd = self.ssd.is_some();
        let (victims, decisions) = {
            let mut pol = self.policies.lock();
            // The index stays locked while the policy chooses: its guard checks the answer
            // against the index, which must hold exactly the blocks the policy was told of (a
            // put committed mid-call would make a truthful policy look like one that hides
            // victims).
            let mut ix = self.ix();
            let ev = ix.take_events();
            pol.feed(&ev);
            let exclude = ix.excluded(now, tier);
            let proposed = pol.eviction.victims(&*ix, tier, bytes, &exclude);
            let victims = ix.valid_victims(&proposed, tier, bytes, &exclude, |c| self.dram.in_use(&c.0));
            if victims.is_empty() && !proposed.is_empty() {
                tracing::debug!(proposed = proposed.len(), "eviction policy proposed only ineligible victims");
            }
            let batch = (tier == Tier::Dram && has_ssd && !victims.is_empty()).then(|| ix.demotion_batch(&victims));
            drop(ix);
            let decisions: Vec<Admit> = batch.map(|b| pol.admission.admit(&b)).unwrap_or_default();
            (victims, decisions)
        };
        if victims.is_empty() {
            return 0;
        }
        let (out, demotions) = {
            let mut ix = self.ix();
            let mut out = ix.evict(&victims, tier, &decisions, now);
            self.meta.enqueue(std::mem::take(&mut out.meta));
            // Pinned while the index still holds them: the demotion reads them unlocked.
            let pins: Vec<(u64, PinnedBlock)> = out.demotions.iter().map(|(id, c)| (*id, self.dram.pin(c.0))).collect();
            (out, pins)
        };
        let evicted = out.gone + out.demotions.len();
        self.metrics.evictions.with_label_values(&[tier.name()]).inc_by(evicted as u64);
        self.metrics.evictions_cascaded.inc_by(out.cascaded as u64);
        self.metrics.evictions_refused.inc_by(out.refused as u64);
        let mut gone = out.gone;
        self.release(out.dropped);
        let demotions = self.offload_first(demotions).await;
        gone += demotions.1;
        for (id, copy) in demotions.0 {
            if self.demote(id, copy).await {
                gone += 1;
            }
        }
        gone
    }

    /// Offer the demotions to another node's free DRAM first (when an offload target is set):
    /// those it took leave this node as evicted; the rest are returned for SSD, with the count
    /// of those that left.
    pub(super) async fn offload_first(&self, demotions: Vec<(u64, PinnedBlock)>) -> (Vec<(u64, PinnedBlock)>, usize) {
        let Some(o) = self.offload.get().filter(|_| !demotions.is_empty()) else { return (demotions, 0) };
        let described: Vec<Option<kvpool_core::Change>> = {
            let ix = self.ix();
            demotions.iter().map(|(id, _)| ix.describe(*id)).collect()
        };
        // The pinned copies are read in place while the offer runs.
        let offer: Vec<(kvpool_core::Change, &[u8])> =
            demotions.iter().zip(&described).filter_map(|((_, copy), d)| Some((d.clone()?, copy.bytes()))).collect();
        let taken = o.offload(offer).await;
        let mut taken = taken.into_iter();
        let (mut rest, mut moved) = (Vec::new(), 0);
        for ((id, copy), d) in demotions.into_iter().zip(described) {
            let took = d.is_some() && taken.next().unwrap_or(false);
            self.metrics.cluster_offloads.with_label_values(&[if took { "moved" } else { "kept" }]).inc();
            if !took {
                rest.push((id, copy));
                continue;
            }
            drop(copy);
            let mut ix = self.ix();
            match ix.finish_demotion(id, None, wall_ms()) {
                Demoted::Evicted { dropped, meta } => {
                    self.meta.enqueue(meta.into_iter().collect());
                    drop(ix);
                    self.release([dropped]);
                }
                Demoted::Moved { dram, meta } => {
                    // Not reached with no SSD extent written; handled like the SSD path.
                    self.meta.enqueue(vec![meta]);
                    drop(ix);
                    if let Some(c) = dram {
                        self.dram.release_ref(c.0);
                    }
                }
                Demoted::Vanished => {}
            }
            moved += 1;
        }
        (rest, moved)
    }

    /// Copy a DRAM victim to SSD, then drop its DRAM copy. When SSD has no room the block is
    /// simply evicted; without an SSD tier (a victim no other node took) it is evicted under the
    /// usual rules ([`Index::evict_untaken`]). Returns whether the DRAM copy left.
    pub(super) async fn demote(&self, id: u64, copy: PinnedBlock) -> bool {
        let size = copy.len();
        let Some(ssd) = self.ssd.clone() else {
            // No SSD tier, and no other node took it: evicted under the usual rules, as they
            // stand now (a lease taken while it was offered keeps it).
            drop(copy);
            let out = {
                let mut ix = self.ix();
                let mut out = ix.evict_untaken(id, Instant::now());
                self.meta.enqueue(std::mem::take(&mut out.meta));
                out
            };
            self.metrics.evictions_cascaded.inc_by(out.cascaded as u64);
            self.metrics.evictions_refused.inc_by(out.refused as u64);
            self.release(out.dropped);
            return out.gone > 0;
        };
        let written = match self.reserve_in(&*ssd, size, None).await {
            Some(extent) => {
                let (s2, data) = (ssd.clone(), copy.clone());
                let write = move || {
                    let mut extent = extent;
                    Medium::write(&*s2, &mut extent, 0, data.bytes())
                };
                match tokio::task::spawn_blocking(write).await {
                    Ok(Ok(())) => Some(extent.offset),
                    r => {
                        warn!(?r, "demotion write failed; block evicted instead");
                        ssd.release(extent);
                        None
                    }
                }
            }
            None => None,
        };
        drop(copy);
        let mut ix = self.ix();
        match ix.finish_demotion(id, written, wall_ms()) {
            Demoted::Moved { dram, meta } => {
                self.meta.enqueue(vec![meta]);
                drop(ix);
                if let Some(c) = dram {
                    self.dram.release_ref(c.0);
                }
                self.metrics.demotions.inc();
            }
            Demoted::Evicted { dropped, meta } => {
                self.meta.enqueue(meta.into_iter().collect());
                drop(ix);
                self.release([dropped]);
            }
            Demoted::Vanished => {
                drop(ix);
                if let Some(offset) = written {
                    ssd.release(SsdExtent { offset, len: size });
                }
            }
        }
        true
    }

    /// One round of background work: soft-pin expiry, event flush, watermarks.
    pub async fn maintain(&self) {
        self.ix().expire_soft_pins(wall_ms());
        // Busy (warming after a restart, or a long call): the next round feeds the events, and
        // this task does not tie up a runtime thread waiting.
        if let Some(mut pol) = self.policies.try_lock() {
            self.feed(&mut pol);
        }
        // Above its high watermark, a tier is brought down to its low one, fastest tier first;
        // each is measured when its turn comes (demotions from the one before fill it).
        let tiers = self.spaces().len();
        for i in 0..tiers {
            let (tier, excess) = {
                let (s, high, low) = self.spaces()[i];
                if s.used() as f64 <= high * s.capacity() as f64 {
                    continue;
                }
                (s.tier(), s.used().saturating_sub((low * s.capacity() as f64) as u64))
            };
            self.evict(tier, excess).await;
        }
        self.update_gauges();
    }
}
