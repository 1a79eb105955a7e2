//! What the two extra front doors share (the Unix control socket, `local.rs`, and the TCP bulk
//! channel, `bulk/`): the table of tokens that bind a connection to a QUIC connection's session,
//! the room a session has for each door's connections, the one signal that a session (or a
//! token) has ended, the gate for connections that have not shown a token yet, and the one way
//! a door refuses a connection.
//!
//! This is a floor below `session` and `shared`: it knows neither, so both can hold its types.

use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorBody, ErrorCode, Response};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of a token.
pub const TOKEN_LEN: usize = 32;
/// A token: random bytes that bind a connection to a session.
pub type Token = [u8; TOKEN_LEN];
/// Time a new connection has, from its accept, for its first byte, any handshake and its token.
pub const BIND_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections one QUIC connection may have bound through each door at once.
pub const MAX_BOUND_PER_SESSION: usize = 64;
/// Connections a door holds that have not presented a token yet, in all: what peers without
/// credentials can hold (a socket, a handshake, a buffer) is bounded by this.
pub const MAX_UNBOUND: usize = 256;
/// Of those, from one peer (an IPv4 address, an IPv6 /64, a local process): one peer cannot
/// keep a door full and closed to everyone else.
pub const MAX_UNBOUND_PER_PEER: usize = 64;
/// First byte of a TLS record carrying a handshake message (a ClientHello). No token starts
/// with it, so a plaintext bulk connection is never taken for TLS.
pub const TLS_HANDSHAKE: u8 = 0x16;

/// The front door a request came through; the request table says which requests each carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    Quic,
    /// The same-host Unix control socket (PROTOCOL.md 11.6).
    Control,
    /// The TCP bulk channel (PROTOCOL.md 11.10).
    Bulk,
}

/// An end that happens once and that any number of tasks wait for: a QUIC connection's end,
/// or a control token's (replaced, or its connection ended).
#[derive(Clone, Debug)]
pub struct Life(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Life {
    fn default() -> Life {
        Life(Arc::new(tokio::sync::watch::Sender::new(false)))
    }
}

impl Life {
    pub fn end(&self) {
        self.0.send_replace(true);
    }

    pub fn has_ended(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once it has ended (at once if it has).
    pub async fn ended(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|e| *e).await;
    }
}

/// What a token binds a connection to: a QUIC connection's session.
pub trait Owner: Send + Sync + 'static {
    fn tenant(&self) -> u32;
    fn life(&self) -> &Life;
}

/// A standing token's hold (the control channel's): dropping it ends the token and closes every
/// connection bound with it.
pub struct Ticket(Life);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// How many tokens a table holds unspent: in all, of one session, of one tenant.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub total: usize,
    pub per_session: usize,
    pub per_tenant: usize,
}

enum Lasts {
    /// Spent by the first connection that presents it (refused or not), or gone at `expires`.
    Once { expires: Instant },
    /// Good for any number of connections until its ticket is dropped.
    Standing(Life),
}

struct Entry<S> {
    owner: Weak<S>,
    tenant: u32,
    /// The address it was issued to, where the door checks one.
    peer: Option<IpAddr>,
    /// Only a TLS connection may present it.
    tls_only: bool,
    lasts: Lasts,
}

impl<S: Owner> Entry<S> {
    fn live(&self, now: Instant) -> bool {
        let owner_live = self.owner.upgrade().is_some_and(|o| !o.life().has_ended());
        owner_live
            && match &self.lasts {
                Lasts::Once { expires } => *expires > now,
                Lasts::Standing(life) => !life.has_ended(),
            }
    }
}

/// Why no token was issued.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("{0} tokens wait for their connection on this server; connect with the ones you have")]
    Full(usize),
    #[error("{0} tokens of this QUIC connection wait for their connection")]
    Session(usize),
    #[error("{0} tokens of this tenant wait for their connection")]
    Tenant(usize),
    #[error("no random bytes for a token: {0}")]
    Random(String),
}

impl IssueError {
    /// The wire error its request is answered with.
    pub fn code(&self) -> ErrorCode {
        match self {
            IssueError::Random(_) => ErrorCode::Internal,
            _ => ErrorCode::Rejected,
        }
    }
}

