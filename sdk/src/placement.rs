//! Placement: blocks to place, the live nodes, and the answer.

use crate::{Events, Tier};

/// "No node" in node-id columns (e.g. a root block's `parent_node`).
pub const NO_NODE: u64 = u64::MAX;

/// Blocks to place, as columns, plus how many copies each needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceBatch {
    pub id: Vec<u64>,
    pub size: Vec<u64>,
    pub tokens: Vec<u32>,
    pub parent: Vec<u64>,
    /// Node that holds the parent block ([`NO_NODE`] for a root or an absent parent).
    pub parent_node: Vec<u64>,
    /// Preferred tier code per block.
    pub tier: Vec<u8>,
    /// Copies per block, each on a distinct node; at least 1.
    pub replicas: u32,
    /// The storage node on the host of the client that puts these blocks (an engine's own
    /// node), or [`NO_NODE`] when it has none or the host cannot tell.
    pub client_node: u64,
}

impl Default for PlaceBatch {
    fn default() -> PlaceBatch {
        PlaceBatch {
            id: Vec::new(),
            size: Vec::new(),
            tokens: Vec::new(),
            parent: Vec::new(),
            parent_node: Vec::new(),
            tier: Vec::new(),
            replicas: 1,
            client_node: NO_NODE,
        }
    }
}

/// One block to place (a row of [`PlaceBatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceRequest {
    pub id: u64,
    pub size: u64,
    pub tokens: u32,
    pub parent: u64,
    pub parent_node: u64,
    pub tier: Tier,
}

impl PlaceBatch {
    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn push(&mut self, r: PlaceRequest) {
        self.id.push(r.id);
        self.size.push(r.size);
        self.tokens.push(r.tokens);
        self.parent.push(r.parent);
        self.parent_node.push(r.parent_node);
        self.tier.push(r.tier as u8);
    }

    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        [self.size.len(), self.tokens.len(), self.parent.len(), self.parent_node.len(), self.tier.len()]
            .iter()
            .all(|&l| l == n)
    }

    pub fn iter(&self) -> impl Iterator<Item = PlaceRequest> + '_ {
        let n = if self.is_well_formed() { self.id.len() } else { 0 };
        (0..n).map(move |i| PlaceRequest {
            id: self.id[i],
            size: self.size[i],
            tokens: self.tokens[i],
            parent: self.parent[i],
            parent_node: self.parent_node[i],
            tier: Tier::from_u8(self.tier[i]).unwrap_or(Tier::Dram),
        })
    }

    /// Copies per block a policy must return given `nodes` live nodes: `min(replicas, nodes)`,
    /// at least 1 (0 only when there is no node at all).
    pub fn effective_replicas(&self, nodes: usize) -> usize {
        (self.replicas.max(1) as usize).min(nodes)
    }
}

impl FromIterator<PlaceRequest> for PlaceBatch {
    fn from_iter<I: IntoIterator<Item = PlaceRequest>>(iter: I) -> PlaceBatch {
        let mut b = PlaceBatch::default();
        for r in iter {
            b.push(r);
        }
        b
    }
}

/// Live storage nodes as columns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSet {
    pub id: Vec<u64>,
    /// Free bytes per tier, indexed by `Tier as usize`.
    pub free: [Vec<u64>; 3],
    /// Relative load; lower is less busy.
    pub load: Vec<u32>,
}

impl NodeSet {
    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn push(&mut self, id: u64, free: [u64; 3], load: u32) {
        self.id.push(id);
        for (col, f) in self.free.iter_mut().zip(free) {
            col.push(f);
        }
        self.load.push(load);
    }

    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        self.free.iter().all(|c| c.len() == n) && self.load.len() == n
    }

    /// Free bytes of node at index `i` in `tier` (0 for a malformed set).
    pub fn free_at(&self, i: usize, tier: Tier) -> u64 {
        self.free[tier as usize].get(i).copied().unwrap_or(0)
    }

    /// Tier to use on node `i` for a block of `size` preferring `want`: `want` when it has room,
    /// else the next slower tier with room, else `want` (the host evicts to make room).
    pub fn fit_tier(&self, i: usize, want: Tier, size: u64) -> Tier {
        Tier::ALL.iter().copied().filter(|&t| t >= want).find(|&t| self.free_at(i, t) >= size).unwrap_or(want)
    }
}

/// Placement answer: block `i` owns entries `[i*r, (i+1)*r)` of both columns, where
/// `r = PlaceBatch::effective_replicas(nodes.len())`; the nodes of one block are distinct.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placements {
    pub node: Vec<u64>,
    pub tier: Vec<u8>,
}

impl Placements {
    pub fn push(&mut self, node: u64, tier: Tier) {
        self.node.push(node);
        self.tier.push(tier as u8);
    }
}

/// Placement: choose the storage node (and tier) of new blocks and their replicas.
pub trait PlacementPolicy {
    /// Apply a batch of events (most placement policies need none).
    fn on_events(&mut self, _events: &Events) {}
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NO_PARENT;

    #[test]
    fn placement_columns() {
        let mut nodes = NodeSet::default();
        nodes.push(9, [0, 50, 1000], 1);
        nodes.push(8, [0, 500, 1000], 2);
        assert!(nodes.is_well_formed());
        assert_eq!(nodes.fit_tier(0, Tier::Dram, 100), Tier::Ssd);
        assert_eq!(nodes.fit_tier(1, Tier::Dram, 100), Tier::Dram);
        assert_eq!(nodes.fit_tier(0, Tier::Dram, 5000), Tier::Dram);
        let mut b: PlaceBatch =
            [PlaceRequest { id: 1, size: 1, tokens: 1, parent: NO_PARENT, parent_node: NO_NODE, tier: Tier::Dram }]
                .into_iter()
                .collect();
        assert_eq!(b.effective_replicas(2), 1);
        b.replicas = 3;
        assert_eq!(b.effective_replicas(2), 2);
        b.replicas = 0;
        assert_eq!(b.effective_replicas(2), 1);
        assert_eq!(b.effective_replicas(0), 0);
    }
}
