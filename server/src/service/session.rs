//! What one authenticated connection holds between its requests: its principal and protocol
//! version, and for version 2 its shared-memory peer, the reservations granted to it, and the
//! leases of blocks it located. Everything is released when the connection ends, and
//! reservations and leases also when their time is up (a client cannot pin memory by going
//! quiet on a live connection).

use super::staged::Staged;
use super::stream::{error, Fail};
use crate::auth::Principal;
use crate::store::read::Served;
use crate::store::Store;
use kvpool_proto::ErrorCode;
use kvpool_transport::shm::Ticket;
use kvpool_transport::PeerId;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// A put item granted by `PutIntent`, waiting for its bytes (`Write`, or one-sided) and
/// `PutDone`. Locked while a `Write` fills it; taken out when `PutDone` commits it.
pub(super) type Reserved = tokio::sync::Mutex<Option<Staged>>;

/// Blocks located by `GetLocate` (or held by `LookupLease`), kept in place until released or
/// expired.
pub struct LeaseHold {
    pub blocks: Vec<Option<Served>>,
    /// The index's hold on the blocks a `LookupLease` counted; let go with the lease.
    pub held: Option<Held>,
}

/// A hold on blocks a `LookupLease` counted: let go when the lease ends (released, expired, or
/// its connection gone), exactly once.
pub struct Held {
    pub(super) store: Arc<Store>,
    pub(super) ids: Vec<u64>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.store.unhold(&self.ids);
    }
}

pub struct Session {
    pub principal: Principal,
    /// Negotiated protocol version.
    pub version: u16,
    /// The client's address, where the front door has one (a master places an engine's blocks
    /// on the storage node that shares it).
    pub peer: Option<std::net::IpAddr>,
    shm: Mutex<Option<Ticket>>,
    /// Binding of same-host control sockets to this connection; dropping it closes them.
    local: Mutex<Option<Box<dyn Send>>>,
    grants: Mutex<HashMap<u64, Arc<Reserved>>>,
    leases: Mutex<HashMap<u64, Arc<LeaseHold>>>,
    next: AtomicU64,
    /// Room for the TCP bulk connections bound to this connection.
    bulk: Arc<tokio::sync::Semaphore>,
    /// Set when the connection ends.
    ended: tokio::sync::watch::Sender<bool>,
}

impl Session {
    pub fn new(principal: Principal, version: u16, peer: Option<std::net::IpAddr>) -> Arc<Session> {
        Arc::new(Session {
            principal,
            version,
            peer,
            shm: Mutex::new(None),
            local: Mutex::new(None),
            grants: Mutex::new(HashMap::new()),
            leases: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            bulk: Arc::new(tokio::sync::Semaphore::new(super::bulk::MAX_CONNECTIONS_PER_SESSION)),
            ended: tokio::sync::watch::Sender::new(false),
        })
    }

    fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The connection's shared-memory peer, once its client attached.
    pub fn shm_peer(&self) -> Option<PeerId> {
        self.shm.lock().as_ref().map(|t| t.peer)
    }

    /// A new shm ticket for this connection (an earlier one, and its buffers, are dropped).
    pub fn set_shm(&self, ticket: Ticket) {
        *self.shm.lock() = Some(ticket);
    }

    /// The connection ended: its control sockets close and its shared buffers are let go now,
    /// even while a request in flight still holds the session.
    pub fn end(&self) {
        self.local.lock().take();
        self.shm.lock().take();
        self.ended.send_replace(true);
    }

    /// Whether the connection has ended.
    pub fn has_ended(&self) -> bool {
        *self.ended.borrow()
    }

    /// Resolves once the connection has ended (at once if it has).
    pub async fn ended(&self) {
        let mut rx = self.ended.subscribe();
        let _ = rx.wait_for(|e| *e).await;
    }

    /// A new control-channel ticket for this connection (sockets bound by an earlier one close).
    pub fn set_local(&self, ticket: impl Send + 'static) {
        *self.local.lock() = Some(Box::new(ticket));
    }

    /// Room for one more TCP bulk connection, held until the permit drops; `None` when full.
    pub(super) fn bulk_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.bulk.clone().try_acquire_owned().ok()
    }

    /// Keep a granted put item for `ttl`; returns its reservation's name.
    pub(super) fn grant(self: &Arc<Self>, staged: Staged, ttl: Duration) -> u64 {
        let id = self.next_id();
        self.grants.lock().insert(id, Arc::new(tokio::sync::Mutex::new(Some(staged))));
        let weak = Arc::downgrade(self);
        expire(weak, ttl, move |s| {
            s.grants.lock().remove(&id);
        });
        id
    }

    pub(super) fn reservation(&self, id: u64) -> Option<Arc<Reserved>> {
        self.grants.lock().get(&id).cloned()
    }

    pub(super) fn take_reservation(&self, id: u64) -> Option<Arc<Reserved>> {
        self.grants.lock().remove(&id)
    }

    /// Keep located blocks for `ttl`; returns the lease's name.
    pub fn lease(self: &Arc<Self>, hold: LeaseHold, ttl: Duration) -> u64 {
        let id = self.next_id();
        self.leases.lock().insert(id, Arc::new(hold));
        let weak = Arc::downgrade(self);
        expire(weak, ttl, move |s| {
            s.leases.lock().remove(&id);
        });
        id
    }

    pub fn leased(&self, id: u64) -> Option<Arc<LeaseHold>> {
        self.leases.lock().get(&id).cloned()
    }

    /// Names of the reservations and leases held now (for tests and the fuzz driver).
    pub fn held(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.grants.lock().keys().copied().collect();
        ids.extend(self.leases.lock().keys().copied());
        ids
    }

    pub fn release(&self, id: u64) -> bool {
        self.leases.lock().remove(&id).is_some()
    }
}

/// Run `f` on the session after `ttl`, if it still exists.
fn expire(session: Weak<Session>, ttl: Duration, f: impl FnOnce(&Session) + Send + 'static) {
    tokio::spawn(async move {
        tokio::time::sleep(ttl).await;
        if let Some(s) = session.upgrade() {
            f(&s);
        }
    });
}

/// A reservation or lease this connection does not hold (any more).
pub(super) fn expired(what: &str, id: u64) -> Fail {
    Fail::Reply(error(
        ErrorCode::Expired,
        format!("no {what} {id} on this connection (expired, used, or never granted)"),
    ))
}