/// Why a connection's token did not bind it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RedeemError {
    #[error("unknown token (never issued, used already, expired, replaced, or its QUIC connection ended)")]
    Unknown,
    #[error("the token was issued to another address")]
    OtherAddress,
    #[error("plaintext was not granted to this token: connect with TLS")]
    TlsOnly,
}

impl RedeemError {
    /// The wire error the refusal carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            RedeemError::Unknown | RedeemError::OtherAddress => ErrorCode::Unauthorized,
            RedeemError::TlsOnly => ErrorCode::Forbidden,
        }
    }
}

/// A door's tokens, each bound to a session (and, for one-use tokens, the address it was issued
/// to). Bounded by its [`Caps`]; tokens of ended sessions, expired or revoked ones are purged as
/// new ones are issued.
pub struct Tokens<S> {
    map: Mutex<HashMap<Token, Entry<S>>>,
    caps: Caps,
}

impl<S: Owner> Tokens<S> {
    pub fn new(caps: Caps) -> Tokens<S> {
        Tokens { map: Mutex::new(HashMap::new()), caps }
    }

    fn insert(&self, owner: &Arc<S>, entry: impl FnOnce(Weak<S>) -> Entry<S>) -> Result<Token, IssueError> {
        let mut token = [0u8; TOKEN_LEN];
        getrandom::getrandom(&mut token).map_err(|e| IssueError::Random(e.to_string()))?;
        if token[0] == TLS_HANDSHAKE {
            token[0] ^= 0x80;
        }
        let now = Instant::now();
        let mut map = self.map.lock();
        map.retain(|_, e| e.live(now));
        if map.len() >= self.caps.total {
            return Err(IssueError::Full(self.caps.total));
        }
        let mine = Arc::downgrade(owner);
        // Neither one connection nor one tenant can take the table from the others.
        if map.values().filter(|e| e.owner.ptr_eq(&mine)).count() >= self.caps.per_session {
            return Err(IssueError::Session(self.caps.per_session));
        }
        let tenant = owner.tenant();
        if map.values().filter(|e| e.tenant == tenant).count() >= self.caps.per_tenant {
            return Err(IssueError::Tenant(self.caps.per_tenant));
        }
        map.insert(token, entry(mine));
        Ok(token)
    }

    /// A token for one connection from `peer`, good for `ttl`.
    pub fn issue_once(&self, owner: &Arc<S>, peer: IpAddr, tls_only: bool, ttl: Duration) -> Result<Token, IssueError> {
        let expires = Instant::now() + ttl;
        let (tenant, peer) = (owner.tenant(), Some(peer.to_canonical()));
        self.insert(owner, |owner| Entry { owner, tenant, peer, tls_only, lasts: Lasts::Once { expires } })
    }

    /// A token for any number of connections, until the returned ticket is dropped.
    pub fn issue_standing(&self, owner: &Arc<S>) -> Result<(Token, Ticket), IssueError> {
        let life = Life::default();
        let (tenant, lasts) = (owner.tenant(), Lasts::Standing(life.clone()));
        let token = self.insert(owner, |owner| Entry { owner, tenant, peer: None, tls_only: false, lasts })?;
        Ok((token, Ticket(life)))
    }

    /// The session a connection from `peer` (TLS or not) binds to with `token`, and the end that
    /// closes it (its session's, or its standing token's). A one-use token is spent even when
    /// refused: one that leaked is never good again.
    pub fn redeem(&self, token: &Token, peer: Option<IpAddr>, tls: bool) -> Result<(Arc<S>, Life), RedeemError> {
        let now = Instant::now();
        let mut map = self.map.lock();
        let Some(entry) = map.get(token) else { return Err(RedeemError::Unknown) };
        let verdict = entry.admit(now, peer, tls);
        if matches!(entry.lasts, Lasts::Once { .. }) {
            map.remove(token);
        }
        verdict
    }
}

