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

// The log holds tens of thousands of these: keep them from growing unnoticed (64-bit targets).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Change>() <= 64);

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
    /// The node whose copy this is: 0 for this server's own; a cluster master logs its storage
    /// nodes' changes under their node ids.
    pub node: u32,
}

/// What a subscriber reads: the changes from its cursor that pass its filter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeBatch {
    /// Changes from the cursor on that are no longer held (it fell behind): all of them,
    /// whether they would have passed the filter or not, since they are gone.
    pub lagged: u64,
    /// The cursor to read from next.
    pub next: u64,
    /// (sequence number, change), oldest first.
    pub changes: Vec<(u64, Change)>,
}

/// Changes are held in shared chunks of at most this many, so that a reader takes the log's
/// lock only to clone a few chunk references, and a huge publication (a remove-all) still
/// leaves the log bounded.
const CHUNK: usize = 1024;

/// The newest `capacity` changes (all of them until that many were logged), numbered from 1.
#[derive(Debug)]
pub struct ChangeLog {
    capacity: usize,
    /// Sequence number of the first change held.
    first: u64,
    /// Changes held.
    held: usize,
    /// (sequence number of the chunk's first change, the chunk), contiguous, oldest first; the
    /// oldest chunk's changes before `first` are gone.
    chunks: VecDeque<(u64, Arc<Chunk>)>,
}

/// A stretch of the log taken under its lock, read outside it.
#[derive(Debug, Clone)]
pub struct ChangeWindow {
    lagged: u64,
    start: u64,
    chunks: Vec<(u64, Arc<Chunk>)>,
}

/// A change as the log holds it, borrowed: what a reader's filter looks at before anything is
/// copied out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangeRef<'a> {
    pub kind: ChangeKind,
    pub tier: Tier,
    pub tenant: u32,
    pub key: &'a [u8],
    pub parent: Option<&'a [u8]>,
    pub size: u64,
    pub time_ms: u64,
    pub node: u32,
}

impl ChangeRef<'_> {
    pub fn to_change(&self) -> Change {
        Change {
            kind: self.kind,
            tier: self.tier,
            tenant: self.tenant,
            key: self.key.into(),
            parent: self.parent.map(Into::into),
            size: self.size,
            time_ms: self.time_ms,
            node: self.node,
        }
    }
}

/// A change's fixed fields in a [`Chunk`]; its key and parent are ranges of the chunk's bytes.
#[derive(Debug, Clone, Copy)]
struct Head {
    kind: ChangeKind,
    tier: Tier,
    tenant: u32,
    node: u32,
    key_at: u32,
    key_len: u32,
    /// [`NO_PARENT_AT`] when the change has no parent key.
    parent_at: u32,
    parent_len: u32,
    size: u64,
    time_ms: u64,
}

const NO_PARENT_AT: u32 = u32::MAX;

/// Up to [`CHUNK`] changes stored compactly: the log holds tens of thousands, and as one
/// `Change` each (two shared keys apiece, in a chunk per publication, often of one change)
/// they cost about 250 bytes a change, a fixed 16 MiB at the default capacity that a node with
/// few blocks pays per block. Here a chunk's keys share one buffer, and a parent key that is
/// the previous change's key or parent (a chain's put, the chain rule's cascade) is stored
/// once: about 90 bytes a change for 40-byte keys. Publications fill the newest chunk in place
/// while no reader holds it.
#[derive(Debug, Default)]
struct Chunk {
    heads: Vec<Head>,
    bytes: Vec<u8>,
}

impl Chunk {
    #[cfg(test)]
    fn new(changes: impl Iterator<Item = Change>) -> Chunk {
        let mut chunk = Chunk::default();
        changes.for_each(|c| chunk.push(&c));
        chunk
    }

    /// The offset of `b` in the chunk's bytes: one of `known`'s, or appended.
    fn place(&mut self, b: &[u8], known: &[(u32, u32)]) -> (u32, u32) {
        for &(at, len) in known {
            if len as usize == b.len() && &self.bytes[at as usize..(at + len) as usize] == b {
                return (at, len);
            }
        }
        // Keys are at most 64 KiB (the index refuses longer ones), a chunk at most 1,024
        // changes: offsets fit in 32 bits.
        let at = self.bytes.len() as u32;
        self.bytes.extend_from_slice(b);
        (at, b.len() as u32)
    }

