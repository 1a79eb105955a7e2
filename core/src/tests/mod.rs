//! The index and its policies in memory, with time passed in.

use super::*;
use kvpool_policies::{LeafLru, ThresholdAdmission};
use kvpool_policy_sdk::{key_hash, AdmissionPolicy, Event, EvictionPolicy, NO_DEPTH, NO_ID};
use kvpool_policy_sdk::{Admit, AdmitBatch, EventKind, Events, IndexView, NodeSet, Pin, Tier, NO_PARENT};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// Policy SDK 0.2: key identity, misses, chain rule, warm snapshot.
mod loops;
mod sdk;

/// A DRAM copy for tests: a name, and a share count standing for in-flight readers.
#[derive(Clone, Debug)]
struct Copy(Arc<AtomicUsize>);

impl CopyHandle for Copy {
    type Kept = Copy;
    fn keep(&self) -> Copy {
        self.clone()
    }
    fn restore(kept: &Copy, _: u64) -> Copy {
        kept.clone()
    }
    fn in_use(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }
}

fn copy(_id: u64) -> Copy {
    Copy(Arc::new(AtomicUsize::new(0)))
}

const GRAN: Granularity = Granularity { dram: 256, ssd: 4096 };
const T1: u32 = 1;
const T2: u32 = 2;

fn pool(has_ssd: bool, threshold: u64) -> Pool<Copy> {
    Pool::new(
        Index::new(GRAN, has_ssd),
        Policies::new(Box::new(Native(LeafLru::new())), Box::new(Native(ThresholdAdmission::new(threshold)))),
    )
}

fn spec<'a>(key: &'a [u8], size: u64, parent: Option<&'a [u8]>) -> PutSpec<'a> {
    PutSpec { key, size, parent, tokens: 16, seq_tokens: 16, pin: PinRequest::None }
}

/// A block of `tenant` to publish with a DRAM copy: no checksum, insert mode, clocks at 0 (call
/// sites name what differs).
fn block<'a>(tenant: u32, id: u64, spec: PutSpec<'a>, now: Instant) -> Commit<'a, Copy> {
    let planned = Planned { tenant, id, tier: Tier::Dram, upsert: false };
    let (checksum, dram, ssd, wall_ms, soft_pin_ttl_ms) = (0, Some(copy(id)), None, 0, 0);
    Commit { planned, spec, checksum, dram, ssd, now, wall_ms, soft_pin_ttl_ms }
}

