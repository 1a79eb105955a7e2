//! Reads: locating a get's blocks under the lock, reading SSD copies (verified, and promoted to
//! DRAM when there is room) outside it, lookups and existence checks.

use super::dram::{DramBlock, DramTier, PinnedBlock};
use super::tier::{Medium, Space, SsdExtent};
use super::{checksum, wall_us, DramCopy, Store};
use kvpool_core::Located;
use kvpool_policy_sdk::Tier;
use std::sync::Arc;
use std::time::Instant;
use tracing::warn;

/// A located block for a get, resolved under the lock and read outside it.
pub enum GetPlan {
    Dram { block: PinnedBlock, checksum: u64 },
    Ssd { id: u64, file: u64, size: u64, checksum: u64 },
    Missing,
}

/// Why an SSD copy could not be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// This node has no SSD tier (any more): the block is not here.
    #[error("no SSD tier")]
    NoSsd,
    /// The copy could not be read or failed its checksum; it was dropped, never served.
    #[error("the SSD copy could not be read or failed its checksum")]
    Corrupt,
}

/// Bytes of one get item, ready to send.
pub enum Served {
    /// Served from a DRAM range (also after a promotion; the tier says where it came from).
    Dram(PinnedBlock, u64, Tier),
    Owned(Vec<u8>, u64, Tier),
}

/// A DRAM block as bytes that may be sent without copying: it stays allocated while they live.
struct BlockBytes(PinnedBlock);

impl AsRef<[u8]> for BlockBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl Served {
    /// The value as an owned, cheaply cloned buffer (no copy for DRAM blocks).
    pub fn into_bytes(self) -> bytes::Bytes {
        match self {
            Served::Dram(b, _, _) => bytes::Bytes::from_owner(BlockBytes(b)),
            Served::Owned(v, _, _) => bytes::Bytes::from(v),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Served::Dram(b, _, _) => b.bytes(),
            Served::Owned(v, _, _) => v,
        }
    }
    pub fn checksum(&self) -> u64 {
        match self {
            Served::Dram(_, c, _) | Served::Owned(_, c, _) => *c,
        }
    }
    pub fn tier(&self) -> Tier {
        match self {
            Served::Dram(_, _, t) | Served::Owned(_, _, t) => *t,
        }
    }
}

