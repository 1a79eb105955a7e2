//! The TCP bulk channel's front door: requests of an authenticated QUIC connection carried by a
//! TCP connection, so that bulk bytes ride the kernel's TCP segmentation and receive offloads
//! (one 64 KB `sendmsg`/`recvmsg` where QUIC pays per 1,500-byte packet in user space).
//!
//! A client asks `BulkAttach` on its QUIC connection and gets a port and a one-time token. It
//! connects (TLS 1.3 with the server's QUIC certificate, or plaintext when it asked for that
//! and its address is in `bulk.trusted_networks`), presents the token, and then sends one
//! request at a time in envelopes (`bulk_stream.rs`, PROTOCOL.md 11.10). A token binds one TCP
//! connection, from the QUIC connection's own address, to that connection's session (tenant,
//! leases, reservations): a connection without a valid token, with a used one, or from
//! another address is refused before it can read or store anything. Its connections close
//! when the QUIC connection ends.

use super::bulk_stream::{refuse, run};
use super::session::Session;
use super::shared::Shared;
use super::stream::{error, Fail};
use kvpool_proto::{BulkOffer, ErrorCode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, info, warn};

/// Bytes of a token.
pub const TOKEN_LEN: usize = 32;
/// A token not presented within this long is forgotten.
pub const TOKEN_TTL: Duration = Duration::from_secs(10);
/// Time a new TCP connection has for its TLS handshake and token.
const BIND_TIMEOUT: Duration = Duration::from_secs(5);
/// Tokens waiting for their connection, over all sessions: a client asking without connecting
/// cannot grow the table without bound.
const MAX_PENDING: usize = 4096;
/// TCP connections one QUIC connection may bind at once, and tokens it may hold unspent.
pub const MAX_CONNECTIONS_PER_SESSION: usize = 64;
/// TCP connections between accept and a redeemed token, over all peers: what a peer without
/// credentials can hold (a socket, a TLS handshake, the read buffer) is bounded by this.
pub const MAX_UNBOUND: usize = 256;
/// Socket bytes read at once under TLS.
pub const TLS_READ_BUFFER: usize = 256 << 10;
/// First byte of a TLS record carrying a handshake message (a ClientHello).
const TLS_HANDSHAKE: u8 = 0x16;

struct Pending {
    session: Weak<Session>,
    peer: IpAddr,
    tls: bool,
    expires: Instant,
}

/// The bulk channel of a server: its listener, TLS, trusted networks and live tokens.
pub struct BulkDoor {
    listener: Mutex<Option<std::net::TcpListener>>,
    port: u16,
    tls: tokio_rustls::TlsAcceptor,
    trusted: Vec<ipnet::IpNet>,
    pending: Mutex<HashMap<[u8; TOKEN_LEN], Pending>>,
    unbound: Arc<tokio::sync::Semaphore>,
}

