//! Events: what happened to block copies, one row ([`Event`]) or a batch of columns ([`Events`]).

use crate::{Pin, Tier, NO_DEPTH, NO_ID, NO_PARENT};

/// What happened to a block copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EventKind {
    /// A copy of the block now lives in `tier` (new block, demotion or promotion).
    Inserted = 0,
    /// The copy in `tier` was read (a `get`; `lookup`/`exists` never produce this).
    Accessed = 1,
    /// The copy in `tier` is gone (evicted, removed, or moved away).
    Removed = 2,
    /// The block's pin changed to `pin` (e.g. a soft pin expired).
    PinChanged = 3,
    /// A read or lookup wanted a key that has no resident block: `id` is [`NO_ID`]; `key`,
    /// `depth` and `parent` (the resident block before it in the chain looked up) say what.
    Missed = 4,
}

impl EventKind {
    pub fn from_u8(v: u8) -> Option<EventKind> {
        match v {
            0 => Some(EventKind::Inserted),
            1 => Some(EventKind::Accessed),
            2 => Some(EventKind::Removed),
            3 => Some(EventKind::PinChanged),
            4 => Some(EventKind::Missed),
            _ => None,
        }
    }
}

/// One event, as a row. Hosts and tests build batches from these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    /// Block id, fresh for every put (never reused); [`NO_ID`] on a miss. Opaque: the host's
    /// table slot (low 32 bits) and that slot's generation, so neither small nor in put order.
    pub id: u64,
    /// Key hash ([`key_hash`](crate::key_hash)): the same for a key whatever block id it has.
    pub key: u64,
    pub size: u64,
    pub tokens: u32,
    pub tier: Tier,
    /// Parent block id, or [`NO_PARENT`].
    pub parent: u64,
    pub pin: Pin,
    /// Position in the prefix chain (0 for a root), or [`NO_DEPTH`].
    pub depth: u32,
    /// Requests that wanted the key so far, as the host knows: misses of the key before the
    /// put plus reads since (on `Inserted`, `Accessed`), misses remembered (on `Missed`); 0 when
    /// the host does not count. A running total: take the largest seen, do not add.
    pub count: u32,
    /// Host clock in microseconds: when it happened, or in a snapshot the last access.
    pub time: u64,
}

impl Event {
    /// The constructors set `key` to the id (tests that do not care about key identity) and
    /// leave depth unknown, count and time 0; hosts set them with the `with_*` methods.
    fn new(kind: EventKind, id: u64, tier: Tier) -> Event {
        Event {
            kind,
            id,
            key: id,
            size: 0,
            tokens: 0,
            tier,
            parent: NO_PARENT,
            pin: Pin::None,
            depth: NO_DEPTH,
            count: 0,
            time: 0,
        }
    }
    pub fn inserted(id: u64, size: u64, tier: Tier, parent: u64) -> Event {
        Event { size, parent, ..Event::new(EventKind::Inserted, id, tier) }
    }
    pub fn accessed(id: u64, tier: Tier) -> Event {
        Event::new(EventKind::Accessed, id, tier)
    }
    pub fn removed(id: u64, tier: Tier) -> Event {
        Event::new(EventKind::Removed, id, tier)
    }
    pub fn pin_changed(id: u64, pin: Pin) -> Event {
        Event { pin, ..Event::new(EventKind::PinChanged, id, Tier::Dram) }
    }
    /// A miss of `key` at chain position `depth`; `parent` is the resident block before it.
    pub fn missed(key: u64, depth: u32, parent: u64) -> Event {
        Event { key, depth, parent, count: 1, ..Event::new(EventKind::Missed, NO_ID, Tier::Dram) }
    }
    pub fn with_tokens(mut self, tokens: u32) -> Event {
        self.tokens = tokens;
        self
    }
    pub fn with_pin(mut self, pin: Pin) -> Event {
        self.pin = pin;
        self
    }
    pub fn with_key(mut self, key: u64) -> Event {
        self.key = key;
        self
    }
    pub fn with_depth(mut self, depth: u32) -> Event {
        self.depth = depth;
        self
    }
    pub fn with_count(mut self, count: u32) -> Event {
        self.count = count;
        self
    }
    pub fn with_time(mut self, time: u64) -> Event {
        self.time = time;
        self
    }
    pub fn with_parent(mut self, parent: u64) -> Event {
        self.parent = parent;
        self
    }
}

