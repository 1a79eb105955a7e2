//! A put, as the store sees it: plan every item before any byte is read (existing keys,
//! admission, placement), place it (a reserved DRAM range, or a buffer bound for SSD), and
//! commit the filled block (writing it to SSD first where it goes there).
//!
//! The plan (index, then admission and placement, then the index's decision) is the core's one
//! put decision, [`kvpool_core::plan_put`], which the benchmark's replay runs too; the store
//! only says where its index and policies are ([`Sides`]). An admitted item's plan
//! ([`Planned`]) travels unchanged, inside its [`Placed`], to the index's [`Commit`].

use super::dram::DramBlock;
use super::tier::{Medium, MediumError};
use super::{checksum, wall_ms, DramCopy, Store};
use kvpool_core::{Commit, Index, Planned, Policies, PutPlan, PutRefusal, PutSides, PutSpec};
use kvpool_policy_sdk::{NodeSet, Tier};
use std::time::Instant;
use tracing::warn;

/// Where a planned item's bytes land before its commit.
pub enum Landing {
    /// A reserved DRAM range: the block's copy once committed.
    Dram(DramBlock),
    /// A buffer its bytes wait in before the SSD write.
    Ssd(Vec<u8>),
}

/// A put item between its plan and its commit: the core's plan, carried as is; where its bytes
/// land; and, once they have, their xxh3-64 when whoever moved them hashed them on the way.
pub struct Placed {
    pub planned: Planned,
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
        f(&mut self.0.ix())
    }

    fn with_policies<R>(&mut self, f: impl FnOnce(&mut Policies, &dyn Fn() -> NodeSet) -> R) -> R {
        let mut pol = self.0.policies.lock();
        self.0.feed(&mut pol);
        f(&mut pol, &|| self.0.nodes())
    }
}

impl Store {
    /// Decide every item of a put before any byte is read: existing keys, admission, placement.
    /// The core's plans, as they are (a refusal by admission is counted here).
    pub fn plan_put(&self, tenant: u32, specs: &[PutSpec<'_>], upsert: bool) -> Vec<PutPlan> {
        let plans = kvpool_core::plan_put(&mut Sides(self), tenant, specs, upsert, self.dram.capacity()).plans;
        let rejected = plans.iter().filter(|p| **p == PutPlan::Skip(PutRefusal::Rejected)).count();
        self.metrics.rejected_puts.with_label_values(&["admission"]).inc_by(rejected as u64);
        plans
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
        planned: Planned,
        size: u64,
        into_dram: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Placed, PutError> {
        let landing = if planned.tier == Tier::Ssd && !into_dram {
            Landing::Ssd(vec![0u8; size as usize])
        } else {
            Landing::Dram(self.reserve(planned.tenant, size, deadline).await?)
        };
        Ok(Placed { planned, landing, sum: None })
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
        let Placed { planned, landing, sum } = placed;
        match landing {
            Landing::Dram(block) => {
                let sum = sum.unwrap_or_else(|| checksum(block.bytes()));
                self.publish(planned, spec, sum, Some(DramCopy(block.commit())), None)
            }
            Landing::Ssd(data) => self.commit_ssd(planned, spec, data, sum).await,
        }
    }

    /// Hand a filled block's copies to the index; a copy the index refused is given back.
    fn publish(
        &self,
        planned: Planned,
        spec: &PutSpec<'_>,
        sum: u64,
        dram: Option<DramCopy>,
        ssd: Option<u64>,
    ) -> Result<(), PutError> {
        // The record keeps a DRAM copy without its length ([`DramKept`]): its size is it.
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
        let r = ix.publish(Commit {
            planned,
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
        planned: Planned,
        spec: &PutSpec<'_>,
        data: Vec<u8>,
        sum: Option<u64>,
    ) -> Result<(), PutError> {
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
        let r = self.publish(planned, spec, sum, None, Some(extent.offset));
        if r.is_err() {
            ssd.release(extent);
        }
        r
    }
}