/// `c` as an upsert.
fn upserting(mut c: Commit<'_, Copy>) -> Commit<'_, Copy> {
    c.planned.upsert = true;
    c
}

/// Plan one block, which admission must take; its plan.
fn plan(p: &mut Pool<Copy>, tenant: u32, s: PutSpec<'_>, upsert: bool) -> Planned {
    match p.plan_put(tenant, &[s], upsert, 1 << 30, &NodeSet::default())[0] {
        PutPlan::Store(planned) => planned,
        PutPlan::Skip(r) => panic!("{r:?}"),
    }
}

/// Plan and commit one block into DRAM; returns its id.
fn put(p: &mut Pool<Copy>, tenant: u32, s: PutSpec<'_>, now: Instant) -> Result<u64, PutRefusal> {
    let plans = p.plan_put(tenant, &[s], false, 1 << 30, &NodeSet::default());
    let id = match plans[0] {
        PutPlan::Store(planned) => planned.id,
        PutPlan::Skip(st) => return Err(st),
    };
    p.index
        .publish(Commit { checksum: 7, wall_ms: 1_000, soft_pin_ttl_ms: 60_000, ..block(tenant, id, s, now) })
        .map(|_| id)
}

fn keys(ks: &[&str]) -> Vec<Vec<u8>> {
    ks.iter().map(|k| k.as_bytes().to_vec()).collect()
}

#[test]
fn put_get_lookup_remove_and_tenants_are_apart() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"a", 1000, None), now).unwrap();
    put(&mut p, T1, spec(b"b", 10, Some(b"a")), now).unwrap();
    assert_eq!(put(&mut p, T1, spec(b"a", 5, None), now), Err(PutRefusal::AlreadyExists));
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b", "c"]), 0), 2);
    assert_eq!(p.index.lookup(T1, &keys(&["x", "a"]), 0), 0, "a gap ends the prefix");
    assert_eq!(p.index.lookup(T2, &keys(&["a"]), 0), 0, "another tenant's key space");
    assert_eq!(p.index.exists(T1, &keys(&["a", "zz"])), vec![true, false]);
    let got = p.index.plan_get(T1, &keys(&["a", "nope"]), now + Duration::from_secs(5), 0);
    assert!(matches!(got[0], Located::Dram { checksum: 7, .. }));
    assert!(matches!(got[1], Located::Missing));
    let c = p.index.tenant_counters(T1);
    assert_eq!((c.resident, c.blocks, c.bytes, c.hits[0], c.misses[0]), (2, [2, 0], [1024 + 256, 0], 1, 1));
    assert_eq!(p.index.tenant_counters(T2), TenantCounters::default());
    // Leased: a plain remove refuses, a forced one goes; time passed in decides expiry.
    let (st, _, _) = p.index.remove(T1, &keys(&["a"]), false, now);
    assert_eq!(st, vec![RemoveStatus::Leased]);
    let (st, dropped, meta) = p.index.remove(T1, &keys(&["a", "q"]), false, now + Duration::from_secs(6));
    assert_eq!(st, vec![RemoveStatus::Ok, RemoveStatus::NotFound]);
    assert_eq!(dropped.len(), 1);
    assert!(meta.is_empty(), "a DRAM-only block has no record to remove");
    assert_eq!(p.index.counts(), (1, 1, 0));
}

#[test]
fn only_blocks_with_an_ssd_copy_are_persisted() {
    let mut p = pool(true, 0);
    let now = Instant::now();
    let s = spec(b"on-ssd", 100, None);
    let plans = p.plan_put(T1, &[s], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store(Planned { id, .. }) = plans[0] else { panic!() };
    let (_, meta) =
        p.index.publish(Commit { checksum: 5, dram: None, ssd: Some(8192), ..block(T1, id, s, now) }).unwrap();
    assert!(matches!(&meta[..], [MetaOp::Put { record, .. }] if record.ssd_file == Some(8192)));
    // A DRAM block gets a record when it is demoted, and loses it with its SSD copy.
    let d = put(&mut p, T1, spec(b"dram", 100, None), now).unwrap();
    assert_eq!(p.index.evict(&[d], Tier::Dram, &[Admit::Into(Tier::Ssd)], now).demotions.len(), 1);
    let Demoted::Moved { meta: MetaOp::Put { .. }, .. } = p.index.finish_demotion(d, Some(4096), 1) else { panic!() };
    let (_, dropped, meta) = p.index.remove(T1, &keys(&["dram", "on-ssd"]), true, now);
    assert_eq!(dropped.len(), 2);
    assert_eq!(meta.iter().filter(|m| matches!(m, MetaOp::Remove { .. })).count(), 2);
}

#[test]
fn upsert_replaces_unless_leased() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"k", 100, None), now).unwrap();
    p.index.plan_get(T1, &keys(&["k"]), now + Duration::from_secs(1), 0);
    let s = spec(b"k", 200, None);
    let planned = plan(&mut p, T1, s, true);
    let r = p.index.publish(upserting(Commit { checksum: 9, dram: Some(copy(0)), ..block(T1, planned.id, s, now) }));
    assert_eq!(r.unwrap_err(), PutRefusal::Leased);
    assert_eq!(p.index.plans_held(), 0, "a refused publication ends its plan");
    let later = now + Duration::from_secs(2);
    let planned = plan(&mut p, T1, s, true);
    let (replaced, meta) = p
        .index
        .publish(upserting(Commit { checksum: 9, dram: Some(copy(0)), ..block(T1, planned.id, s, later) }))
        .unwrap();
    assert!(replaced.unwrap().dram.is_some(), "the old copy comes back to be freed");
    assert!(meta.is_empty(), "DRAM-only blocks have no records");
    assert_eq!(p.index.tenant_counters(T1).bytes[0], 256);
}

