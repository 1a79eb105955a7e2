//! Policy SDK 0.2 as the core serves it: key identity, misses, the chain rule, the warm snapshot.

use super::*;

/// Events the policies were given since the last call, as rows.
fn drain(p: &mut Pool<Copy>) -> Vec<Event> {
    p.index.take_events().iter().collect()
}

#[test]
fn key_hash_is_stable_across_evict_and_reput_and_scoped_to_the_tenant() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    // (Pool::plan_put hands pending events to the policies: collect them before each put.)
    let a = put(&mut p, T1, spec(b"k", 256, None), now).unwrap();
    assert_eq!(p.index.evict(&[a], Tier::Dram, &[], now).gone, 1);
    let mut ev = drain(&mut p);
    let b = put(&mut p, T1, spec(b"k", 256, None), now).unwrap();
    ev.extend(drain(&mut p));
    let c = put(&mut p, T2, spec(b"k", 256, None), now).unwrap();
    ev.extend(drain(&mut p));
    assert_ne!(a, b, "every put gets a fresh id");
    let rows: Vec<(EventKind, u64, u64)> = ev.iter().map(|e| (e.kind, e.id, e.key)).collect();
    let (k1, k2) = (key_hash(T1, b"k"), key_hash(T2, b"k"));
    assert_ne!(k1, k2, "scoped to the tenant");
    assert_eq!(
        rows,
        vec![
            (EventKind::Inserted, a, k1),
            (EventKind::Removed, a, k1),
            (EventKind::Inserted, b, k1),
            (EventKind::Inserted, c, k2)
        ]
    );
    // Admission rows carry the key hash and depth too.
    let (_, batch) = p.index.plan_put(T1, &[spec(b"k2", 1, Some(b"k")), spec(b"k3", 1, Some(b"k2"))], false, 1 << 30);
    let rows: Vec<(u64, u64, u32)> = batch.iter().map(|r| (r.key, r.parent, r.depth)).collect();
    let first = batch.id[0];
    assert_eq!(rows, vec![(key_hash(T1, b"k2"), b, 1), (key_hash(T1, b"k3"), first, 2)], "a parent may be a row");
}

#[test]
fn misses_of_lookups_and_gets_reach_the_policies_with_chain_position() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    let a = put(&mut p, T1, spec(b"a", 256, None), now).unwrap();
    drain(&mut p);
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b", "c"]), 5_000_000), 1);
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b"]), 6_000_000), 1);
    // A full hit reports nothing.
    assert_eq!(p.index.lookup(T1, &keys(&["a"]), 7_000_000), 1);
    p.index.plan_get(T1, &keys(&["a", "b"]), now, 8_000_000);
    let m: Vec<(u64, u64, u32, u64, u32, u64)> = drain(&mut p)
        .iter()
        .filter(|e| e.kind == EventKind::Missed)
        .map(|e| (e.id, e.key, e.depth, e.parent, e.count, e.time))
        .collect();
    let (kb, kc) = (key_hash(T1, b"b"), key_hash(T1, b"c"));
    assert_eq!(
        m,
        vec![
            (NO_ID, kb, 1, a, 1, 5_000_000),
            // The block before it is absent too: no resident parent to name.
            (NO_ID, kc, 2, NO_PARENT, 1, 5_000_000),
            // Asked again: the count is the misses of the key the index remembers.
            (NO_ID, kb, 1, a, 2, 6_000_000),
            (NO_ID, kb, 1, a, 3, 8_000_000),
        ]
    );
    // A put after misses starts with them counted; every read adds one.
    let b = put(&mut p, T1, spec(b"b", 256, Some(b"a")), now).unwrap();
    p.index.plan_get(T1, &keys(&["b"]), now, 9_000_000);
    let ev = drain(&mut p);
    let ins = ev.iter().find(|e| e.kind == EventKind::Inserted).unwrap();
    let acc = ev.iter().find(|e| e.kind == EventKind::Accessed).unwrap();
    assert_eq!((ins.id, ins.count, ins.depth, ins.parent), (b, 3, 1, a));
    assert_eq!((acc.id, acc.count, acc.time), (b, 4, 9_000_000));
}

#[test]
fn evicting_a_parent_cascades_to_its_descendants_or_is_refused() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    let r = put(&mut p, T1, spec(b"r", 256, None), now).unwrap();
    let c1 = put(&mut p, T1, spec(b"c1", 256, Some(b"r")), now).unwrap();
    let c2 = put(&mut p, T1, spec(b"c2", 256, Some(b"c1")), now).unwrap();
    let x = put(&mut p, T1, spec(b"x", 256, None), now).unwrap();
    assert_eq!(IndexView::resident_children(&p.index, r), vec![c1]);
    // c2 is leased: taking r would strand it, so r stays.
    p.index.plan_get(T1, &keys(&["c2"]), now + Duration::from_secs(5), 0);
    let out = p.index.evict(&[r], Tier::Dram, &[], now);
    assert_eq!((out.gone, out.cascaded, out.refused), (0, 0, 1));
    assert_eq!(p.index.counts().0, 4);
    drain(&mut p);
    // Once the lease is over, r goes with its chain, deepest first.
    let later = now + Duration::from_secs(6);
    let out = p.index.evict(&[r], Tier::Dram, &[], later);
    assert_eq!((out.gone, out.cascaded, out.refused, out.dropped.len()), (3, 2, 0, 3));
    let removed: Vec<u64> = drain(&mut p).iter().filter(|e| e.kind == EventKind::Removed).map(|e| e.id).collect();
    assert_eq!(removed, vec![c2, c1, r]);
    assert_eq!(p.index.exists(T1, &keys(&["r", "c1", "c2", "x"])), vec![false, false, false, true]);
    assert_eq!(p.index.tenant_counters(T1).evictions[0], 3);
    let _ = x;
}

