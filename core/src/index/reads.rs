//! Reads: gets (located and leased), lookups of chains (misses reported to the policies), and
//! existence checks.

use super::{Index, Located};
use crate::blocks::CopyHandle;
use kvpool_policy_sdk::{EventKind, Tier, NO_DEPTH, NO_PARENT};
use smallvec::SmallVec;
use std::time::Instant;

impl<D: CopyHandle> Index<D> {
    // ---- reads --------------------------------------------------------------------------

    /// Locate and lease the keys of a get; hits update recency and count as reads of the key,
    /// misses are reported to the policies (`wall_us`: wall clock, µs). A missing key's chain
    /// position is one more than the previous key's of the same get, or its index in the get
    /// when nothing before says otherwise (gets name chains from their root).
    pub fn plan_get(&mut self, tenant: u32, keys: &[Vec<u8>], lease_until: Instant, wall_us: u64) -> Vec<Located<D>> {
        self.clock(wall_us);
        let mut out = Vec::with_capacity(keys.len());
        // (id, depth) of the previous key of the get, when known.
        let mut prev: Option<(u64, u32)> = None;
        for (i, k) in keys.iter().enumerate() {
            let Some(id) = self.blocks.id_of(tenant, k) else {
                let depth = match prev {
                    Some((_, d)) if d != NO_DEPTH => d + 1,
                    _ => i as u32,
                };
                let parent = prev.map_or(NO_PARENT, |p| p.0);
                self.missed(tenant, k, depth, parent);
                prev = Some((NO_PARENT, depth));
                let has_ssd = self.has_ssd;
                let t = self.tenant_mut(tenant);
                t.misses[0] += 1;
                if has_ssd {
                    t.misses[1] += 1;
                }
                out.push(Located::Missing);
                continue;
            };
            let stamp = self.next_stamp();
            let b = self.blocks.get_mut(id).expect("index and blocks agree");
            b.stamp = stamp;
            let k: &[u8] = k;
            b.wanted = b.wanted.saturating_add(1);
            prev = Some((id, b.depth));
            let (loc, ev) = match b.dram() {
                Some(copy) => {
                    (Located::Dram { id, copy, checksum: b.checksum }, b.event(k, id, EventKind::Accessed, Tier::Dram))
                }
                None => {
                    let locator = b.ssd.get().expect("a block has at least one copy");
                    (
                        Located::Ssd { id, locator, size: b.size(), checksum: b.checksum },
                        b.event(k, id, EventKind::Accessed, Tier::Ssd),
                    )
                }
            };
            let t = self.tenant_mut(tenant);
            if matches!(loc, Located::Dram { .. }) {
                t.hits[0] += 1;
            } else {
                t.misses[0] += 1;
                t.hits[1] += 1;
            }
            self.leases.insert(id, lease_until);
            self.emit(ev);
            out.push(loc);
        }
        out
    }

    /// Number of leading chain blocks resident in any tier. No lease, no recency update; every
    /// absent key of the chain is reported to the policies as a miss at its chain position
    /// (`wall_us`: wall clock, µs).
    pub fn lookup(&mut self, tenant: u32, chain: &[Vec<u8>], wall_us: u64) -> usize {
        let hashes: SmallVec<[u64; 64]> = chain.iter().map(|k| self.blocks.hash_of(tenant, k)).collect();
        let hit =
            chain.iter().zip(&hashes).take_while(|(k, &h)| self.blocks.id_of_hashed(h, tenant, k).is_some()).count();
        if hit == chain.len() {
            return hit;
        }
        self.clock(wall_us);
        let mut prev = if hit == 0 { NO_PARENT } else { self.blocks.id_of(tenant, &chain[hit - 1]).expect("counted") };
        for (i, k) in chain.iter().enumerate().skip(hit) {
            if let Some(id) = self.blocks.id_of(tenant, k) {
                prev = id;
                continue;
            }
            self.missed(tenant, k, i as u32, prev);
            prev = NO_PARENT;
        }
        hit
    }

    /// The block id of a resident key (no lease, no event).
    pub fn id_of(&self, tenant: u32, key: &[u8]) -> Option<u64> {
        self.blocks.id_of(tenant, key)
    }

    pub fn exists(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<bool> {
        let hashes: SmallVec<[u64; 64]> = keys.iter().map(|k| self.blocks.hash_of(tenant, k)).collect();
        keys.iter().zip(hashes).map(|(k, h)| self.blocks.id_of_hashed(h, tenant, k).is_some()).collect()
    }
}