/// Every plan ends in a publication or a release, and holds its block's slot until then: a
/// rejected row holds nothing, a plan is published at most once, and a released one never.
#[test]
fn a_plan_holds_its_id_until_published_or_released() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    let a = plan(&mut p, T1, spec(b"a", 100, None), false);
    let b = plan(&mut p, T1, spec(b"b", 100, None), false);
    assert_eq!(p.index.plans_held(), 2);
    assert!(!p.index.exists(T1, &keys(&["a"]))[0], "a planned block is not there yet");
    assert!(p.index.size_in_tier(a.id, Tier::Dram).is_none());
    p.index.publish(block(T1, a.id, spec(b"a", 100, None), now)).unwrap();
    assert_eq!(p.index.size_in_tier(a.id, Tier::Dram), Some(100));
    let again = p.index.publish(upserting(block(T1, a.id, spec(b"a2", 100, None), now)));
    assert_eq!(again.unwrap_err(), PutRefusal::NoSpace, "published twice");
    assert!(p.index.release_plan(&b));
    assert!(!p.index.release_plan(&b), "released twice");
    assert!(!p.index.release_plan(&a), "a published plan holds nothing");
    let late = p.index.publish(block(T1, b.id, spec(b"b", 100, None), now));
    assert_eq!(late.unwrap_err(), PutRefusal::NoSpace, "published after its release");
    assert_eq!(p.index.plans_held(), 0);
    // The released slot comes back under a new id; the old one finds nothing.
    let c = plan(&mut p, T1, spec(b"c", 100, None), false);
    assert_ne!(c.id, b.id);
    p.index.publish(block(T1, c.id, spec(b"c", 100, None), now)).unwrap();
    assert!(p.index.size_in_tier(b.id, Tier::Dram).is_none());
    assert_eq!(p.index.counts(), (2, 2, 0));
    // Rows admission rejects (a threshold above the row's 16 tokens) hold nothing.
    let mut q = pool(false, 1 << 20);
    let plans = q.plan_put(T1, &[spec(b"x", 100, None)], false, 1 << 30, &NodeSet::default());
    assert_eq!(plans[0], PutPlan::Skip(PutRefusal::Rejected));
    assert_eq!(q.index.plans_held(), 0);
}

#[test]
fn eviction_is_leaf_first_and_skips_leased_blocks() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    // A chain r <- c1 <- c2, and a lone block x put last.
    put(&mut p, T1, spec(b"r", 256, None), now).unwrap();
    put(&mut p, T1, spec(b"c1", 256, Some(b"r")), now).unwrap();
    put(&mut p, T1, spec(b"c2", 256, Some(b"c1")), now).unwrap();
    put(&mut p, T1, spec(b"x", 256, None), now).unwrap();
    let out = p.evict(Tier::Dram, 512, false, now);
    assert_eq!(out.gone, 2);
    let left = p.index.exists(T1, &keys(&["r", "c1", "c2", "x"]));
    // The chain keeps its prefix property: what remains of it is a prefix.
    assert!(left[0] || !left[1], "{left:?}");
    assert!(left[1] || !left[2], "{left:?}");
    // A leased block stays even when it is the only candidate (no SSD tier to keep it in).
    let mut p = pool(false, 0);
    put(&mut p, T1, spec(b"only", 256, None), now).unwrap();
    p.index.plan_get(T1, &keys(&["only"]), now + Duration::from_secs(5), 0);
    assert_eq!(p.evict(Tier::Dram, 256, false, now).gone, 0);
    assert_eq!(p.evict(Tier::Dram, 256, false, now + Duration::from_secs(6)).gone, 1);
}

