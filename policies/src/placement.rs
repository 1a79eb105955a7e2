//! Placement policies: consistent hash, least loaded, prefix affinity. Each returns
//! `effective_replicas` distinct nodes per block (see [`Placements`]); the tier on a node is the
//! preferred one when it has room, else the next slower tier with room ([`NodeSet::fit_tier`]).

use kvpool_policy_sdk::{
    FromParams, NodeSet, ParamError, Params, PlaceBatch, PlacementPolicy, Placements, Tier, NO_NODE,
};
use std::collections::HashMap;

/// splitmix64 finaliser: a fixed, well-mixed hash so placements are the same on every host.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Consistent-hash ring over node ids with `vnodes` points per node: adding or removing a node
/// moves only the blocks that hashed next to its points. Replicas are the next distinct nodes
/// clockwise.
#[derive(Debug, Clone)]
pub struct ConsistentHash {
    vnodes: u32,
    ring_nodes: Vec<u64>,
    /// (point, index into the current `NodeSet`), sorted by point.
    ring: Vec<(u64, usize)>,
}

impl ConsistentHash {
    pub fn new(vnodes: u32) -> ConsistentHash {
        ConsistentHash { vnodes: vnodes.max(1), ring_nodes: Vec::new(), ring: Vec::new() }
    }

    fn ensure_ring(&mut self, nodes: &NodeSet) {
        if self.ring_nodes == nodes.id {
            return;
        }
        self.ring_nodes = nodes.id.clone();
        self.ring.clear();
        for (i, &n) in nodes.id.iter().enumerate() {
            for v in 0..self.vnodes {
                self.ring.push((mix(mix(n) ^ u64::from(v)), i));
            }
        }
        self.ring.sort_unstable();
    }

    /// Indices of `r` distinct nodes for `key`, clockwise from its point.
    fn pick(&self, key: u64, r: usize, out: &mut Vec<usize>) {
        out.clear();
        if self.ring.is_empty() {
            return;
        }
        let h = mix(key);
        let start = self.ring.partition_point(|&(p, _)| p < h);
        for k in 0..self.ring.len() {
            let (_, i) = self.ring[(start + k) % self.ring.len()];
            if !out.contains(&i) {
                out.push(i);
                if out.len() == r {
                    break;
                }
            }
        }
    }
}

impl Default for ConsistentHash {
    fn default() -> ConsistentHash {
        ConsistentHash::new(64)
    }
}

impl FromParams for ConsistentHash {
    /// `vnodes` (default 64, at most 4096).
    fn from_params(p: &Params) -> Result<ConsistentHash, ParamError> {
        Ok(ConsistentHash::new(p.get_u64("vnodes", 64)?.clamp(1, 4096) as u32))
    }
}

impl PlacementPolicy for ConsistentHash {
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        let mut out = Placements::default();
        if !nodes.is_well_formed() {
            return out;
        }
        self.ensure_ring(nodes);
        let r = blocks.effective_replicas(nodes.len());
        let mut picked = Vec::with_capacity(r);
        for b in blocks.iter() {
            self.pick(b.id, r, &mut picked);
            for &i in &picked {
                out.push(nodes.id[i], nodes.fit_tier(i, b.tier, b.size));
            }
        }
        out
    }
}

/// Working copy of node state for one batch: what this batch already put where counts.
struct Loads {
    load: Vec<u64>,
    free: [Vec<u64>; 3],
}

impl Loads {
    fn new(nodes: &NodeSet) -> Loads {
        Loads { load: nodes.load.iter().map(|&l| u64::from(l)).collect(), free: nodes.free.clone() }
    }

    /// Less loaded first, then more free space in `tier`, then lower node id.
    fn better(&self, nodes: &NodeSet, a: usize, b: usize, tier: Tier) -> bool {
        let t = tier as usize;
        (self.load[a], std::cmp::Reverse(self.free[t][a]), nodes.id[a])
            < (self.load[b], std::cmp::Reverse(self.free[t][b]), nodes.id[b])
    }

    /// Best node not in `taken`.
    fn best(&self, nodes: &NodeSet, tier: Tier, taken: &[usize]) -> Option<usize> {
        (0..nodes.len())
            .filter(|i| !taken.contains(i))
            .reduce(|a, b| if self.better(nodes, b, a, tier) { b } else { a })
    }

    /// Record a copy on node `i` and return its tier.
    fn charge(&mut self, i: usize, want: Tier, size: u64) -> Tier {
        let t =
            Tier::ALL.into_iter().filter(|&t| t >= want).find(|&t| self.free[t as usize][i] >= size).unwrap_or(want);
        self.free[t as usize][i] = self.free[t as usize][i].saturating_sub(size);
        self.load[i] += 1;
        t
    }
}

