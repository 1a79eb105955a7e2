//! A put, as the store sees it: plan every item before any byte is read (existing keys,
//! admission, placement), place it (a reserved DRAM range, or a buffer bound for SSD), and
//! commit the filled block (writing it to SSD first where it goes there).
//!
//! The plan (index, then admission and placement, then the index's decision) is the core's one
//! put decision, [`kvpool_core::plan_put`], which the benchmark's replay runs too; the store
//! only says where its index and policies are ([`Sides`]). An admitted item's plan
//! ([`Planned`]) travels unchanged, inside its [`Plan`] and then its [`Placed`], to the index's
//! [`Commit`].
//!
//! A plan holds its block's id (a slot of the index) until it is committed. Whatever drops it
//! first (a put cut short, an item refused for space, a one-sided put that timed out) gives
//! the slot back: [`Plan`] notes the id on drop, and the index releases it at the store's next
//! put, under the lock it takes anyway (never from a destructor, which may run anywhere).

use super::dram::DramBlock;
use super::tier::{Medium, MediumError};
use super::{checksum, wall_ms, DramCopy, Store};
use kvpool_core::{Commit, Index, Planned, Policies, PutPlan, PutRefusal, PutSides, PutSpec};
use kvpool_policy_sdk::{NodeSet, Tier};
use std::sync::Arc;
use std::time::Instant;
use tracing::warn;

/// Where a planned item's bytes land before its commit.
pub enum Landing {
    /// A reserved DRAM range: the block's copy once committed.
    Dram(DramBlock),
    /// A buffer its bytes wait in before the SSD write.
    Ssd(Vec<u8>),
}

/// An admitted item's plan, not yet committed: dropped, it gives its block's id back.
pub struct Plan {
    planned: Planned,
    /// Where a drop notes the plan; `None` once it was handed to the index.
    ends: Option<Arc<Abandoned>>,
}

impl Plan {
    pub fn planned(&self) -> &Planned {
        &self.planned
    }

    /// The plan, for the index, which ends it (publishes or releases its id) from here on.
    fn into_index(mut self) -> Planned {
        self.ends = None;
        self.planned
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        if let Some(a) = self.ends.take() {
            a.0.lock().push(self.planned);
        }
    }
}

/// Plans dropped before their commit, for the index to release at the next put.
#[derive(Default)]
pub(crate) struct Abandoned(parking_lot::Mutex<Vec<Planned>>);

/// An item's plan as the store hands it out: a plan that holds its block's id, or the refusal.
pub type ItemPlan = Result<Plan, PutRefusal>;

/// A put item between its plan and its commit: the core's plan, carried as is; where its bytes
/// land; and, once they have, their xxh3-64 when whoever moved them hashed them on the way.
pub struct Placed {
    pub plan: Plan,
    pub landing: Landing,
    pub sum: Option<u64>,
}

impl Placed {
    /// The bytes the value fills.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.landing {
            Landing::Dram(b) => b.bytes_mut(),
            Landing::Ssd(v) => v,
        }
    }
}

/// Why a put item was not stored.
#[derive(Debug, thiserror::Error)]
pub enum PutError {
    /// The index or the policies refused it (the key exists, is leased, was not admitted, or
    /// there is no room).
    #[error("put refused: {0:?}")]
    Refused(PutRefusal),
    /// The bytes bound for SSD could not be written; the extent was given back.
    #[error("SSD write failed: {0}")]
    SsdWrite(#[source] MediumError),
    /// The blocking task that wrote to SSD did not finish (it panicked or was cancelled).
    #[error("SSD write task failed: {0}")]
    SsdTask(#[source] tokio::task::JoinError),
    /// A filled DRAM block whose length is not its item's size (a bug of the caller).
    #[error("a DRAM copy of {len} bytes for an item of {size}")]
    Length { len: u64, size: u64 },
}

/// The store's index and policies, as the core's put decision takes them: each behind its own
/// lock, the index never held while a policy runs.
struct Sides<'a>(&'a Store);

impl PutSides for Sides<'_> {
    type Copy = DramCopy;

    fn with_index<R>(&mut self, f: impl FnOnce(&mut Index<DramCopy>) -> R) -> R {
        let mut ix = self.0.ix();
        self.0.release_abandoned(&mut ix);
        f(&mut ix)
    }

    fn with_policies<R>(&mut self, f: impl FnOnce(&mut Policies, &dyn Fn() -> NodeSet) -> R) -> R {
        let mut pol = self.0.policies.lock();
        self.0.feed(&mut pol);
        f(&mut pol, &|| self.0.nodes())
    }
}