impl<S: Owner> Entry<S> {
    fn admit(&self, now: Instant, peer: Option<IpAddr>, tls: bool) -> Result<(Arc<S>, Life), RedeemError> {
        if !self.live(now) {
            return Err(RedeemError::Unknown);
        }
        if self.peer.is_some() && self.peer != peer.map(|p| p.to_canonical()) {
            return Err(RedeemError::OtherAddress);
        }
        if self.tls_only && !tls {
            return Err(RedeemError::TlsOnly);
        }
        // A request in flight may hold the session after its QUIC connection ended.
        let owner = self.owner.upgrade().filter(|o| !o.life().has_ended()).ok_or(RedeemError::Unknown)?;
        let life = match &self.lasts {
            Lasts::Once { .. } => owner.life().clone(),
            Lasts::Standing(life) => life.clone(),
        };
        Ok((owner, life))
    }
}

/// Room for one session's connections through one door: a permit per bound connection.
pub struct Slots(Arc<Semaphore>);

impl Default for Slots {
    fn default() -> Slots {
        Slots(Arc::new(Semaphore::new(MAX_BOUND_PER_SESSION)))
    }
}

impl Slots {
    /// Room for one more connection, held until the permit drops; `None` when full.
    pub fn take(&self) -> Option<OwnedSemaphorePermit> {
        self.0.clone().try_acquire_owned().ok()
    }
}

/// Who is at a door before showing a token, as the gate counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// An IPv4 address, or an IPv6 /64 (one host may hold a whole /64).
    Net(IpAddr),
    /// A process on this host (by its pid).
    Process(i32),
}

impl Peer {
    pub fn of_ip(ip: IpAddr) -> Peer {
        match ip.to_canonical() {
            IpAddr::V6(v6) => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                Peer::Net(IpAddr::V6(prefix.into()))
            }
            v4 => Peer::Net(v4),
        }
    }
}

/// The places at a door for connections that have not shown a token: [`MAX_UNBOUND`] in all,
/// [`MAX_UNBOUND_PER_PEER`] per peer.
pub struct Gate {
    total: Arc<Semaphore>,
    per_peer: Arc<Mutex<HashMap<Peer, usize>>>,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate { total: Arc::new(Semaphore::new(MAX_UNBOUND)), per_peer: Arc::default() }
    }
}

