//! The put decision, written once: plan (existing keys, sizes, chain positions), admit, place,
//! decide. The server's store and [`Pool`](crate::Pool) (so the benchmark's replay) both take it
//! through [`plan_put`]; each tells it through [`PutSides`] where its index and policies are.

use crate::blocks::CopyHandle;
use crate::index::put::{PutPlan, PutSpec};
use crate::index::Index;
use crate::policies::Policies;
use kvpool_policy_sdk::{Admit, AdmitBatch, NodeSet, PlaceBatch, Placements, Tier, NO_NODE, NO_PARENT};

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

/// Where a put decision finds the index and the policies. The server keeps them behind two
/// locks and never runs a policy with the index locked; [`Pool`](crate::Pool) holds both in
/// one thread.
pub trait PutSides {
    type Copy: CopyHandle;
    /// Run `f` on the index (the server locks it for `f` alone).
    fn with_index<R>(&mut self, f: impl FnOnce(&mut Index<Self::Copy>) -> R) -> R;
    /// Run `f` on the policies once they have every event the index has pending; `nodes` reads
    /// this node's free space, for a placement policy (asked only when one is loaded).
    fn with_policies<R>(&mut self, f: impl FnOnce(&mut Policies, &dyn Fn() -> NodeSet) -> R) -> R;
}

/// A put decided: one plan per item, and what admission answered (for counters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutDecision {
    pub plans: Vec<PutPlan>,
    /// Rows asked of admission: the items not decided before it (new keys that can fit).
    pub asked: usize,
    /// Answers the admission policy gave: missing rows are admitted to DRAM, extra ones ignored.
    pub answered: usize,
    /// Rows the policy itself rejected (the chain rule then rejects the rows below them too).
    pub policy_rejected: usize,
}

/// Decide every item of a put before any byte is read: existing keys and blocks that can never
/// fit (`max_copy` bytes, the DRAM tier's capacity), then admission and, when a placement policy
/// is loaded, placement of the others, then the chain rule and the tier of each. Policies are
/// asked only when some item got that far (and fed every pending event first).
pub fn plan_put<S: PutSides>(
    sides: &mut S,
    tenant: u32,
    items: &[PutSpec<'_>],
    upsert: bool,
    max_copy: u64,
) -> PutDecision {
    let (pending, batch) = sides.with_index(|ix| ix.plan_put(tenant, items, upsert, max_copy));
    let (decisions, placed) = if batch.is_empty() {
        (Vec::new(), None)
    } else {
        // The rows asked hold their ids from here: a policy that panics (a native one's bug;
        // guarded Wasm modules trap instead) must not take them along.
        let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sides.with_policies(|pol, nodes| {
                let decisions = pol.admission.admit(&batch);
                let placed = pol
                    .placement
                    .as_mut()
                    .map(|p| placed_tiers(&p.place(&placement_batch(&batch), &nodes()), batch.len()));
                (decisions, placed)
            })
        }));
        match asked {
            Ok(answers) => answers,
            Err(panic) => {
                sides.with_index(|ix| ix.release_pending(&pending));
                std::panic::resume_unwind(panic)
            }
        }
    };
    let plans = sides.with_index(|ix| ix.decide_put(tenant, &pending, &batch, &decisions, placed.as_deref()));
    let policy_rejected = decisions.iter().take(batch.len()).filter(|d| **d == Admit::Reject).count();
    PutDecision { plans, asked: batch.len(), answered: decisions.len(), policy_rejected }
}