impl BulkDoor {
    /// Listen on `listen`, or (empty) on the QUIC address's IP and port, or a free port there.
    pub fn bind(
        listen: &str,
        quic: SocketAddr,
        tls: Arc<rustls::ServerConfig>,
        trusted: Vec<ipnet::IpNet>,
    ) -> io::Result<BulkDoor> {
        let listener = if listen.trim().is_empty() {
            std::net::TcpListener::bind(quic).or_else(|_| std::net::TcpListener::bind(SocketAddr::new(quic.ip(), 0)))?
        } else {
            let addr: SocketAddr =
                listen.parse().map_err(|_| io::Error::other(format!("bad bulk.listen {listen:?}")))?;
            std::net::TcpListener::bind(addr)?
        };
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        if trusted.iter().any(|n| n.prefix_len() == 0) {
            warn!("bulk.trusted_networks lists a whole address family: any client may move bytes in plaintext");
        }
        Ok(BulkDoor {
            listener: Mutex::new(Some(listener)),
            port,
            tls: tokio_rustls::TlsAcceptor::from(tls),
            trusted,
            pending: Mutex::new(HashMap::new()),
            unbound: Arc::new(tokio::sync::Semaphore::new(MAX_UNBOUND)),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        crate::config::trusted(&self.trusted, ip)
    }

    /// A token for one TCP connection of `session` (answer to `BulkAttach`).
    pub(super) fn issue(&self, session: &Arc<Session>, plaintext: bool) -> Result<BulkOffer, Fail> {
        let peer = session.peer.ok_or_else(|| {
            Fail::Reply(error(ErrorCode::Unsupported, "the bulk channel is asked for on a QUIC connection"))
        })?;
        let mut token = [0u8; TOKEN_LEN];
        getrandom::getrandom(&mut token).map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
        // A plaintext connection starts with its token; the first byte of a TLS one is 0x16.
        if token[0] == TLS_HANDSHAKE {
            token[0] ^= 0x80;
        }
        let tls = !(plaintext && self.trusts(peer));
        let now = Instant::now();
        let mut pending = self.pending.lock();
        pending.retain(|_, p| p.expires > now && p.session.strong_count() > 0);
        if pending.len() >= MAX_PENDING {
            return Err(Fail::Reply(error(
                ErrorCode::Rejected,
                format!("{MAX_PENDING} bulk tokens wait for their connection; connect with the ones you have"),
            )));
        }
        let mine = Arc::downgrade(session);
        // One session cannot take the table from the others.
        if pending.values().filter(|p| p.session.ptr_eq(&mine)).count() >= MAX_CONNECTIONS_PER_SESSION {
            return Err(Fail::Reply(error(
                ErrorCode::Rejected,
                format!("{MAX_CONNECTIONS_PER_SESSION} bulk tokens of this connection wait for their connection"),
            )));
        }
        let p = Pending { session: mine, peer: peer.to_canonical(), tls, expires: now + TOKEN_TTL };
        pending.insert(token, p);
        Ok(BulkOffer { port: self.port, token: token.to_vec(), tls, expires_ms: TOKEN_TTL.as_millis() as u32 })
    }

    /// Spend `token` for a connection from `peer` that is (or is not) TLS. A token is spent
    /// even when refused: one that leaked is never good again.
    fn redeem(&self, token: &[u8; TOKEN_LEN], peer: IpAddr, tls: bool) -> Result<Arc<Session>, (ErrorCode, String)> {
        let p = self.pending.lock().remove(token);
        let unknown = || {
            (
                ErrorCode::Unauthorized,
                "unknown bulk token (never issued, used already, expired, or its QUIC connection ended)".to_string(),
            )
        };
        let p = p.filter(|p| p.expires > Instant::now()).ok_or_else(unknown)?;
        if p.peer != peer.to_canonical() {
            return Err((ErrorCode::Unauthorized, "the bulk token was issued to another address".into()));
        }
        if p.tls && !tls {
            return Err((ErrorCode::Forbidden, "plaintext was not granted to this token: connect with TLS".into()));
        }
        // A request in flight may hold the session after its QUIC connection ended.
        p.session.upgrade().filter(|s| !s.has_ended()).ok_or_else(unknown)
    }
}

/// Accept bulk connections until the runtime stops; returns at once when the server has no
/// bulk channel or it is already served.
pub async fn serve(shared: Arc<Shared>) {
    let Some(door) = shared.bulk.get() else { return };
    let Some(std_listener) = door.listener.lock().take() else { return };
    let listener = match tokio::net::TcpListener::from_std(std_listener) {
        Ok(l) => l,
        Err(e) => return warn!(error = %e, "cannot serve the bulk channel"),
    };
    info!(port = door.port, trusted = door.trusted.len(), "TCP bulk channel offered");
    loop {
        let (sock, addr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                debug!(error = %e, "bulk accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = door.unbound.clone().try_acquire_owned() else {
            // Full of connections that have not shown a token: this one is closed unanswered.
            shared.metrics.bulk_refused.inc();
            debug!(%addr, "{MAX_UNBOUND} bulk connections wait for their token; closing a new one");
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_tcp(sock, addr.ip(), &shared, permit).await {
                debug!(error = %e, %addr, "bulk connection ended");
            }
        });
    }
}

/// One TCP connection: TLS unless its address is trusted and its first byte is not a TLS
/// handshake, then the token and the envelopes.
async fn serve_tcp(
    sock: tokio::net::TcpStream,
    peer: IpAddr,
    shared: &Arc<Shared>,
    permit: OwnedSemaphorePermit,
) -> io::Result<()> {
    let Some(door) = shared.bulk.get() else { return Ok(()) };
    sock.set_nodelay(true)?;
    // One deadline for the first byte, the handshake and the token.
    let deadline = tokio::time::Instant::now() + BIND_TIMEOUT;
    let plain = if door.trusts(peer) {
        let mut first = [0u8; 1];
        match tokio::time::timeout_at(deadline, sock.peek(&mut first)).await {
            Ok(Ok(1)) => first[0] != TLS_HANDSHAKE,
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                shared.metrics.bulk_refused.inc();
                return Ok(());
            }
        }
    } else {
        false
    };
    if plain {
        return bind_and_run(sock, peer, false, shared, deadline, Some(permit)).await;
    }
    // rustls reads the socket 4 KiB at a time: a buffer under it turns that into one read per
    // 256 KiB (a copy in memory instead of 60 system calls).
    let sock = tokio::io::BufReader::with_capacity(TLS_READ_BUFFER, sock);
    let tls = match tokio::time::timeout_at(deadline, door.tls.accept(sock)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            shared.metrics.bulk_refused.inc();
            return Err(e);
        }
        Err(_) => {
            shared.metrics.bulk_refused.inc();
            return Ok(());
        }
    };
    bind_and_run(tls, peer, true, shared, deadline, Some(permit)).await
}

