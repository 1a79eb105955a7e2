//! What the server offers through `BulkAttach`, and checks when a TCP connection binds: the
//! listener, TLS, the trusted networks, the one-use tokens and the places of connections that
//! have not shown one yet.

use crate::service::doors::{Caps, Gate, Token, Tokens};
use crate::service::session::Session;
use crate::service::stream::{error, Fail};
use kvpool_proto::{BulkOffer, ErrorCode};
use parking_lot::Mutex;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

/// A token not presented within this long is forgotten.
pub const TOKEN_TTL: Duration = Duration::from_secs(10);
/// Tokens waiting for their connection: 4,096 in all (a client asking without connecting cannot
/// grow the table without bound), 64 of one QUIC connection, and a quarter of the table for one
/// tenant (one tenant's many connections cannot take it from the others).
const CAPS: Caps = Caps { total: 4096, per_session: 64, per_tenant: 1024 };

/// The bulk channel of a server: its listener, TLS, trusted networks, tokens and gate.
pub struct BulkDoor {
    pub(super) listener: Mutex<Option<std::net::TcpListener>>,
    pub(super) port: u16,
    pub(super) tls: Arc<rustls::ServerConfig>,
    trusted: Vec<ipnet::IpNet>,
    pub(super) tokens: Tokens<Session>,
    pub(super) gate: Gate,
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
            tls,
            trusted,
            tokens: Tokens::new(CAPS),
            gate: Gate::default(),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub(super) fn trusts(&self, ip: IpAddr) -> bool {
        crate::config::trusted(&self.trusted, ip)
    }

    pub(super) fn trusted_networks(&self) -> usize {
        self.trusted.len()
    }

    /// A token for one TCP connection of `session` (answer to `BulkAttach`).
    pub(in crate::service) fn issue(&self, session: &Arc<Session>, plaintext: bool) -> Result<BulkOffer, Fail> {
        let peer = session.peer.ok_or_else(|| {
            Fail::Reply(error(ErrorCode::Unsupported, "the bulk channel is asked for on a QUIC connection"))
        })?;
        let tls = !(plaintext && self.trusts(peer));
        let token: Token = self
            .tokens
            .issue_once(session, peer, tls, TOKEN_TTL)
            .map_err(|e| Fail::Reply(error(e.code(), format!("bulk channel: {e}"))))?;
        Ok(BulkOffer { port: self.port, token: token.to_vec(), tls, expires_ms: TOKEN_TTL.as_millis() as u32 })
    }
}