#[test]
fn a_held_chain_stays_until_every_hold_goes_whatever_the_clock() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"r", 256, None), now).unwrap();
    put(&mut p, T1, spec(b"c", 256, Some(b"r")), now).unwrap();
    put(&mut p, T1, spec(b"x", 256, None), now).unwrap();
    // Two lookups hold r and c (x is not part of the chain asked; "gap" is absent).
    let (hit, ids) = p.index.lookup_hold(T1, &keys(&["r", "c", "gap"]), 0);
    assert_eq!((hit, ids.len()), (2, 2));
    let (_, again) = p.index.lookup_hold(T1, &keys(&["r"]), 0);
    assert_eq!(p.index.held(), 2);
    let much_later = now + Duration::from_secs(3600);
    // Eviction takes only x, and a remove without force refuses the held root.
    assert_eq!(p.evict(Tier::Dram, 768, false, much_later).gone, 1);
    assert_eq!(p.index.exists(T1, &keys(&["r", "c", "x"])), vec![true, true, false]);
    assert_eq!(p.index.remove(T1, &keys(&["r"]), false, much_later).0, vec![RemoveStatus::Leased]);
    // The first holder lets go: r is still held by the second, c is free (and evicted first).
    p.index.unhold(&ids);
    assert_eq!(p.index.held(), 1);
    assert_eq!(p.evict(Tier::Dram, 512, false, much_later).gone, 1);
    assert_eq!(p.index.exists(T1, &keys(&["r", "c"])), vec![true, false]);
    p.index.unhold(&again);
    assert_eq!(p.index.held(), 0);
    assert_eq!(p.evict(Tier::Dram, 256, false, much_later).gone, 1);
    // A held block removed by force takes its hold along; a late unhold is harmless.
    let (_, ids) = {
        put(&mut p, T1, spec(b"y", 256, None), now).unwrap();
        p.index.lookup_hold(T1, &keys(&["y"]), 0)
    };
    let (removed, skipped, _, _) = p.index.remove_all(T1, false, now, |k| k == b"y");
    assert_eq!((removed, skipped), (0, 1));
    p.index.remove(T1, &keys(&["y"]), true, now);
    assert_eq!(p.index.held(), 0);
    p.index.unhold(&ids);
    assert_eq!(p.index.held(), 0);
}

#[test]
fn a_copy_in_use_is_not_a_victim() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"busy", 256, None), now).unwrap();
    let Located::Dram { copy, .. } = p.index.plan_get(T1, &keys(&["busy"]), now, 0).remove(0) else { panic!() };
    copy.0.fetch_add(1, Ordering::Relaxed);
    assert_eq!(p.evict(Tier::Dram, 256, false, now).gone, 0);
    copy.0.fetch_sub(1, Ordering::Relaxed);
    assert_eq!(p.evict(Tier::Dram, 256, false, now).gone, 1);
}

#[test]
fn demotion_moves_blocks_to_ssd_and_survives_races() {
    let mut p = pool(true, 0);
    let now = Instant::now();
    let a = put(&mut p, T1, spec(b"a", 300, None), now).unwrap();
    let b = put(&mut p, T1, spec(b"b", 300, None), now).unwrap();
    let out = p.evict(Tier::Dram, 600, true, now);
    assert_eq!(out.demotions.len(), 2, "admission (threshold 0) sends both to SSD");
    assert_eq!(p.index.evict(&[a], Tier::Dram, &[Admit::Into(Tier::Ssd)], now).demotions.len(), 0, "in flight");
    // a: written; b: removed while moving.
    match p.index.finish_demotion(a, Some(41), 0) {
        Demoted::Moved { dram: Some(_), meta: MetaOp::Put { record, .. } } => {
            assert_eq!((record.ssd_file, record.in_dram), (Some(41), false))
        }
        other => panic!("{other:?}"),
    }
    p.index.remove(T1, &keys(&["b"]), true, now);
    assert!(matches!(p.index.finish_demotion(b, Some(42), 0), Demoted::Vanished));
    let c = p.index.tenant_counters(T1);
    assert_eq!((c.blocks, c.demotions, c.evictions[0]), ([0, 1], 1, 2));
    assert!(matches!(p.index.plan_get(T1, &keys(&["a"]), now, 0).remove(0), Located::Ssd { locator: 41, .. }));
    // Promotion back to DRAM, then a corrupt SSD copy is dropped but the DRAM copy serves.
    p.index.install_promoted(a, 41, copy(a)).unwrap();
    assert!(p.index.install_promoted(a, 41, copy(a)).is_err(), "already promoted");
    let (d, _) = p.index.drop_corrupt(a, 41).unwrap();
    assert_eq!(d.ssd, Some((41, 300)));
    assert!(matches!(p.index.plan_get(T1, &keys(&["a"]), now, 0).remove(0), Located::Dram { .. }));
    assert_eq!(p.index.tenant_counters(T1).corrupt, 1);
}