/// A bulk connection after its transport handshake (TLS or plaintext TCP; an in-memory pipe
/// in the fuzz driver): the token, then one envelope after another.
pub async fn serve_stream<S>(stream: S, peer: IpAddr, tls: bool, shared: &Arc<Shared>) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    bind_and_run(stream, peer, tls, shared, tokio::time::Instant::now() + BIND_TIMEOUT, None).await
}

/// The token by `deadline`, then the envelopes; `permit` (a place among the unbound
/// connections) is let go once the token is spent.
async fn bind_and_run<S>(
    mut stream: S,
    peer: IpAddr,
    tls: bool,
    shared: &Arc<Shared>,
    deadline: tokio::time::Instant,
    permit: Option<OwnedSemaphorePermit>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let Some(door) = shared.bulk.get() else { return Ok(()) };
    let mut token = [0u8; TOKEN_LEN];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut token)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return refuse(&mut stream, shared, ErrorCode::Timeout, "no token in time".into()).await,
    }
    let session = match door.redeem(&token, peer, tls) {
        Ok(s) => s,
        Err((code, message)) => return refuse(&mut stream, shared, code, message).await,
    };
    drop(permit);
    let Some(_count) = session.bulk_slot() else {
        let m = format!("at most {MAX_CONNECTIONS_PER_SESSION} bulk connections per QUIC connection");
        return refuse(&mut stream, shared, ErrorCode::Rejected, m).await;
    };
    shared.metrics.bulk_bound.inc();
    let weak = Arc::downgrade(&session);
    let ended = {
        let s = session.clone();
        async move { s.ended().await }
    };
    drop(session);
    tokio::select! {
        r = run(stream, weak, if tls { "tls" } else { "tcp" }, shared) => r,
        // The QUIC connection ended: its bulk connections go with it.
        _ = ended => Ok(()),
    }
}
