//! SSD demotion/promotion, crash recovery after SIGKILL, and corruption detection.

use kvpool_proto::ErrorCode;
use kvpool_tests::{value_for, Opts, TestServer, ADMIN_KEY};
use std::time::Duration;

fn ssd_opts() -> Opts {
    Opts { dram: "8MiB", ssd: "512MiB", ..Opts::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demotion_to_ssd_and_promotion_on_hit() {
    let srv = TestServer::start(ssd_opts());
    let c = srv.client(ADMIN_KEY).await;
    let keys: Vec<String> = (0..40).map(|i| format!("blk-{i}")).collect();
    for k in &keys {
        c.put(k, &value_for(k, 1 << 20)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = c.stats().await.unwrap();
    assert!(s.demotions > 0, "{s:?}");
    assert_eq!(s.blocks, 40, "nothing is lost: DRAM victims went to SSD");
    // every block comes back intact; the early ones from SSD
    let r = c.get_batch(&keys[..4]).await.unwrap();
    for (k, g) in keys.iter().zip(&r) {
        assert_eq!(g.status, ErrorCode::Ok);
        assert_eq!(g.tier, 2, "{k} should be served from ssd");
        assert!(g.value.as_deref() == Some(value_for(k, 1 << 20).as_slice()));
    }
    for k in &keys {
        assert!(c.get(k).await.unwrap().unwrap() == value_for(k, 1 << 20), "{k}");
    }
    let s = c.stats().await.unwrap();
    assert!(s.promotions > 0, "{s:?}");
    let ssd = s.tiers.iter().find(|t| t.tier == "ssd").unwrap();
    assert!(ssd.hits >= 4);
    let m = srv.scrape();
    assert!(kvpool_tests::metric(&m, "kvpool_demotions_total") > 0.0);
    assert!(kvpool_tests::metric(&m, "kvpool_hits_total{tier=\"ssd\"}") >= 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_put_storm_then_restart_serves_exactly_what_it_reports() {
    let mut srv = TestServer::start(ssd_opts());
    let c = srv.client(ADMIN_KEY).await;
    let storm = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut i = 0u64;
            loop {
                let k = format!("storm-{i}");
                if c.put(&k, &value_for(&k, 256 << 10)).await.is_err() {
                    return i;
                }
                i += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    srv.kill();
    let attempted = storm.await.unwrap() + 1;
    assert!(attempted > 20, "storm too short: {attempted}");
    srv.start_again();
    let c = srv.client(ADMIN_KEY).await;
    let s = c.stats().await.unwrap();
    // DRAM copies are gone from the index: only SSD blocks came back
    assert_eq!(s.tiers.iter().find(|t| t.tier == "dram").unwrap().blocks, 0);
    let keys: Vec<String> = (0..attempted).map(|i| format!("storm-{i}")).collect();
    let mut reported = 0;
    for chunk in keys.chunks(256) {
        let present = c.exists(chunk).await.unwrap();
        for (k, p) in chunk.iter().zip(present) {
            if p {
                reported += 1;
                let v = c.get(k).await.unwrap().unwrap_or_else(|| panic!("{k} reported but missing"));
                assert!(v == value_for(k, 256 << 10), "{k}: wrong bytes after restart");
            }
        }
    }
    assert_eq!(s.blocks, reported, "stats and exists agree");
    assert!(reported > 0, "SSD-tier blocks must survive a crash");
    // and the pool keeps working
    c.put("after", b"ok").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_restart_keeps_ssd_blocks() {
    let mut srv = TestServer::start(ssd_opts());
    let c = srv.client(ADMIN_KEY).await;
    for i in 0..30 {
        let k = format!("k{i}");
        c.put(&k, &value_for(&k, 1 << 20)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = c.stats().await.unwrap();
    let on_ssd = before.tiers.iter().find(|t| t.tier == "ssd").unwrap().blocks;
    assert!(on_ssd > 0);
    drop(c);
    srv.restart();
    let c = srv.client(ADMIN_KEY).await;
    let after = c.stats().await.unwrap();
    assert_eq!(after.blocks, on_ssd);
    for i in 0..30 {
        let k = format!("k{i}");
        if let Some(v) = c.get(&k).await.unwrap() {
            assert!(v == value_for(&k, 1 << 20));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_ssd_byte_is_detected_and_never_served() {
    let srv = TestServer::start(ssd_opts());
    let c = srv.client(ADMIN_KEY).await;
    let keys: Vec<String> = (0..24).map(|i| format!("c{i}")).collect();
    for k in &keys {
        c.put(k, &value_for(k, 1 << 20)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Flip one byte in the middle of every block in the SSD segment file (all values are 1 MiB,
    // so their extents are the written 1 MiB stretches of the file).
    let seg = srv.data_dir().join("ssd").join("blocks.kvs");
    let mut data = std::fs::read(&seg).unwrap();
    let mut flipped = 0;
    for chunk in data.chunks_mut(1 << 20) {
        if chunk.iter().any(|b| *b != 0) {
            chunk[chunk.len() / 2] ^= 0x5a;
            flipped += 1;
        }
    }
    std::fs::write(&seg, data).unwrap();
    assert!(flipped > 0);
    let mut misses = 0;
    for k in &keys {
        match c.get(k).await {
            Ok(Some(v)) => assert!(v == value_for(k, 1 << 20), "{k}: corrupted bytes were served"),
            Ok(None) => panic!("{k}: a corrupt block is reported as corrupt the first time"),
            Err(e) => {
                assert_eq!(e.code(), ErrorCode::Corrupt, "{e}");
                misses += 1;
                // dropped: from now on a plain miss
                assert_eq!(c.get(k).await.unwrap(), None);
            }
        }
    }
    assert_eq!(misses, flipped, "every corrupted block reads as a miss");
    let s = c.stats().await.unwrap();
    assert_eq!(s.corrupt_blocks, flipped as u64);
    assert_eq!(c.exists(&keys).await.unwrap().iter().filter(|p| !**p).count(), flipped, "corrupt blocks are dropped");
}
