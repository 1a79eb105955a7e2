//! The block store of one node: the no-I/O core (`kvpool-core`: index and policy slots) behind
//! two locks, the tiers (the DRAM segment and the SSD segment file, both behind the [`tier`]
//! traits), and sled metadata written off the critical section.
//!
//! Locks: `policies` may be taken before `index`, never the other way round. The index lock is
//! held for index work only (no policy call, no sled write, no file I/O), so a lookup or a get
//! never waits on a Wasm policy. Index events reach the policies in order: whoever holds the
//! policies lock drains them from the index and feeds them.
//!
//! A put is two-phase: `reserve` hands out an exclusively owned DRAM range, the caller streams
//! the bytes into it, `commit` publishes it. Readers clone the block's handle, so memory is
//! never freed under an in-flight read.

pub mod dram;
pub mod meta;
mod open;
pub mod put;
pub mod read;
mod remove;
mod room;
pub mod ssd;
#[cfg(test)]
mod tests;
pub mod tier;

pub use dram::{DramBlock, DramKept, DramRef, PinnedBlock};

use crate::events::EventLog;
use crate::metrics::Metrics;
use dram::DramTier;
use kvpool_core::{CopyHandle, Dropped, Index, NewSlot, Policies, TenantCounters};
use kvpool_policy_sdk::{Events, NodeSet, Tier};
use meta::Meta;
use parking_lot::Mutex;
use ssd::SsdTier;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tier::{Medium, Space, SsdExtent};
use tracing::warn;

/// A boxed future that can move between threads.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Meta(#[from] meta::MetaError),
    #[error(transparent)]
    Ssd(#[from] ssd::SsdError),
    #[error(transparent)]
    Segment(#[from] dram::SegmentAllocError),
    #[error("cannot start a thread: {0}")]
    Io(#[source] std::io::Error),
}

/// Settings the store needs (a slice of the server config).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub data_dir: PathBuf,
    pub dram_bytes: u64,
    pub dram_high: f64,
    pub dram_low: f64,
    /// Fault every page of the segment in at start.
    pub dram_populate: bool,
    pub ssd_dir: Option<PathBuf>,
    pub ssd_bytes: u64,
    pub ssd_high: f64,
    pub ssd_low: f64,
    pub ssd_fsync: bool,
    /// sled's cache of the persisted records, bytes.
    pub meta_cache: u64,
    pub lease_ttl: Duration,
    pub soft_pin_ttl: Duration,
    pub put_wait: Duration,
    pub promote_on_hit: bool,
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Wall clock in µs: the time policies see on events.
fn wall_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// A place DRAM victims can go before SSD: another node's free DRAM.
pub trait Offload: Send + Sync {
    /// Store these blocks (each described by its change, with its bytes) elsewhere; per block,
    /// whether it is now stored there. Must answer promptly (it runs on the eviction path).
    fn offload<'a>(&'a self, blocks: Vec<(kvpool_core::Change, &'a [u8])>) -> BoxFuture<'a, Vec<bool>>;
}

pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// A DRAM copy as the index holds it: the range, inline in the record. Reads pin it
/// ([`DramTier::pin`]) under the index's lock; a copy the index lets go is handed back with
/// [`DramTier::release_ref`] (see [`Store::release`]), exactly once.
#[derive(Clone, Copy, Debug)]
pub struct DramCopy(pub DramRef);

/// Whether a read holds a copy is the tier's to say: the store passes
/// [`DramTier::in_use`] to [`Index::valid_victims`].
impl CopyHandle for DramCopy {
    /// The range without its length: the record's size is the length.
    type Kept = DramKept;
    fn keep(&self) -> DramKept {
        self.0.kept()
    }
    fn restore(kept: &DramKept, len: u64) -> DramCopy {
        DramCopy(DramRef::restore(*kept, len))
    }
}

pub struct Store {
    pub cfg: StoreConfig,
    dram: Arc<DramTier>,
    ssd: Option<Arc<SsdTier>>,
    meta: Meta,
    index: Mutex<Index<DramCopy>>,
    policies: Mutex<Policies>,
    metrics: Arc<Metrics>,
    /// Wakes the background evictor early (a put pushed usage past the high watermark).
    pub kick: tokio::sync::Notify,
    /// Where the index's KV events go, once attached.
    events: std::sync::OnceLock<Arc<EventLog>>,
    /// Where DRAM victims may go before SSD: another node's free DRAM (a cluster storage node).
    offload: std::sync::OnceLock<Arc<dyn Offload>>,
    /// Plans dropped before their commit, released at the next put.
    abandoned: Arc<put::Abandoned>,
}

/// The index, locked. Unlocking hands the KV events of what was done under the lock to the
/// event log (still under the lock, so the log's order is the index's order).
struct Ix<'a> {
    guard: parking_lot::MutexGuard<'a, Index<DramCopy>>,
    events: Option<&'a EventLog>,
}

impl std::ops::Deref for Ix<'_> {
    type Target = Index<DramCopy>;
    fn deref(&self) -> &Index<DramCopy> {
        &self.guard
    }
}

impl std::ops::DerefMut for Ix<'_> {
    fn deref_mut(&mut self) -> &mut Index<DramCopy> {
        &mut self.guard
    }
}

impl Drop for Ix<'_> {
    fn drop(&mut self) {
        if let Some(log) = self.events {
            log.publish(self.guard.take_changes());
        }
    }
}