impl Store {
    /// Decide every item of a put before any byte is read: existing keys, admission, placement.
    /// The core's plans, each admitted one holding its block's id until it is committed or
    /// dropped (a refusal by admission is counted here).
    pub fn plan_put(&self, tenant: u32, specs: &[PutSpec<'_>], upsert: bool) -> Vec<ItemPlan> {
        let plans = kvpool_core::plan_put(&mut Sides(self), tenant, specs, upsert, self.dram.capacity()).plans;
        let rejected = plans.iter().filter(|p| **p == PutPlan::Skip(PutRefusal::Rejected)).count();
        self.metrics.rejected_puts.with_label_values(&["admission"]).inc_by(rejected as u64);
        plans
            .into_iter()
            .map(|p| match p {
                PutPlan::Store(planned) => Ok(Plan { planned, ends: Some(self.abandoned.clone()) }),
                PutPlan::Skip(r) => Err(r),
            })
            .collect()
    }

    /// Release the ids of plans dropped since the last time.
    fn release_abandoned(&self, ix: &mut Index<DramCopy>) {
        let gone = std::mem::take(&mut *self.abandoned.0.lock());
        for p in &gone {
            ix.release_plan(p);
        }
    }

    /// Plans that hold an id: made and neither committed nor dropped (those dropped since the
    /// last put are released first).
    pub fn plans_held(&self) -> usize {
        let mut ix = self.ix();
        self.release_abandoned(&mut ix);
        ix.plans_held()
    }

    fn no_space(&self, tenant: u32) -> PutError {
        self.metrics.rejected_puts.with_label_values(&["no_space"]).inc();
        self.ix().count_no_space(tenant, 1);
        PutError::Refused(PutRefusal::NoSpace)
    }

    /// Room for a planned item's `size` bytes: a DRAM range (evicting, then waiting for space
    /// until `deadline`), or a buffer when it is planned for SSD and its bytes need not land in
    /// DRAM (`into_dram`: they are written there one-sidedly).
    pub async fn reserve_for(
        &self,
        plan: Plan,
        size: u64,
        into_dram: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Placed, PutError> {
        let planned = *plan.planned();
        let landing = if planned.tier == Tier::Ssd && !into_dram {
            Landing::Ssd(vec![0u8; size as usize])
        } else {
            Landing::Dram(self.reserve(planned.tenant, size, deadline).await?)
        };
        Ok(Placed { plan, landing, sum: None })
    }

    /// Reserve DRAM for `len` bytes, evicting and then waiting for space until `deadline`.
    async fn reserve(&self, tenant: u32, len: u64, deadline: tokio::time::Instant) -> Result<DramBlock, PutError> {
        let b = self.reserve_in(&self.dram, len, Some(deadline)).await.ok_or_else(|| self.no_space(tenant))?;
        if self.dram.used() as f64 > self.cfg.dram_high * self.dram.capacity() as f64 {
            self.kick.notify_one();
        }
        Ok(b)
    }

    /// Publish a filled item: a DRAM block as it is, or bytes bound for SSD once written there.
    /// `AlreadyExists` / `Leased` when the key changed meanwhile. Without a `sum` (nobody hashed
    /// the bytes as they landed) the block is hashed here.
    pub async fn commit(&self, spec: &PutSpec<'_>, placed: Placed) -> Result<(), PutError> {
        let Placed { plan, landing, sum } = placed;
        match landing {
            Landing::Dram(block) => {
                let sum = sum.unwrap_or_else(|| checksum(block.bytes()));
                self.publish(plan, spec, sum, Some(DramCopy(block.commit())), None)
            }
            Landing::Ssd(data) => self.commit_ssd(plan, spec, data, sum).await,
        }
    }

    /// Hand a filled block's copies to the index; a copy the index refused is given back.
    fn publish(
        &self,
        plan: Plan,
        spec: &PutSpec<'_>,
        sum: u64,
        dram: Option<DramCopy>,
        ssd: Option<u64>,
    ) -> Result<(), PutError> {
        // The record keeps a DRAM copy without its length ([`DramKept`]): its size is it.
        let planned = *plan.planned();
        if let Some(c) = dram.filter(|c| c.0.len() != spec.size) {
            tracing::error!(
                planned.id,
                len = c.0.len(),
                size = spec.size,
                "a DRAM copy's length is not its item's size"
            );
            self.dram.release_ref(c.0);
            return Err(PutError::Length { len: c.0.len(), size: spec.size });
        }
        let soft_ttl = self.cfg.soft_pin_ttl.as_millis() as u64;
        let mut ix = self.ix();
        self.release_abandoned(&mut ix);
        let r = ix.publish(Commit {
            planned: plan.into_index(),
            spec: *spec,
            checksum: sum,
            dram,
            ssd,
            now: Instant::now(),
            wall_ms: wall_ms(),
            soft_pin_ttl_ms: soft_ttl,
        });
        match r {
            Ok((replaced, meta)) => {
                self.meta.enqueue(meta);
                drop(ix);
                self.release(replaced);
                Ok(())
            }
            Err(refusal) => {
                drop(ix);
                // Refused before the index took it: the range is still ours to give back.
                if let Some(c) = dram {
                    self.dram.release_ref(c.0);
                }
                Err(PutError::Refused(refusal))
            }
        }
    }

    /// Write a block's bytes to the SSD tier, then publish it.
    async fn commit_ssd(
        &self,
        plan: Plan,
        spec: &PutSpec<'_>,
        data: Vec<u8>,
        sum: Option<u64>,
    ) -> Result<(), PutError> {
        let planned = *plan.planned();
        let Some(ssd) = self.ssd.clone() else { return Err(PutError::Refused(PutRefusal::NoSpace)) };
        let Some(extent) = self.reserve_in(&*ssd, spec.size, None).await else {
            return Err(self.no_space(planned.tenant));
        };
        let sum = sum.unwrap_or_else(|| checksum(&data));
        let s2 = ssd.clone();
        // An SSD extent is an address (Copy): the write gets its own.
        let written = tokio::task::spawn_blocking(move || {
            let mut extent = extent;
            Medium::write(&*s2, &mut extent, 0, &data)
        })
        .await;
        let failed = match written {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(PutError::SsdWrite(e)),
            Err(e) => Some(PutError::SsdTask(e)),
        };
        if let Some(e) = failed {
            warn!(error = %e, "ssd write failed");
            ssd.release(extent);
            return Err(e);
        }
        let r = self.publish(plan, spec, sum, None, Some(extent.offset));
        if r.is_err() {
            ssd.release(extent);
        }
        r
    }
}
