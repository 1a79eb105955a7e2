//! Shared frame of the general eviction algorithms (LRU, ARC, S3-FIFO, SIEVE): per-tier
//! algorithm state plus the rules every eviction policy must follow (hard pins never, soft pins
//! only after every unpinned candidate, excluded ids never, stop once enough bytes are chosen).

use crate::hash::{IdMap, IdSet};
use kvpool_policy_sdk::{Event, EventKind, Events, Pin, Tier};

/// What the frame answers for a candidate offered by an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Not evictable now (excluded, pinned, already chosen): move past it.
    Skip,
    /// Chosen; more bytes are still needed.
    Take,
    /// Chosen, and that was enough: stop without touching more state.
    TakeLast,
}

/// One tier's ordering. Blocks stay in the structure until the host sends `Removed`. `key` is
/// the block's key hash: ghosts remember keys, since a key comes back under a fresh id.
pub(crate) trait TierOrder: Default {
    fn insert(&mut self, id: u64, key: u64);
    fn access(&mut self, id: u64);
    fn remove(&mut self, id: u64, key: u64);
    /// Offer candidates in eviction order until `f` returns `TakeLast` or none is left.
    fn candidates(&mut self, f: &mut dyn FnMut(u64) -> Step);
    /// Room for `n` more inserted blocks (a bulk load is coming).
    fn reserve(&mut self, _n: usize) {}
}

/// No slot: list ends and the cursor's "past the back" state.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    id: u64,
    prev: u32,
    next: u32,
}

/// Insertion-ordered set with O(1) push-back, removal and move-to-back: a doubly linked list
/// over a slab of slots with dense indices, plus an id index. The front is the oldest.
///
/// It carries one cursor, kept valid across every change: it names the first element behind a
/// position in the order (the next one to visit), or "past the back" (`NIL`), in which case the
/// next element pushed becomes the cursor. That is exactly "the first element pushed after the
/// last visited one", whatever is removed or moved in between.
#[derive(Debug, Clone)]
pub(crate) struct Queue {
    slots: Vec<Slot>,
    free: Vec<u32>,
    index: IdMap<u64, u32>,
    head: u32,
    tail: u32,
    cursor: u32,
}

impl Default for Queue {
    fn default() -> Queue {
        Queue { slots: Vec::new(), free: Vec::new(), index: IdMap::default(), head: NIL, tail: NIL, cursor: NIL }
    }
}

impl Queue {
    pub fn len(&self) -> usize {
        self.index.len()
    }
    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }
    fn link_back(&mut self, s: u32) {
        let sl = &mut self.slots[s as usize];
        sl.prev = self.tail;
        sl.next = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.slots[self.tail as usize].next = s;
        }
        self.tail = s;
        if self.cursor == NIL {
            self.cursor = s;
        }
    }
    fn unlink(&mut self, s: u32) {
        let Slot { prev, next, .. } = self.slots[s as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        if self.cursor == s {
            self.cursor = next;
        }
    }
    /// Append `id`, or move it to the back if present.
    pub fn push_back(&mut self, id: u64) {
        if let Some(&s) = self.index.get(&id) {
            if self.tail == s && self.cursor != NIL {
                return;
            }
            self.unlink(s);
            self.link_back(s);
            return;
        }
        let s = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize].id = id;
                s
            }
            None => {
                self.slots.push(Slot { id, prev: NIL, next: NIL });
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id, s);
        self.link_back(s);
    }
    /// Move `id` to the back if present; whether it was.
    pub fn touch(&mut self, id: u64) -> bool {
        match self.index.get(&id) {
            Some(_) => {
                self.push_back(id);
                true
            }
            None => false,
        }
    }
    fn release(&mut self, s: u32) {
        self.unlink(s);
        self.free.push(s);
    }
    pub fn remove(&mut self, id: u64) -> bool {
        match self.index.remove(&id) {
            Some(s) => {
                self.release(s);
                true
            }
            None => false,
        }
    }
    pub fn pop_front(&mut self) -> Option<u64> {
        if self.head == NIL {
            return None;
        }
        let s = self.head;
        let id = self.slots[s as usize].id;
        self.index.remove(&id);
        self.release(s);
        Some(id)
    }
    /// Reserve room for `n` more elements.
    pub fn reserve(&mut self, n: usize) {
        self.index.reserve(n);
        self.slots.reserve(n.saturating_sub(self.free.len()));
    }
    /// Point the cursor at the front (past the back when empty).
    pub fn rewind(&mut self) {
        self.cursor = self.head;
    }
    /// The element at the cursor.
    pub fn at_cursor(&self) -> Option<u64> {
        (self.cursor != NIL).then(|| self.slots[self.cursor as usize].id)
    }
    /// Move the cursor past its element.
    pub fn advance(&mut self) {
        if self.cursor != NIL {
            self.cursor = self.slots[self.cursor as usize].next;
        }
    }
}