#[test]
fn failed_demotion_evicts_and_leased_ssd_blocks_stay() {
    let mut p = pool(true, 1_000_000);
    let now = Instant::now();
    let a = put(&mut p, T1, PutSpec { seq_tokens: 2_000_000, ..spec(b"a", 300, None) }, now).unwrap();
    let out = p.evict(Tier::Dram, 300, true, now);
    assert_eq!(out.demotions.len(), 1);
    assert!(matches!(p.index.finish_demotion(a, None, 0), Demoted::Evicted { .. }));
    assert_eq!(p.index.counts(), (0, 0, 0));
    // Admission rejects the demotion (threshold): the block is dropped, not demoted.
    let b = put(&mut p, T1, PutSpec { seq_tokens: 2_000_000, ..spec(b"b", 300, None) }, now);
    assert!(b.is_ok());
    let mut q = pool(true, 1_000_000);
    let plans = q.plan_put(T1, &[spec(b"low", 10, None)], false, 1 << 30, &NodeSet::default());
    assert_eq!(plans, vec![PutPlan::Skip(PutRefusal::Rejected)]);
    assert_eq!(q.index.tenant_counters(T1).rejected, 1);
}

#[test]
fn soft_pins_expire_by_wall_clock_and_hard_pins_stay() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    let s = PutSpec { pin: PinRequest::Soft { ttl_ms: 500 }, ..spec(b"soft", 256, None) };
    let plans = p.plan_put(T1, &[s], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store(Planned { id, .. }) = plans[0] else { panic!() };
    p.index.publish(Commit { checksum: 1, wall_ms: 1_000, soft_pin_ttl_ms: 60_000, ..block(T1, id, s, now) }).unwrap();
    let h = PutSpec { pin: PinRequest::Hard, ..spec(b"hard", 256, None) };
    let plans = p.plan_put(T1, &[h], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store(Planned { id: hid, .. }) = plans[0] else { panic!() };
    p.index.publish(Commit { checksum: 1, wall_ms: 1_000, soft_pin_ttl_ms: 60_000, ..block(T1, hid, h, now) }).unwrap();
    assert_eq!(IndexView::pin(&p.index, id), Pin::Soft);
    p.index.expire_soft_pins(1_499);
    assert_eq!(IndexView::pin(&p.index, id), Pin::Soft);
    p.index.expire_soft_pins(1_500);
    assert_eq!(IndexView::pin(&p.index, id), Pin::None);
    let ev = p.index.take_events();
    assert!(ev.iter().any(|e| e.kind == EventKind::PinChanged && e.id == id));
    assert_eq!(p.evict(Tier::Dram, 10_000, false, now).gone, 1, "the hard-pinned block never goes");
    assert_eq!(p.index.exists(T1, &keys(&["hard"])), vec![true]);
}

#[test]
fn recovery_keeps_complete_ssd_copies_and_relinks_chains() {
    let rec = |parent: Option<&str>, file: Option<u64>, in_dram: bool| BlockRecord {
        size: 100,
        tokens: 1,
        seq_tokens: 1,
        parent: parent.map(|p| p.as_bytes().to_vec()),
        checksum: 1,
        created_ms: 0,
        pin: 0,
        pin_until_ms: 0,
        ssd_file: file,
        in_dram,
    };
    let records = vec![
        (T1, b"child".to_vec(), Some(rec(Some("root"), Some(2), true))),
        (T1, b"root".to_vec(), Some(rec(None, Some(1), false))),
        (T1, b"dram-only".to_vec(), Some(rec(None, None, true))),
        (T1, b"short-file".to_vec(), Some(rec(None, Some(3), false))),
        (T1, b"garbage".to_vec(), None),
    ];
    // Extents 1 and 2 are claimable; 3 is not (say, it overlaps a newer record's).
    let mut claimed = Vec::new();
    let mut ix: Index<Copy> = Index::new(GRAN, true);
    let r = ix.recover(
        records,
        |extents| {
            claimed.extend_from_slice(extents);
            extents.iter().map(|&(loc, _)| loc != 3).collect()
        },
        0,
    );
    assert_eq!((r.kept, r.dropped), (2, 3));
    assert_eq!(claimed, vec![(2, 100), (1, 100), (3, 100)]);
    assert_eq!(r.meta.iter().filter(|m| matches!(m, MetaOp::Remove { .. })).count(), 3);
    assert_eq!(r.meta.iter().filter(|m| matches!(m, MetaOp::Put { .. })).count(), 0, "records stay as they are");
    // Parents first in the snapshot, with the link restored.
    let ev: Vec<_> = r.snapshot.iter().collect();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[1].parent, ev[0].id);
    assert_eq!(ix.lookup(T1, &keys(&["root", "child"]), 0), 2);
    assert_eq!(ix.tenant_counters(T1).bytes, [0, 8192]);
}

