//! Putting blocks: plan (existing keys, sizes, chain positions), decide (admission and
//! placement answers, the chain rule for admission), publish (a block whose bytes are complete).

use super::{probe, saturate, Index};
use crate::blocks::{Block, CopyHandle, KeyAt, Kids, Locator, MAX_KEY_LEN};
use crate::changes::ChangeKind;
use crate::effects::{Dropped, MetaOp};
use crate::table::slot_of;
use kvpool_policy_sdk::{key_hash, Admit, AdmitBatch, AdmitRequest, EventKind, Pin, Tier, NO_DEPTH, NO_PARENT};
use std::sync::Arc;
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

/// How a put item will be handled, decided before its bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutPlan {
    /// Store the bytes: the plan travels with them, as is, to [`Index::publish`].
    Store(Planned),
    /// Do not store: discard the bytes and answer this.
    Skip(PutRefusal),
}

/// A put item its plan admitted: carried unchanged from [`Index::decide_put`] (through the
/// bytes' arrival) to [`Commit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub tenant: u32,
    /// The id the block will be published under.
    pub id: u64,
    /// The tier its bytes go to first.
    pub tier: Tier,
    /// Replace the key's block unless it is leased; without it a present key refuses.
    pub upsert: bool,
}

/// Why a put item was not stored (there is no "ok" here: a stored item has no refusal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutRefusal {
    AlreadyExists,
    /// Upsert of a block that is leased to readers.
    Leased,
    /// Refused by the admission policy.
    Rejected,
    NoSpace,
}

/// A block whose bytes are complete, as [`Index::publish`] takes it.
#[derive(Debug)]
pub struct Commit<'a, D> {
    /// What its plan decided ([`PutPlan::Store`]).
    pub planned: Planned,
    pub spec: PutSpec<'a>,
    /// xxh3-64 of the bytes, verified on every read.
    pub checksum: u64,
    /// The copies: a DRAM handle, an SSD locator, or both.
    pub dram: Option<D>,
    pub ssd: Option<u64>,
    /// Monotonic time, for leases.
    pub now: Instant,
    /// Wall clock (ms), for pins and records.
    pub wall_ms: u64,
    /// How long a soft pin asked with `ttl_ms` 0 lasts.
    pub soft_pin_ttl_ms: u64,
}

/// A put item whose admission is still to be asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pending {
    Skip(PutRefusal),
    /// Row `row` of the admission batch, for block `id` (an upsert or not).
    Ask {
        id: u64,
        row: usize,
        upsert: bool,
    },
}

impl<D: CopyHandle> Index<D> {
    // ---- put ----------------------------------------------------------------------------