#[derive(Debug, Clone)]
struct Meta {
    key: u64,
    pin: Pin,
    /// Size of the copy in each tier, when resident there.
    size: [Option<u64>; 3],
}

/// An [`EvictionPolicy`](kvpool_policy_sdk::EvictionPolicy) built from one `O` per tier.
#[derive(Debug, Default)]
pub(crate) struct Tiered<O> {
    meta: IdMap<u64, Meta>,
    pub tiers: [O; 3],
}

impl<O: TierOrder> Tiered<O> {
    pub fn on_events(&mut self, events: &Events) {
        // Bulk loads (a replayed snapshot) grow the maps once instead of rehashing as they go.
        if events.len() >= 4096 {
            let mut inserts = [0usize; 3];
            for e in events.iter() {
                if e.kind == EventKind::Inserted {
                    inserts[e.tier as usize] += 1;
                }
            }
            self.meta.reserve(inserts.iter().sum());
            for (o, n) in self.tiers.iter_mut().zip(inserts) {
                if n > 0 {
                    o.reserve(n);
                }
            }
        }
        for e in events.iter() {
            self.apply(e);
        }
    }

    fn apply(&mut self, e: Event) {
        let t = e.tier as usize;
        match e.kind {
            EventKind::Inserted => {
                let m = self.meta.entry(e.id).or_insert(Meta { key: e.key, pin: e.pin, size: [None; 3] });
                m.pin = e.pin;
                let again = m.size[t].replace(e.size).is_some();
                // A re-insert of a resident copy counts as a use, not as a new block.
                if again {
                    self.tiers[t].access(e.id);
                } else {
                    self.tiers[t].insert(e.id, m.key);
                }
            }
            EventKind::Accessed => {
                if self.meta.get(&e.id).is_some_and(|m| m.size[t].is_some()) {
                    self.tiers[t].access(e.id);
                }
            }
            EventKind::Removed => {
                let Some(m) = self.meta.get_mut(&e.id) else { return };
                if m.size[t].take().is_none() {
                    return;
                }
                let key = m.key;
                if m.size.iter().all(Option::is_none) {
                    self.meta.remove(&e.id);
                }
                self.tiers[t].remove(e.id, key);
            }
            EventKind::PinChanged => {
                if let Some(m) = self.meta.get_mut(&e.id) {
                    m.pin = e.pin;
                }
            }
            // These general algorithms keep no key history beyond their own ghosts.
            EventKind::Missed => {}
        }
    }

    pub fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        let t = tier as usize;
        let mut out = Vec::new();
        if bytes == 0 {
            return out;
        }
        let mut freed = 0u64;
        let mut seen: IdSet<u64> = IdSet::default();
        let mut soft = Vec::new();
        let meta = &self.meta;
        self.tiers[t].candidates(&mut |id| {
            if !seen.insert(id) || exclude.binary_search(&id).is_ok() {
                return Step::Skip;
            }
            let Some(m) = meta.get(&id) else { return Step::Skip };
            let Some(size) = m.size[t] else { return Step::Skip };
            match m.pin {
                Pin::Hard => Step::Skip,
                Pin::Soft => {
                    soft.push((id, size));
                    Step::Skip
                }
                Pin::None => {
                    out.push(id);
                    freed = freed.saturating_add(size);
                    if freed >= bytes {
                        Step::TakeLast
                    } else {
                        Step::Take
                    }
                }
            }
        });
        // Soft pins go only when the unpinned ones were not enough, in the algorithm's order.
        for (id, size) in soft {
            if freed >= bytes {
                break;
            }
            out.push(id);
            freed = freed.saturating_add(size);
        }
        out
    }

    pub fn resident(&self, tier: Tier) -> usize {
        self.meta.values().filter(|m| m.size[tier as usize].is_some()).count()
    }
}
