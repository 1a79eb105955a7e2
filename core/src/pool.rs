//! An index and its policies driven from one thread: the unit tests' and the benchmark's replay
//! pool, taking the same put decision the server's store takes.

use crate::blocks::CopyHandle;
use crate::index::evict::Evicted;
use crate::index::put::{PutPlan, PutSpec};
use crate::index::Index;
use crate::policies::Policies;
use crate::put::{plan_put, PutDecision, PutSides};
use kvpool_policy_sdk::{Admit, NodeSet, Tier};
use std::time::Instant;

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

    /// Plan a put ([`plan_put`]): existing keys, admission, then placement when a placement
    /// policy is loaded (`nodes` describes this node's free space).
    pub fn plan_put(
        &mut self,
        tenant: u32,
        items: &[PutSpec<'_>],
        upsert: bool,
        max_copy: u64,
        nodes: &NodeSet,
    ) -> Vec<PutPlan> {
        self.put_decision(tenant, items, upsert, max_copy, nodes).plans
    }

    /// [`Pool::plan_put`] with what admission answered.
    pub fn put_decision(
        &mut self,
        tenant: u32,
        items: &[PutSpec<'_>],
        upsert: bool,
        max_copy: u64,
        nodes: &NodeSet,
    ) -> PutDecision {
        plan_put(&mut PoolSides { pool: self, nodes }, tenant, items, upsert, max_copy)
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

/// A [`Pool`] as the put decision's two sides, with the free space its caller gave.
struct PoolSides<'a, D: CopyHandle> {
    pool: &'a mut Pool<D>,
    nodes: &'a NodeSet,
}

impl<D: CopyHandle> PutSides for PoolSides<'_, D> {
    type Copy = D;
    fn with_index<R>(&mut self, f: impl FnOnce(&mut Index<D>) -> R) -> R {
        f(&mut self.pool.index)
    }
    fn with_policies<R>(&mut self, f: impl FnOnce(&mut Policies, &dyn Fn() -> NodeSet) -> R) -> R {
        self.pool.flush();
        let nodes = self.nodes;
        f(&mut self.pool.policies, &|| nodes.clone())
    }
}
