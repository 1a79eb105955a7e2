//! Opening a store: the tiers, sled, the index rebuilt from sled, the policies warmed with it,
//! and the one-time move of an SSD tier of the earlier layout into the segment file.

use super::dram::{self, DramTier};
use super::meta::{self, Meta};
use super::ssd::{self, SsdTier};
use super::tier::Medium;
use super::{wall_ms, Store, StoreConfig, StoreError};
use crate::metrics::Metrics;
use kvpool_core::{Granularity, Index, Policies};
use kvpool_policy_sdk::Events;
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Move an SSD tier of the earlier layout (one `<id>.blk` file per block) into the segment file:
/// each record's block is copied into an extent and its record updated; records whose file is
/// missing or short are dropped. Done once; sled remembers the layout.
fn migrate_legacy_ssd(meta: &Meta, ssd: &SsdTier, dir: &std::path::Path) -> Result<(), StoreError> {
    const LAYOUT_KEY: &str = "ssd-layout";
    const LAYOUT: &[u8] = b"segment-v1";
    if meta.kv.get(LAYOUT_KEY).ok().flatten().is_some_and(|v| v.as_ref() == LAYOUT) {
        return Ok(());
    }
    let files: std::collections::HashMap<u64, (u64, PathBuf)> =
        ssd::legacy_files(dir).into_iter().map(|(id, len, p)| (id, (len, p))).collect();
    if !files.is_empty() {
        tracing::info!(files = files.len(), dir = %dir.display(), "migrating the SSD tier to a segment file");
    }
    let (mut moved, mut dropped) = (0u64, 0u64);
    let mut placed = Vec::new();
    for (tenant, key, rec) in meta.all() {
        let Some(mut r) = rec else { continue };
        let Some(file) = r.ssd_file else { continue };
        let copied = files.get(&file).filter(|(len, _)| *len == r.size).and_then(|(_, path)| {
            let data = std::fs::read(path).ok()?;
            let mut extent = ssd.reserve(r.size)?;
            match Medium::write(ssd, &mut extent, 0, &data) {
                Ok(()) => Some(extent),
                Err(_) => {
                    ssd.release(extent);
                    None
                }
            }
        });
        match copied {
            Some(extent) => {
                r.ssd_file = Some(extent.offset);
                meta.put_now(tenant, &key, &r)?;
                placed.push(extent);
                moved += 1;
            }
            None => {
                meta.remove_now(tenant, &key)?;
                dropped += 1;
            }
        }
    }
    // Recovery claims the extents again from the records.
    for extent in placed {
        ssd.release(extent);
    }
    meta.kv.insert(LAYOUT_KEY, LAYOUT).map_err(meta::MetaError::from)?;
    meta.flush()?;
    for (_, (_, path)) in files {
        let _ = std::fs::remove_file(path);
    }
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if moved + dropped > 0 {
        tracing::info!(moved, dropped, "SSD tier migrated");
    }
    Ok(())
}

impl Store {
    /// Open the tiers and sled, and rebuild the index from sled (SSD copies survive a restart).
    pub fn open(cfg: StoreConfig, metrics: Arc<Metrics>, policies: Policies) -> Result<Arc<Store>, StoreError> {
        let meta = Meta::open(&cfg.data_dir.join("meta"), cfg.meta_cache)?;
        let dram = DramTier::new(cfg.dram_bytes, cfg.dram_populate)?;
        let ssd = match (&cfg.ssd_dir, cfg.ssd_bytes) {
            (Some(dir), cap) if cap > 0 => {
                let t = SsdTier::open(dir, cap, cfg.ssd_fsync)?;
                migrate_legacy_ssd(&meta, &t, dir)?;
                Some(Arc::new(t))
            }
            _ => None,
        };
        let gran = Granularity { dram: dram::UNIT, ssd: ssd::SSD_UNIT };
        let mut index = Index::new(gran, ssd.is_some());
        // Newest first: an extent two records name (a crash between a reuse and the older
        // record's removal) belongs to the newer one.
        let started = Instant::now();
        let mut records = meta.all();
        let read_ms = started.elapsed().as_millis() as u64;
        records.sort_unstable_by_key(|(_, _, r)| std::cmp::Reverse(r.as_ref().map_or(0, |r| r.created_ms)));
        let t = Instant::now();
        let rec = index.recover(
            records,
            |extents| match &ssd {
                Some(s) => s.adopt_all(extents),
                None => vec![false; extents.len()],
            },
            wall_ms(),
        );
        let index_ms = t.elapsed().as_millis() as u64;
        meta.enqueue(rec.meta);
        if rec.kept + rec.dropped > 0 {
            tracing::info!(
                kept = rec.kept,
                dropped = rec.dropped,
                ms = started.elapsed().as_millis() as u64,
                read_ms,
                index_ms,
                "recovered block index from sled (SSD copies kept and verified on first read, DRAM copies dropped)"
            );
        }
        let store = Arc::new(Store {
            cfg,
            dram,
            ssd,
            meta,
            index: Mutex::new(index),
            policies: Mutex::new(policies),
            metrics,
            kick: tokio::sync::Notify::new(),
            events: std::sync::OnceLock::new(),
            offload: std::sync::OnceLock::new(),
            abandoned: Default::default(),
        });
        store.update_gauges();
        if !rec.snapshot.is_empty() {
            store.warm_policies(rec.snapshot)?;
        }
        Ok(store)
    }

    /// Feed the recovered blocks to the policies on a thread of its own, so that lookups and
    /// gets serve at once (they need only the index). The thread holds the policy lock from
    /// before this returns until the feed is done: whatever needs a policy (a put's admission,
    /// an eviction) waits for the policies to know every recovered block, and events of reads
    /// meanwhile reach them after the snapshot, in order.
    pub(super) fn warm_policies(self: &Arc<Self>, snapshot: Events) -> Result<(), StoreError> {
        let (locked, wait) = std::sync::mpsc::sync_channel(1);
        let store = Arc::clone(self);
        std::thread::Builder::new()
            .name("kvpool-warm".into())
            .spawn(move || {
                let mut pol = store.policies.lock();
                let _ = locked.send(());
                let t = Instant::now();
                // The same parents-first snapshot a policy swap replays.
                pol.feed(&snapshot);
                tracing::info!(
                    events = snapshot.len(),
                    ms = t.elapsed().as_millis() as u64,
                    "policies warmed with the recovered blocks"
                );
            })
            .map_err(StoreError::Io)?;
        // Until the thread holds the lock, nothing may take it first.
        let _ = wait.recv();
        Ok(())
    }
}
