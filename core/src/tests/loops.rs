//! Puts and records that name each other as parents: chains stay trees, so eviction's chain
//! walk ends.

use super::*;

/// A waits for "B"; B is put under "A": B's parent is A, and A keeps waiting for "B" (adopted,
/// each would be the other's parent). Evicting either ends, and takes the other along.
#[test]
fn puts_that_name_each_other_as_parents_do_not_close_a_loop() {
    for victim in ["a", "b"] {
        let mut p = pool(false, 0);
        let now = Instant::now();
        let a = put(&mut p, T1, spec(b"a", 100, Some(b"b")), now).unwrap();
        let b = put(&mut p, T1, spec(b"b", 100, Some(b"a")), now).unwrap();
        assert_eq!(p.index.resident_children(a), vec![b]);
        assert_eq!(p.index.resident_children(b), Vec::<u64>::new(), "a is not adopted by its own child");
        let v = if victim == "a" { a } else { b };
        let out = p.index.evict(&[v], Tier::Dram, &[], now);
        let gone = if victim == "a" { 2 } else { 1 };
        assert_eq!(out.gone, gone, "victim {victim}");
        assert_eq!(p.index.counts().0, 2 - gone as u64);
    }
}

/// The same with a longer loop: a waits for "c", b is under a, c is put under b.
#[test]
fn a_longer_loop_is_not_closed_either() {
    let mut p = pool(false, 0);
    let now = Instant::now();
    let a = put(&mut p, T1, spec(b"a", 100, Some(b"c")), now).unwrap();
    let b = put(&mut p, T1, spec(b"b", 100, Some(b"a")), now).unwrap();
    let c = put(&mut p, T1, spec(b"c", 100, Some(b"b")), now).unwrap();
    assert_eq!(p.index.resident_children(b), vec![c]);
    assert!(p.index.resident_children(c).is_empty());
    assert_eq!(p.index.evict(&[a], Tier::Dram, &[], now).gone, 3);
    // And a block that waits for a key its chain does not reach is adopted as before.
    let x = put(&mut p, T1, spec(b"x", 100, Some(b"y")), now).unwrap();
    let y = put(&mut p, T1, spec(b"y", 100, None), now).unwrap();
    assert_eq!(p.index.resident_children(y), vec![x]);
}

/// Records that name each other, or themselves, as parents are recovered without a loop.
#[test]
fn recovered_records_that_name_each_other_do_not_close_a_loop() {
    let rec = |parent: &str, file: u64| BlockRecord {
        size: 100,
        tokens: 1,
        seq_tokens: 1,
        parent: Some(parent.as_bytes().to_vec()),
        checksum: 1,
        created_ms: 0,
        pin: 0,
        pin_until_ms: 0,
        ssd_file: Some(file),
        in_dram: false,
    };
    let records = vec![
        (T1, b"a".to_vec(), Some(rec("b", 1))),
        (T1, b"b".to_vec(), Some(rec("a", 2))),
        (T1, b"self".to_vec(), Some(rec("self", 3))),
    ];
    let mut ix: Index<Copy> = Index::new(GRAN, true);
    let r = ix.recover(records, |e| vec![true; e.len()], 0);
    assert_eq!(r.kept, 3);
    let id = |k: &str| ix.id_of(T1, k.as_bytes()).expect("recovered");
    let (a, b, s) = (id("a"), id("b"), id("self"));
    assert!(ix.resident_children(s).is_empty(), "not its own child");
    assert_eq!(ix.resident_children(a).len() + ix.resident_children(b).len(), 1, "one link of the two");
    for v in [a, b, s] {
        let mut ix2: Index<Copy> = Index::new(GRAN, true);
        let records = vec![
            (T1, b"a".to_vec(), Some(rec("b", 1))),
            (T1, b"b".to_vec(), Some(rec("a", 2))),
            (T1, b"self".to_vec(), Some(rec("self", 3))),
        ];
        ix2.recover(records, |e| vec![true; e.len()], 0);
        let out = ix2.evict(&[v], Tier::Ssd, &[], Instant::now());
        assert!(out.gone >= 1, "evicting {v:#x} ends");
    }
}