#[test]
fn a_swap_sees_every_event_after_its_snapshot() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"before", 256, None), now).unwrap();
    p.flush();
    let snapshot = p.index.snapshot();
    p.policies.start_tap();
    put(&mut p, T1, spec(b"during", 256, None), now).unwrap();
    p.flush();
    let mut fresh = LeafLru::new();
    kvpool_policy_sdk::EvictionPolicy::on_events(&mut fresh, &snapshot);
    p.policies.swap(NewSlot::Eviction(Box::new(Native(fresh))));
    // The new policy knows both blocks: it can free both.
    assert_eq!(p.evict(Tier::Dram, 512, false, now).gone, 2);
}

#[test]
fn compact_locator() {
    use crate::blocks::Locator;
    let mut l = Locator::some(0);
    assert_eq!((l.get(), l.is_some()), (Some(0), true));
    assert_eq!(l.take(), Some(0));
    assert!(l.is_none() && l.get().is_none());
    assert_eq!(Locator::from(None), Locator::NONE);
    assert_eq!(Locator::from(Some(4096)).get(), Some(4096));
}

/// (kind, tier, key) of the index's KV events since the last call.
fn changes(p: &mut Pool<Copy>) -> Vec<(ChangeKind, Tier, String)> {
    p.index.take_changes().into_iter().map(|c| (c.kind, c.tier, String::from_utf8_lossy(&c.key).into_owned())).collect()
}

