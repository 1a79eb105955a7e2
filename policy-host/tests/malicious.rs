//! Misbehaving modules (built from source in `tests/malicious`): the host stays usable, the
//! native fallback answers, the fault is counted by kind, and the limit quarantines the module.

mod common;

use common::Oracle;
use kvpool_policies::{LeafLru, LeastLoaded, ThresholdAdmission};
use kvpool_policy_host::{
    Deadline, FaultKind, GuardedAdmission, GuardedEviction, GuardedPlacement, HostConfig, HostError, PolicyEngine,
    PolicyKind,
};
use kvpool_policy_sdk::{
    AdmissionPolicy, Admit, AdmitBatch, AdmitRequest, Event, Events, EvictionPolicy, IndexView, NodeSet, Params, Pin,
    PlaceBatch, PlaceRequest, PlacementPolicy, Tier, NO_NODE, NO_PARENT,
};
use std::time::{Duration, Instant};

/// Blocks 1..=10 in DRAM, 100 bytes each, a chain 1 <- 2 <- 3; block 4 hard-pinned.
fn oracle() -> Oracle {
    let mut o = Oracle::default();
    let ev: Events = (1..=10u64)
        .map(|i| {
            let parent = if (2..=3).contains(&i) { i - 1 } else { NO_PARENT };
            let pin = if i == 4 { Pin::Hard } else { Pin::None };
            Event::inserted(i, 100, Tier::Dram, parent).with_pin(pin)
        })
        .collect();
    o.apply(&ev);
    o
}

fn expected(o: &Oracle, bytes: u64, exclude: &[u64]) -> Vec<u64> {
    let mut p = LeafLru::new();
    p.on_events(&o.snapshot());
    p.victims(Tier::Dram, bytes, exclude)
}

fn guard_with(cfg: HostConfig, name: &str, params: &[(&str, &str)], o: &Oracle) -> GuardedEviction {
    let engine = PolicyEngine::new(cfg).unwrap();
    let params = Params::from_pairs(params.iter().copied());
    let m = engine.load(name, PolicyKind::Eviction, &common::malicious()[name], &params).unwrap();
    GuardedEviction::new(&m, Box::new(LeafLru::new()), &o.snapshot()).unwrap()
}

fn guard(name: &str, params: &[(&str, &str)], o: &Oracle) -> GuardedEviction {
    guard_with(HostConfig::default(), name, params, o)
}

/// One bad call: the fallback's answer comes back, one fault of `kind` is counted.
fn one_fault(g: &mut GuardedEviction, o: &Oracle, kind: FaultKind, exclude: &[u64]) -> Duration {
    let before = g.faults();
    let t = Instant::now();
    let got = g.victims(o, Tier::Dram, 200, exclude);
    let took = t.elapsed();
    assert_eq!(got, expected(o, 200, exclude), "fallback answers");
    let after = g.faults();
    assert_eq!(after.total(), before.total() + 1, "fault counted: {:?}", g.last_fault());
    assert_eq!(g.last_fault().unwrap().0, kind, "{:?}", g.last_fault());
    took
}

#[test]
fn infinite_loop_times_out_then_quarantines() {
    let o = oracle();
    let mut g = guard("spin", &[], &o);
    for i in 0..3 {
        let took = one_fault(&mut g, &o, FaultKind::Timeout, &[]);
        assert!(took < Duration::from_secs(2), "deadline took {took:?}");
        assert_eq!(g.is_quarantined(), i == 2);
    }
    assert_eq!(g.faults().timeout, 3);
    // Quarantined: the fallback answers at once, nothing more is counted.
    let t = Instant::now();
    assert_eq!(g.victims(&o, Tier::Dram, 200, &[]), expected(&o, 200, &[]));
    assert!(t.elapsed() < Duration::from_millis(20));
    let info = g.info();
    assert!(info.quarantined && info.faults.total() == 3 && info.fallback_answers == 4 && info.answered == 0);
}

#[test]
fn infinite_loop_under_fuel_times_out() {
    let o = oracle();
    let cfg = HostConfig { deadline: Deadline::Fuel(50_000_000), ..HostConfig::default() };
    let mut g = guard_with(cfg, "spin", &[], &o);
    one_fault(&mut g, &o, FaultKind::Timeout, &[]);
}

#[test]
fn stuck_on_events_refuses_swap_or_faults() {
    let o = oracle();
    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    let params = Params::from_pairs([("where", "events")]);
    let m = engine.load("spin", PolicyKind::Eviction, &common::malicious()["spin"], &params).unwrap();
    // Replaying the block set into it never finishes: the swap is refused.
    let r = GuardedEviction::new(&m, Box::new(LeafLru::new()), &o.snapshot());
    assert!(matches!(r, Err(HostError::Replay { .. })));
    // Loaded on an empty pool, the first events fault it; the fallback still gets them.
    let mut g = GuardedEviction::new(&m, Box::new(LeafLru::new()), &Events::new()).unwrap();
    g.on_events(&o.snapshot());
    assert_eq!(g.faults().timeout, 1);
    assert_eq!(g.victims(&o, Tier::Dram, 200, &[]), expected(&o, 200, &[]));
}