/// A place at the gate, given back when dropped (the token is spent, or the connection ended).
pub struct Pass {
    _total: OwnedSemaphorePermit,
    peer: Peer,
    per_peer: Arc<Mutex<HashMap<Peer, usize>>>,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut m = self.per_peer.lock();
        if let Some(n) = m.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

impl Gate {
    /// A place for a new connection of `peer`; `None` when the door, or this peer's share of it,
    /// is full.
    pub fn enter(&self, peer: Peer) -> Option<Pass> {
        let mut m = self.per_peer.lock();
        let n = m.entry(peer).or_insert(0);
        if *n >= MAX_UNBOUND_PER_PEER {
            return None;
        }
        let total = self.total.clone().try_acquire_owned().ok()?;
        *n += 1;
        Some(Pass { _total: total, peer, per_peer: self.per_peer.clone() })
    }
}

/// Refuse a connection before it is bound: a status byte 1, a frame holding `Error`, then the
/// end of the stream (PROTOCOL.md 11.6 and 11.10).
pub async fn refuse<S: AsyncWrite + Unpin>(
    s: &mut S,
    refused: &prometheus::IntCounter,
    code: ErrorCode,
    message: String,
) -> io::Result<()> {
    refused.inc();
    tracing::debug!(%message, "connection refused at a door");
    let mut out = vec![1u8];
    out.extend(encode_frame(&Response::Error(ErrorBody { code, message })).map_err(io::Error::other)?);
    s.write_all(&out).await?;
    s.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct S(u32, Life);
    impl Owner for S {
        fn tenant(&self) -> u32 {
            self.0
        }
        fn life(&self) -> &Life {
            &self.1
        }
    }

    fn s(tenant: u32) -> Arc<S> {
        Arc::new(S(tenant, Life::default()))
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const TTL: Duration = Duration::from_secs(10);

    #[test]
    fn a_one_use_token_binds_once_from_its_address_and_is_spent_when_refused() {
        let t = Tokens::new(Caps { total: 8, per_session: 8, per_tenant: 8 });
        let owner = s(1);
        let tok = t.issue_once(&owner, A, true, TTL).unwrap();
        assert_ne!(tok[0], TLS_HANDSHAKE);
        assert_eq!(t.redeem(&tok, Some(A), false).unwrap_err(), RedeemError::TlsOnly);
        assert_eq!(t.redeem(&tok, Some(A), true).unwrap_err(), RedeemError::Unknown, "spent by the refusal");
        let tok = t.issue_once(&owner, A, false, TTL).unwrap();
        assert_eq!(t.redeem(&tok, Some("10.0.0.2".parse().unwrap()), true).unwrap_err(), RedeemError::OtherAddress);
        let tok = t.issue_once(&owner, A, false, TTL).unwrap();
        let (got, life) = t.redeem(&tok, Some(A), false).unwrap();
        assert!(Arc::ptr_eq(&got, &owner));
        owner.life().end();
        assert!(life.has_ended(), "a bound connection ends with its session");
        let tok = t.issue_once(&s(1), A, false, Duration::ZERO).unwrap();
        assert_eq!(t.redeem(&tok, Some(A), false).unwrap_err(), RedeemError::Unknown, "expired");
    }

    #[test]
    fn caps_hold_per_session_per_tenant_and_in_all() {
        let t = Tokens::new(Caps { total: 6, per_session: 2, per_tenant: 3 });
        let (a1, a2, b) = (s(1), s(1), s(2));
        for _ in 0..2 {
            t.issue_once(&a1, A, false, TTL).unwrap();
        }
        assert!(matches!(t.issue_once(&a1, A, false, TTL), Err(IssueError::Session(2))));
        t.issue_once(&a2, A, false, TTL).unwrap();
        assert!(matches!(t.issue_once(&a2, A, false, TTL), Err(IssueError::Tenant(3))));
        // The other tenant still gets its tokens, up to the table's size.
        let others: Vec<_> = (0..3).map(|_| s(3)).collect();
        t.issue_once(&b, A, false, TTL).unwrap();
        t.issue_once(&others[0], A, false, TTL).unwrap();
        t.issue_once(&others[1], A, false, TTL).unwrap();
        assert!(matches!(t.issue_once(&others[2], A, false, TTL), Err(IssueError::Full(6))));
        // A session that ends gives its tokens back.
        a1.life().end();
        t.issue_once(&others[2], A, false, TTL).unwrap();
    }

    #[test]
    fn a_standing_token_binds_until_its_ticket_drops() {
        let t = Tokens::new(Caps { total: 8, per_session: 1, per_tenant: 8 });
        let owner = s(1);
        let (tok, ticket) = t.issue_standing(&owner).unwrap();
        let (_, life) = t.redeem(&tok, None, false).unwrap();
        let (_, again) = t.redeem(&tok, None, false).unwrap();
        drop(ticket);
        assert!(life.has_ended() && again.has_ended(), "its connections close");
        assert_eq!(t.redeem(&tok, None, false).unwrap_err(), RedeemError::Unknown);
        // Its place is free for the next one.
        t.issue_standing(&owner).unwrap();
    }

    #[test]
    fn the_gate_keeps_places_for_other_peers() {
        let g = Gate::default();
        let one = Peer::of_ip(A);
        let held: Vec<Pass> = (0..MAX_UNBOUND_PER_PEER).map(|_| g.enter(one).unwrap()).collect();
        assert!(g.enter(one).is_none(), "one peer holds its share at most");
        assert!(g.enter(Peer::Process(7)).is_some());
        // IPv6 peers are counted by /64.
        let v6 = |s: &str| Peer::of_ip(s.parse().unwrap());
        assert_eq!(v6("2001:db8::1"), v6("2001:db8::ffff:1"));
        assert_ne!(v6("2001:db8::1"), v6("2001:db8:0:1::1"));
        drop(held);
        let _kept = g.enter(one).expect("places come back");
        let all: Vec<Pass> = (0..MAX_UNBOUND as i32).filter_map(|i| g.enter(Peer::Process(i / 8))).collect();
        assert_eq!(all.len(), MAX_UNBOUND - 1, "one place is still held above");
        assert!(g.enter(Peer::Process(10_000)).is_none(), "the door is full");
    }
}