    fn push(&mut self, c: &Change) {
        // The previous change's key and parent: where a chain's parent key already is.
        let mut prev = [(0u32, 0u32); 2];
        let mut known = 0;
        if let Some(h) = self.heads.last() {
            prev[0] = (h.key_at, h.key_len);
            known = 1;
            if h.parent_at != NO_PARENT_AT {
                prev[1] = (h.parent_at, h.parent_len);
                known = 2;
            }
        }
        let (key_at, key_len) = self.place(&c.key, &prev[..known]);
        let (parent_at, parent_len) = match &c.parent {
            Some(p) => self.place(p, &prev[..known]),
            None => (NO_PARENT_AT, 0),
        };
        self.heads.push(Head {
            kind: c.kind,
            tier: c.tier,
            tenant: c.tenant,
            node: c.node,
            key_at,
            key_len,
            parent_at,
            parent_len,
            size: c.size,
            time_ms: c.time_ms,
        });
    }

    fn len(&self) -> usize {
        self.heads.len()
    }

    fn get(&self, i: usize) -> ChangeRef<'_> {
        let h = &self.heads[i];
        let range = |at: u32, len: u32| &self.bytes[at as usize..(at + len) as usize];
        ChangeRef {
            kind: h.kind,
            tier: h.tier,
            tenant: h.tenant,
            key: range(h.key_at, h.key_len),
            parent: (h.parent_at != NO_PARENT_AT).then(|| range(h.parent_at, h.parent_len)),
            size: h.size,
            time_ms: h.time_ms,
            node: h.node,
        }
    }
}

impl ChangeLog {
    pub fn new(capacity: usize) -> ChangeLog {
        ChangeLog { capacity, first: 1, held: 0, chunks: VecDeque::new() }
    }

    /// Number the changes (consecutively, in order) and keep them; the oldest chunks go while
    /// the newer ones hold `capacity` changes (a capacity of 0 numbers changes and keeps none).
    /// Returns the next sequence number.
    pub fn append(&mut self, changes: Vec<Change>) -> u64 {
        if self.capacity == 0 {
            self.first += changes.len() as u64;
            return self.next_seq();
        }
        let chunk_len = self.chunk_len();
        for c in &changes {
            let seq = self.next_seq();
            let open = match self.chunks.back_mut() {
                Some((_, last)) if last.len() < chunk_len => Arc::get_mut(last),
                _ => None,
            };
            match open {
                Some(chunk) => chunk.push(c),
                None => {
                    // The newest chunk is full or a reader holds it: it is sealed as it is.
                    if let Some(last) = self.chunks.back_mut().and_then(|(_, l)| Arc::get_mut(l)) {
                        last.heads.shrink_to_fit();
                        last.bytes.shrink_to_fit();
                    }
                    let mut chunk = Chunk::default();
                    chunk.push(c);
                    self.chunks.push_back((seq, Arc::new(chunk)));
                }
            }
            self.held += 1;
            // The oldest change goes; its chunk goes with its last change (a reader holding
            // the chunk skips what is gone by the log's `first`).
            while self.held > self.capacity {
                self.held -= 1;
                self.first += 1;
                if self.chunks.front().is_some_and(|(s, c)| self.first >= s + c.len() as u64) {
                    self.chunks.pop_front();
                }
            }
        }
        self.next_seq()
    }

    /// Changes per chunk: [`CHUNK`], or fewer in a small log, whose memory would otherwise be
    /// mostly the gone part of its oldest chunk.
    fn chunk_len(&self) -> usize {
        (self.capacity / 16).clamp(1, CHUNK)
    }

    /// Number `n` changes that cannot be logged (the cluster master forgot copies whose keys
    /// it did not keep). The log stays contiguous, so what it held goes with them: every
    /// reader before the gap learns it missed changes, as if it had fallen behind.
    pub fn skip(&mut self, n: u64) -> u64 {
        if n > 0 {
            self.first = self.next_seq() + n;
            self.held = 0;
            self.chunks.clear();
        }
        self.next_seq()
    }

