//! Storage nodes that die under a cluster client: a killed process, which its host reports at
//! once (ICMP port unreachable), and a silent node (a hung process, or a host gone), which only
//! the client's probe finds out. Either way a read costs a bounded delay, never the idle timeout.

use kvpool_client::{ClusterClient, ErrorCode, TransportChoice};
use kvpool_tests::cluster::{chain, cluster, nodes_until, put_chain, read_back, visible, Cluster};
use kvpool_tests::ALICE_KEY;
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 10;

/// Two nodes, chains put until both hold some; a client whose node probe gives up after
/// `answer_within`. Returns the keys, which of them are on the victim (the node of the first),
/// and the victim's index in `cl.nodes`.
async fn two_nodes_holding_chains(
    answer_within: Duration,
) -> (Cluster, ClusterClient, Vec<String>, Vec<bool>, usize, u32) {
    let cl = cluster(2, "64MiB", "0");
    let mut cfg = cl.config(ALICE_KEY);
    // QUIC: a killed process on a Unix socket closes it, which is not what is tested here.
    cfg.transport = TransportChoice::Quic;
    cfg.request_timeout = Duration::from_secs(30);
    cfg.dead_after = Duration::from_secs(30);
    cfg.node_answer_within = answer_within;
    let c = ClusterClient::connect(cfg).await.unwrap();
    nodes_until(&c, "two nodes join", |n| n.len() == 2 && n.iter().all(|n| n.live)).await;
    // Chains until both nodes hold some (placement keeps a chain together).
    let mut keys = Vec::new();
    let r = loop {
        let ch = chain(&format!("chain{}", keys.len()), 4);
        assert_eq!(put_chain(&c, &ch, SIZE, 1).await, vec![ErrorCode::Ok; 4]);
        keys.extend(ch);
        visible(&c, &keys).await;
        let r = c.route(&keys).await.unwrap();
        if r.items.iter().any(|n| n != &r.items[0]) {
            break r;
        }
        assert!(keys.len() < 64, "every chain went to one node");
    };
    assert_eq!(read_back(&c, &keys, SIZE).await, vec![ErrorCode::Ok; keys.len()], "both nodes connected");
    let victim = r.items[0][0];
    let on_victim: Vec<bool> = r.items.iter().map(|n| n == &[victim]).collect();
    let idx = cl.nodes.iter().position(|s| r.nodes.iter().any(|a| a.node == victim && a.addr == s.addr())).unwrap();
    (cl, c, keys, on_victim, idx, victim)
}

/// Reads while the master still routes to the dead victim: its blocks miss, the others are
/// read, and no read waits `limit`.
async fn reads_miss_the_victim(c: &ClusterClient, keys: &[String], on_victim: &[bool], limit: Duration) {
    for round in 0..3 {
        let t = Instant::now();
        let got = read_back(c, keys, SIZE).await;
        let took = t.elapsed();
        for (st, &lost) in got.iter().zip(on_victim) {
            assert_eq!(*st, if lost { ErrorCode::NotFound } else { ErrorCode::Ok }, "round {round}");
        }
        eprintln!("round {round}: a read with a dead node took {took:?}");
        assert!(took < limit, "round {round}: a read waited {took:?} on a dead node");
    }
}

/// New blocks placed on the victim once it is back are stored and read, through a connection
/// the client made again by itself.
async fn the_victim_serves_again(c: &ClusterClient, victim: u32) {
    nodes_until(c, "the node is live", |n| n.iter().filter(|n| n.live).count() == 2).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut round = 0;
    loop {
        let keys = chain(&format!("again{round}"), 8);
        round += 1;
        let put = put_chain(c, &keys, SIZE, 1).await;
        let stored: Vec<String> =
            keys.iter().zip(&put).filter(|(_, st)| **st == ErrorCode::Ok).map(|(k, _)| k.clone()).collect();
        visible(c, &stored).await;
        let r = c.route(&stored).await.unwrap();
        let here: Vec<String> =
            stored.iter().zip(&r.items).filter(|(_, n)| n.contains(&victim)).map(|(k, _)| k.clone()).collect();
        if !here.is_empty() && read_back(c, &here, SIZE).await.iter().all(|s| *s == ErrorCode::Ok) {
            return;
        }
        assert!(Instant::now() < deadline, "the node never served a block again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A killed node's host answers the client's next packet with port unreachable: the read
/// misses its blocks at once, long before the probe's bound (10 s here; the idle timeout 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_is_known_dead_from_its_hosts_answer_not_a_timeout() {
    let (mut cl, c, keys, on_victim, idx, victim) = two_nodes_holding_chains(Duration::from_secs(10)).await;
    cl.nodes[idx].kill();
    // Loose for a loaded CI machine; without the host's answer the first read takes 10 s.
    reads_miss_the_victim(&c, &keys, &on_victim, Duration::from_secs(3)).await;
    cl.nodes[idx].start_again();
    the_victim_serves_again(&c, victim).await;
}

/// A node that stops answering with its port still open (frozen: no close, no port
/// unreachable, as a host gone from the network): the read misses its blocks within
/// `node_answer_within` (the probe), later reads skip the node at once, and the node is used
/// again once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_costs_a_read_a_probe_not_the_idle_timeout() {
    let (cl, c, keys, on_victim, idx, victim) = two_nodes_holding_chains(Duration::from_millis(250)).await;
    cl.nodes[idx].freeze();
    reads_miss_the_victim(&c, &keys, &on_victim, Duration::from_secs(3)).await;
    cl.nodes[idx].thaw();
    the_victim_serves_again(&c, victim).await;
}
