//! Rebuilding the index from persisted records after a restart (only SSD copies survive).

use super::{saturate, Index};
use crate::blocks::{Block, BlockRecord, CopyHandle, KeyAt, Kids, Locator, Stamp, MAX_KEY_LEN};
use crate::effects::MetaOp;
use crate::table::slot_of;
use kvpool_policy_sdk::{Events, Pin, Tier, NO_DEPTH, NO_PARENT};
use std::sync::Arc;

/// Recovery of the index from persisted records.
#[derive(Debug, Default)]
pub struct Recovered {
    pub kept: u64,
    pub dropped: u64,
    pub meta: Vec<MetaOp>,
    /// The recovered block set, parents first, for the policies.
    pub snapshot: Events,
}

impl<D: CopyHandle> Index<D> {
    // ---- recovery -----------------------------------------------------------------------

    /// Rebuild from persisted records. Only SSD copies survive a restart, and only those whose
    /// extent the SSD tier lets `adopt` claim: it gets every candidate's (locator, size) in one
    /// slice, in record order, and answers which it claimed. Pass records newest first, so that
    /// when a crash left two records naming one extent, the newer keeps it. Their bytes are
    /// verified when first read, as every SSD read is.
    pub fn recover(
        &mut self,
        records: Vec<(u32, Vec<u8>, Option<BlockRecord>)>,
        adopt: impl FnOnce(&[(u64, u64)]) -> Vec<bool>,
        wall_ms: u64,
    ) -> Recovered {
        let mut out = Recovered::default();
        // One allocation for the whole set instead of a rehash at every doubling.
        self.blocks.reserve(records.len());
        let has_ssd = self.has_ssd;
        // A record whose key the arena cannot hold (longer than any configurable key limit) is
        // dropped like one without an SSD copy, and its extent is not claimed.
        let candidate = move |key: &[u8], rec: &Option<BlockRecord>| {
            rec.as_ref()
                .filter(|_| key.len() <= MAX_KEY_LEN)
                .and_then(|r| r.ssd_file.filter(|_| has_ssd).map(|f| (f, r.size)))
        };
        let extents: Vec<(u64, u64)> = records.iter().filter_map(|(_, k, r)| candidate(k, r)).collect();
        let claimed = adopt(&extents);
        let mut claimed = claimed.into_iter();
        // (child, tenant, parent key) of every recovered block put under a parent: linked below,
        // and only those whose parent is gone keep their key (in `orphan_keys`).
        let mut parents: Vec<(u64, u32, Vec<u8>)> = Vec::new();
        for (tenant, key, rec) in records {
            let usable = candidate(&key, &rec).is_some() && claimed.next().unwrap_or(false);
            let Some(r) = rec.filter(|_| usable) else {
                out.meta.push(MetaOp::Remove { tenant, key: key.into() });
                out.dropped += 1;
                continue;
            };
            let file = r.ssd_file.expect("checked usable");
            let pin = match Pin::from_u8(r.pin).unwrap_or(Pin::None) {
                Pin::Soft if r.pin_until_ms <= wall_ms => Pin::None,
                p => p,
            };
            let b = Block {
                gen: 0,
                tenant,
                key: KeyAt::UNSET,
                // Records are written from blocks, whose sizes fit.
                size: u32::try_from(r.size).unwrap_or(u32::MAX),
                tokens: r.tokens,
                seq_tokens: saturate(r.seq_tokens),
                parent: NO_PARENT,
                checksum: r.checksum,
                pin,
                dram: None,
                ssd: Locator::some(file),
                moving: false,
                depth: NO_DEPTH,
                wanted: 0,
                // Before every access of this run (recovered blocks were idle since then).
                stamp: Stamp::at_us(r.created_ms.min(wall_ms).saturating_mul(1000)),
                kids: Kids::NONE,
            };
            let size = b.size();
            // Slots run out only past 2^32 - 2 blocks, terabytes of records before any SSD
            // holds that many: a record beyond them is dropped like an unusable one.
            let Some(id) = self.blocks.insert_new(b, &key) else {
                out.meta.push(MetaOp::Remove { tenant, key: key.into() });
                out.dropped += 1;
                continue;
            };
            self.record_ms = self.record_ms.max(r.created_ms);
            if pin == Pin::Soft {
                self.soft_pins.insert((r.pin_until_ms, id));
                self.pin_until.insert(id, r.pin_until_ms);
            }
            if let Some(pk) = r.parent {
                parents.push((id, tenant, pk));
            }
            self.copy_added(tenant, Tier::Ssd, size);
            self.tenant_mut(tenant).resident += 1;
            out.kept += 1;
        }
        // In id order (ids were given in record order), so that children lists are stable. A
        // link that would close a loop (records that name each other, or themselves, as
        // parents) is not made: that child waits for its parent key as if it were absent. `top`
        // finds each block's chain top as linked so far (union-find by slot, paths halved); a
        // child is still the top of its own chain when it is linked.
        let mut top: Vec<u32> = (0..self.blocks.slot_bound() as u32).collect();
        let find = |top: &mut Vec<u32>, mut x: u32| {
            while top[x as usize] != x {
                top[x as usize] = top[top[x as usize] as usize];
                x = top[x as usize];
            }
            x
        };
        for (id, tenant, pk) in parents {
            let (cs, parent) = (slot_of(id), self.blocks.id_of(tenant, &pk));
            match parent.filter(|&pid| find(&mut top, slot_of(pid)) != cs) {
                Some(pid) => {
                    top[cs as usize] = slot_of(pid);
                    self.add_kid(pid, id);
                    self.blocks.get_mut(id).expect("listed").parent = pid;
                }
                None => {
                    let pk: Arc<[u8]> = pk.into();
                    self.orphan_keys.insert(id, pk.clone());
                    self.orphans.entry((tenant, pk)).or_default().push(id);
                }
            }
        }
        // Depths: roots are 0, a block under a known parent one more; orphans stay unknown.
        let ids: Vec<u64> = self.blocks.ids().collect();
        let mut path = Vec::new();
        for id in ids {
            let mut cur = id;
            let mut d = loop {
                let b = self.blocks.get(cur).expect("walked");
                if b.depth != NO_DEPTH {
                    break b.depth;
                }
                if b.parent == NO_PARENT && !self.orphan_keys.contains_key(&cur) {
                    break 0;
                }
                if b.parent == NO_PARENT || path.len() > self.blocks.len() {
                    break NO_DEPTH;
                }
                path.push(cur);
                cur = b.parent;
            };
            self.blocks.get_mut(cur).expect("walked").depth = d;
            while let Some(x) = path.pop() {
                d = if d == NO_DEPTH { NO_DEPTH } else { d + 1 };
                self.blocks.get_mut(x).expect("walked").depth = d;
            }
        }
        // Accesses of this run come after every recovered block, even if the wall clock steps
        // back later.
        self.clock(wall_ms.saturating_mul(1000));
        self.stamp = self.stamp.max(Stamp::at_us(self.clock_us));
        out.snapshot = self.snapshot();
        out
    }
}
