//! The server's KV event log: the index's changes, numbered and stamped, in a bounded ring that
//! subscriptions (`Subscribe`, PROTOCOL.md 11.7) read from their own cursors.
//!
//! Publishing never waits for a subscriber: it appends under a short lock and bumps a watch.
//! A subscriber that falls behind the ring is told how many events it missed.

use crate::metrics::Metrics;
use kvpool_core::{Change, ChangeBatch, ChangeKind, ChangeLog, ChangeRef};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

pub struct EventLog {
    ring: Mutex<ChangeLog>,
    /// The next sequence number, for subscribers waiting on news.
    next: watch::Sender<u64>,
    /// Random per process: a subscriber resuming with a cursor of another log learns it.
    pub log_id: u64,
    capacity: usize,
    subscribers: AtomicUsize,
    max_subscribers: usize,
    metrics: Arc<Metrics>,
    /// `events_total` by kind, resolved once (publishing runs under the index lock).
    counted: [prometheus::IntCounter; 3],
}

/// A subscription's place among the `max_subscribers`; dropping it frees the place.
pub struct Subscriber(Arc<EventLog>);

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.0.subscribers.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.event_subscribers.dec();
    }
}

/// `events_total` label of each kind, in [`kind_index`] order.
const KIND_NAMES: [&str; 3] = ["stored", "removed", "evicted"];

fn kind_index(k: ChangeKind) -> usize {
    match k {
        ChangeKind::Stored => 0,
        ChangeKind::Removed => 1,
        ChangeKind::Evicted => 2,
    }
}

impl EventLog {
    pub fn new(capacity: usize, max_subscribers: usize, metrics: Arc<Metrics>) -> EventLog {
        // Unpredictability does not matter here, distinctness across restarts does; the clock
        // stands in if the OS has no entropy to give.
        let mut raw = [0u8; 8];
        let log_id = match getrandom::getrandom(&mut raw) {
            Ok(()) => u64::from_le_bytes(raw),
            Err(_) => SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1),
        }
        .max(1);
        EventLog {
            ring: Mutex::new(ChangeLog::new(capacity)),
            next: watch::Sender::new(1),
            log_id,
            capacity,
            subscribers: AtomicUsize::new(0),
            max_subscribers,
            counted: KIND_NAMES.map(|name| metrics.events.with_label_values(&[name])),
            metrics,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Log changes, in order, stamped with the wall clock.
    pub fn publish(&self, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let mut counts = [0u64; 3];
        for c in &changes {
            counts[kind_index(c.kind)] += 1;
        }
        for (counter, n) in self.counted.iter().zip(counts) {
            counter.inc_by(n);
        }
        let mut changes = changes;
        for c in &mut changes {
            c.time_ms = now;
        }
        // Publishers hold the index lock: the ring's lock is held for an append only.
        let next = self.ring.lock().append(changes);
        self.next.send_replace(next);
    }

    /// Changes that cannot be logged, `n` of them removals: see [`ChangeLog::skip`].
    pub fn skip(&self, n: u64) {
        self.counted[kind_index(ChangeKind::Removed)].inc_by(n);
        let next = self.ring.lock().skip(n);
        self.next.send_replace(next);
    }

    /// See [`ChangeLog::read`]. The ring's lock is held only to take shared references to the
    /// stretch asked for; filtering and copying happen outside it, so a reader never holds up
    /// the publishers (who hold the index lock).
    pub fn read(&self, from: u64, max: usize, scan: usize, keep: impl Fn(&ChangeRef<'_>) -> bool) -> ChangeBatch {
        let window = self.ring.lock().window(from, scan);
        let b = window.read(max, scan, keep);
        if b.lagged > 0 {
            self.metrics.events_lagged.inc_by(b.lagged);
        }
        b
    }

    pub fn next_seq(&self) -> u64 {
        self.ring.lock().next_seq()
    }

    /// Wakes when events are published.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.next.subscribe()
    }

    /// Take a subscriber's place; `None` when `max_subscribers` are open.
    pub fn join(self: &Arc<Self>) -> Option<Subscriber> {
        let taken = self
            .subscribers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max_subscribers).then_some(n + 1));
        taken.ok()?;
        self.metrics.event_subscribers.inc();
        Some(Subscriber(self.clone()))
    }
}