#[test]
fn the_change_feed_reports_every_copy_that_comes_or_goes_and_why() {
    use ChangeKind::{Evicted, Removed, Stored};
    let mut p = pool(true, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"off", 10, None), now).unwrap();
    assert!(changes(&mut p).is_empty(), "off by default");
    p.index.set_change_feed(true);
    let a = put(&mut p, T1, spec(b"a", 300, None), now).unwrap();
    put(&mut p, T1, spec(b"b", 300, Some(b"a")), now).unwrap();
    let c = p.index.take_changes();
    assert_eq!(c.len(), 2);
    assert_eq!(
        (c[1].kind, c[1].tier, &*c[1].key, c[1].parent.as_deref(), c[1].tenant),
        (Stored, Tier::Dram, &b"b"[..], Some(&b"a"[..]), T1)
    );
    // A demotion: the SSD copy arrives before the DRAM copy goes.
    let d = p.index.demotion_batch(&[a]);
    assert_eq!(d.len(), 1);
    let out = p.index.evict(&[a], Tier::Dram, &[Admit::Into(Tier::Ssd)], now);
    assert_eq!(out.demotions.len(), 1);
    assert!(changes(&mut p).is_empty(), "nothing has moved yet");
    let _ = p.index.finish_demotion(a, Some(4096), 0);
    assert_eq!(changes(&mut p), vec![(Stored, Tier::Ssd, "a".into()), (Evicted, Tier::Dram, "a".into())]);
    // Promotion, a corrupt SSD copy, a client remove.
    p.index.install_promoted(a, 4096, copy(a)).unwrap();
    p.index.drop_corrupt(a, 4096).unwrap();
    assert_eq!(changes(&mut p), vec![(Stored, Tier::Dram, "a".into()), (Removed, Tier::Ssd, "a".into())]);
    // Evicting the root cascades to its child (no SSD admission): both are evictions.
    let out = p.index.evict(&[a], Tier::Dram, &[Admit::Reject], now);
    assert_eq!(out.cascaded, 1);
    assert_eq!(changes(&mut p), vec![(Evicted, Tier::Dram, "b".into()), (Evicted, Tier::Dram, "a".into())]);
    // An upsert replaces (the old copy is removed, the new stored); remove and remove-all.
    let s = spec(b"off", 20, None);
    let plans = p.plan_put(T1, &[s], true, 1 << 30, &NodeSet::default());
    let PutPlan::Store(Planned { id, .. }) = plans[0] else { panic!("{plans:?}") };
    p.index.publish(upserting(block(T1, id, s, now))).unwrap();
    put(&mut p, T1, spec(b"z", 1, None), now).unwrap();
    p.index.remove(T1, &keys(&["z"]), false, now);
    p.index.remove_all(T1, false, now, |_| true);
    assert_eq!(
        changes(&mut p),
        vec![
            (Removed, Tier::Dram, "off".into()),
            (Stored, Tier::Dram, "off".into()),
            (Stored, Tier::Dram, "z".into()),
            (Removed, Tier::Dram, "z".into()),
            (Removed, Tier::Dram, "off".into()),
        ]
    );
    p.index.set_change_feed(false);
    put(&mut p, T1, spec(b"q", 1, None), now).unwrap();
    assert!(changes(&mut p).is_empty());
}

/// One stamp per access keeps both the access order and the time: under a frozen clock the
/// stamps still grow, more than 4,096 of them borrow the next µs, and a clock that goes back
/// never lowers them.
#[test]
fn stamps_order_accesses_and_keep_their_time() {
    let mut s = crate::blocks::Stamp::default();
    let mut last = s;
    for _ in 0..10_000 {
        s = s.next(7);
        assert!(s > last);
        last = s;
    }
    assert_eq!(s.us(), 9, "10,000 accesses in one µs borrow two more µs");
    let later = s.next(1_000_000);
    assert_eq!(later.us(), 1_000_000);
    assert!(later.next(5) > later, "a clock that went back does not lower the stamps");
}

/// Records take the index's record clock: a record written while the wall clock stands
/// earlier than a previous write still reads as newer (recovery gives a contested extent to
/// the newest record).
#[test]
fn record_times_never_go_backwards() {
    let mut p = pool(true, 0);
    let now = Instant::now();
    let mut created = Vec::new();
    for (key, wall_ms) in [(&b"a"[..], 5_000), (b"b", 2_000), (b"c", 9_000)] {
        let s = spec(key, 100, None);
        let plans = p.plan_put(T1, &[s], false, 1 << 30, &NodeSet::default());
        let PutPlan::Store(Planned { id, .. }) = plans[0] else { panic!("{plans:?}") };
        let (_, meta) = p
            .index
            .publish(Commit {
                checksum: 7,
                ssd: Some(4096 * id),
                wall_ms,
                soft_pin_ttl_ms: 60_000,
                ..block(T1, id, s, now)
            })
            .unwrap();
        let Some(MetaOp::Put { record, .. }) = meta.into_iter().next() else { panic!("an SSD block has a record") };
        created.push(record.created_ms);
    }
    assert_eq!(created, vec![5_000, 5_000, 9_000]);
}

