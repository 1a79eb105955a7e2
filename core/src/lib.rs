//! kvpool's core with no I/O: the block index of a pool node (keys, prefix chains, leases, pins,
//! copies per tier, per-tenant counters) and its policy slots.
//!
//! Nothing here touches a socket, a file, sled or the clock: time is passed in, copies are
//! opaque handles, and whatever must happen outside (free a copy, delete a file, write a sled
//! record) comes back as data ([`Dropped`], [`MetaOp`]). The index is what policies are shown
//! through the SDK's [`IndexView`](kvpool_policy_sdk::IndexView), the one view the core's
//! eviction slot and the Wasm host's guard share. The server wraps an [`Index`] and
//! [`Policies`] in two locks, so that reads never wait on a policy call; [`Pool`] drives both
//! in one thread, the way the benchmark's replay and the unit tests do.

mod blocks;
pub use blocks::{BlockRecord, CopyHandle, MAX_KEY_LEN};
mod changes;
mod index;
mod policies;
#[cfg(test)]
mod tests;

pub use changes::{Change, ChangeBatch, ChangeKind, ChangeLog, ChangeWindow};
pub use index::{
    Commit, Demoted, Evicted, Granularity, Index, Located, Pending, PutPlan, PutStatus, Recovered, RemoveStatus,
    TenantCounters, DEFAULT_MISS_MEMORY,
};
pub use policies::{Admitter, Evictor, Native, NewSlot, Placer, Policies};

use kvpool_policy_sdk::{Admit, AdmitBatch, NodeSet, PlaceBatch, Placements, Tier, NO_NODE, NO_PARENT};
use std::time::Instant;

/// How a put asks to be pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinRequest {
    None,
    /// `ttl_ms` 0 means the pool's default.
    Soft {
        ttl_ms: u64,
    },
    Hard,
}

/// One item of a put, as the index sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutSpec<'a> {
    pub key: &'a [u8],
    pub size: u64,
    /// Key of the previous block of the prefix chain.
    pub parent: Option<&'a [u8]>,
    pub tokens: u32,
    pub seq_tokens: u64,
    pub pin: PinRequest,
}

/// Copies that left the index: the caller frees the DRAM copy (by dropping it) and releases and
/// deletes the SSD copy (locator, size), outside any lock.
#[derive(Debug)]
pub struct Dropped<D> {
    pub dram: Option<D>,
    pub ssd: Option<(u64, u64)>,
}

/// A change to the persisted metadata, to be applied in the order the index produced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaOp {
    Put { tenant: u32, key: Box<[u8]>, record: BlockRecord },
    Remove { tenant: u32, key: Box<[u8]> },
}

/// The placement question for a put's admitted blocks on a single node (node 0).
pub fn placement_batch(batch: &AdmitBatch) -> PlaceBatch {
    let mut pb = PlaceBatch::default();
    for r in batch.iter() {
        pb.id.push(r.id);
        pb.size.push(r.size);
        pb.tokens.push(r.tokens);
        pb.parent.push(r.parent);
        pb.parent_node.push(if r.parent == NO_PARENT { NO_NODE } else { 0 });
        pb.tier.push(Tier::Dram as u8);
    }
    pb
}

/// Tiers chosen by a placement answer, one per block of the batch (DRAM where it said nothing
/// usable).
pub fn placed_tiers(p: &Placements, n: usize) -> Vec<Tier> {
    (0..n).map(|i| p.tier.get(i).and_then(|&t| Tier::from_u8(t)).unwrap_or(Tier::Dram)).collect()
}

/// An index and its policies driven from one thread: the same decisions the server takes, in
/// the same order, with no locks and no I/O.
pub struct Pool<D: CopyHandle> {
    pub index: Index<D>,
    pub policies: Policies,
}

impl<D: CopyHandle> Pool<D> {
    pub fn new(index: Index<D>, policies: Policies) -> Pool<D> {
        Pool { index, policies }
    }

    /// Hand the index's pending events to the policies.
    pub fn flush(&mut self) {
        let ev = self.index.take_events();
        self.policies.feed(&ev);
    }

    /// Plan a put: existing keys, admission, then placement when a placement policy is loaded
    /// (`nodes` describes this node's free space).
    pub fn plan_put(
        &mut self,
        tenant: u32,
        items: &[PutSpec<'_>],
        upsert: bool,
        max_copy: u64,
        nodes: &NodeSet,
    ) -> Vec<PutPlan> {
        let (pending, batch) = self.index.plan_put(tenant, items, upsert, max_copy);
        if batch.is_empty() {
            return self.index.decide_put(tenant, &pending, &batch, &[], None);
        }
        self.flush();
        let decisions = self.policies.admission.admit(&batch);
        let placed = self
            .policies
            .placement
            .as_mut()
            .map(|p| placed_tiers(&p.place(&placement_batch(&batch), nodes), batch.len()));
        self.index.decide_put(tenant, &pending, &batch, &decisions, placed.as_deref())
    }

    /// Choose victims in `tier` for `bytes`, validated against the index.
    pub fn select_victims(&mut self, tier: Tier, bytes: u64, now: Instant) -> Vec<u64> {
        self.flush();
        let exclude = self.index.excluded(now, tier);
        let proposed = self.policies.eviction.victims(&self.index, tier, bytes, &exclude);
        self.index.valid_victims(&proposed, tier, bytes, &exclude, D::in_use)
    }

    /// Evict at least `bytes` from `tier` (DRAM victims go to SSD when admission takes them).
    pub fn evict(&mut self, tier: Tier, bytes: u64, has_ssd: bool, now: Instant) -> Evicted<D> {
        let victims = self.select_victims(tier, bytes, now);
        let decisions: Vec<Admit> = if tier == Tier::Dram && has_ssd {
            self.policies.admission.admit(&self.index.demotion_batch(&victims))
        } else {
            Vec::new()
        };
        self.index.evict(&victims, tier, &decisions, now)
    }
}
