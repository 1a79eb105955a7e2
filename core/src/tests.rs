//! The index and its policies in memory, with time passed in.

use super::*;
use kvpool_policies::{LeafLru, ThresholdAdmission};
use kvpool_policy_sdk::{EventKind, Tier};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A DRAM copy for tests: a name, and a share count standing for in-flight readers.
#[derive(Clone, Debug)]
struct Copy(Arc<AtomicUsize>);

impl CopyHandle for Copy {
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

/// Plan and commit one block into DRAM; returns its id.
fn put(p: &mut Pool<Copy>, tenant: u32, s: PutSpec<'_>, now: Instant) -> Result<u64, PutStatus> {
    let plans = p.plan_put(tenant, &[s], false, 1 << 30, &NodeSet::default());
    let id = match plans[0] {
        PutPlan::Store { id, .. } => id,
        PutPlan::Skip(st) => return Err(st),
    };
    p.index.commit(tenant, id, &s, false, 7, Some(copy(id)), None, now, 1_000, 60_000).map(|_| id)
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
    assert_eq!(put(&mut p, T1, spec(b"a", 5, None), now), Err(PutStatus::AlreadyExists));
    assert_eq!(p.index.lookup(T1, &keys(&["a", "b", "c"])), 2);
    assert_eq!(p.index.lookup(T1, &keys(&["x", "a"])), 0, "a gap ends the prefix");
    assert_eq!(p.index.lookup(T2, &keys(&["a"])), 0, "another tenant's key space");
    assert_eq!(p.index.exists(T1, &keys(&["a", "zz"])), vec![true, false]);
    let got = p.index.plan_get(T1, &keys(&["a", "nope"]), now + Duration::from_secs(5));
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
    let PutPlan::Store { id, .. } = plans[0] else { panic!() };
    let (_, meta) = p.index.commit(T1, id, &s, false, 5, None, Some(8192), now, 0, 0).unwrap();
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
    let id = put(&mut p, T1, spec(b"k", 100, None), now).unwrap();
    p.index.plan_get(T1, &keys(&["k"]), now + Duration::from_secs(1));
    let s = spec(b"k", 200, None);
    let r = p.index.commit(T1, id + 100, &s, true, 9, Some(copy(0)), None, now, 0, 0);
    assert_eq!(r.unwrap_err(), PutStatus::Leased);
    let later = now + Duration::from_secs(2);
    let (replaced, meta) = p.index.commit(T1, id + 100, &s, true, 9, Some(copy(0)), None, later, 0, 0).unwrap();
    assert!(replaced.unwrap().dram.is_some(), "the old copy comes back to be freed");
    assert!(meta.is_empty(), "DRAM-only blocks have no records");
    assert_eq!(p.index.tenant_counters(T1).bytes[0], 256);
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
    p.index.plan_get(T1, &keys(&["only"]), now + Duration::from_secs(5));
    assert_eq!(p.evict(Tier::Dram, 256, false, now).gone, 0);
    assert_eq!(p.evict(Tier::Dram, 256, false, now + Duration::from_secs(6)).gone, 1);
}

#[test]
fn a_copy_in_use_is_not_a_victim() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    put(&mut p, T1, spec(b"busy", 256, None), now).unwrap();
    let Located::Dram { copy, .. } = p.index.plan_get(T1, &keys(&["busy"]), now).remove(0) else { panic!() };
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
    assert!(matches!(p.index.plan_get(T1, &keys(&["a"]), now).remove(0), Located::Ssd { locator: 41, .. }));
    // Promotion back to DRAM, then a corrupt SSD copy is dropped but the DRAM copy serves.
    p.index.install_promoted(a, 41, copy(a)).unwrap();
    assert!(p.index.install_promoted(a, 41, copy(a)).is_err(), "already promoted");
    let (d, _) = p.index.drop_corrupt(a, 41).unwrap();
    assert_eq!(d.ssd, Some((41, 300)));
    assert!(matches!(p.index.plan_get(T1, &keys(&["a"]), now).remove(0), Located::Dram { .. }));
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
    assert_eq!(plans, vec![PutPlan::Skip(PutStatus::Rejected)]);
    assert_eq!(q.index.tenant_counters(T1).rejected, 1);
}

#[test]
fn soft_pins_expire_by_wall_clock_and_hard_pins_stay() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    let s = PutSpec { pin: PinRequest::Soft { ttl_ms: 500 }, ..spec(b"soft", 256, None) };
    let plans = p.plan_put(T1, &[s], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store { id, .. } = plans[0] else { panic!() };
    p.index.commit(T1, id, &s, false, 1, Some(copy(id)), None, now, 1_000, 60_000).unwrap();
    let h = PutSpec { pin: PinRequest::Hard, ..spec(b"hard", 256, None) };
    let plans = p.plan_put(T1, &[h], false, 1 << 30, &NodeSet::default());
    let PutPlan::Store { id: hid, .. } = plans[0] else { panic!() };
    p.index.commit(T1, hid, &h, false, 1, Some(copy(hid)), None, now, 1_000, 60_000).unwrap();
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
        |loc, size| {
            claimed.push((loc, size));
            loc != 3
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
    assert_eq!(ix.lookup(T1, &keys(&["root", "child"])), 2);
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