/// A batch of events as columns (one `Vec` per field): this is what crosses the Wasm boundary,
/// because columns of plain numbers lower ~25x cheaper than a list of records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Events {
    pub kind: Vec<u8>,
    pub id: Vec<u64>,
    pub key: Vec<u64>,
    pub size: Vec<u64>,
    pub tokens: Vec<u32>,
    pub tier: Vec<u8>,
    pub parent: Vec<u64>,
    pub pin: Vec<u8>,
    pub depth: Vec<u32>,
    pub count: Vec<u32>,
    pub time: Vec<u64>,
}

impl Events {
    pub fn new() -> Events {
        Events::default()
    }

    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn clear(&mut self) {
        self.kind.clear();
        self.id.clear();
        self.key.clear();
        self.size.clear();
        self.tokens.clear();
        self.tier.clear();
        self.parent.clear();
        self.pin.clear();
        self.depth.clear();
        self.count.clear();
        self.time.clear();
    }

    pub fn reserve(&mut self, n: usize) {
        self.kind.reserve(n);
        self.id.reserve(n);
        self.key.reserve(n);
        self.size.reserve(n);
        self.tokens.reserve(n);
        self.tier.reserve(n);
        self.parent.reserve(n);
        self.pin.reserve(n);
        self.depth.reserve(n);
        self.count.reserve(n);
        self.time.reserve(n);
    }

    pub fn push(&mut self, e: Event) {
        self.kind.push(e.kind as u8);
        self.id.push(e.id);
        self.key.push(e.key);
        self.size.push(e.size);
        self.tokens.push(e.tokens);
        self.tier.push(e.tier as u8);
        self.parent.push(e.parent);
        self.pin.push(e.pin as u8);
        self.depth.push(e.depth);
        self.count.push(e.count);
        self.time.push(e.time);
    }

    /// Append every row of `other`.
    pub fn extend_from(&mut self, other: &Events) {
        self.kind.extend_from_slice(&other.kind);
        self.id.extend_from_slice(&other.id);
        self.key.extend_from_slice(&other.key);
        self.size.extend_from_slice(&other.size);
        self.tokens.extend_from_slice(&other.tokens);
        self.tier.extend_from_slice(&other.tier);
        self.parent.extend_from_slice(&other.parent);
        self.pin.extend_from_slice(&other.pin);
        self.depth.extend_from_slice(&other.depth);
        self.count.extend_from_slice(&other.count);
        self.time.extend_from_slice(&other.time);
    }

    /// True when every column has the same length (a guest should ignore a batch that is not).
    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        [
            self.kind.len(),
            self.key.len(),
            self.size.len(),
            self.tokens.len(),
            self.tier.len(),
            self.parent.len(),
            self.pin.len(),
            self.depth.len(),
            self.count.len(),
            self.time.len(),
        ]
        .iter()
        .all(|&l| l == n)
    }

    /// The row at `i`; `None` for an unknown kind, tier or pin code (or past the end).
    pub fn get(&self, i: usize) -> Option<Event> {
        Some(Event {
            kind: EventKind::from_u8(*self.kind.get(i)?)?,
            id: *self.id.get(i)?,
            key: *self.key.get(i)?,
            size: *self.size.get(i)?,
            tokens: *self.tokens.get(i)?,
            tier: Tier::from_u8(*self.tier.get(i)?)?,
            parent: *self.parent.get(i)?,
            pin: Pin::from_u8(*self.pin.get(i)?)?,
            depth: *self.depth.get(i)?,
            count: *self.count.get(i)?,
            time: *self.time.get(i)?,
        })
    }

    /// Rows of the batch; rows with an unknown kind, tier or pin code are skipped.
    pub fn iter(&self) -> impl Iterator<Item = Event> + '_ {
        let n = if self.is_well_formed() { self.id.len() } else { 0 };
        (0..n).filter_map(move |i| self.get(i))
    }
}

impl FromIterator<Event> for Events {
    fn from_iter<I: IntoIterator<Item = Event>>(iter: I) -> Events {
        let mut ev = Events::new();
        for e in iter {
            ev.push(e);
        }
        ev
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_columns_yield_no_rows() {
        let mut e: Events = [Event::inserted(1, 1, Tier::Dram, NO_PARENT)].into_iter().collect();
        assert_eq!(e.iter().count(), 1);
        e.pin.push(0);
        assert_eq!(e.iter().count(), 0);
    }
}
