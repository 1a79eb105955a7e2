//! What one authenticated connection holds between its requests: its principal and protocol
//! version, and for version 2 its shared-memory peer, its control channel's token, the room for
//! the connections each extra door binds to it, the reservations granted to it, and the leases
//! of blocks it located. Everything is released when the connection ends, and
//! reservations and leases also when their time is up (a client cannot pin memory by going
//! quiet on a live connection).

use super::doors::{self, Door, Life, Slots, Ticket};
use super::staged::Staged;
use super::stream::{error, Fail};
use crate::auth::Principal;
use crate::store::read::Served;
use crate::store::Store;
use kvpool_proto::ErrorCode;
use kvpool_transport::shm;
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
    shm: Mutex<Option<shm::Ticket>>,
    /// The control channel's standing token; dropping it (replaced, or the connection ended)
    /// closes the sockets bound with it.
    control: Mutex<Option<Ticket>>,
    grants: Mutex<HashMap<u64, Arc<Reserved>>>,
    leases: Mutex<HashMap<u64, Arc<LeaseHold>>>,
    next: AtomicU64,
    /// Room for the connections bound to this connection through each extra door.
    control_sockets: Slots,
    bulk_connections: Slots,
    /// Ends when the connection ends.
    life: Life,
}

impl Session {
    pub fn new(principal: Principal, version: u16, peer: Option<std::net::IpAddr>) -> Arc<Session> {
        Arc::new(Session {
            principal,
            version,
            peer,
            shm: Mutex::new(None),
            control: Mutex::new(None),
            grants: Mutex::new(HashMap::new()),
            leases: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            control_sockets: Slots::default(),
            bulk_connections: Slots::default(),
            life: Life::default(),
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
    pub fn set_shm(&self, ticket: shm::Ticket) {
        *self.shm.lock() = Some(ticket);
    }

    /// The connection ended: its control sockets and bulk connections close and its shared
    /// buffers are let go now, even while a request in flight still holds the session.
    pub fn end(&self) {
        self.control.lock().take();
        self.shm.lock().take();
        self.life.end();
    }

    /// Whether the connection has ended.
    pub fn has_ended(&self) -> bool {
        self.life.has_ended()
    }

    /// Resolves once the connection has ended (at once if it has).
    pub async fn ended(&self) {
        self.life.ended().await
    }

    /// Replace the control channel's token with the one `issue` makes: the sockets bound with
    /// the old one close first, so that a connection never holds two.
    pub(super) fn replace_control<T, E>(&self, issue: impl FnOnce() -> Result<(T, Ticket), E>) -> Result<T, E> {
        let mut control = self.control.lock();
        control.take();
        let (offer, ticket) = issue()?;
        *control = Some(ticket);
        Ok(offer)
    }

    /// Room for one more connection through `door`, held until the permit drops; `None` when
    /// full (or for QUIC, which the server's connection limit bounds instead).
    pub(super) fn slot(&self, door: Door) -> Option<tokio::sync::OwnedSemaphorePermit> {
        match door {
            Door::Quic => None,
            Door::Control => self.control_sockets.take(),
            Door::Bulk => self.bulk_connections.take(),
        }
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

impl doors::Owner for Session {
    fn tenant(&self) -> u32 {
        self.principal.tenant_id
    }
    fn life(&self) -> &Life {
        &self.life
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
