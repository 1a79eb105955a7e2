//! The master's unit tests: reports, routes, placement, dead nodes and incarnations.

use super::*;
use kvpool_proto::{NodeBlock, PinSpec};

fn master(timeout: Duration) -> Master {
    let ids = std::sync::Mutex::new(HashMap::<String, u32>::new());
    let resolve = move |name: &str| {
        let mut ids = ids.lock().unwrap();
        let n = ids.len() as u32;
        *ids.entry(name.to_string()).or_insert(n)
    };
    Master::new(100, timeout, Box::new(resolve), None)
}

fn join(m: &Master, name: &str, dram: u64) -> u32 {
    m.join(NodeJoinRequest {
        name: name.into(),
        addr: format!("{name}:1"),
        server_name: "localhost".into(),
        fingerprint: vec![0; 32],
        incarnation: 7,
        tiers: vec![TierUse { tier: 1, capacity: dram, used: 0 }],
    })
    .node
}

fn stored(key: &str, tier: u8) -> NodeBlock {
    NodeBlock {
        kind: KvEventKind::Stored,
        tier,
        tenant: "t".into(),
        key: key.as_bytes().to_vec(),
        parent: None,
        size: 10,
    }
}

fn report(m: &Master, node: u32, reset: bool, blocks: Vec<NodeBlock>) -> Result<(), ReportError> {
    let tiers = vec![TierUse { tier: 1, capacity: 10_000, used: 0 }];
    m.report(NodeReportRequest { node, incarnation: 7, reset, tiers, blocks })
}

fn item(key: &str, parent: Option<&str>) -> PutItem {
    PutItem {
        key: key.into(),
        size: 100,
        parent: parent.map(|p| p.as_bytes().to_vec()),
        tokens: 16,
        seq_tokens: 0,
        pin: PinSpec::None,
    }
}

#[test]
fn reports_route_and_death_forgets() {
    let m = master(Duration::from_millis(300));
    let (a, b) = (join(&m, "a", 1000), join(&m, "b", 1000));
    report(&m, a, true, vec![stored("k1", 1), stored("k2", 2)]).unwrap();
    report(&m, b, true, vec![stored("k1", 2)]).unwrap();
    let r = m.route("t", &[b"k1".to_vec(), b"k2".to_vec(), b"k3".to_vec()]);
    // DRAM holders first.
    assert_eq!(r.items, vec![vec![a, b], vec![a], vec![]]);
    assert_eq!(r.nodes.len(), 2);
    // Another tenant sees nothing.
    assert_eq!(m.route("u", &[b"k1".to_vec()]).items, vec![Vec::<u32>::new()]);
    // An eviction of the only tier drops the node's copy.
    report(&m, a, false, vec![NodeBlock { kind: KvEventKind::Evicted, ..stored("k1", 1) }]).unwrap();
    assert_eq!(m.route("t", &[b"k1".to_vec()]).items, vec![vec![b]]);
    // Silence kills; a dead node's reports are refused until it joins again.
    let later = Instant::now() + Duration::from_secs(1);
    assert_eq!(m.sweep(later), 2);
    assert!(m.route("t", &[b"k2".to_vec()]).items[0].is_empty());
    assert_eq!(report(&m, a, false, vec![]), Err(ReportError::Unknown(a)));
    assert_eq!(join(&m, "a", 1000), a, "a node keeps its id across joins");
    assert_eq!(
        m.report(NodeReportRequest { node: a, incarnation: 8, reset: true, tiers: vec![], blocks: vec![] }),
        Err(ReportError::Stale(a))
    );
    report(&m, a, true, vec![stored("k2", 2)]).unwrap();
    assert_eq!(m.route("t", &[b"k2".to_vec()]).items, vec![vec![a]]);
    let list = m.nodes();
    assert_eq!(list.nodes.iter().map(|n| (n.live, n.copies)).collect::<Vec<_>>(), vec![(true, 1), (false, 0)]);
}

#[test]
fn placement_keeps_chains_spreads_replicas_and_checks_the_policy() {
    let m = master(Duration::from_secs(3));
    let (a, b, c) = (join(&m, "a", 10_000), join(&m, "b", 10_000), join(&m, "c", 10_000));
    report(&m, b, true, vec![stored("root", 1)]).unwrap();
    // A chain continues where its parent is, and stays together within the batch.
    let items = vec![item("x1", Some("root")), item("x2", Some("x1"))];
    let r = m.place("t", &items, 1, None, |_, _| None);
    assert_eq!(r.items, vec![vec![b], vec![b]]);
    // Replicas land on distinct nodes.
    let r = m.place("t", &[item("y", None)], 3, None, |_, _| None);
    let mut got = r.items[0].clone();
    got.sort_unstable();
    assert_eq!(got, vec![a, b, c]);
    // A policy that names a node that does not exist is overruled.
    let r = m.place("t", &[item("z", None)], 1, None, |_, _| Some(Placements { node: vec![99], tier: vec![1] }));
    assert!(r.items[0].len() == 1 && r.items[0][0] != 99);
    // A valid answer is followed.
    let r =
        m.place("t", &[item("z", None)], 1, None, |_, _| Some(Placements { node: vec![u64::from(c)], tier: vec![1] }));
    assert_eq!(r.items, vec![vec![c]]);
    // With no live node nothing is placed.
    m.sweep(Instant::now() + Duration::from_secs(10));
    assert_eq!(m.place("t", &[item("w", None)], 1, None, |_, _| None).items, vec![Vec::<u32>::new()]);
}