/// Each copy goes to the least loaded node (ties: most free space in the tier, lowest id);
/// every copy placed in a batch adds one to its node's load, so a batch spreads out.
#[derive(Debug, Clone, Default)]
pub struct LeastLoaded;

impl FromParams for LeastLoaded {
    fn from_params(_: &Params) -> Result<LeastLoaded, ParamError> {
        Ok(LeastLoaded)
    }
}

impl PlacementPolicy for LeastLoaded {
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        let mut out = Placements::default();
        if !nodes.is_well_formed() {
            return out;
        }
        let r = blocks.effective_replicas(nodes.len());
        let mut loads = Loads::new(nodes);
        let mut taken = Vec::with_capacity(r);
        for b in blocks.iter() {
            taken.clear();
            while taken.len() < r {
                let Some(i) = loads.best(nodes, b.tier, &taken) else { break };
                taken.push(i);
                let t = loads.charge(i, b.tier, b.size);
                out.push(nodes.id[i], t);
            }
        }
        out
    }
}

/// Keep an engine's blocks beside it and a prefix chain together: a block goes to the client's
/// own node (`client_node`) while that node has room for it in the preferred tier, else to its
/// parent's node (the host's `parent_node`, or where this batch just put the parent) unless that
/// node has no room for it in the preferred or a slower tier; a node whose load exceeds
/// `spill_load` is passed over for both. Chain roots and spilled blocks go to the least loaded
/// node. Further replicas go to the least loaded other nodes.
#[derive(Debug, Clone)]
pub struct PrefixAffinity {
    pub spill_load: u32,
}

impl Default for PrefixAffinity {
    fn default() -> PrefixAffinity {
        PrefixAffinity { spill_load: u32::MAX }
    }
}

impl FromParams for PrefixAffinity {
    /// `spill_load` (default unlimited).
    fn from_params(p: &Params) -> Result<PrefixAffinity, ParamError> {
        Ok(PrefixAffinity { spill_load: p.get_u64("spill_load", u64::from(u32::MAX))?.min(u64::from(u32::MAX)) as u32 })
    }
}