impl Store {
    /// Locate and lease the keys of a get; hits update recency.
    pub fn plan_get(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<GetPlan> {
        let lease = Instant::now() + self.cfg.lease_ttl;
        let mut ix = self.ix();
        let located = ix.plan_get(tenant, keys, lease, wall_us());
        // DRAM hits are pinned while the index still holds them: they are read unlocked.
        let located: Vec<(Located<DramCopy>, Option<PinnedBlock>)> = located
            .into_iter()
            .map(|l| {
                let pin = match &l {
                    Located::Dram { copy, .. } => Some(self.dram.pin(copy.0)),
                    _ => None,
                };
                (l, pin)
            })
            .collect();
        drop(ix);
        let m = &self.metrics;
        located
            .into_iter()
            .map(|(l, pin)| match (l, pin) {
                (Located::Missing, _) => {
                    m.misses.with_label_values(&["dram"]).inc();
                    if self.ssd.is_some() {
                        m.misses.with_label_values(&["ssd"]).inc();
                    }
                    GetPlan::Missing
                }
                (Located::Dram { checksum, .. }, Some(block)) => {
                    m.hits.with_label_values(&["dram"]).inc();
                    GetPlan::Dram { block, checksum }
                }
                (Located::Dram { .. }, None) => unreachable!("every DRAM hit was pinned"),
                (Located::Ssd { id, locator, size, checksum }, _) => {
                    m.misses.with_label_values(&["dram"]).inc();
                    m.hits.with_label_values(&["ssd"]).inc();
                    GetPlan::Ssd { id, file: locator, size, checksum }
                }
            })
            .collect()
    }

    /// Read an SSD copy, verify it, and promote it to DRAM when there is room.
    /// [`ReadError::Corrupt`] when the checksum fails (the copy is dropped, never served).
    pub async fn read_ssd(self: &Arc<Self>, id: u64, file: u64, size: u64, sum: u64) -> Result<Served, ReadError> {
        let Some(ssd) = self.ssd.clone() else { return Err(ReadError::NoSsd) };
        let promote = self.cfg.promote_on_hit
            && (self.dram.used() + DramTier::footprint(size)) as f64
                <= self.cfg.dram_high * self.dram.capacity() as f64;
        let target = if promote { self.dram.allocate(size) } else { None };
        let extent = SsdExtent { offset: file, len: size };
        let read = tokio::task::spawn_blocking(move || match target {
            Some(mut blk) => Medium::read_into(&*ssd, &extent, 0, blk.bytes_mut()).map(|()| (Some(blk), Vec::new())),
            None => Medium::read(&*ssd, &extent, size).map(|v| (None, v)),
        })
        .await;
        let (blk, vec) = match read {
            Ok(Ok(x)) => x,
            other => {
                warn!(id, file, ?other, "ssd read failed; block dropped");
                self.drop_corrupt(id, file);
                return Err(ReadError::Corrupt);
            }
        };
        let actual = match &blk {
            Some(b) => checksum(b.bytes()),
            None => checksum(&vec),
        };
        if actual != sum {
            warn!(id, file, "checksum mismatch on ssd read; block dropped, never served");
            self.metrics.corrupt.inc();
            self.drop_corrupt(id, file);
            return Err(ReadError::Corrupt);
        }
        let Some(blk) = blk else {
            if self.cfg.promote_on_hit {
                // DRAM is full: promote off the request path, making room by eviction.
                let (store, data) = (self.clone(), vec.clone());
                tokio::spawn(async move { store.promote(id, file, data).await });
            }
            return Ok(Served::Owned(vec, sum, Tier::Ssd));
        };
        Ok(Served::Dram(self.install_promoted(id, file, blk), sum, Tier::Ssd))
    }

    pub(super) async fn promote(&self, id: u64, file: u64, data: Vec<u8>) {
        let len = data.len() as u64;
        // Off the request path: room for this block only, and never a wait for it.
        let mut blk = match self.dram.reserve(len) {
            Some(b) => b,
            None => {
                self.evict(Tier::Dram, self.dram.footprint(len)).await;
                let Some(b) = self.dram.reserve(len) else { return };
                b
            }
        };
        if Medium::write(&self.dram, &mut blk, 0, &data).is_err() {
            return;
        }
        self.install_promoted(id, file, blk);
    }

    /// Give a promoted copy to the index (when the block still wants it), pinned for the read
    /// that promoted it; a copy the index did not take is freed when that pin drops.
    pub(super) fn install_promoted(&self, id: u64, file: u64, blk: DramBlock) -> PinnedBlock {
        let r = blk.commit();
        let mut ix = self.ix();
        let pin = self.dram.pin(r);
        if ix.install_promoted(id, file, DramCopy(r)).is_ok() {
            self.metrics.promotions.inc();
        } else {
            drop(ix);
            self.dram.release_ref(r);
        }
        pin
    }

    pub(super) fn drop_corrupt(&self, id: u64, file: u64) {
        let mut ix = self.ix();
        if let Some((dropped, meta)) = ix.drop_corrupt(id, file) {
            self.meta.enqueue(meta.into_iter().collect());
            drop(ix);
            self.release([dropped]);
        }
    }

    /// Number of leading chain blocks resident in any tier. No lease, no recency update.
    pub fn lookup(&self, tenant: u32, chain: &[Vec<u8>]) -> u32 {
        let n = self.ix().lookup(tenant, chain, wall_us());
        self.metrics.lookup_blocks.with_label_values(&["hit"]).inc_by(n as u64);
        self.metrics.lookup_blocks.with_label_values(&["miss"]).inc_by((chain.len() - n) as u64);
        n as u32
    }

    /// [`Store::lookup`], holding the resident leading blocks until [`Store::unhold`] of the
    /// returned ids.
    pub fn lookup_hold(&self, tenant: u32, chain: &[Vec<u8>]) -> (u32, Vec<u64>) {
        let (n, ids) = self.ix().lookup_hold(tenant, chain, wall_us());
        self.metrics.lookup_blocks.with_label_values(&["hit"]).inc_by(n as u64);
        self.metrics.lookup_blocks.with_label_values(&["miss"]).inc_by((chain.len() - n) as u64);
        (n as u32, ids)
    }

    /// Let go of the hold [`Store::lookup_hold`] took on `ids`.
    pub fn unhold(&self, ids: &[u64]) {
        if !ids.is_empty() {
            self.ix().unhold(ids);
        }
    }

    /// Number of blocks held by lookups now.
    pub fn held(&self) -> usize {
        self.ix().held()
    }

    pub fn exists(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<bool> {
        self.ix().exists(tenant, keys)
    }
}
