use super::*;
use crate::blocks::{KeyAt, Kids, Locator, Stamp};
use kvpool_policy_sdk::Pin;
use std::collections::HashMap;

/// A record whose size tells which put it came from.
fn block(n: u64, tenant: u32) -> Block<u64> {
    Block {
        gen: 0,
        tenant,
        key: KeyAt::UNSET,
        size: n as u32,
        tokens: 0,
        seq_tokens: 0,
        parent: 0,
        checksum: 0,
        pin: Pin::None,
        dram: Some(n),
        ssd: Locator::NONE,
        moving: false,
        depth: 0,
        wanted: 0,
        stamp: Stamp::default(),
        kids: Kids::NONE,
    }
}

/// A fixed xorshift: the tests are deterministic and need no crate.
fn rng(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Random plans, publications, releases and removals against a map model: ids and keys always
/// find the same record, held slots are found by neither, slots are reused, and no id is ever
/// handed out twice (so a removed or released id never finds a newer block in its old slot).
#[test]
fn agrees_with_a_map_model() {
    let mut t: Blocks<u64> = Blocks::new();
    let mut model: HashMap<(u32, Vec<u8>), (u64, u64)> = HashMap::new();
    let mut held: Vec<u64> = Vec::new();
    let mut gone: Vec<u64> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut n = 1u64;
    let mut rnd = rng(0x2545_F491_4F6C_DD1D);
    for step in 0..40_000 {
        let tenant = (rnd() % 3) as u32;
        let key = format!("k{}", rnd() % 2_000).into_bytes();
        match model.get(&(tenant, key.clone())).copied() {
            Some((id, _)) if rnd().is_multiple_of(2) => {
                let (b, k) = t.remove(id).expect("present");
                assert_eq!((b.tenant, &*k), (tenant, &key[..]));
                model.remove(&(tenant, key.clone()));
                assert!(t.get(id).is_none() && t.id_of(tenant, &key).is_none());
                assert!(t.remove(id).is_none(), "removed twice");
                gone.push(id);
            }
            Some((id, size)) => {
                assert_eq!(t.id_of(tenant, &key), Some(id));
                assert_eq!(t.get(id).map(|b| u64::from(b.size)), Some(size));
                t.get_mut(id).expect("present").wanted += 1;
            }
            None if rnd().is_multiple_of(4) => {
                // A plan that is dropped: its id finds nothing, before and after.
                let id = t.reserve_id().expect("room");
                assert!(seen.insert(id), "id {id:#x} handed out twice");
                assert!(t.is_held(id) && !t.contains(id) && t.get(id).is_none());
                held.push(id);
            }
            None => {
                let id = t.reserve_id().expect("room");
                assert!(seen.insert(id), "id {id:#x} handed out twice");
                assert_eq!(t.id_of(tenant, &key), None);
                assert!(t.insert(id, block(n, tenant), &key).is_ok());
                assert!(t.insert(id, block(n, tenant), b"other").is_err(), "published twice");
                model.insert((tenant, key), (id, n));
                n += 1;
            }
        }
        if held.len() > 8 {
            let id = held.swap_remove((rnd() % 8) as usize);
            assert!(t.release(id));
            assert!(!t.release(id), "released twice");
            assert!(t.insert(id, block(0, 0), b"late").is_err(), "published after its release");
            gone.push(id);
        }
        if step % 5_000 == 0 {
            t.reserve(100);
        }
    }
    assert_eq!((t.len(), t.held()), (model.len(), held.len()));
    for id in &gone {
        assert!(t.get(*id).is_none() && !t.contains(*id), "a gone id finds a block");
    }
    let mut ids: Vec<u64> = t.ids().collect();
    ids.sort_unstable();
    let mut want: Vec<u64> = model.values().map(|v| v.0).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    for ((tenant, key), (id, _)) in &model {
        assert_eq!(t.id_of(*tenant, key), Some(*id));
        let b = t.get(*id).expect("present");
        assert_eq!((b.tenant, t.key(b)), (*tenant, &key[..]));
        let s = t.slot(*id).expect("present");
        assert_eq!(t.id_at(s as u32), Some(*id));
        assert!(s < t.slot_bound());
    }
    // Slots were reused: never more than were resident or held at once (6,000 keys + 9 held).
    assert!(t.slot_bound() <= 6_009, "{} slots", t.slot_bound());
    // Freed key places were reused too.
    for len in 2..=5 {
        assert!(t.keys.places(len) <= 3 * 2_000, "length {len}: {} places", t.keys.places(len));
    }
}

/// A slot comes back under the next generation; ids stay clear of 0 and of `u64::MAX` ("none").
#[test]
fn a_freed_slot_comes_back_under_a_new_id() {
    let mut t: Blocks<u64> = Blocks::new();
    let a = t.reserve_id().unwrap();
    assert!(a != 0 && a != u64::MAX);
    assert!(t.insert(a, block(1, 1), b"a").is_ok());
    t.remove(a).unwrap();
    let b = t.reserve_id().unwrap();
    assert_eq!((b as u32, a as u32), (0, 0), "the same slot");
    assert_ne!(a, b);
    assert!(t.insert(b, block(2, 1), b"a").is_ok());
    assert!(t.get(a).is_none(), "the old id does not find the new block");
    assert_eq!(t.get(b).map(|x| x.size), Some(2));
    assert_eq!(t.id_of(1, b"a"), Some(b));
}

/// A slot whose generations run out is retired: it is never handed out again.
#[test]
fn a_slot_out_of_generations_is_retired() {
    let mut t: Blocks<u64> = Blocks::new();
    let a = t.reserve_id().unwrap();
    // Age the slot to its last generation, as 2^32 reuses would.
    t.slots[0] = Slot::Held { gen: LAST_GEN };
    let last = id_of(LAST_GEN, 0);
    assert!(!t.is_held(a) && t.is_held(last));
    assert!(t.insert(last, block(1, 1), b"x").is_ok());
    t.remove(last).unwrap();
    let next = t.reserve_id().unwrap();
    assert_eq!(next as u32, 1, "a new slot, not the retired one");
    assert_eq!(t.slot_bound(), 2);
}
