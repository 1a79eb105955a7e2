//! The store with its real tiers and sled, in a temporary directory.

use super::put::PutError;
use super::read::{GetPlan, ReadError};
use super::*;
use crate::metrics::Metrics;
use kvpool_core::{BlockRecord, PinRequest, PutRefusal, PutSpec};
use kvpool_proto::ErrorCode;
use std::time::Duration;

/// A commit's outcome as the wire gives it (the service maps it so).
fn code(r: Result<(), PutError>) -> ErrorCode {
    match r {
        Ok(()) => ErrorCode::Ok,
        Err(PutError::Refused(PutRefusal::AlreadyExists)) => ErrorCode::AlreadyExists,
        Err(_) => ErrorCode::Internal,
    }
}

fn cfg(dir: &std::path::Path) -> StoreConfig {
    StoreConfig {
        data_dir: dir.to_path_buf(),
        dram_bytes: 8 << 20,
        dram_high: 0.95,
        dram_low: 0.85,
        dram_populate: false,
        ssd_dir: Some(dir.join("ssd")),
        ssd_bytes: 64 << 20,
        ssd_high: 0.95,
        ssd_low: 0.85,
        ssd_fsync: false,
        meta_cache: 64 << 20,
        lease_ttl: Duration::from_secs(5),
        soft_pin_ttl: Duration::from_secs(60),
        put_wait: Duration::from_millis(100),
        promote_on_hit: false,
    }
}

fn record(size: u64, sum: u64, file: u64, created_ms: u64) -> BlockRecord {
    BlockRecord {
        size,
        tokens: 0,
        seq_tokens: 0,
        parent: None,
        checksum: sum,
        created_ms,
        pin: 0,
        pin_until_ms: 0,
        ssd_file: Some(file),
        in_dram: false,
    }
}

async fn read(store: &Arc<Store>, key: &str) -> Result<Vec<u8>, ErrorCode> {
    match store.plan_get(1, &[key.as_bytes().to_vec()]).remove(0) {
        GetPlan::Ssd { id, file, size, checksum } => {
            store.read_ssd(id, file, size, checksum).await.map(|s| s.bytes().to_vec()).map_err(|e| match e {
                ReadError::NoSsd => ErrorCode::NotFound,
                ReadError::Corrupt => ErrorCode::Corrupt,
            })
        }
        GetPlan::Dram { block, .. } => Ok(block.bytes().to_vec()),
        GetPlan::Missing => Err(ErrorCode::NotFound),
    }
}

#[tokio::test]
async fn a_file_per_block_ssd_tier_is_migrated_into_the_segment() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir_all(&ssd).unwrap();
    {
        // The earlier layout: `<id>.blk` files named by the records.
        let meta = meta::Meta::open(&dir.path().join("meta"), 64 << 20).unwrap();
        for (i, key) in ["a", "b", "short", "gone"].iter().enumerate() {
            let data = vec![i as u8 + 1; 10_000];
            let file = i as u64 + 1;
            meta.put_now(1, key.as_bytes(), &record(10_000, checksum(&data), file, 1)).unwrap();
            let on_disk = if *key == "short" { &data[..100] } else { &data[..] };
            if *key != "gone" {
                std::fs::write(ssd.join(format!("{file:016x}.blk")), on_disk).unwrap();
            }
        }
        std::fs::write(ssd.join("0000000000000009.tmp"), b"partial").unwrap();
        meta.flush().unwrap();
    }
    let store = Store::open(cfg(dir.path()), Arc::new(Metrics::new()), crate::policy::builtin_policies(0)).unwrap();
    assert_eq!(read(&store, "a").await.unwrap(), vec![1u8; 10_000]);
    assert_eq!(read(&store, "b").await.unwrap(), vec![2u8; 10_000]);
    assert_eq!(read(&store, "short").await, Err(ErrorCode::NotFound), "a short file is dropped");
    assert_eq!(read(&store, "gone").await, Err(ErrorCode::NotFound));
    assert!(ssd::legacy_files(&ssd).is_empty(), "old files are gone");
    assert!(std::fs::read_dir(&ssd).unwrap().all(|e| e.unwrap().file_name() == ssd::SEGMENT_FILE));
    store.flush();
    drop(store);
    // A restart finds them in the segment (no second migration).
    let store = Store::open(cfg(dir.path()), Arc::new(Metrics::new()), crate::policy::builtin_policies(0)).unwrap();
    assert_eq!(read(&store, "b").await.unwrap(), vec![2u8; 10_000]);
}

