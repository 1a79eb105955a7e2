//! KV events: what happened to which block copy, in the order the index did it, for routers
//! that place requests where their prefix is cached (vLLM's and Dynamo's KV-aware routers).
//!
//! The index records one [`Change`] per copy that came or went, when asked to
//! ([`crate::Index::set_change_feed`]). A [`ChangeLog`] numbers them and keeps the newest ones in
//! a bounded ring that subscribers read from their own cursor: a subscriber that falls behind
//! the ring is told how many it missed, and nobody ever waits for a subscriber.

use kvpool_policy_sdk::Tier;
use std::collections::VecDeque;
use std::sync::Arc;

/// What happened to a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    /// A copy came into a tier: a put, a demotion's new SSD copy, a promotion's DRAM copy.
    Stored,
    /// A client removed the block (remove, remove-all, an upsert that replaced it), or the pool
    /// dropped a copy whose bytes failed their checksum.
    Removed,
    /// The pool let the copy go to make room: eviction, the chain rule's cascade, a demotion
    /// that moved the block out of DRAM.
    Evicted,
}

/// One copy that came or went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub kind: ChangeKind,
    pub tier: Tier,
    pub tenant: u32,
    pub key: Arc<[u8]>,
    /// The previous key of the block's prefix chain, as the put named it.
    pub parent: Option<Arc<[u8]>>,
    pub size: u64,
    /// Wall clock (ms) stamped by whoever logs the change; the index has no clock and leaves 0.
    pub time_ms: u64,
}

/// What a subscriber reads: the changes from its cursor that pass its filter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeBatch {
    /// Changes the subscriber asked for that are no longer in the ring (it fell behind).
    pub lagged: u64,
    /// The cursor to read from next.
    pub next: u64,
    /// (sequence number, change), oldest first.
    pub changes: Vec<(u64, Change)>,
}

/// The newest changes, numbered from 1, at most `capacity` of them.
#[derive(Debug)]
pub struct ChangeLog {
    capacity: usize,
    /// Sequence number of `ring[0]`.
    first: u64,
    ring: VecDeque<Change>,
}

impl ChangeLog {
    pub fn new(capacity: usize) -> ChangeLog {
        ChangeLog { capacity, first: 1, ring: VecDeque::with_capacity(capacity.min(4096)) }
    }

    /// Number the change and keep it; the oldest goes when the ring is full (a capacity of 0
    /// numbers changes and keeps none). Returns its sequence number.
    pub fn push(&mut self, c: Change) -> u64 {
        let seq = self.next_seq();
        if self.capacity == 0 {
            self.first += 1;
            return seq;
        }
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
            self.first += 1;
        }
        self.ring.push_back(c);
        seq
    }

    /// The sequence number the next change will get.
    pub fn next_seq(&self) -> u64 {
        self.first + self.ring.len() as u64
    }

    /// The oldest sequence number still held.
    pub fn oldest(&self) -> u64 {
        self.first
    }

    /// Up to `max` changes from sequence `from` on that pass `keep`, looking at no more than
    /// `scan` entries (a filtered subscriber among many others' changes still returns soon).
    /// A `from` older than the ring counts the missing changes as `lagged` (all of them, whether
    /// they would have passed the filter or not: they are gone, so nobody can tell).
    pub fn read(&self, from: u64, max: usize, scan: usize, keep: impl Fn(&Change) -> bool) -> ChangeBatch {
        // Sequence numbers start at 1: a cursor of 0 asks for the first.
        let from = from.max(1);
        let end = self.next_seq();
        let start = from.clamp(self.first, end);
        let lagged = self.first.saturating_sub(from);
        let mut out = ChangeBatch { lagged, next: start, changes: Vec::new() };
        let skip = (start - self.first) as usize;
        for (i, c) in self.ring.iter().skip(skip).take(scan.max(1)).enumerate() {
            if out.changes.len() >= max.max(1) {
                break;
            }
            let seq = start + i as u64;
            out.next = seq + 1;
            if keep(c) {
                out.changes.push((seq, c.clone()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(tenant: u32, key: &str) -> Change {
        Change {
            kind: ChangeKind::Stored,
            tier: Tier::Dram,
            tenant,
            key: key.as_bytes().into(),
            parent: None,
            size: 1,
            time_ms: 0,
        }
    }

    #[test]
    fn numbers_keeps_the_newest_and_counts_what_a_late_reader_missed() {
        let mut log = ChangeLog::new(4);
        for i in 0..10 {
            assert_eq!(log.push(change(0, &format!("k{i}"))), i + 1);
        }
        assert_eq!((log.oldest(), log.next_seq()), (7, 11));
        let b = log.read(1, 100, 100, |_| true);
        assert_eq!(b.lagged, 6);
        assert_eq!(b.changes.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![7, 8, 9, 10]);
        assert_eq!(&*b.changes[0].1.key, b"k6");
        assert_eq!(b.next, 11);
        // Caught up: nothing, no lag, the cursor stays.
        let b = log.read(11, 100, 100, |_| true);
        assert_eq!((b.lagged, b.next, b.changes.len()), (0, 11, 0));
        // A cursor past the end reads from the end; a cursor of 0 means the first.
        assert_eq!(log.read(99, 10, 10, |_| true).next, 11);
        let mut fresh = ChangeLog::new(4);
        fresh.push(change(0, "a"));
        let b = fresh.read(0, 10, 10, |_| true);
        assert_eq!((b.lagged, b.changes.len()), (0, 1));
    }

    #[test]
    fn a_filter_skips_without_losing_its_place_and_scans_boundedly() {
        let mut log = ChangeLog::new(100);
        for i in 0..20 {
            log.push(change(i % 2, &format!("k{i}")));
        }
        // Tenant 1 only, at most 3 per read.
        let b = log.read(1, 3, 100, |c| c.tenant == 1);
        assert_eq!(b.changes.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![2, 4, 6]);
        assert_eq!(b.next, 7);
        // A scan bound of 4 entries returns after looking at 4, with the cursor past them.
        let b = log.read(7, 100, 4, |c| c.tenant == 7);
        assert!(b.changes.is_empty());
        assert_eq!(b.next, 11);
        // Reading on from each batch's `next` sees every change once.
        let (mut cur, mut seen) = (1, Vec::new());
        while cur < log.next_seq() {
            let b = log.read(cur, 2, 3, |c| c.tenant == 0);
            seen.extend(b.changes.iter().map(|(s, _)| *s));
            cur = b.next;
        }
        assert_eq!(seen, (1..=19).step_by(2).collect::<Vec<u64>>());
    }

    #[test]
    fn capacity_zero_numbers_but_keeps_nothing() {
        let mut log = ChangeLog::new(0);
        log.push(change(0, "a"));
        log.push(change(0, "b"));
        let b = log.read(1, 10, 10, |_| true);
        assert_eq!((b.lagged, b.next, b.changes.len()), (2, 3, 0));
    }
}