    /// First half of planning a put: existing keys and blocks that can never fit are decided
    /// here; the others get an id and a row in the returned admission batch.
    pub fn plan_put(
        &mut self,
        tenant: u32,
        items: &[PutSpec<'_>],
        upsert: bool,
        max_copy: u64,
    ) -> (Vec<Pending>, AdmitBatch) {
        let mut pending = Vec::with_capacity(items.len());
        let mut batch = AdmitBatch::default();
        // Rows of this put by key: a parent may be an earlier row (a chain put in one call).
        let mut rows: Vec<(&[u8], u64, u32)> = Vec::new();
        for it in items {
            if !upsert && self.blocks.id_of(tenant, it.key).is_some() {
                pending.push(Pending::Skip(PutRefusal::AlreadyExists));
                continue;
            }
            // Keys beyond the arena's two-byte lengths are refused like values beyond the
            // record's four-byte sizes (the server's configured key limit is below both).
            if self.gran.footprint(Tier::Dram, it.size) > max_copy
                || it.size > u64::from(u32::MAX)
                || it.key.len() > MAX_KEY_LEN
            {
                pending.push(Pending::Skip(PutRefusal::NoSpace));
                continue;
            }
            // The block's slot is held from now on: admission is told the id it will have.
            let Some(id) = self.blocks.reserve_id() else {
                pending.push(Pending::Skip(PutRefusal::NoSpace));
                continue;
            };
            let resident = it.parent.and_then(|p| self.blocks.id_of(tenant, p));
            let in_batch = || it.parent.and_then(|p| rows.iter().rev().find(|r| r.0 == p).map(|r| (r.1, r.2)));
            let (parent, depth) = match (resident, in_batch()) {
                (Some(pid), _) => (pid, self.depth_under(pid, it.parent)),
                (None, Some((rid, d))) => (rid, if d == NO_DEPTH { NO_DEPTH } else { d + 1 }),
                (None, None) => (NO_PARENT, self.depth_under(NO_PARENT, it.parent)),
            };
            rows.push((it.key, id, depth));
            pending.push(Pending::Ask { id, row: batch.len(), upsert });
            batch.push(AdmitRequest {
                id,
                key: key_hash(tenant, it.key),
                size: it.size,
                tokens: it.tokens,
                seq_tokens: it.seq_tokens,
                tier: Tier::Dram,
                parent,
                depth,
            });
        }
        (pending, batch)
    }

    /// Second half: combine admission decisions (and placement tiers, when a placement policy
    /// answered) into plans. The chain rule for admission applies first: a row whose parent row
    /// in `batch` is rejected is rejected too ([`AdmitBatch::enforce_chain`]). Rejections count
    /// against the tenant.
    pub fn decide_put(
        &mut self,
        tenant: u32,
        pending: &[Pending],
        batch: &AdmitBatch,
        decisions: &[Admit],
        placed: Option<&[Tier]>,
    ) -> Vec<PutPlan> {
        let mut decisions = decisions.to_vec();
        if decisions.len() < batch.len() {
            decisions.resize(batch.len(), Admit::Into(Tier::Dram));
        }
        batch.enforce_chain(&mut decisions);
        let has_ssd = self.has_ssd;
        let mut rejected = 0;
        let plans = pending
            .iter()
            .map(|p| match *p {
                Pending::Skip(s) => PutPlan::Skip(s),
                Pending::Ask { id, row, upsert } => {
                    match decisions.get(row).copied().unwrap_or(Admit::Into(Tier::Dram)) {
                        Admit::Reject => {
                            rejected += 1;
                            self.blocks.release(id);
                            PutPlan::Skip(PutRefusal::Rejected)
                        }
                        Admit::Into(t) => {
                            let t = placed.and_then(|p| p.get(row).copied()).unwrap_or(t);
                            let tier = if t == Tier::Ssd && has_ssd { Tier::Ssd } else { Tier::Dram };
                            PutPlan::Store(Planned { tenant, id, tier, upsert })
                        }
                    }
                }
            })
            .collect();
        if rejected > 0 {
            self.tenant_mut(tenant).rejected += rejected;
        }
        plans
    }

    /// Give back what a plan holds (the slot of its block's id) when its block will not be
    /// published: its bytes did not arrive, or nobody will commit them. Every
    /// [`PutPlan::Store`] ends either here or in [`Index::publish`]; false when `planned` holds
    /// nothing (already published or released).
    pub fn release_plan(&mut self, planned: &Planned) -> bool {
        self.blocks.release(planned.id)
    }

    /// Release what a put's rows asked of admission hold ([`Index::plan_put`]), when no
    /// decision will be taken on them.
    pub(crate) fn release_pending(&mut self, pending: &[Pending]) {
        for p in pending {
            if let Pending::Ask { id, .. } = *p {
                self.blocks.release(id);
            }
        }
    }

    /// Slots held by plans that are neither published nor released yet.
    pub fn plans_held(&self) -> usize {
        self.blocks.held()
    }

    /// Publish a block whose bytes are complete. `Err` when the key changed meanwhile (an insert
    /// found it present, an upsert found the old value leased), or when the plan holds nothing
    /// (it was published or released already: `NoSpace`): the caller frees the copy. The plan
    /// is over either way.
    pub fn publish(&mut self, c: Commit<'_, D>) -> Result<(Option<Dropped<D>>, Vec<MetaOp>), PutRefusal> {
        let id = c.planned.id;
        if !self.blocks.is_held(id) {
            return Err(PutRefusal::NoSpace);
        }
        let r = self.publish_held(c);
        if r.is_err() {
            self.blocks.release(id);
        }
        r
    }

    fn publish_held(&mut self, c: Commit<'_, D>) -> Result<(Option<Dropped<D>>, Vec<MetaOp>), PutRefusal> {
        let Commit { planned, spec, checksum, dram, ssd, now, wall_ms, soft_pin_ttl_ms } = c;
        let Planned { tenant, id, upsert, .. } = planned;
        let spec = &spec;
        if spec.key.len() > MAX_KEY_LEN || spec.size > u64::from(u32::MAX) {
            return Err(PutRefusal::NoSpace);
        }
        let mut meta = Vec::with_capacity(2);
        let mut replaced = None;
        if let Some(old) = self.blocks.id_of(tenant, spec.key) {
            if !upsert {
                return Err(PutRefusal::AlreadyExists);
            }
            if self.is_leased(old, now) {
                return Err(PutRefusal::Leased);
            }
            let (d, m) = self.drop_block(old, ChangeKind::Removed).expect("indexed block exists");
            replaced = Some(d);
            meta.extend(m);
        }
        let parent = spec.parent.and_then(|p| self.blocks.id_of(tenant, p)).unwrap_or(NO_PARENT);
        let (pin, pin_until_ms) = match spec.pin {
            PinRequest::None => (Pin::None, 0),
            PinRequest::Hard => (Pin::Hard, 0),
            PinRequest::Soft { ttl_ms } => {
                (Pin::Soft, wall_ms.saturating_add(if ttl_ms == 0 { soft_pin_ttl_ms } else { ttl_ms }))
            }
        };
        self.clock(wall_ms.saturating_mul(1000));
        let stamp = self.next_stamp();
        let hash = key_hash(tenant, spec.key);
        // Resident blocks that were waiting for this key as their parent. One that is this
        // block's own ancestor (puts that name each other as parents) keeps waiting: adopted, it
        // would close a loop that chain walks would never leave.
        let mut children: Vec<u64> = self
            .orphans
            .remove(&probe(tenant, spec.key))
            .unwrap_or_default()
            .into_iter()
            .filter(|&c| self.blocks.contains(c))
            .collect();
        if !children.is_empty() && parent != NO_PARENT {
            let root = self.root_of(parent);
            if let Some(i) = children.iter().position(|&c| c == root) {
                let pk: Arc<[u8]> = spec.key.into();
                self.orphans.entry((tenant, pk)).or_default().push(children.swap_remove(i));
            }
        }
        for c in &children {
            self.blocks.get_mut(*c).expect("filtered").parent = id;
            self.orphan_keys.remove(c);
        }
        match (parent, spec.parent) {
            (NO_PARENT, Some(pk)) => {
                let pk: Arc<[u8]> = pk.into();
                self.orphans.entry((tenant, pk.clone())).or_default().push(id);
                self.orphan_keys.insert(id, pk);
            }
            (NO_PARENT, None) => {}
            (pid, _) => self.add_kid(pid, id),
        }
        let kids = match children[..] {
            [] => Kids::NONE,
            [c] => Kids(slot_of(c)),
            _ => {
                self.many_kids.insert(id, children);
                Kids::MANY
            }
        };
        let block = Block {
            gen: 0,
            tenant,
            key: KeyAt::UNSET,
            // plan_put refused sizes beyond 4 bytes.
            size: u32::try_from(spec.size).unwrap_or(u32::MAX),
            tokens: spec.tokens,
            seq_tokens: saturate(spec.seq_tokens),
            parent,
            checksum,
            pin,
            dram: dram.as_ref().map(D::keep),
            ssd: Locator::from(ssd),
            moving: false,
            depth: self.depth_under(parent, spec.parent),
            wanted: self.misses.count(hash),
            stamp,
            kids,
        };
        if pin == Pin::Soft {
            self.soft_pins.insert((pin_until_ms, id));
            self.pin_until.insert(id, pin_until_ms);
        }
        if self.blocks.insert(id, block, spec.key).is_err() {
            unreachable!("the slot was held on entry and nothing since releases it");
        }
        // Only blocks with an SSD copy are persisted: a DRAM copy does not survive a restart.
        if self.blocks.get(id).expect("just inserted").ssd.is_some() {
            let key = Box::from(spec.key);
            meta.push(MetaOp::Put { tenant, key, record: self.record_of(id, wall_ms) });
        }
        for tier in [Tier::Dram, Tier::Ssd] {
            let b = self.blocks.get(id).expect("just inserted");
            if b.has(tier) {
                let ev = b.event(spec.key, id, EventKind::Inserted, tier);
                self.copy_added(tenant, tier, spec.size);
                self.emit(ev);
                self.note_change(id, ChangeKind::Stored, tier);
            }
        }
        self.tenant_mut(tenant).resident += 1;
        Ok((replaced, meta))
    }
}