#[tokio::test]
async fn two_records_naming_one_extent_leave_it_to_the_newer() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = SsdTier::open(&dir.path().join("ssd"), 64 << 20, false).unwrap();
        s.write(0, &[9u8; 5000]).unwrap();
        let meta = meta::Meta::open(&dir.path().join("meta"), 64 << 20).unwrap();
        meta.kv.insert("ssd-layout", b"segment-v1".as_slice()).unwrap();
        // "old" was removed and its extent reused by "new", but the removal never reached sled.
        meta.put_now(1, b"old", &record(5000, checksum(&[3u8; 5000]), 0, 10)).unwrap();
        meta.put_now(1, b"new", &record(5000, checksum(&[9u8; 5000]), 0, 20)).unwrap();
        meta.flush().unwrap();
    }
    let store = Store::open(cfg(dir.path()), Arc::new(Metrics::new()), crate::policy::builtin_policies(0)).unwrap();
    assert_eq!(read(&store, "new").await.unwrap(), vec![9u8; 5000]);
    assert_eq!(read(&store, "old").await, Err(ErrorCode::NotFound));
}

/// A plan holds its block's id until committed; one dropped on the way (before its space, with
/// its space, or refused at commit) gives it back at the next put, and the committed one stays.
#[tokio::test]
async fn plans_dropped_before_their_commit_give_their_ids_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(cfg(dir.path()), Arc::new(Metrics::new()), crate::policy::builtin_policies(0)).unwrap();
    let item = |k: &'static [u8]| PutSpec {
        key: k,
        size: 4096,
        parent: None,
        tokens: 0,
        seq_tokens: 0,
        pin: PinRequest::None,
    };
    let items = [item(b"a"), item(b"b"), item(b"c"), item(b"d")];
    let mut plans = store.plan_put(1, &items, false).into_iter().map(|p| match p {
        Ok(p) => p,
        Err(r) => panic!("refused: {r:?}"),
    });
    let (a, b, c, d) = (plans.next().unwrap(), plans.next().unwrap(), plans.next().unwrap(), plans.next().unwrap());
    assert_eq!(store.plans_held(), 4);
    let by = tokio::time::Instant::now() + Duration::from_secs(1);
    drop(a);
    let placed_b = store.reserve_for(b, 4096, false, by).await.unwrap();
    drop(placed_b);
    let mut placed_c = store.reserve_for(c, 4096, false, by).await.unwrap();
    placed_c.bytes_mut().fill(1);
    assert_eq!(code(store.commit(&items[2], placed_c).await), ErrorCode::Ok);
    // Committed into a key that another put took meanwhile: refused, and its id is given back.
    let mut placed_d = store.reserve_for(d, 4096, false, by).await.unwrap();
    placed_d.bytes_mut().fill(2);
    assert_eq!(code(store.commit(&items[2], placed_d).await), ErrorCode::AlreadyExists);
    assert_eq!(store.plans_held(), 0);
    assert_eq!(store.exists(1, &[b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]), vec![false, false, true]);
    assert_eq!(read(&store, "c").await.unwrap(), vec![1u8; 4096]);
    assert_eq!(store.counts().0, 1);
}

#[tokio::test]
async fn a_block_found_corrupt_on_the_way_out_is_counted_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(cfg(dir.path()), Arc::new(Metrics::new()), crate::policy::builtin_policies(0)).unwrap();
    let item = PutSpec { key: b"k", size: 4096, parent: None, tokens: 0, seq_tokens: 0, pin: PinRequest::None };
    let Ok(plan) = store.plan_put(1, std::slice::from_ref(&item), false).remove(0) else {
        panic!("expected a plan to store");
    };
    let by = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut placed = store.reserve_for(plan, 4096, false, by).await.unwrap();
    assert!(matches!(placed.landing, super::put::Landing::Dram(_)));
    placed.bytes_mut().fill(7);
    assert_eq!(code(store.commit(&item, placed).await), ErrorCode::Ok);
    // Leased by a reader, as a get's block is while it is copied out.
    let plan = store.plan_get(1, &[b"k".to_vec()]);
    assert!(matches!(plan[0], GetPlan::Dram { .. }));
    store.drop_corrupt_key(1, b"k");
    assert_eq!(store.tenant_counters(1).corrupt, 1);
    assert_eq!(store.exists(1, &[b"k".to_vec()]), vec![false]);
    drop(plan);
    assert_eq!(read(&store, "k").await, Err(ErrorCode::NotFound));
}