impl Store {
    /// The index, locked (its KV events are published when the lock is let go).
    fn ix(&self) -> Ix<'_> {
        Ix { guard: self.index.lock(), events: self.events.get().map(|e| &**e) }
    }

    /// Log the index's KV events from now on (once; a second log is refused and returned).
    /// Send DRAM victims to `o` before SSD (once; a cluster storage node sets it). Without an
    /// SSD tier, the victims `o` does not take are dropped as before.
    pub fn set_offload(&self, o: Arc<dyn Offload>) {
        if self.offload.set(o).is_ok() {
            self.index.lock().set_offload(true);
        }
    }

    pub fn attach_events(&self, log: Arc<EventLog>) -> Result<(), Arc<EventLog>> {
        let mut ix = self.index.lock();
        self.events.set(log)?;
        ix.set_change_feed(true);
        Ok(())
    }

    /// Address and length of the DRAM segment (registered once with the copy engine).
    pub fn dram_segment(&self) -> (usize, usize) {
        self.dram.segment()
    }

    /// DRAM bytes allocated, reservations of puts in flight included.
    pub fn dram_used(&self) -> u64 {
        self.dram.used()
    }

    pub fn dram_capacity(&self) -> u64 {
        self.dram.capacity()
    }

    /// Every tier of this node, fastest first, with its (high, low) watermarks.
    fn spaces(&self) -> Vec<(&dyn Space, f64, f64)> {
        let mut v: Vec<(&dyn Space, f64, f64)> = vec![(&self.dram, self.cfg.dram_high, self.cfg.dram_low)];
        if let Some(s) = &self.ssd {
            v.push((&**s, self.cfg.ssd_high, self.cfg.ssd_low));
        }
        v
    }

    pub fn update_gauges(&self) {
        let m = &self.metrics;
        for (s, _, _) in self.spaces() {
            m.bytes_used.with_label_values(&[s.tier().name()]).set(s.used() as i64);
            m.capacity.with_label_values(&[s.tier().name()]).set(s.capacity() as i64);
        }
        let (_, dram_blocks, ssd_blocks) = self.counts();
        m.blocks.with_label_values(&["dram"]).set(dram_blocks as i64);
        m.blocks.with_label_values(&["ssd"]).set(ssd_blocks as i64);
        m.put_plans.set(self.plans_held() as i64);
    }

    /// (blocks, DRAM copies, SSD copies)
    pub fn counts(&self) -> (u64, u64, u64) {
        self.ix().counts()
    }

    /// One tenant's residency and counters.
    pub fn tenant_counters(&self, tenant: u32) -> TenantCounters {
        self.ix().tenant_counters(tenant)
    }

    /// This node's inventory and the event-log position it is consistent with: every change
    /// logged from that position on came after it (changes are published under the index lock).
    pub fn inventory(&self) -> (u64, Vec<kvpool_core::Change>) {
        let ix = self.ix();
        let cursor = self.events.get().map_or(0, |l| l.next_seq());
        (cursor, ix.inventory())
    }

    /// The answer of this node's placement module (`None` when none is loaded).
    pub fn place(
        &self,
        batch: &kvpool_policy_sdk::PlaceBatch,
        nodes: &NodeSet,
    ) -> Option<kvpool_policy_sdk::Placements> {
        let mut pol = self.policies.lock();
        self.feed(&mut pol);
        pol.placement.as_mut().map(|p| p.place(batch, nodes))
    }

    pub fn tier_usage(&self) -> Vec<(Tier, u64, u64)> {
        self.spaces().into_iter().map(|(s, _, _)| (s.tier(), s.capacity(), s.used())).collect()
    }

    /// Free what the index let go of: DRAM copies drop here; SSD extents go back to the tier once
    /// the removal of their records is durable (a crash before that must not find a record
    /// naming an extent that a newer block overwrote).
    fn release(&self, dropped: impl IntoIterator<Item = Dropped<DramCopy>>) {
        let mut extents = Vec::new();
        for d in dropped {
            if let Some(c) = d.dram {
                self.dram.release_ref(c.0);
            }
            if let Some((offset, len)) = d.ssd {
                extents.push(SsdExtent { offset, len });
            }
        }
        if let (false, Some(s)) = (extents.is_empty(), &self.ssd) {
            let s = s.clone();
            self.meta.after_durable(move || extents.into_iter().for_each(|e| s.release(e)));
        }
    }

    /// Hand the index's pending events to the policies (the caller holds the policies lock).
    fn feed(&self, policies: &mut Policies) {
        let ev = self.ix().take_events();
        policies.feed(&ev);
    }

    /// This node's free space, as a placement policy sees it.
    fn nodes(&self) -> NodeSet {
        let mut free = [0u64; 3];
        for (s, _, _) in self.spaces() {
            free[s.tier() as usize] = s.free();
        }
        let mut nodes = NodeSet::default();
        nodes.push(0, free, 0);
        nodes
    }

    /// Wait for every queued metadata change, then flush sled.
    pub fn flush(&self) {
        if let Err(e) = self.meta.flush() {
            warn!(error = %e, "metadata flush failed");
        }
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }
}

impl crate::policy::PolicySlots for Store {
    fn begin_swap(&self) -> Events {
        let mut pol = self.policies.lock();
        // The snapshot and the start of the tap are one instant: events before it are in the
        // snapshot (and fed to the current policies now), events after it reach the tap.
        let (ev, snapshot) = {
            let mut ix = self.ix();
            (ix.take_events(), ix.snapshot())
        };
        pol.feed(&ev);
        pol.start_tap();
        snapshot
    }

    fn abort_swap(&self) {
        self.policies.lock().abort_tap();
    }

    fn finish_swap(&self, slot: NewSlot) {
        let old = {
            let mut pol = self.policies.lock();
            self.feed(&mut pol);
            pol.swap(slot)
        };
        // The old module (and its wasmtime store) is dropped outside the lock.
        drop(old);
    }

    fn with_policies(&self, f: &mut dyn FnMut(&Policies)) {
        f(&self.policies.lock());
    }
}
