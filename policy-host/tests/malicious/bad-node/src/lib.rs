//! Placement on a node that does not exist.
use kvpool_policy_sdk::*;

pub struct BadNode;

impl FromParams for BadNode {
    fn from_params(_: &Params) -> Result<Self, ParamError> {
        Ok(BadNode)
    }
}

impl PlacementPolicy for BadNode {
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        let mut p = Placements::default();
        for _ in 0..blocks.len() * blocks.effective_replicas(nodes.len()) {
            p.push(424242, Tier::Dram);
        }
        p
    }
}

export_placement!(BadNode);
