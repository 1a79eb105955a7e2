//! The Wasm policy engine through the QUIC admin API: load, list, rollback, persistence,
//! hot swap under load, and misbehaving modules.

use kvpool_client::PutOptions;
use kvpool_proto::{ErrorCode, PinSpec, PolicyKind};
use kvpool_tests::{components, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_only_load_list_rollback_and_restart_restores() {
    let comps = tokio::task::spawn_blocking(|| components(false)).await.unwrap();
    let mut srv = TestServer::start(Opts { dram: "32MiB", ..Opts::default() });
    let admin = srv.client(ADMIN_KEY).await;
    let alice = srv.client(ALICE_KEY).await;
    let sieve = std::fs::read(&comps["sieve"]).unwrap();
    let lru = std::fs::read(&comps["lru"]).unwrap();

    let err = alice.policy_load(PolicyKind::Eviction, "sieve", &[], &sieve).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Forbidden);
    assert_eq!(alice.policy_list().await.unwrap_err().code(), ErrorCode::Forbidden);

    // Garbage is refused with a typed error and the built-in stays active.
    let err = admin.policy_load(PolicyKind::Eviction, "junk", &[], b"not wasm").await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::PolicyError);
    // An admission module cannot be loaded as eviction.
    let threshold = std::fs::read(&comps["threshold"]).unwrap();
    let err = admin.policy_load(PolicyKind::Eviction, "threshold", &[], &threshold).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::PolicyError);

    for i in 0..20 {
        admin.put(format!("k{i}"), &value_for(&format!("k{i}"), 64 << 10)).await.unwrap();
    }
    let info = admin.policy_load(PolicyKind::Eviction, "sieve", &[], &sieve).await.unwrap();
    assert!(info.active && !info.builtin && info.name == "sieve" && info.sha256.len() == 64);
    let params = vec![("store_threshold".to_string(), "1024".to_string())];
    let info = admin.policy_load(PolicyKind::Admission, "threshold", &params, &threshold).await.unwrap();
    assert_eq!(info.params, params);
    // the module decides now: a short prefix is rejected through it
    let short = PutOptions { seq_tokens: 512, tokens: 512, parent: None, pin: PinSpec::None };
    assert_eq!(admin.put_with("short", b"x", short.clone()).await.unwrap_err().code(), ErrorCode::Rejected);
    let info = admin.policy_load(PolicyKind::Eviction, "lru", &[], &lru).await.unwrap();
    assert_eq!(info.name, "lru");

    let list = admin.policy_list().await.unwrap();
    let active: Vec<_> = list.iter().filter(|p| p.active).map(|p| (p.kind, p.name.clone())).collect();
    assert!(active.contains(&(PolicyKind::Eviction, "lru".into())), "{active:?}");
    assert!(active.contains(&(PolicyKind::Admission, "threshold".into())), "{active:?}");
    assert!(list.iter().any(|p| p.kind == PolicyKind::Eviction && p.name == "sieve" && !p.active));

    // rollback: lru -> sieve
    let info = admin.policy_rollback(PolicyKind::Eviction).await.unwrap();
    assert_eq!(info.name, "sieve");

    // restart restores the active modules and their parameters
    drop((admin, alice));
    srv.restart();
    let admin = srv.client(ADMIN_KEY).await;
    let list = admin.policy_list().await.unwrap();
    let ev = list.iter().find(|p| p.kind == PolicyKind::Eviction && p.active).unwrap();
    assert_eq!(ev.name, "sieve");
    let adm = list.iter().find(|p| p.kind == PolicyKind::Admission && p.active).unwrap();
    assert_eq!((adm.name.as_str(), adm.params.clone()), ("threshold", params));
    assert_eq!(admin.put_with("short", b"x", short.clone()).await.unwrap_err().code(), ErrorCode::Rejected);
    // rollback past the first module gives the built-in back
    admin.policy_rollback(PolicyKind::Eviction).await.unwrap();
    let info = admin.policy_rollback(PolicyKind::Admission).await.unwrap();
    assert!(info.builtin);
    let list = admin.policy_list().await.unwrap();
    assert!(list.iter().filter(|p| p.active).all(|p| p.builtin), "{list:?}");
    // Nothing left to roll back: not-found (policy-error is for loads that fail).
    assert_eq!(admin.policy_rollback(PolicyKind::Eviction).await.unwrap_err().code(), ErrorCode::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_swap_under_load_fails_no_request() {
    let comps = tokio::task::spawn_blocking(|| components(false)).await.unwrap();
    // Every block is read right after it is written: a short lease keeps the small pool evictable.
    let srv = TestServer::start(Opts { dram: "16MiB", cache: "lease_ttl_ms = 200".into(), ..Opts::default() });
    let admin = srv.client(ADMIN_KEY).await;
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..3 {
        let (c, stop, ops) = (srv.client(ADMIN_KEY).await, stop.clone(), ops.clone());
        workers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = format!("w{w}-{i}");
                let parent = (!i.is_multiple_of(4)).then(|| format!("w{w}-{}", i - 1).into_bytes());
                let opts = PutOptions { parent, tokens: 16, seq_tokens: 16 * (i % 4 + 1), pin: PinSpec::None };
                c.put_with(&k, &value_for(&k, 256 << 10), opts).await?;
                if let Some(v) = c.get(&k).await? {
                    anyhow::ensure!(v == value_for(&k, 256 << 10), "bytes differ");
                }
                let chain: Vec<String> = (i.saturating_sub(3)..=i).map(|j| format!("w{w}-{j}")).collect();
                c.lookup(&chain).await?;
                let s = c.stats().await?;
                let d = s.tiers.iter().find(|t| t.tier == "dram").unwrap();
                anyhow::ensure!(d.used_bytes <= d.capacity_bytes, "dram over capacity");
                ops.fetch_add(4, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok(i)
        }));
    }
    let cycle = ["lru", "sieve", "s3fifo", "arc", "leaf-lru"];
    for n in 0..10 {
        let name = cycle[n % cycle.len()];
        let wasm = std::fs::read(&comps[name]).unwrap();
        let info = admin.policy_load(PolicyKind::Eviction, name, &[], &wasm).await.unwrap();
        assert_eq!(info.name, name);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut puts = 0;
    for w in workers {
        match w.await.unwrap() {
            Ok(n) => puts += n,
            Err(e) => {
                let log = srv.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!("no request may fail during hot swaps: {e}\nserver log tail:\n{}", tail.join("\n"));
            }
        }
    }
    assert!(puts > 60, "too little load: {puts} puts");
    let s = admin.stats().await.unwrap();
    assert_eq!(s.ops.iter().map(|o| o.errors).sum::<u64>(), 0, "{:?}", s.ops);
    let d = s.tiers.iter().find(|t| t.tier == "dram").unwrap();
    assert!(d.evictions > 0, "the swapped policies must have been asked for victims");
    let list = admin.policy_list().await.unwrap();
    let active = list.iter().find(|p| p.kind == PolicyKind::Eviction && p.active).unwrap();
    assert_eq!(active.name, "leaf-lru");
    let faults = active.faults_trap + active.faults_timeout + active.faults_invalid;
    if faults != 0 {
        let log = srv.log();
        let warn: Vec<&str> = log.lines().filter(|l| l.contains("fault")).take(10).collect();
        panic!("{faults} policy faults: {active:?}\n{}", warn.join("\n"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_modules_fall_back_and_are_quarantined() {
    let comps = tokio::task::spawn_blocking(|| components(true)).await.unwrap();
    let srv = TestServer::start(Opts { dram: "8MiB", ..Opts::default() });
    let admin = srv.client(ADMIN_KEY).await;
    for bad in ["spin", "hog", "panicky", "unknown", "flood", "everything"] {
        let wasm = std::fs::read(&comps[bad]).unwrap();
        admin.policy_load(PolicyKind::Eviction, bad, &[], &wasm).await.unwrap();
        // enough puts to need eviction several times
        for i in 0..24 {
            let k = format!("{bad}-{i}");
            admin.put(&k, &value_for(&k, 1 << 20)).await.unwrap();
        }
        // newest data is intact and readable
        let k = format!("{bad}-23");
        assert!(admin.get(&k).await.unwrap().unwrap() == value_for(&k, 1 << 20));
        let list = admin.policy_list().await.unwrap();
        let p = list.iter().find(|p| p.kind == PolicyKind::Eviction && p.active).unwrap();
        assert_eq!(p.name, bad);
        let faults = p.faults_trap + p.faults_timeout + p.faults_invalid;
        assert!(faults >= 1, "{bad}: fault not counted: {p:?}");
        assert!(p.quarantined, "{bad}: repeated faults must quarantine: {p:?}");
        assert!(p.fallback_answers >= 1, "{bad}: the fallback must answer");
    }
    let m = srv.scrape();
    assert!(kvpool_tests::metric(&m, "kvpool_policy_quarantined") >= 1.0, "{m}");
    admin.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_back_a_quarantined_module_clears_its_quarantine_on_metrics() {
    let comps = tokio::task::spawn_blocking(|| components(true)).await.unwrap();
    let srv = TestServer::start(Opts { dram: "8MiB", ..Opts::default() });
    let admin = srv.client(ADMIN_KEY).await;
    let wasm = std::fs::read(&comps["panicky"]).unwrap();
    admin.policy_load(PolicyKind::Eviction, "panicky", &[], &wasm).await.unwrap();
    for i in 0..24 {
        let k = format!("q-{i}");
        admin.put(&k, &value_for(&k, 1 << 20)).await.unwrap();
    }
    let list = admin.policy_list().await.unwrap();
    assert!(list.iter().any(|p| p.kind == PolicyKind::Eviction && p.active && p.quarantined), "{list:?}");
    let series = "kvpool_policy_quarantined{kind=\"eviction\",module=\"panicky\"}";
    assert_eq!(kvpool_tests::metric(&srv.scrape(), series), 1.0);

    // Rolled back: the built-in is active, and no module of any kind is quarantined.
    let now = admin.policy_rollback(PolicyKind::Eviction).await.unwrap();
    assert!(now.builtin && !now.quarantined, "{now:?}");
    let m = srv.scrape();
    assert_eq!(kvpool_tests::metric(&m, "kvpool_policy_quarantined"), 0.0, "{m}");
    assert_eq!(kvpool_tests::metric(&m, "kvpool_policy_faults"), 0.0, "{m}");
    // The pool serves on with the built-in.
    admin.put("after", &value_for("after", 1 << 20)).await.unwrap();
}