#[test]
fn a_chain_blind_policy_never_leaves_orphans() {
    // Plain LRU knows no chains: it names the roots first. The chain rule keeps every
    // remaining block reachable.
    let mut p = Pool::new(
        Index::new(GRAN, false),
        Policies::new(Box::new(Native(kvpool_policies::Lru::new())), Box::new(Native(ThresholdAdmission::new(0)))),
    );
    let now = Instant::now();
    let names: Vec<String> = (0..27).map(|i| format!("b{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        let parent = (i % 9 != 0).then(|| names[i - 1].as_bytes());
        put(&mut p, T1, spec(n.as_bytes(), 256, parent), now).unwrap();
    }
    let out = p.evict(Tier::Dram, 256 * 3, false, now);
    assert!(out.cascaded > 0);
    for chain in names.chunks(9) {
        let ks: Vec<Vec<u8>> = chain.iter().map(|k| k.as_bytes().to_vec()).collect();
        let resident = p.index.exists(T1, &ks).iter().filter(|&&e| e).count();
        assert_eq!(p.index.lookup(T1, &ks, 0), resident, "every resident block of a chain is reachable");
    }
}

#[test]
fn a_parent_put_again_adopts_its_resident_children() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"r", 256, None), now).unwrap();
    let c = put(&mut p, T1, spec(b"c", 256, Some(b"r")), now).unwrap();
    p.index.remove(T1, &keys(&["r"]), true, now);
    let r2 = put(&mut p, T1, spec(b"r", 256, None), now).unwrap();
    assert_eq!(IndexView::resident_children(&p.index, r2), vec![c]);
    let out = p.index.evict(&[r2], Tier::Dram, &[], now);
    assert_eq!((out.gone, out.cascaded), (2, 1));
    assert_eq!(p.index.counts().0, 0);
}

#[test]
fn admission_rejects_the_rest_of_a_chain_after_a_rejected_row() {
    struct RejectDepth1;
    impl AdmissionPolicy for RejectDepth1 {
        fn on_events(&mut self, _: &Events) {}
        fn admit(&mut self, b: &AdmitBatch) -> Vec<Admit> {
            b.iter().map(|r| if r.depth == 1 { Admit::Reject } else { Admit::Into(r.tier) }).collect()
        }
    }
    let mut p = Pool::new(
        Index::<Copy>::new(GRAN, false),
        Policies::new(Box::new(Native(LeafLru::new())), Box::new(Native(RejectDepth1))),
    );
    let items = [spec(b"a", 1, None), spec(b"b", 1, Some(b"a")), spec(b"c", 1, Some(b"b")), spec(b"d", 1, Some(b"c"))];
    let plans = p.plan_put(T1, &items, false, 1 << 30, &NodeSet::default());
    assert!(matches!(plans[0], PutPlan::Store(_)));
    assert!(plans[1..].iter().all(|p| *p == PutPlan::Skip(PutRefusal::Rejected)), "{plans:?}");
    assert_eq!(p.index.tenant_counters(T1).rejected, 3);
}

#[test]
fn the_swap_snapshot_is_warm() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b"]), 100_000), 0);
    let a = p.plan_put(T1, &[spec(b"a", 256, None)], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store(Planned { id: a, .. }) = a[0] else { panic!() };
    p.index.publish(Commit { checksum: 1, wall_ms: 100, ..block(T1, a, spec(b"a", 256, None), now) }).unwrap();
    let b = p.plan_put(T1, &[spec(b"b", 256, Some(b"a"))], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store(Planned { id: b, .. }) = b[0] else { panic!() };
    p.index.publish(Commit { checksum: 1, wall_ms: 100, ..block(T1, b, spec(b"b", 256, Some(b"a")), now) }).unwrap();
    p.index.plan_get(T1, &keys(&["a"]), now, 300_000);
    p.index.plan_get(T1, &keys(&["a"]), now, 400_000);
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b", "c"]), 500_000), 2);
    let snap: Vec<(EventKind, u64, u64, u32, u32, u64)> =
        p.index.snapshot().iter().map(|e| (e.kind, e.id, e.key, e.depth, e.count, e.time)).collect();
    let k = |s: &[u8]| key_hash(T1, s);
    assert_eq!(
        snap,
        vec![
            (EventKind::Missed, NO_ID, k(b"a"), 0, 1, 100_000),
            (EventKind::Missed, NO_ID, k(b"b"), 1, 1, 100_000),
            (EventKind::Missed, NO_ID, k(b"c"), 2, 1, 500_000),
            // Parents before children (a was used last); count = misses before the put + reads.
            (EventKind::Inserted, a, k(b"a"), 0, 3, 400_000),
            (EventKind::Inserted, b, k(b"b"), 1, 1, 100_000),
        ]
    );
    // A policy built from the snapshot orders blocks as one that saw the history: b, then a.
    let mut fresh = LeafLru::new();
    fresh.on_events(&p.index.snapshot());
    assert_eq!(fresh.victims(Tier::Dram, 512, &[]), vec![b, a]);
    // Forgetting misses: none in the snapshot.
    p.index.set_miss_memory(0);
    assert!(p.index.snapshot().iter().all(|e| e.kind == EventKind::Inserted && e.depth != NO_DEPTH));
}
