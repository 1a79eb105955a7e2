//! The eviction policy and the host's index as its guard sees it.

use crate::{Events, Pin, Tier};

/// Eviction: choose which block copies of a tier to drop (or demote) to free space.
pub trait EvictionPolicy {
    /// Apply a batch of events, in order.
    fn on_events(&mut self, events: &Events);

    /// Choose copies resident in `tier` whose sizes add up to at least `bytes`, in the order
    /// they should go. Never return an id in `exclude` (sorted ascending: leased or in-flight
    /// blocks) nor a hard-pinned block. Return fewer bytes only when nothing else is evictable.
    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64>;
}

/// A host's block index as the host side of a policy sees it: the truth a guard checks an
/// eviction module's answer against, and the warm snapshot a new policy starts from. The node's
/// core implements it; its eviction slots and the Wasm host's guard read it. Guests never see it.
pub trait IndexView {
    /// Size of the copy of `id` resident in `tier`, or `None` when there is none.
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64>;
    /// Current pin of `id` (`Pin::None` for an unknown id).
    fn pin(&self, id: u64) -> Pin;
    /// Bytes that could be freed in `tier` without touching `exclude`d (sorted) or hard-pinned
    /// copies: a module may return fewer bytes than asked only when this is smaller.
    fn evictable_bytes(&self, tier: Tier, exclude: &[u64]) -> u64;
    /// Resident blocks (a copy in any tier) whose parent is `id`: the chain rule's input.
    fn resident_children(&self, id: u64) -> Vec<u64>;
    /// The warm snapshot (see the WIT `events` record): the host's recent misses as `Missed`
    /// events, oldest first, then every block as `Inserted` events with its pin, read count and
    /// last access, least recently used first and parents before children. Used to start a
    /// swapped-in policy and to rebuild a module after a trap.
    fn snapshot(&self) -> Events;
}