impl PlacementPolicy for PrefixAffinity {
    fn place(&mut self, blocks: &PlaceBatch, nodes: &NodeSet) -> Placements {
        let mut out = Placements::default();
        if !nodes.is_well_formed() {
            return out;
        }
        let r = blocks.effective_replicas(nodes.len());
        let index: HashMap<u64, usize> = nodes.id.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut loads = Loads::new(nodes);
        // Primary node chosen in this batch, for children that follow their parent in the batch.
        let mut primary: HashMap<u64, usize> = HashMap::new();
        let mut taken = Vec::with_capacity(r);
        let client = if blocks.client_node != NO_NODE { index.get(&blocks.client_node).copied() } else { None };
        for b in blocks.iter() {
            taken.clear();
            if r == 0 {
                continue;
            }
            let near = client.filter(|&i| loads.free[b.tier as usize][i] >= b.size && nodes.load[i] <= self.spill_load);
            let parent_node = if b.parent_node != NO_NODE { index.get(&b.parent_node).copied() } else { None };
            let affine = near.or_else(|| {
                parent_node.or_else(|| primary.get(&b.parent).copied()).filter(|&i| {
                    let fits =
                        Tier::ALL.into_iter().filter(|&t| t >= b.tier).any(|t| loads.free[t as usize][i] >= b.size);
                    fits && nodes.load[i] <= self.spill_load
                })
            });
            let first = match affine {
                Some(i) => i,
                None => match loads.best(nodes, b.tier, &taken) {
                    Some(i) => i,
                    None => continue,
                },
            };
            primary.insert(b.id, first);
            taken.push(first);
            let t = loads.charge(first, b.tier, b.size);
            out.push(nodes.id[first], t);
            while taken.len() < r {
                let Some(i) = loads.best(nodes, b.tier, &taken) else { break };
                taken.push(i);
                let t = loads.charge(i, b.tier, b.size);
                out.push(nodes.id[i], t);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{PlaceRequest, NO_PARENT};

    fn nodes(spec: &[(u64, u64, u32)]) -> NodeSet {
        let mut n = NodeSet::default();
        for &(id, dram, load) in spec {
            n.push(id, [0, dram, 1000], load);
        }
        n
    }

    fn req(id: u64, parent: u64, parent_node: u64) -> PlaceRequest {
        PlaceRequest { id, size: 10, tokens: 16, parent, parent_node, tier: Tier::Dram }
    }

    #[test]
    fn consistent_hash_is_stable_and_distinct() {
        let n3 = nodes(&[(1, 100, 0), (2, 100, 0), (3, 100, 0)]);
        let mut b: PlaceBatch = (0..200).map(|i| req(i, NO_PARENT, NO_NODE)).collect();
        b.replicas = 2;
        let mut p = ConsistentHash::default();
        let a = p.place(&b, &n3);
        assert_eq!(a.node.len(), 400);
        assert!(a.node.chunks(2).all(|c| c[0] != c[1]));
        // Every node gets a share.
        for id in 1..=3 {
            assert!(a.node.iter().step_by(2).filter(|&&n| n == id).count() > 30);
        }
        // Removing node 3 moves only the blocks that were on it.
        b.replicas = 1;
        let before = p.place(&b, &n3);
        let after = p.place(&b, &nodes(&[(1, 100, 0), (2, 100, 0)]));
        for (x, y) in before.node.iter().zip(&after.node) {
            assert!(x == y || *x == 3);
        }
        // More replicas than nodes: one per node.
        b.replicas = 5;
        assert_eq!(p.place(&b, &n3).node.len(), 600);
    }

    #[test]
    fn least_loaded_spreads_and_spills_tier() {
        let n = nodes(&[(1, 100, 5), (2, 15, 0), (3, 100, 1)]);
        let b: PlaceBatch = (0..3).map(|i| req(i, NO_PARENT, NO_NODE)).collect();
        let a = LeastLoaded.place(&b, &n);
        // 2 (load 0), then 2 again at load 1 ties 3 but has less room (5 vs 100): 3; then 2.
        assert_eq!(a.node, vec![2, 3, 2]);
        // Node 2 had 15 bytes of DRAM: the second block on it goes to SSD.
        assert_eq!(a.tier, vec![Tier::Dram as u8, Tier::Dram as u8, Tier::Ssd as u8]);
    }

    #[test]
    fn prefix_affinity_follows_parent() {
        let n = nodes(&[(1, 100, 9), (2, 100, 0), (3, 5, 0)]);
        let b: PlaceBatch = [
            req(10, 9, 1),               // parent on busy node 1: stays there
            req(11, 10, NO_NODE),        // parent placed in this batch: node 1
            req(20, NO_PARENT, NO_NODE), // root: least loaded (2)
            req(30, 8, 3),               // parent's node has no room in dram but has ssd: stays
        ]
        .into_iter()
        .collect();
        let a = PrefixAffinity::default().place(&b, &n);
        assert_eq!(a.node, vec![1, 1, 2, 3]);
        assert_eq!(a.tier[3], Tier::Ssd as u8);
        let spill = PrefixAffinity { spill_load: 5 }.place(&b, &n);
        assert_ne!(spill.node[0], 1);
    }

    #[test]
    fn an_engines_blocks_go_to_its_own_node_while_it_has_room() {
        // Node 3 is the client's: most loaded, yet it takes the chain while its DRAM has room;
        // then the chain rule goes on (the parent's node, in a slower tier while one has room).
        let n = nodes(&[(1, 100, 0), (2, 100, 5), (3, 25, 9)]);
        let mut b = PlaceBatch { client_node: 3, ..PlaceBatch::default() };
        for (id, parent) in [(1, NO_PARENT), (2, 1), (3, 2), (4, 3)] {
            b.push(req(id, parent, NO_NODE));
        }
        let p = PrefixAffinity::default().place(&b, &n);
        assert_eq!(p.node, vec![3, 3, 3, 3]);
        assert_eq!(p.tier, vec![Tier::Dram as u8, Tier::Dram as u8, Tier::Ssd as u8, Tier::Ssd as u8]);
        // Without SSD there, the chain moves on to the least loaded node once node 3 is full.
        let mut small = NodeSet::default();
        for (id, dram, ssd, load) in [(1, 100, 1000, 0), (2, 100, 1000, 5), (3, 25, 0, 9)] {
            small.push(id, [0, dram, ssd], load);
        }
        assert_eq!(PrefixAffinity::default().place(&b, &small).node, vec![3, 3, 1, 1]);
        // A client node that is not live, or none: as before.
        for client in [7, NO_NODE] {
            let b = PlaceBatch { client_node: client, ..b.clone() };
            assert_eq!(PrefixAffinity::default().place(&b, &n).node, vec![1, 1, 1, 1]);
        }
        // Past spill_load it is passed over like any node.
        assert_eq!(PrefixAffinity { spill_load: 8 }.place(&b, &n).node, vec![1, 1, 1, 1]);
    }
}
