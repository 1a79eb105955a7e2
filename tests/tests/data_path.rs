//! Round trips, immutability, lookup, leases, watermarks and eviction order, through the client.

use kvpool_client::{PutEntry, PutOptions};
use kvpool_proto::{ErrorCode, PinSpec, PutMode};
use kvpool_tests::{value_for, Opts, TestServer, ADMIN_KEY};
use rand::{Rng, SeedableRng};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_of_random_sizes_single_and_batch() {
    let srv = TestServer::start(Opts { dram: "512MiB", ..Opts::default() });
    let c = srv.client(ADMIN_KEY).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut sizes = vec![1usize, 2, 255, 256, 257, 4096, 65536, 1 << 20, 16 << 20];
    sizes.extend((0..12).map(|_| rng.gen_range(1..=16 << 20)));
    for (i, &n) in sizes.iter().enumerate() {
        let key = format!("single-{i}");
        let v: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        c.put(&key, &v).await.unwrap();
        let got = c.get(&key).await.unwrap().expect("present");
        assert_eq!(got.len(), n);
        assert!(got == v, "bytes differ for size {n}");
    }
    // Batch of mixed sizes, one request each way.
    let vals: Vec<(String, Vec<u8>)> =
        (0..48).map(|i| (format!("batch-{i}"), (0..rng.gen_range(1..=2 << 20)).map(|_| rng.gen()).collect())).collect();
    let entries: Vec<PutEntry> = vals.iter().map(|(k, v)| PutEntry::new(k.as_bytes(), v)).collect();
    let codes = c.put_batch(&entries, PutMode::Insert).await.unwrap();
    assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
    let keys: Vec<&str> = vals.iter().map(|(k, _)| k.as_str()).collect();
    let got = c.get_batch(&keys).await.unwrap();
    for ((_, v), g) in vals.iter().zip(&got) {
        assert_eq!(g.status, ErrorCode::Ok);
        assert!(g.value.as_deref() == Some(v.as_slice()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_with_gaps_immutability_and_upsert() {
    let srv = TestServer::start(Opts::default());
    let c = srv.client(ADMIN_KEY).await;
    for k in ["c0", "c1", "c3"] {
        c.put(k, k.as_bytes()).await.unwrap();
    }
    assert_eq!(c.lookup(&["c0", "c1", "c2", "c3"]).await.unwrap(), 2);
    assert_eq!(c.lookup(&["x", "c0"]).await.unwrap(), 0);
    assert_eq!(c.exists(&["c0", "c2", "c3"]).await.unwrap(), vec![true, false, true]);
    // immutable: a second put keeps the first value
    let err = c.put("c0", b"other").await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::AlreadyExists);
    assert_eq!(c.get("c0").await.unwrap().unwrap(), b"c0");
    let codes =
        c.put_batch(&[PutEntry::new(b"c0", b"zz"), PutEntry::new(b"c9", b"nine")], PutMode::Insert).await.unwrap();
    assert_eq!(codes, vec![ErrorCode::AlreadyExists, ErrorCode::Ok]);
    // upsert replaces (c3 was never read, so it is not leased)
    c.upsert("c3", b"new value").await.unwrap();
    assert_eq!(c.get("c3").await.unwrap().unwrap(), b"new value");
    // lookup/exists on a missing key do not create anything
    assert_eq!(c.exists(&["c2"]).await.unwrap(), vec![false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_refuses_a_leased_block_unless_forced() {
    let srv = TestServer::start(Opts::default());
    let c = srv.client(ADMIN_KEY).await;
    c.put("leased", b"v").await.unwrap();
    c.put("free", b"v").await.unwrap();
    c.get("leased").await.unwrap().unwrap();
    assert_eq!(c.remove("leased", false).await.unwrap_err().code(), ErrorCode::Leased);
    // lookup/exists never renew or grant a lease
    c.lookup(&["free"]).await.unwrap();
    c.exists(&["free"]).await.unwrap();
    c.remove("free", false).await.unwrap();
    c.remove("leased", true).await.unwrap();
    assert_eq!(c.exists(&["leased", "free"]).await.unwrap(), vec![false, false]);
    assert_eq!(c.remove("leased", false).await.unwrap_err().code(), ErrorCode::NotFound);
    let r = c.remove_all(false).await.unwrap();
    assert_eq!(r.removed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_protects_a_read_from_eviction_and_memory_stays_in_the_segment() {
    let srv = TestServer::start(Opts { dram: "16MiB", ..Opts::default() });
    let c = srv.client(ADMIN_KEY).await;
    let hot = value_for("hot", 1 << 20);
    c.put("hot", &hot).await.unwrap();
    c.put("cold", &value_for("cold", 1 << 20)).await.unwrap();
    // lease "hot" (a get) just before the storm; "cold" is older and unleased
    assert!(c.get("hot").await.unwrap().unwrap() == hot);
    let rss_before = srv.rss();
    let watcher = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut max_used = 0;
            for _ in 0..200 {
                let s = c.stats().await.unwrap();
                let d = s.tiers.iter().find(|t| t.tier == "dram").unwrap();
                assert!(d.used_bytes <= d.capacity_bytes, "used {} > capacity {}", d.used_bytes, d.capacity_bytes);
                max_used = max_used.max(d.used_bytes);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            max_used
        })
    };
    // ~96 MiB through a 16 MiB segment
    for i in 0..96 {
        let k = format!("storm-{i}");
        c.put(&k, &value_for(&k, 1 << 20)).await.unwrap();
    }
    let max_used = watcher.await.unwrap();
    assert!(max_used > 0);
    assert_eq!(c.exists(&["hot", "cold"]).await.unwrap(), vec![true, false], "the leased block must survive");
    assert!(c.get("hot").await.unwrap().unwrap() == hot);
    // the bytes live in the segment: RSS grows by at most the segment plus slack
    let rss_after = srv.rss();
    assert!(rss_after < rss_before + (16 << 20) + (48 << 20), "rss {rss_before} -> {rss_after}");
    let s = c.stats().await.unwrap();
    let d = s.tiers.iter().find(|t| t.tier == "dram").unwrap();
    assert!(d.evictions >= 80, "evictions {}", d.evictions);
    let m = srv.scrape();
    assert!(kvpool_tests::metric(&m, "kvpool_evictions_total{tier=\"dram\"}") >= 80.0);
    assert!(m.contains("kvpool_op_duration_seconds_bucket{op=\"put\""));
    // The server's heap as its allocator counts it: held bytes within the resident pages.
    let allocated = kvpool_tests::metric(&m, "kvpool_heap_bytes{kind=\"allocated\"}");
    let resident = kvpool_tests::metric(&m, "kvpool_heap_bytes{kind=\"resident\"}");
    assert!(allocated > 0.0 && allocated <= resident, "heap: allocated {allocated}, resident {resident}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_is_leaf_first_and_keeps_chains_as_prefixes() {
    let srv = TestServer::start(Opts { dram: "16MiB", ..Opts::default() });
    let c = srv.client(ADMIN_KEY).await;
    // Eight chains of four 512 KiB blocks, oldest chain first: 16 MiB of data, so eviction runs.
    let chains: Vec<Vec<String>> = (0..8).map(|ch| (0..4).map(|b| format!("chain{ch}-b{b}")).collect()).collect();
    for chain in &chains {
        for (i, k) in chain.iter().enumerate() {
            let opts = PutOptions {
                parent: (i > 0).then(|| chain[i - 1].clone().into_bytes()),
                tokens: 512,
                seq_tokens: 512 * (i as u64 + 1),
                pin: PinSpec::None,
            };
            c.put_with(k, &value_for(k, 512 << 10), opts).await.unwrap();
        }
    }
    // More unrelated blocks push the oldest chains out.
    for i in 0..12 {
        let k = format!("filler-{i}");
        c.put(&k, &value_for(&k, 512 << 10)).await.unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let mut partial = 0;
    for chain in &chains {
        let present = c.exists(chain).await.unwrap();
        let n = c.lookup(chain).await.unwrap();
        // resident blocks of a chain always form a prefix: no root evicted before its leaf
        assert!(present.iter().skip(n).all(|p| !p), "chain {chain:?} has a gap: {present:?}");
        if n > 0 && n < 4 {
            partial += 1;
        }
    }
    // the oldest chain went first, leaf first
    let first = c.exists(&chains[0]).await.unwrap();
    assert!(!first[3], "oldest chain's leaf should be evicted first");
    let last = c.exists(&chains[7]).await.unwrap();
    assert!(last.iter().all(|p| *p), "newest chain must be intact: {last:?}");
    let _ = partial;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_threshold_rejects_short_prefixes_and_hard_pins_survive() {
    let srv = TestServer::start(Opts { dram: "8MiB", cache: "store_threshold = 1024".into(), ..Opts::default() });
    let c = srv.client(ADMIN_KEY).await;
    let opts = |seq| PutOptions { seq_tokens: seq, tokens: 512, ..PutOptions::default() };
    let err = c.put_with("short", b"x", opts(512)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Rejected);
    c.put_with("long", b"x", opts(1024)).await.unwrap();
    assert_eq!(c.exists(&["short", "long"]).await.unwrap(), vec![false, true]);
    let pinned = value_for("pinned", 1 << 20);
    c.put_with("pinned", &pinned, PutOptions { pin: PinSpec::Hard, ..opts(4096) }).await.unwrap();
    for i in 0..40 {
        let k = format!("p-{i}");
        c.put_with(&k, &value_for(&k, 1 << 20), opts(4096)).await.unwrap();
    }
    assert!(c.get("pinned").await.unwrap().unwrap() == pinned);
    let s = c.stats().await.unwrap();
    assert!(s.rejected_puts >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_waits_then_fails_with_no_space_and_keeps_serving() {
    let srv = TestServer::start(Opts { dram: "8MiB", cache: "put_wait_ms = 300".into(), ..Opts::default() });
    let c = srv.client(ADMIN_KEY).await;
    // hard pins fill the segment: nothing is evictable
    let mut stored = Vec::new();
    for i in 0..16 {
        let k = format!("pin-{i}");
        match c.put_with(&k, &value_for(&k, 1 << 20), PutOptions { pin: PinSpec::Hard, ..PutOptions::default() }).await
        {
            Ok(()) => stored.push(k),
            Err(e) => {
                assert_eq!(e.code(), ErrorCode::NoSpace);
                break;
            }
        }
    }
    assert!(stored.len() >= 6, "{} pinned", stored.len());
    let t = std::time::Instant::now();
    let err = c.put("one-more", &value_for("one-more", 1 << 20)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::NoSpace);
    assert!(t.elapsed() >= std::time::Duration::from_millis(250), "a put waits for space before failing");
    // the pool still serves, and freeing space makes puts work again
    assert!(c.get(&stored[0]).await.unwrap().unwrap() == value_for(&stored[0], 1 << 20));
    c.remove(&stored[0], true).await.unwrap();
    c.put("one-more", &value_for("one-more", 1 << 20)).await.unwrap();
    assert!(srv.scrape().contains("kvpool_rejected_puts_total{reason=\"no_space\"}"));
}

/// Sum of a metric's samples whose labels include every one of `labels`.
fn labelled(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_metrics_count_bytes_and_time_by_transport_and_direction() {
    use kvpool_client::{Client, TransportChoice};
    let srv = TestServer::start(Opts::default());
    let quic = Client::connect(srv.client_config_on(ADMIN_KEY, TransportChoice::Quic)).await.unwrap();
    let v = value_for("q", 300_000);
    quic.put("q", &v).await.unwrap();
    assert!(quic.get("q").await.unwrap().expect("present") == v);
    let shm = Client::connect(srv.client_config_on(ADMIN_KEY, TransportChoice::Shm)).await.unwrap();
    let mut buf = shm.alloc_buffer(1 << 20).unwrap();
    buf.as_mut_slice()[..200_000].copy_from_slice(&value_for("s", 200_000));
    let entry = [("s", buf.slice(0, 200_000).unwrap(), PutOptions::default())];
    assert_eq!(shm.put_from_batch(&entry, PutMode::Insert).await.unwrap(), vec![ErrorCode::Ok]);
    let got = shm.get_into_batch(&["s"], &[buf.slice(500_000, 200_000).unwrap()]).await.unwrap();
    assert_eq!(got[0].status, ErrorCode::Ok);
    let text = srv.scrape();
    for (transport, direction, at_least) in
        [("quic", "in", 300_000.0), ("quic", "out", 300_000.0), ("shm", "in", 200_000.0), ("shm", "out", 200_000.0)]
    {
        let labels = [format!("transport=\"{transport}\""), format!("direction=\"{direction}\"")];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        let bytes = labelled(&text, "kvpool_transfer_bytes_total", &labels);
        assert!(bytes >= at_least, "{transport} {direction}: {bytes} bytes\n{text}");
        assert!(labelled(&text, "kvpool_transfer_seconds_count", &labels) >= 1.0, "{transport} {direction}");
    }
}
