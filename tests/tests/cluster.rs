//! A cluster pool of real processes on 127.0.0.1: a master and storage nodes, driven through
//! `ClusterClient` and the `kvpool nodes` command.

use kvpool_client::proto::{EventScope, KvEventKind};
use kvpool_client::{ClientConfig, ClusterClient, ErrorCode, PutOptions, Trust};
use kvpool_tests::cluster::{
    chain, cluster, master, nodes_until, put_chain, read_back, storage, visible, Cluster, REPORT_MS, TIMEOUT_MS,
};
use kvpool_tests::{bin, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use std::time::{Duration, Instant};

/// `kvpool ARGS` against `master` with `key` (the CLI finds out it is a master): exit code,
/// stdout, stderr.
fn kvpool_cluster_cli(master: &TestServer, key: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(bin("kvpool"))
        .args(["--server", &master.addr(), "--api-key", key, "--ca"])
        .arg(master.endpoint["cert_path"].as_str().unwrap())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_the_sum_of_the_nodes_and_a_put_is_a_hit_for_every_client() {
    let cl = cluster(3, "16MiB", "0");
    let a = cl.client(ALICE_KEY).await;
    nodes_until(&a, "three nodes join", |n| n.len() == 3 && n.iter().all(|n| n.live)).await;
    // 24 MiB of chains, more than one node's 16 MiB of DRAM.
    const SIZE: usize = 512 << 10;
    let chains: Vec<Vec<String>> = (0..12).map(|i| chain(&format!("conv{i}"), 4)).collect();
    for ch in &chains {
        assert_eq!(put_chain(&a, ch, SIZE, 1).await, vec![ErrorCode::Ok; 4], "{ch:?}");
    }
    let all: Vec<String> = chains.concat();
    visible(&a, &all).await;
    // Another inference node (its own client) finds every chain and reads it back.
    let b = cl.client(ALICE_KEY).await;
    for ch in &chains {
        assert_eq!(b.lookup(ch).await.unwrap(), 4, "{ch:?}");
    }
    assert_eq!(read_back(&b, &all, SIZE).await, vec![ErrorCode::Ok; all.len()]);
    // A chain stays on one node; the chains spread over all three.
    let r = b.route(&all).await.unwrap();
    for (ch, routes) in chains.iter().zip(r.items.chunks(4)) {
        assert!(routes.iter().all(|n| n == &routes[0]), "{ch:?} split over {routes:?}");
    }
    let nodes = nodes_until(&b, "every copy reported", |n| n.iter().map(|n| n.copies).sum::<u64>() == 48).await;
    assert!(nodes.iter().all(|n| n.copies > 0 && n.copies < 48), "{nodes:#?}");
    // Tenants stay apart across the cluster.
    let bob = cl.client(BOB_KEY).await;
    assert_eq!(bob.lookup(&chains[0]).await.unwrap(), 0);
    assert_eq!(read_back(&bob, &chains[0], SIZE).await, vec![ErrorCode::NotFound; 4]);
    // The master holds no blocks: a put sent to it directly is refused with a reason...
    let mut cfg = cl.config(ALICE_KEY);
    cfg.transport = kvpool_client::TransportChoice::Quic;
    let direct = kvpool_client::Client::connect_direct(cfg.clone()).await.unwrap();
    let e = direct.put("k", b"v").await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");
    // Metrics: the master's per-node figures, each node's reports.
    let m = cl.master.scrape();
    assert_eq!(kvpool_tests::metric(&m, "kvpool_cluster_nodes{state=\"live\"}"), 3.0, "{m}");
    let copies: f64 = ["s0", "s1", "s2"]
        .iter()
        .map(|n| kvpool_tests::metric(&m, &format!("kvpool_cluster_node_copies{{node=\"{n}\"}}")))
        .sum();
    assert_eq!(copies, 48.0);
    assert!(kvpool_tests::metric(&cl.nodes[0].scrape(), "kvpool_cluster_reports_total") > 0.0);
    // `kvpool nodes` shows the operator the same.
    let out = std::process::Command::new(bin("kvpool"))
        .args(["--server", &cl.master.addr(), "--api-key", ADMIN_KEY, "--ca"])
        .arg(cl.master.endpoint["cert_path"].as_str().unwrap())
        .arg("nodes")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    for name in ["s0", "s1", "s2"] {
        assert!(text.lines().any(|l| l.contains(name) && l.contains("live") && l.contains("dram")), "{text}");
    }
    // The CLI's block commands pointed at the master: through it to the nodes, with nothing
    // to say that it is a master (`--cluster` is still accepted).
    let cli = |args: &[&str]| kvpool_cluster_cli(&cl.master, ALICE_KEY, args);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), b"from the cli").unwrap();
    let path = file.path().to_str().unwrap();
    assert_eq!(cli(&["put", "cli-key", path, "--replicas", "2"]).0, Some(0));
    let deadline = Instant::now() + Duration::from_secs(20);
    while cli(&["exists", "cli-key"]).0 != Some(0) {
        assert!(Instant::now() < deadline, "the put never became visible");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cli(&["get", "cli-key"]).1, "from the cli");
    assert_eq!(cli(&["--cluster", "get", "cli-key"]).1, "from the cli");
    // Statistics come from every storage node.
    let (code, text, err) = cli(&["stats"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(["== s0", "== s1", "== s2"].iter().all(|n| text.contains(n)), "{text}");
    let (code, text, _) = cli(&["lookup", &chains[0][0], &chains[0][1], "nope"]);
    assert_eq!((code, text.trim()), (Some(0), "2"));
    // The get leased the copy it read: a plain rm leaves it and says so; --force removes both.
    let (code, _, err) = cli(&["rm", "cli-key"]);
    assert!(code == Some(1) && err.contains("leased"), "{code:?} {err}");
    assert_eq!(cli(&["rm", "--force", "cli-key"]).0, Some(0));
    let (code, _, err) = cli(&["rm", "cli-key"]);
    assert_eq!(code, Some(3), "{err}");
    // ...and a plain `Client::connect` finds out it is a master and routes through it.
    let routed = kvpool_client::Client::connect(cl.config(ALICE_KEY)).await.unwrap();
    assert!(routed.is_cluster());
    assert_eq!(routed.lookup(&chains[1]).await.unwrap(), 4);
    assert_eq!(routed.get(&chains[1][0]).await.unwrap().as_deref(), Some(value_for(&chains[1][0], SIZE).as_slice()));
    routed.put_with("via-connect", b"v", PutOptions::default()).await.unwrap();
    visible(routed.cluster().unwrap(), &["via-connect".to_string()]).await;
    assert_eq!(routed.get("via-connect").await.unwrap().as_deref(), Some(&b"v"[..]));
    // Reads into buffers come from each holder; a node on this host is read through shared
    // memory (the test transport allowing it), others over QUIC.
    let mut bufs: Vec<Vec<u8>> = chains[2].iter().map(|_| vec![0u8; SIZE]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let got = routed.get_batch_into(&chains[2], &mut slices).await.unwrap();
    assert!(got.iter().all(|r| r.status == ErrorCode::Ok && r.size == SIZE as u64), "{got:?}");
    for (k, b) in chains[2].iter().zip(&bufs) {
        assert!(b == &value_for(k, SIZE), "{k}: wrong bytes");
    }
    let paths = routed.cluster().unwrap().node_transports();
    let want = if kvpool_tests::test_transport() == kvpool_client::TransportChoice::Quic { "quic" } else { "shm" };
    assert!(!paths.is_empty() && paths.iter().all(|(_, t)| *t == want), "{paths:?}");
    // (The get leased it: removing it at once takes `force`.)
    assert_eq!(routed.remove_batch(&["via-connect"], true).await.unwrap(), vec![ErrorCode::Ok]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_turns_into_misses_and_its_ssd_blocks_come_back() {
    let mut cl = cluster(3, "8MiB", "256MiB");
    let c = cl.client(ALICE_KEY).await;
    nodes_until(&c, "three nodes join", |n| n.len() == 3 && n.iter().all(|n| n.live)).await;
    // 36 MiB over 3 x 8 MiB of DRAM: every node demotes some blocks to its SSD.
    const SIZE: usize = 1 << 20;
    let chains: Vec<Vec<String>> = (0..9).map(|i| chain(&format!("doc{i}"), 4)).collect();
    for ch in &chains {
        assert_eq!(put_chain(&c, ch, SIZE, 1).await, vec![ErrorCode::Ok; 4]);
    }
    let all: Vec<String> = chains.concat();
    visible(&c, &all).await;
    let r = c.route(&all).await.unwrap();
    let nodes = c.nodes().await.unwrap();
    let victim = nodes.iter().max_by_key(|n| n.copies).unwrap().clone();
    let idx = cl.nodes.iter().position(|s| s.addr() == victim.addr).expect("the victim is one of ours");
    // By every holder, not the first: a node offers its DRAM victims to another node's free
    // DRAM before its SSD, so a block may have moved, with the master still naming the old
    // holder (first, when both hold it in DRAM) until that node's next report. A block with a
    // live copy must keep serving.
    let on_victim: Vec<String> =
        all.iter().zip(&r.items).filter(|(_, n)| n.iter().all(|&h| h == victim.node)).map(|(k, _)| k.clone()).collect();
    let elsewhere: Vec<String> =
        all.iter().zip(&r.items).filter(|(_, n)| n.iter().any(|&h| h != victim.node)).map(|(k, _)| k.clone()).collect();
    assert!(!on_victim.is_empty() && !elsewhere.is_empty());

    // Readers keep reading while the node dies: they may miss, never get wrong bytes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (c, all, stop) = (c.clone(), all.clone(), stop.clone());
            tokio::spawn(async move {
                let mut reads = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for st in read_back(&c, &all, SIZE).await {
                        assert!(matches!(st, ErrorCode::Ok | ErrorCode::NotFound), "{st:?}");
                    }
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Reads promote SSD blocks, whose DRAM victims may move to the victim meanwhile: blocks
    // whose only copy is there right before the kill may be lost too.
    let just_before = c.route(&all).await.unwrap();
    let on_victim_at_kill: Vec<&String> =
        all.iter().zip(&just_before.items).filter(|(_, n)| *n == &[victim.node]).map(|(k, _)| k).collect();
    cl.nodes[idx].kill();
    let dead =
        nodes_until(&c, "the killed node is declared dead", |n| n.iter().any(|n| n.node == victim.node && !n.live))
            .await;
    assert!(dead.iter().filter(|n| n.live).count() == 2);
    // Blocks whose only copy was on it are misses (not errors); every block with a live copy
    // still serves. (A copy another node registered after the first route counts as live.)
    let after = c.route(&all).await.unwrap();
    let lost: Vec<String> =
        all.iter().zip(&after.items).filter(|(_, n)| n.is_empty()).map(|(k, _)| k.clone()).collect();
    let live: Vec<String> =
        all.iter().zip(&after.items).filter(|(_, n)| !n.is_empty()).map(|(k, _)| k.clone()).collect();
    assert!(!lost.is_empty(), "every block of the dead node had a copy elsewhere");
    assert!(
        lost.iter().all(|k| on_victim.contains(k) || on_victim_at_kill.contains(&k)),
        "a block never on the dead node was lost: {lost:?}"
    );
    assert!(
        elsewhere.iter().all(|k| live.contains(k) || on_victim_at_kill.contains(&k)),
        "a block with a live copy was lost"
    );
    assert_eq!(c.lookup(&lost[..1]).await.unwrap(), 0);
    assert_eq!(read_back(&c, &lost, SIZE).await, vec![ErrorCode::NotFound; lost.len()]);
    assert_eq!(read_back(&c, &live, SIZE).await, vec![ErrorCode::Ok; live.len()]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        assert!(r.await.unwrap() > 0);
    }

    // Back on the same data directory: it joins again, and what it kept on SSD serves again.
    cl.nodes[idx].start_again();
    let back =
        nodes_until(&c, "the node returns", |n| n.iter().any(|n| n.node == victim.node && n.live && n.copies > 0))
            .await;
    let returned = back.iter().find(|n| n.node == victim.node).unwrap();
    assert_eq!(returned.name, victim.name, "same name, same id");
    let direct = cl.nodes[idx].client(ADMIN_KEY).await;
    let alice_direct = cl.nodes[idx].client(ALICE_KEY).await;
    let kept = alice_direct.exists(&on_victim).await.unwrap();
    let kept: Vec<String> = on_victim.iter().zip(kept).filter(|(_, p)| *p).map(|(k, _)| k.clone()).collect();
    assert!(!kept.is_empty(), "the node kept nothing on SSD");
    assert!(kept.len() < on_victim.len(), "DRAM copies cannot survive a kill");
    assert_eq!(direct.stats().await.unwrap().tiers.iter().find(|t| t.tier == "dram").unwrap().blocks, 0);
    visible(&c, &kept).await;
    // This client took the node for down when it died, and skips it until its background
    // reconnect (with backoff) finds it back: reads of it resume within a backoff.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = read_back(&c, &kept, SIZE).await;
        if got == vec![ErrorCode::Ok; kept.len()] {
            break;
        }
        assert!(Instant::now() < deadline, "the returned node's SSD blocks never served again: {got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_land_on_distinct_nodes_and_survive_a_sibling() {
    let mut cl = cluster(3, "16MiB", "0");
    let c = cl.client(ALICE_KEY).await;
    nodes_until(&c, "three nodes join", |n| n.len() == 3 && n.iter().all(|n| n.live)).await;
    // A router follows the whole pool at the master: one event stream, each event naming the
    // storage node of the copy.
    let mut events = c
        .master()
        .subscribe(kvpool_client::SubscribeOptions { scope: EventScope::Tenant, ..Default::default() })
        .await
        .unwrap();
    const SIZE: usize = 64 << 10;
    let keys = chain("rep", 10);
    assert_eq!(put_chain(&c, &keys, SIZE, 2).await, vec![ErrorCode::Ok; 10]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let routes = loop {
        let r = c.route(&keys).await.unwrap();
        if r.items.iter().all(|n| n.len() == 2) {
            break r;
        }
        assert!(Instant::now() < deadline, "{:?}", r.items);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(routes.items.iter().all(|n| n[0] != n[1]), "{:?}", routes.items);
    let mut stored: Vec<(String, String)> = Vec::new();
    while stored.len() < 20 {
        let b = events.next_within(Duration::from_secs(10)).await.unwrap().expect("stored events");
        for e in b.events {
            assert_eq!(e.kind, KvEventKind::Stored, "{e:?}");
            assert_eq!(e.tenant, "alice");
            stored.push((String::from_utf8(e.key).unwrap(), e.node));
        }
    }
    stored.sort();
    let mut expect: Vec<(String, String)> = Vec::new();
    let nodes = c.nodes().await.unwrap();
    let name_of = |id: u32| nodes.iter().find(|n| n.node == id).unwrap().name.clone();
    for (k, on) in keys.iter().zip(&routes.items) {
        for &n in on {
            expect.push((k.clone(), name_of(n)));
        }
    }
    expect.sort();
    assert_eq!(stored, expect, "every copy stored is seen once, naming its node");
    // Kill the node holding the most copies: every block still has its sibling.
    let nodes = c.nodes().await.unwrap();
    let victim = nodes.iter().max_by_key(|n| n.copies).unwrap().clone();
    let idx = cl.nodes.iter().position(|s| s.addr() == victim.addr).unwrap();
    cl.nodes[idx].kill();
    nodes_until(&c, "the killed node is declared dead", |n| n.iter().any(|n| n.node == victim.node && !n.live)).await;
    // Its copies leave the pool's stream as removed.
    let mut removed = 0;
    while (removed as u64) < victim.copies {
        let b = events.next_within(Duration::from_secs(10)).await.unwrap().expect("removed events");
        for e in b.events {
            assert_eq!((e.kind, e.node.as_str()), (KvEventKind::Removed, victim.name.as_str()), "{e:?}");
            removed += 1;
        }
    }
    assert_eq!(c.lookup(&keys).await.unwrap(), 10);
    assert_eq!(read_back(&c, &keys, SIZE).await, vec![ErrorCode::Ok; 10]);
    let _ = cl.key_file();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_elects_a_master_and_a_failover_keeps_every_block_of_the_live_nodes() {
    let Some(etcd) = kvpool_tests::EtcdServer::start_or_skip() else { return };
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("master-key");
    std::fs::write(&key_file, format!("{ADMIN_KEY}\n")).unwrap();
    let ha = |role: &str, name: &str| {
        let mut extra = format!(
            "[cluster]\nrole = \"{role}\"\netcd = \"{}\"\nnode_name = \"{name}\"\nreport_ms = {REPORT_MS}\nnode_timeout_ms = {TIMEOUT_MS}\n",
            etcd.url
        );
        if role == "storage" {
            extra.push_str(&format!("master_key_file = \"{}\"\n", key_file.display()));
        }
        extra
    };
    let mut masters: Vec<TestServer> = ["m0", "m1"]
        .iter()
        .map(|n| TestServer::start(Opts { dram: "1MiB", extra: ha("master", n), ..Opts::default() }))
        .collect();
    let nodes: Vec<TestServer> = (0..3)
        .map(|i| TestServer::start(Opts { dram: "16MiB", extra: ha("storage", &format!("s{i}")), ..Opts::default() }))
        .collect();
    let mut template = ClientConfig::new("unused:0", ALICE_KEY, Trust::Fingerprint([0; 32]));
    template.transport = kvpool_tests::test_transport();
    template.request_timeout = Duration::from_secs(3);
    let deadline = Instant::now() + Duration::from_secs(20);
    let c = loop {
        match ClusterClient::connect_etcd(&etcd.url, "/kvpool/", template.clone()).await {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "no leader: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    nodes_until(&c, "three nodes join the leader", |n| n.len() == 3 && n.iter().all(|n| n.live)).await;
    const SIZE: usize = 256 << 10;
    let chains: Vec<Vec<String>> = (0..6).map(|i| chain(&format!("ha{i}"), 4)).collect();
    for ch in &chains {
        assert_eq!(put_chain(&c, ch, SIZE, 1).await, vec![ErrorCode::Ok; 4]);
    }
    let all: Vec<String> = chains.concat();
    visible(&c, &all).await;

    // The follower refuses, naming the leader.
    let leader_addr = c.master().config().server.clone();
    let li = masters.iter().position(|m| m.addr() == leader_addr).expect("the leader is one of ours");
    let follower = &masters[1 - li];
    let mut fcfg = ClientConfig::new(
        follower.addr(),
        ALICE_KEY,
        Trust::CaFile(follower.endpoint["cert_path"].as_str().unwrap().into()),
    );
    fcfg.transport = kvpool_client::TransportChoice::Quic;
    let fc = kvpool_client::Client::connect(fcfg).await.unwrap();
    let e = fc.route(&all[..1]).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotLeader, "{e}");
    assert!(e.to_string().contains(&leader_addr), "{e}");

    // Kill the leader under load: readers keep going (they may fail or miss during the
    // failover, never read wrong bytes), and requests fail over to the new leader within a bound.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (c, all, stop) = (c.clone(), all.clone(), stop.clone());
            tokio::spawn(async move {
                let mut ok = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(got) = c.get_batch(&all).await {
                        for (k, g) in all.iter().zip(got) {
                            if g.status == ErrorCode::Ok {
                                assert!(g.value.as_deref() == Some(value_for(k, SIZE).as_slice()), "{k}");
                                ok += 1;
                            }
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                ok
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    masters[li].kill();
    let killed = Instant::now();
    let recovered = loop {
        if let Ok(n) = c.lookup(&all).await {
            if n == all.len() {
                break killed.elapsed();
            }
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "no failover within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("failover: the first full lookup {recovered:?} after the leader was killed");
    if recovered > Duration::from_secs(15) {
        eprintln!("NEW LEADER LOG:\n{}\nSTORAGE LOG:\n{}", masters[1 - li].log(), nodes[0].log());
    }
    assert!(recovered < Duration::from_secs(15), "{recovered:?}");
    assert_ne!(c.master().config().server, leader_addr, "the client follows the new leader");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        assert!(r.await.unwrap() > 0, "the readers read");
    }
    // No block of a live storage node was lost: the new leader learnt them all again.
    assert_eq!(read_back(&c, &all, SIZE).await, vec![ErrorCode::Ok; all.len()]);
    let nodes = c.nodes().await.unwrap();
    assert_eq!(nodes.iter().filter(|n| n.live).count(), 3, "{nodes:#?}");
    assert_eq!(nodes.iter().map(|n| n.copies).sum::<u64>(), all.len() as u64);
    drop(keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_loaded_on_a_running_cluster_where_they_decide() {
    let cl = cluster(2, "16MiB", "0");
    let c = cl.client(ADMIN_KEY).await;
    nodes_until(&c, "two nodes join", |n| n.len() == 2 && n.iter().all(|n| n.live)).await;
    let comps = tokio::task::spawn_blocking(|| kvpool_tests::components(false)).await.unwrap();
    let cli = |args: &[&str]| kvpool_cluster_cli(&cl.master, ADMIN_KEY, args);
    // Eviction runs on every storage node: the module goes to each one.
    let (code, text, err) = cli(&["policy", "load", "eviction", comps["sieve"].to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text} {err}");
    assert!(text.contains("== s0") && text.contains("== s1"), "{text}");
    for node in &cl.nodes {
        let direct = node.client(ADMIN_KEY).await;
        let list = direct.policy_list().await.unwrap();
        assert!(list.iter().any(|p| p.name == "sieve" && p.active), "{list:?}");
    }
    // Placement runs on the master.
    let (code, text, err) = cli(&["policy", "load", "placement", comps["least-loaded"].to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text} {err}");
    assert!(text.contains("== master"), "{text}");
    let list = c.master().policy_list().await.unwrap();
    assert!(list.iter().any(|p| p.name == "least-loaded" && p.active), "{list:?}");
    // Puts are placed by it and still land and read back.
    let keys = chain("pl", 6);
    assert_eq!(put_chain(&c, &keys, 4096, 1).await, vec![ErrorCode::Ok; 6]);
    visible(&c, &keys).await;
    assert_eq!(read_back(&c, &keys, 4096).await, vec![ErrorCode::Ok; 6]);
    // A non-admin key is refused on every node, with the reason.
    let (code, _, err) =
        kvpool_cluster_cli(&cl.master, ALICE_KEY, &["policy", "load", "eviction", comps["lru"].to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("forbidden"), "{err}");
}

/// 12 MiB put straight into a node of 4 MiB of DRAM (no placement), beside a node of 64 MiB:
/// at least 12 of its 24 blocks must end up in the big node's DRAM, and every block the pool
/// still routes reads back as the same tenant's. Returns how many the small node demoted.
async fn spill_from_a_full_node(small_ssd: &'static str) -> u64 {
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("master-key");
    std::fs::write(&key_file, format!("{ADMIN_KEY}\n")).unwrap();
    let master = master();
    let small = storage(&master, &key_file, "small", "4MiB", small_ssd);
    let _big = storage(&master, &key_file, "big", "64MiB", "0");
    let cl = Cluster { master, nodes: Vec::new(), keys };
    let c = cl.client(ALICE_KEY).await;
    nodes_until(&c, "two nodes join", |n| n.len() == 2 && n.iter().all(|n| n.live)).await;
    let direct = small.client(ALICE_KEY).await;
    const SIZE: usize = 512 << 10;
    let names: Vec<String> = (0..24).map(|i| format!("spill-{i}")).collect();
    for k in &names {
        direct.put(k, &value_for(k, SIZE)).await.unwrap();
    }
    // With an SSD every block stays somewhere; without one, the victims no node took are gone.
    let all_kept = small_ssd != "0";
    let deadline = Instant::now() + Duration::from_secs(20);
    let (held, big) = loop {
        let r = c.route(&names).await.unwrap();
        let nodes = c.nodes().await.unwrap();
        let big = nodes.iter().find(|n| n.name == "big").unwrap().node;
        let small_id = nodes.iter().find(|n| n.name == "small").unwrap().node;
        let held: Vec<String> =
            names.iter().zip(&r.items).filter(|(_, n)| !n.is_empty()).map(|(k, _)| k.clone()).collect();
        let on_big = r.items.iter().filter(|n| n.contains(&big)).count();
        // The master learns of the small node's evictions a moment later: the routes are read
        // back only once they agree with what the small node itself holds.
        let truth = direct.exists(&names).await.unwrap();
        let settled = r.items.iter().zip(&truth).all(|(n, &has)| n.contains(&small_id) == has);
        if settled && (!all_kept || held.len() == names.len()) && on_big >= 12 {
            break (held, on_big);
        }
        assert!(Instant::now() < deadline, "victims did not move to the big node: {:?}", r.items);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(big >= 12);
    let m = small.scrape();
    assert!(kvpool_tests::metric(&m, "kvpool_cluster_offloads_total{outcome=\"moved\"}") >= 12.0, "{m}");
    assert_eq!(read_back(&c, &held, SIZE).await, vec![ErrorCode::Ok; held.len()]);
    let bob = cl.client(BOB_KEY).await;
    assert_eq!(bob.lookup(&held[..1]).await.unwrap(), 0);
    direct.stats().await.unwrap().demotions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_moves_its_dram_victims_into_another_nodes_free_dram_before_its_ssd() {
    let demoted = spill_from_a_full_node("64MiB").await;
    assert!(demoted < 12, "the small node demoted {demoted} blocks to its SSD instead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_without_ssd_moves_its_dram_victims_into_another_nodes_free_dram() {
    assert_eq!(spill_from_a_full_node("0").await, 0, "there is no SSD to demote to");
}