/// A node without SSD that offers its DRAM victims to other nodes: a victim nobody took is
/// evicted under the usual rules as they stand when the offer ends. A lease taken meanwhile
/// keeps it; otherwise the chain rule takes its descendants along, and each copy is counted
/// once.
#[test]
fn untaken_offers_are_evicted_under_the_usual_rules() {
    let mut p = pool(false, 0);
    p.index.set_offload(true);
    let now = Instant::now();
    let a = put(&mut p, T1, spec(b"a", 100, None), now).unwrap();
    put(&mut p, T1, spec(b"b", 100, Some(b"a")), now).unwrap();
    let out = p.index.evict(&[a], Tier::Dram, &[], now);
    assert_eq!((out.demotions.len(), out.gone), (1, 0), "offered, not dropped");
    // Read while it was offered: the lease keeps it, and it is an ordinary block again.
    p.index.plan_get(T1, &keys(&["a"]), now + Duration::from_secs(5), 0);
    let out = p.index.evict_untaken(a, now);
    assert_eq!((out.gone, out.dropped.len()), (0, 0));
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b"]), 0), 2);
    assert_eq!(p.index.tenant_counters(T1).evictions[0], 0);
    // Offered again after the lease: nobody takes it, and its child goes with it.
    let later = now + Duration::from_secs(6);
    let out = p.index.evict(&[a], Tier::Dram, &[], later);
    assert_eq!(out.demotions.len(), 1);
    let out = p.index.evict_untaken(a, later);
    assert_eq!((out.gone, out.cascaded, out.dropped.len()), (2, 1, 2));
    assert_eq!(p.index.lookup(T1, &keys(&["a"]), 0), 0);
    assert!(p.index.id_of(T1, b"b").is_none());
    assert_eq!(p.index.tenant_counters(T1).evictions[0], 2);
    // Without the offer, a node without SSD evicts at once, as before.
    p.index.set_offload(false);
    let c = put(&mut p, T1, spec(b"c", 100, None), later).unwrap();
    let out = p.index.evict(&[c], Tier::Dram, &[], later);
    assert_eq!((out.demotions.len(), out.gone), (0, 1));
}

/// A chain demoted to SSD keeps its shape in the eviction policy: the policies hear of each
/// SSD copy before the DRAM copy goes, so a demoted parent is not taken for a leaf of the SSD
/// tier (leaf-first LRU then offers the child, not the parent that strands it).
#[test]
fn a_demoted_chain_keeps_its_leaves_in_the_ssd_tier() {
    let mut p = pool(true, 0);
    let now = Instant::now();
    let a = put(&mut p, T1, spec(b"a", 100, None), now).unwrap();
    let b = put(&mut p, T1, spec(b"b", 100, Some(b"a")), now).unwrap();
    // The child first, then the parent, as leaf-first eviction demotes them.
    for (i, id) in [b, a].into_iter().enumerate() {
        let out = p.index.evict(&[id], Tier::Dram, &[Admit::Into(Tier::Ssd)], now);
        assert_eq!(out.demotions.len(), 1);
        assert!(matches!(p.index.finish_demotion(id, Some(4096 * i as u64), 2_000), Demoted::Moved { .. }));
    }
    // The child is read since: by recency alone the parent would go first.
    p.index.plan_get(T1, &keys(&["b"]), now, 3_000_000);
    assert_eq!(p.select_victims(Tier::Ssd, 100, now), vec![b], "the leaf of the SSD tier goes first");
}

/// A native admission policy that panics mid-put: the put's rows give their ids back.
#[test]
fn a_policy_that_panics_mid_put_leaves_no_plan_held() {
    struct Panics;
    impl AdmissionPolicy for Panics {
        fn on_events(&mut self, _: &Events) {}
        fn admit(&mut self, _: &AdmitBatch) -> Vec<Admit> {
            panic!("a bug in a native policy")
        }
    }
    let mut p: Pool<Copy> =
        Pool::new(Index::new(GRAN, false), Policies::new(Box::new(Native(LeafLru::new())), Box::new(Native(Panics))));
    let items = [spec(b"a", 100, None), spec(b"b", 100, Some(b"a"))];
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.plan_put(T1, &items, false, 1 << 30, &NodeSet::default())
    }));
    assert!(r.is_err(), "the panic goes on to the caller");
    assert_eq!(p.index.plans_held(), 0);
}