fn join_as(m: &Master, name: &str, incarnation: u64) -> u32 {
    let tiers = vec![TierUse { tier: 1, capacity: 1000, used: 0 }];
    let (addr, server_name, fingerprint) = (format!("{name}:1"), "localhost".into(), vec![0; 32]);
    m.join(NodeJoinRequest { name: name.into(), addr, server_name, fingerprint, incarnation, tiers }).node
}

fn report_as(m: &Master, node: u32, incarnation: u64, reset: bool, blocks: Vec<NodeBlock>) {
    let tiers = vec![TierUse { tier: 1, capacity: 10_000, used: 0 }];
    m.report(NodeReportRequest { node, incarnation, reset, tiers, blocks }).unwrap();
}

fn keys(ks: &[&str]) -> Vec<Vec<u8>> {
    ks.iter().map(|k| k.as_bytes().to_vec()).collect()
}

#[test]
fn a_dead_node_leaves_routes_logs_its_keys_as_removed_and_comes_back_with_a_new_incarnation() {
    let log = Arc::new(EventLog::new(1000, 4, Arc::new(crate::metrics::Metrics::new())));
    let ids = std::sync::Mutex::new(HashMap::<String, u32>::new());
    let resolve = move |name: &str| {
        let mut ids = ids.lock().unwrap();
        let n = ids.len() as u32 + 5;
        *ids.entry(name.to_string()).or_insert(n)
    };
    let m = Master::new(100, Duration::from_millis(300), Box::new(resolve), Some(log.clone()));
    let (a, b) = (join_as(&m, "a", 1), join_as(&m, "b", 1));
    report_as(&m, a, 1, true, vec![stored("k1", 1), stored("k1", 2), stored("k2", 1)]);
    report_as(&m, b, 1, true, vec![stored("k1", 2), stored("k3", 2)]);
    assert_eq!(m.route("t", &keys(&["k1", "k2", "k3"])).items, vec![vec![a, b], vec![a], vec![b]]);
    let from = log.next_seq();
    // `a` goes silent: out of every route, its copies logged as removed, one per tier.
    std::thread::sleep(Duration::from_millis(20));
    report_as(&m, b, 1, false, vec![]);
    assert_eq!(m.sweep(Instant::now() + Duration::from_millis(290)), 1);
    assert_eq!(m.route("t", &keys(&["k1", "k2", "k3"])).items, vec![vec![b], vec![], vec![b]]);
    let mut gone: Vec<(Vec<u8>, u8, u32, u32)> = log
        .read(from, 100, 100, |_| true)
        .changes
        .into_iter()
        .map(|(_, c)| (c.key.to_vec(), c.tier as u8, c.node, c.tenant))
        .collect();
    gone.sort();
    assert_eq!(gone, vec![(b"k1".to_vec(), 1, a, 5), (b"k1".to_vec(), 2, a, 5), (b"k2".to_vec(), 1, a, 5)]);
    assert_eq!(m.counts(), (1, 2));
    // It returns as another incarnation: the old one's reports are stale, its inventory counts.
    assert_eq!(join_as(&m, "a", 2), a);
    let tiers = vec![];
    let old = NodeReportRequest { node: a, incarnation: 1, reset: false, tiers, blocks: vec![stored("k9", 1)] };
    assert_eq!(m.report(old), Err(ReportError::Stale(a)));
    report_as(&m, a, 2, true, vec![stored("k2", 2)]);
    assert_eq!(m.route("t", &keys(&["k1", "k2", "k9"])).items, vec![vec![b], vec![a], vec![]]);
    // A join under a live name forgets what the earlier incarnation announced.
    assert_eq!(join_as(&m, "a", 3), a);
    assert_eq!(m.route("t", &keys(&["k2"])).items, vec![Vec::<u32>::new()]);
    assert_eq!(m.counts(), (2, 2));
    // A chain's next block goes where its parent is, once the parent is reported there.
    report_as(&m, a, 3, false, vec![stored("root", 1)]);
    let r = m.place("t", &[item("next", Some("root"))], 1, None, |_, _| None);
    assert_eq!(r.items, vec![vec![a]]);
    // Losing the lead forgets the whole view.
    m.set_leading(false);
    assert!(m.nodes().nodes.is_empty());
    assert_eq!(m.route("t", &keys(&["k1", "root"])).items, vec![Vec::<u32>::new(); 2]);
}

#[test]
fn an_engines_blocks_go_to_the_node_at_its_address() {
    let m = master(Duration::from_secs(3));
    let at = |name: &str, addr: &str| {
        m.join(NodeJoinRequest {
            name: name.into(),
            addr: addr.into(),
            server_name: "localhost".into(),
            fingerprint: vec![0; 32],
            incarnation: 7,
            tiers: vec![TierUse { tier: 1, capacity: 10_000, used: 0 }],
        })
        .node
    };
    let (_a, b) = (at("a", "10.0.0.1:7100"), at("b", "10.0.0.2:7100"));
    let mut seen = None;
    let r = m.place("t", &[item("k", None)], 1, Some("10.0.0.2".parse().unwrap()), |batch, _| {
        seen = Some(batch.client_node);
        None
    });
    assert_eq!(seen, Some(u64::from(b)), "the policy is told the client's node");
    assert_eq!(r.items, vec![vec![b]], "the default placement puts it there");
    // An address no node has, or that two nodes share, names none.
    let _c = at("c", "10.0.0.2:7200");
    for ip in ["10.0.0.9", "10.0.0.2"] {
        let mut seen = None;
        m.place("t", &[item("k2", None)], 1, Some(ip.parse().unwrap()), |batch, _| {
            seen = Some(batch.client_node);
            None
        });
        assert_eq!(seen, Some(NO_NODE), "{ip}");
    }
}