#[test]
fn huge_allocation_traps_quickly() {
    let o = oracle();
    let mut g = guard("hog", &[], &o);
    let took = one_fault(&mut g, &o, FaultKind::Trap, &[]);
    assert!(took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn panic_traps() {
    let o = oracle();
    let mut g = guard("panicky", &[], &o);
    one_fault(&mut g, &o, FaultKind::Trap, &[]);
    // After the trap the instance is rebuilt from the snapshot and faults again.
    one_fault(&mut g, &o, FaultKind::Trap, &[]);
    assert_eq!(g.faults().trap, 2);
}

#[test]
fn excluded_pinned_unknown_and_too_few_victims_are_invalid() {
    let o = oracle();
    let mut g = guard("everything", &[], &o);
    one_fault(&mut g, &o, FaultKind::Invalid, &[1]);
    assert!(g.last_fault().unwrap().1.contains("excluded"), "{:?}", g.last_fault());
    one_fault(&mut g, &o, FaultKind::Invalid, &[]);
    assert!(g.last_fault().unwrap().1.contains("hard-pinned"), "{:?}", g.last_fault());
    assert!(!g.is_quarantined() && g.faults().invalid == 2);

    let mut g = guard("unknown", &[], &o);
    one_fault(&mut g, &o, FaultKind::Invalid, &[]);
    assert!(g.last_fault().unwrap().1.contains("no copy"), "{:?}", g.last_fault());

    let mut g = guard("stingy", &[], &o);
    one_fault(&mut g, &o, FaultKind::Invalid, &[]);
    assert!(g.last_fault().unwrap().1.contains("free 0 of 200"), "{:?}", g.last_fault());
    // Nothing evictable (all excluded, 4 hard-pinned): an empty answer is right.
    let all: Vec<u64> = (1..=10).collect();
    assert_eq!(g.victims(&o, Tier::Dram, 200, &all), Vec::<u64>::new());
    assert_eq!(g.faults().total(), 1);
    assert_eq!(g.faults().consecutive, 0);
}

#[test]
fn flood_of_output_is_refused() {
    let o = oracle();
    // A generous deadline: this test is about sizes, and a loaded CI machine (debug host code
    // lowering millions of ids) must not turn the expected fault into a timeout.
    let cfg = HostConfig {
        deadline: kvpool_policy_host::Deadline::Epoch { tick: Duration::from_millis(10), ticks: 1000 },
        memory_limit: 64 << 20,
        ..HostConfig::default()
    };
    // 10M ids do not fit the 64 MiB memory limit: a trap.
    let mut g = guard_with(cfg.clone(), "flood", &[], &o);
    one_fault(&mut g, &o, FaultKind::Trap, &[]);
    // 2M ids fit, but exceed `max_output`.
    let mut g = guard_with(cfg, "flood", &[("n", "2000000")], &o);
    one_fault(&mut g, &o, FaultKind::Invalid, &[]);
    assert!(g.last_fault().unwrap().1.contains("more than the limit"), "{:?}", g.last_fault());
}

#[test]
fn invalid_answers_quarantine_after_the_limit() {
    let o = oracle();
    let mut g = guard("unknown", &[], &o);
    for _ in 0..3 {
        one_fault(&mut g, &o, FaultKind::Invalid, &[]);
    }
    assert!(g.is_quarantined());
    g.victims(&o, Tier::Dram, 200, &[]);
    assert_eq!(g.faults().total(), 3);
}

#[test]
fn wrong_decision_count_falls_back() {
    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    let m = engine.load("bad-count", PolicyKind::Admission, &common::malicious()["bad-count"], &Params::new()).unwrap();
    let mut g = GuardedAdmission::new(&m, Box::new(ThresholdAdmission::new(100)), &Events::new()).unwrap();
    let req = |seq| AdmitRequest::new(1, 1, 16, seq, Tier::Ssd, NO_PARENT);
    let b: AdmitBatch = [req(10), req(1000)].into_iter().collect();
    assert_eq!(g.admit(&b), vec![Admit::Reject, Admit::Into(Tier::Ssd)]);
    assert_eq!(g.faults().invalid, 1);
    assert!(g.last_fault().unwrap().1.contains("expected 2"));
}

#[test]
fn nonexistent_node_falls_back() {
    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    let m = engine.load("bad-node", PolicyKind::Placement, &common::malicious()["bad-node"], &Params::new()).unwrap();
    let mut g = GuardedPlacement::new(&m, Box::new(LeastLoaded), &Events::new()).unwrap();
    let mut nodes = NodeSet::default();
    nodes.push(1, [0, 1000, 1000], 3);
    nodes.push(2, [0, 1000, 1000], 0);
    let b: PlaceBatch =
        [PlaceRequest { id: 1, size: 10, tokens: 16, parent: NO_PARENT, parent_node: NO_NODE, tier: Tier::Dram }]
            .into_iter()
            .collect();
    let p = g.place(&b, &nodes);
    assert_eq!(p.node, vec![2]);
    assert_eq!(g.faults().invalid, 1);
    assert!(g.last_fault().unwrap().1.contains("424242"));
}

#[test]
fn engine_stays_usable_after_faults() {
    let o = oracle();
    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    for name in ["spin", "hog", "panicky"] {
        let m = engine.load(name, PolicyKind::Eviction, &common::malicious()[name], &Params::new()).unwrap();
        let mut g = GuardedEviction::new(&m, Box::new(LeafLru::new()), &o.snapshot()).unwrap();
        g.victims(&o, Tier::Dram, 200, &[]);
        assert_eq!(g.faults().total(), 1);
    }
    // A well-behaved module on the same engine answers (and is accepted by the guard).
    let m = engine.load("leaf-lru", PolicyKind::Eviction, &common::standard()["leaf-lru"], &Params::new()).unwrap();
    let mut g = GuardedEviction::new(&m, Box::new(LeafLru::new()), &o.snapshot()).unwrap();
    assert_eq!(g.victims(&o, Tier::Dram, 200, &[]), expected(&o, 200, &[]));
    assert_eq!(g.faults().total(), 0);
    assert_eq!(g.info().answered, 1);
}
