//! A put, as the store sees it: plan every item before any byte is read (existing keys,
//! admission, placement), reserve DRAM, and commit the filled block (or write it to SSD).
//!
//! The plan (index, then admission and placement, then the index's decision) is the core's one
//! put decision, [`kvpool_core::plan_put`], which the benchmark's replay runs too; the store
//! only says where its index and policies are ([`Sides`]).

use super::dram::DramBlock;
use super::tier::{Medium, MediumError};
use super::{checksum, wall_ms, DramCopy, Store};
use kvpool_core::{Commit, Index, Policies, PutSides, PutSpec, PutStatus};
use kvpool_policy_sdk::{NodeSet, Tier};
use std::time::Instant;
use tracing::warn;

/// What a put item will do, decided before its bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutPlan {
    /// Stream into DRAM under this pre-assigned id.
    Dram(u64),
    /// Stream straight into the SSD tier (admission or placement asked for it).
    Ssd(u64),
    /// Do not store; drop the bytes, for this reason (never `Ok`).
    Skip(PutStatus),
}

/// Why a put item was not stored.
#[derive(Debug, thiserror::Error)]
pub enum PutError {
    /// The index or the policies refused it (the key exists, is leased, was not admitted, or
    /// there is no room).
    #[error("put refused: {0:?}")]
    Refused(PutStatus),
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

/// An outcome of the index as a `Result`.
fn outcome(s: PutStatus) -> Result<(), PutError> {
    match s {
        PutStatus::Ok => Ok(()),
        refused => Err(PutError::Refused(refused)),
    }
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
    pub fn plan_put(&self, tenant: u32, specs: &[PutSpec<'_>], upsert: bool) -> Vec<PutPlan> {
        let plans = kvpool_core::plan_put(&mut Sides(self), tenant, specs, upsert, self.dram.capacity()).plans;
        plans
            .into_iter()
            .map(|p| match p {
                kvpool_core::PutPlan::Skip(s) => {
                    if s == PutStatus::Rejected {
                        self.metrics.rejected_puts.with_label_values(&["admission"]).inc();
                    }
                    PutPlan::Skip(s)
                }
                kvpool_core::PutPlan::Store { id, tier: Tier::Ssd } => PutPlan::Ssd(id),
                kvpool_core::PutPlan::Store { id, .. } => PutPlan::Dram(id),
            })
            .collect()
    }

    fn no_space(&self, tenant: u32) -> PutError {
        self.metrics.rejected_puts.with_label_values(&["no_space"]).inc();
        self.ix().count_no_space(tenant, 1);
        PutError::Refused(PutStatus::NoSpace)
    }

    /// Reserve DRAM for `len` bytes, evicting and then waiting for space until `deadline`.
    pub async fn reserve(&self, tenant: u32, len: u64, deadline: tokio::time::Instant) -> Result<DramBlock, PutError> {
        let b = self.reserve_in(&self.dram, len, Some(deadline)).await.ok_or_else(|| self.no_space(tenant))?;
        if self.dram.used() as f64 > self.cfg.dram_high * self.dram.capacity() as f64 {
            self.kick.notify_one();
        }
        Ok(b)
    }

    #[allow(clippy::too_many_arguments)]
    fn commit_copy(
        &self,
        tenant: u32,
        id: u64,
        item: &PutSpec<'_>,
        upsert: bool,
        sum: u64,
        dram: Option<DramCopy>,
        ssd: Option<u64>,
    ) -> Result<(), PutError> {
        // The record keeps a DRAM copy without its length ([`DramKept`]): its size is it.
        if let Some(c) = dram.filter(|c| c.0.len() != item.size) {
            tracing::error!(id, len = c.0.len(), size = item.size, "a DRAM copy's length is not its item's size");
            self.dram.release_ref(c.0);
            return Err(PutError::Length { len: c.0.len(), size: item.size });
        }
        let soft_ttl = self.cfg.soft_pin_ttl.as_millis() as u64;
        let mut ix = self.ix();
        let r = ix.publish(Commit {
            tenant,
            id,
            spec: *item,
            upsert,
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
            Err(status) => {
                drop(ix);
                // Refused before the index took it: the range is still ours to give back.
                if let Some(c) = dram {
                    self.dram.release_ref(c.0);
                }
                outcome(status)
            }
        }
    }

    /// Publish a filled DRAM block. `AlreadyExists` / `Leased` when the key changed meanwhile.
    /// `sum` is the block's xxh3-64 when the caller hashed the bytes as they were written (the
    /// copy engine does); otherwise it is computed here.
    pub fn commit(
        &self,
        tenant: u32,
        id: u64,
        item: &PutSpec<'_>,
        upsert: bool,
        block: DramBlock,
        sum: Option<u64>,
    ) -> Result<(), PutError> {
        let sum = sum.unwrap_or_else(|| checksum(block.bytes()));
        self.commit_copy(tenant, id, item, upsert, sum, Some(DramCopy(block.commit())), None)
    }

    /// Publish a block whose bytes go straight to the SSD tier.
    pub async fn commit_ssd(
        &self,
        tenant: u32,
        id: u64,
        item: &PutSpec<'_>,
        upsert: bool,
        data: Vec<u8>,
        sum: Option<u64>,
    ) -> Result<(), PutError> {
        let Some(ssd) = self.ssd.clone() else { return Err(PutError::Refused(PutStatus::NoSpace)) };
        let Some(extent) = self.reserve_in(&*ssd, item.size, None).await else {
            return Err(self.no_space(tenant));
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
        let r = self.commit_copy(tenant, id, item, upsert, sum, None, Some(extent.offset));
        if r.is_err() {
            ssd.release(extent);
        }
        r
    }
}
