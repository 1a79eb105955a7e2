//! The requests an inference engine's connector leans on, against a real server: a lookup that
//! holds what it counted (so that eviction cannot take a block between an engine's lookup and
//! its load) and the removal of every block whose key matches (a prefix-cache reset).

use kvpool_client::{Client, ErrorCode, PutOptions};
use kvpool_tests::{value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

fn chain_opts(keys: &[String], i: usize) -> PutOptions {
    PutOptions { parent: (i > 0).then(|| keys[i - 1].clone().into_bytes()), ..PutOptions::default() }
}

/// Put `keys` as one prefix chain of `size`-byte blocks.
async fn put_chain(c: &Client, keys: &[String], size: usize) {
    for (i, k) in keys.iter().enumerate() {
        c.put_with(k, &value_for(k, size), chain_opts(keys, i)).await.unwrap();
    }
}

/// Fill the pool with `n` blocks of filler (each put waits for eviction's room or fails).
async fn churn(c: &Client, tag: &str, n: usize, size: usize) {
    for i in 0..n {
        let k = format!("{tag}-{i}");
        let _ = c.put(&k, &value_for(&k, size)).await;
    }
}

async fn resident(c: &Client, keys: &[String]) -> Vec<bool> {
    c.exists(keys).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_lease_keeps_its_blocks_through_eviction_until_released() {
    // Gets lease for 100 ms only, so that the reads below do not keep the chain themselves.
    let srv = TestServer::start(Opts { dram: "16MiB", cache: "lease_ttl_ms = 100".into(), ..Opts::default() });
    let c = srv.client(ALICE_KEY).await;
    let chain: Vec<String> = (0..4).map(|i| format!("model@blk{i}")).collect();
    put_chain(&c, &chain, MIB).await;
    let missing = ["model@nope".to_string()];
    let asked: Vec<&String> = chain.iter().chain(missing.iter()).collect();
    let l = c.lookup_lease(&asked, Duration::from_secs(30)).await.unwrap();
    assert_eq!(l.resident, 4);
    assert_ne!(l.lease, 0);
    assert_eq!(l.lease_ms, 30_000);
    // Four times the DRAM in other blocks: without the hold the chain would be gone.
    churn(&c, "filler", 64, MIB).await;
    assert_eq!(resident(&c, &chain).await, vec![true; 4], "held blocks were evicted");
    // A remove without force skips held blocks; the chain's values are intact.
    assert_eq!(c.remove_batch(&chain[..1], false).await.unwrap(), vec![ErrorCode::Leased]);
    for k in &chain {
        assert_eq!(c.get(k).await.unwrap().unwrap(), value_for(k, MIB), "{k}");
    }
    // Released: the chain is ordinary blocks again and eviction may take them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.release(l.lease).await.unwrap();
    assert_eq!(c.release(l.lease).await.unwrap_err().code(), ErrorCode::Expired);
    churn(&c, "filler2", 64, MIB).await;
    assert_eq!(resident(&c, &chain).await, vec![false; 4], "released blocks were never evicted");
    // Nothing counted, nothing held: no lease to release.
    let none = c.lookup_lease(&chain, Duration::ZERO).await.unwrap();
    assert_eq!((none.resident, none.lease), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_ends_with_its_time_and_with_its_connection() {
    let srv = TestServer::start(Opts { dram: "16MiB", ..Opts::default() });
    let c = srv.client(ALICE_KEY).await;
    let a: Vec<String> = (0..3).map(|i| format!("a{i}")).collect();
    let b: Vec<String> = (0..3).map(|i| format!("b{i}")).collect();
    put_chain(&c, &a, MIB).await;
    put_chain(&c, &b, MIB).await;
    // `a` held for 300 ms; `b` held on a second connection that then closes.
    let la = c.lookup_lease(&a, Duration::from_millis(300)).await.unwrap();
    assert_eq!((la.resident, la.lease_ms), (3, 300));
    let other = srv.client(ALICE_KEY).await;
    assert_eq!(other.lookup_lease(&b, Duration::from_secs(60)).await.unwrap().resident, 3);
    // Both holds stand against a remove without force...
    assert_eq!(c.remove_batch(&[&a[0], &b[0]], false).await.unwrap(), vec![ErrorCode::Leased; 2]);
    other.close().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // ...and neither does after its time or its connection.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = c.remove_batch(&[&a[0], &b[0]], false).await.unwrap();
        if st.iter().all(|s| *s != ErrorCode::Leased) {
            assert_eq!(st, vec![ErrorCode::Ok; 2]);
            break;
        }
        assert!(Instant::now() < deadline, "holds outlived their lease: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A hold asks at most a minute: longer asks are cut to it.
    let long = c.lookup_lease(&a[1..], Duration::from_secs(3600)).await.unwrap();
    assert_eq!(long.lease_ms, 60_000);
    // A lease is its connection's own: another connection cannot release it.
    let third = srv.client(ALICE_KEY).await;
    assert_eq!(third.release(long.lease).await.unwrap_err().code(), ErrorCode::Expired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_matching_drops_one_models_blocks_only() {
    let srv = TestServer::start(Opts::default());
    let alice = srv.client(ALICE_KEY).await;
    let bob = srv.client(BOB_KEY).await;
    let mut a_keys = Vec::new();
    for model in ["llama", "llama-2", "qwen"] {
        for i in 0..5 {
            a_keys.push(format!("{model}@tp_rank:0@{i:02x}"));
        }
    }
    for k in &a_keys {
        alice.put(k, &value_for(k, 1000)).await.unwrap();
    }
    bob.put("llama@tp_rank:0@00", b"bob's").await.unwrap();
    // One block of "llama" is held by a lookup: kept without force.
    let l = alice.lookup_lease(&["llama@tp_rank:0@04"], Duration::from_secs(30)).await.unwrap();
    assert_eq!(l.resident, 1);
    let r = alice.remove_matching("llama@", None, false).await.unwrap();
    assert_eq!((r.removed, r.skipped), (4, 1));
    let left: Vec<bool> = alice.exists(&a_keys).await.unwrap();
    let want: Vec<bool> = a_keys.iter().map(|k| !k.starts_with("llama@") || k.ends_with("04")).collect();
    assert_eq!(left, want, "llama-2 and qwen stay, llama goes but its held block");
    assert_eq!(bob.get("llama@tp_rank:0@00").await.unwrap().unwrap(), b"bob's", "another tenant's blocks stay");
    let r = alice.remove_matching("llama@", None, true).await.unwrap();
    assert_eq!((r.removed, r.skipped), (1, 0));
    // A pattern within a prefix, and a pattern alone.
    let r = alice.remove_matching("qwen@", Some("@0[0-2]$"), false).await.unwrap();
    assert_eq!(r.removed, 3);
    let r = alice.remove_matching("", Some(r"^llama-\d@"), false).await.unwrap();
    assert_eq!(r.removed, 5);
    assert_eq!(alice.exists(&["qwen@tp_rank:0@03", "qwen@tp_rank:0@04"]).await.unwrap(), vec![true, true]);
    // A pattern that does not compile, one too large to compile, a prefix past the key limit.
    for (prefix, pattern) in [("", "(unclosed"), ("", "(a{1000}){1000}")] {
        let e = alice.remove_matching(prefix, Some(pattern), false).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArgument, "{pattern}: {e}");
    }
    let e = alice.remove_matching(vec![b'x'; 2000], None, false).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::KeyTooLong);
    // The server serves on, and an admin's empty prefix removes the admin's tenant only.
    let admin = srv.client(ADMIN_KEY).await;
    admin.put("adm", b"x").await.unwrap();
    assert_eq!(admin.remove_matching("", None, false).await.unwrap().removed, 1);
    assert_eq!(alice.exists(&["qwen@tp_rank:0@03"]).await.unwrap(), vec![true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_fails_requests_within_dead_after_not_the_request_timeout() {
    let mut srv = TestServer::start(Opts::default());
    // QUIC only: a same-host control socket would notice at once (the socket closes).
    let mut cfg = srv.client_config_on(ALICE_KEY, kvpool_client::TransportChoice::Quic);
    cfg.request_timeout = Duration::from_secs(30);
    cfg.dead_after = Duration::from_millis(600);
    let c = Client::connect(cfg).await.unwrap();
    c.put("k", b"v").await.unwrap();
    // Idle past several keep-alives: a live server is never taken for dead.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(c.get("k").await.unwrap().unwrap(), b"v");
    srv.kill();
    let t0 = Instant::now();
    let e = c.lookup(&["k"]).await.unwrap_err();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(3), "a dead server took {took:?} to notice");
    assert!(matches!(e, kvpool_client::ClientError::Closed(_) | kvpool_client::ClientError::Connect { .. }), "{e}");
    // Back at the same address: the same client reconnects by itself.
    srv.start_again();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.ping().await {
            Ok(_) => break,
            Err(e) => assert!(Instant::now() < deadline, "no reconnect: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.put("k2", b"v2").await.unwrap();
}