    /// The sequence number the next change will get.
    pub fn next_seq(&self) -> u64 {
        self.first + self.held as u64
    }

    /// The oldest sequence number still held.
    pub fn oldest(&self) -> u64 {
        self.first
    }

    /// The chunks covering at least `scan` changes from sequence `from` on (or all there are),
    /// as shared references: cheap enough to take under a lock that writers wait for.
    pub fn window(&self, from: u64, scan: usize) -> ChangeWindow {
        // Sequence numbers start at 1: a cursor of 0 asks for the first.
        let from = from.max(1);
        let start = from.clamp(self.first, self.next_seq());
        let lagged = self.first.saturating_sub(from);
        let i = self.chunks.partition_point(|(s, _)| *s <= start).saturating_sub(1);
        let mut chunks = Vec::new();
        let mut covered = 0u64;
        for (s, c) in self.chunks.iter().skip(i) {
            let end = s + c.len() as u64;
            if end <= start {
                continue;
            }
            chunks.push((*s, c.clone()));
            covered += end - start.max(*s);
            if covered >= scan.max(1) as u64 {
                break;
            }
        }
        ChangeWindow { lagged, start, chunks }
    }

    /// [`ChangeLog::window`] then [`ChangeWindow::read`], for a reader that holds the log alone.
    pub fn read(&self, from: u64, max: usize, scan: usize, keep: impl Fn(&ChangeRef<'_>) -> bool) -> ChangeBatch {
        self.window(from, scan).read(max, scan, keep)
    }
}

impl ChangeWindow {
    /// Up to `max` changes from the window's start that pass `keep`, looking at no more than
    /// `scan` changes (a filtered subscriber among many others' changes still returns soon).
    pub fn read(&self, max: usize, scan: usize, keep: impl Fn(&ChangeRef<'_>) -> bool) -> ChangeBatch {
        let mut out = ChangeBatch { lagged: self.lagged, next: self.start, changes: Vec::new() };
        let mut examined = 0;
        'chunks: for (s, chunk) in &self.chunks {
            let skip = self.start.saturating_sub(*s) as usize;
            for j in skip..chunk.len() {
                if out.changes.len() >= max.max(1) || examined >= scan.max(1) {
                    break 'chunks;
                }
                examined += 1;
                let seq = s + j as u64;
                out.next = seq + 1;
                let c = chunk.get(j);
                if keep(&c) {
                    out.changes.push((seq, c.to_change()));
                }
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
            node: 0,
        }
    }

    #[test]
    fn numbers_keeps_the_newest_and_counts_what_a_late_reader_missed() {
        let mut log = ChangeLog::new(4);
        for i in 0..10 {
            assert_eq!(log.append(vec![change(0, &format!("k{i}"))]), i + 2);
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
        fresh.append(vec![change(0, "a")]);
        let b = fresh.read(0, 10, 10, |_| true);
        assert_eq!((b.lagged, b.changes.len()), (0, 1));
    }

    #[test]
    fn a_filter_skips_without_losing_its_place_and_scans_boundedly() {
        let mut log = ChangeLog::new(100);
        for i in 0..20 {
            log.append(vec![change(i % 2, &format!("k{i}"))]);
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
    fn a_huge_publication_stays_bounded_and_reads_across_chunks() {
        let mut log = ChangeLog::new(2_000);
        let many: Vec<Change> = (0..5_000).map(|i| change(i % 3, &format!("k{i}"))).collect();
        assert_eq!(log.append(many), 5_001);
        let held = (log.next_seq() - log.oldest()) as usize;
        assert_eq!(held, 2_000);
        // Read everything held in small steps, starting mid-chunk: every change once, in order.
        let (mut cur, mut seen) = (log.oldest() + 17, Vec::new());
        while cur < log.next_seq() {
            let b = log.window(cur, 100).read(7, 100, |c| c.tenant == 1);
            assert!(b.next > cur, "progress");
            seen.extend(b.changes.iter().map(|(s, c)| {
                assert_eq!(&*c.key, format!("k{}", s - 1).as_bytes());
                *s
            }));
            cur = b.next;
        }
        let want: Vec<u64> = (log.oldest() + 17..log.next_seq()).filter(|s| (s - 1) % 3 == 1).collect();
        assert_eq!(seen, want);
        // A window covers what was asked for, not the whole log.
        assert!(log.window(log.oldest(), 10).chunks.len() <= 2);
    }

    #[test]
    fn changes_read_back_whole_and_a_chains_parent_keys_are_stored_once() {
        let key = |i: usize| format!("{i:040}").into_bytes();
        let chain: Vec<Change> = (0..64)
            .map(|i| Change {
                kind: if i % 5 == 0 { ChangeKind::Evicted } else { ChangeKind::Stored },
                tier: if i % 2 == 0 { Tier::Dram } else { Tier::Ssd },
                tenant: 7,
                key: key(i).into(),
                parent: (i > 0).then(|| key(i - 1).into()),
                size: 1000 + i as u64,
                time_ms: 5,
                node: 3,
            })
            .collect();
        // A change whose parent is neither of the previous change's keys keeps its own copy.
        let mut stray = change(1, "stray");
        stray.parent = Some(b"elsewhere".as_slice().into());
        let mut all = chain.clone();
        all.push(stray.clone());
        let chunk = Chunk::new(all.clone().into_iter());
        assert_eq!(chunk.bytes.len(), 64 * 40 + "stray".len() + "elsewhere".len());
        let back: Vec<Change> = (0..chunk.len()).map(|i| chunk.get(i).to_change()).collect();
        assert_eq!(back, all);
        let mut log = ChangeLog::new(100);
        log.append(all.clone());
        let b = log.read(1, 100, 100, |c| c.parent.is_some_and(|p| p == b"elsewhere"));
        assert_eq!(b.changes, vec![(65, stray)]);
    }

    #[test]
    fn publications_fill_the_newest_chunk_unless_a_reader_holds_it() {
        let key = |i: usize| format!("{i:040}").into_bytes();
        let link = |i: usize| Change { parent: (i > 0).then(|| key(i - 1).into()), ..change(0, "") };
        let mut log = ChangeLog::new(65_536);
        for i in 0..64 {
            log.append(vec![Change { key: key(i).into(), ..link(i) }]);
        }
        // One publication per block of a chain: one chunk, each key once.
        assert_eq!(log.chunks.len(), 1);
        assert_eq!(log.chunks[0].1.bytes.len(), 64 * 40);
        // A reader's window stays as it was taken; what is published meanwhile goes to a new
        // chunk, and the next read sees it.
        let w = log.window(1, 1_000);
        log.append(vec![change(0, "after")]);
        assert_eq!(log.chunks.len(), 2);
        let b = w.read(1_000, 1_000, |_| true);
        assert_eq!((b.changes.len(), b.next), (64, 65));
        let b = log.read(b.next, 10, 10, |_| true);
        assert_eq!(b.changes.iter().map(|(s, c)| (*s, &*c.key)).collect::<Vec<_>>(), vec![(65, &b"after"[..])]);
    }

    #[test]
    fn capacity_zero_numbers_but_keeps_nothing() {
        let mut log = ChangeLog::new(0);
        log.append(vec![change(0, "a"), change(0, "b")]);
        let b = log.read(1, 10, 10, |_| true);
        assert_eq!((b.lagged, b.next, b.changes.len()), (2, 3, 0));
    }

    #[test]
    fn a_skip_numbers_the_changes_it_could_not_log_and_readers_learn_they_missed_them() {
        let mut log = ChangeLog::new(10);
        log.append(vec![change(0, "a"), change(0, "b")]);
        assert_eq!(log.skip(0), 3, "nothing to skip");
        assert_eq!(log.skip(5), 8);
        log.append(vec![change(0, "c")]);
        let b = log.read(2, 10, 10, |_| true);
        assert_eq!((b.lagged, b.next), (6, 9));
        assert_eq!(b.changes.iter().map(|(s, c)| (*s, &*c.key)).collect::<Vec<_>>(), vec![(8, &b"c"[..])]);
    }
}
