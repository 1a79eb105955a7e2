//! A bulk connection from its accept to its first envelope: a place at the gate, TLS (with the
//! channel's ALPN) unless a trusted address starts in plaintext, the token, a place among its
//! session's connections; then the envelopes, until the connection or its session ends.
//!
//! rustls does the handshake and carries the token and the status byte; once bound, a TLS
//! connection's records are read and written by `kvpool_net::bulk` with the keys rustls hands
//! over (values decrypted where they land; see that module).

use super::envelope::run;
use crate::service::doors::{refuse, Door, Pass, Peer, BIND_TIMEOUT, MAX_BOUND_PER_SESSION, TLS_HANDSHAKE, TOKEN_LEN};
use crate::service::shared::Shared;
use kvpool_net::bulk::{BulkRead, BulkWrite, Halves};
use kvpool_proto::{ErrorCode, BULK_ALPN};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant as Deadline;
use tracing::{debug, info, warn};

/// A fatal TLS alert `no_application_protocol` (RFC 7301 3.2) in a plaintext record, as
/// rustls sends when a ClientHello offers only other protocols: rustls lets a ClientHello
/// without ALPN through over TCP (only QUIC requires it), so the door sends it itself.
const NO_APPLICATION_PROTOCOL: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x78];

/// Accept bulk connections until the runtime stops; returns at once when the server has no
/// bulk channel or it is already served.
pub async fn serve(shared: Arc<Shared>) {
    let Some(door) = shared.bulk.get() else { return };
    let Some(std_listener) = door.listener.lock().take() else { return };
    let listener = match tokio::net::TcpListener::from_std(std_listener) {
        Ok(l) => l,
        Err(e) => return warn!(error = %e, "cannot serve the bulk channel"),
    };
    info!(port = door.port, trusted = door.trusted_networks(), "TCP bulk channel offered");
    loop {
        let (sock, addr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                debug!(error = %e, "bulk accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(pass) = door.gate.enter(Peer::of_ip(addr.ip())) else {
            // Full of connections that have not shown a token (in all, or from this peer):
            // this one is closed unanswered.
            shared.metrics.bulk_refused.inc();
            debug!(%addr, "bulk connections wait for their token; closing a new one");
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_tcp(sock, addr.ip(), &shared, pass).await {
                debug!(error = %e, %addr, "bulk connection ended");
            }
        });
    }
}

/// One TCP connection: TLS unless its address is trusted and its first byte is not a TLS
/// handshake, then the token and the envelopes.
async fn serve_tcp(sock: tokio::net::TcpStream, peer: IpAddr, shared: &Arc<Shared>, pass: Pass) -> io::Result<()> {
    let Some(door) = shared.bulk.get() else { return Ok(()) };
    sock.set_nodelay(true)?;
    // One deadline for the first byte, the handshake and the token.
    let deadline = Deadline::now() + BIND_TIMEOUT;
    if door.trusts(peer) {
        let mut first = [0u8; 1];
        match tokio::time::timeout_at(deadline, sock.peek(&mut first)).await {
            Ok(Ok(1)) if first[0] != TLS_HANDSHAKE => {
                return serve_plain(sock, peer, false, shared, deadline, Some(pass)).await
            }
            Ok(Ok(1)) => {}
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                shared.metrics.bulk_refused.inc();
                return Ok(());
            }
        }
    }
    serve_tls(sock, peer, shared, deadline, Some(pass)).await
}

/// A handshake step by `deadline`: its value; `None` when time ran out (the connection is then
/// closed). A refusal either way is counted.
async fn step<T>(
    deadline: Deadline,
    f: impl Future<Output = io::Result<T>>,
    refused: &prometheus::IntCounter,
) -> io::Result<Option<T>> {
    match tokio::time::timeout_at(deadline, f).await {
        Ok(Ok(v)) => Ok(Some(v)),
        Ok(Err(e)) => {
            refused.inc();
            Err(e)
        }
        Err(_) => {
            refused.inc();
            Ok(None)
        }
    }
}

/// The TLS handshake (the channel's ALPN required), the token through rustls, then the
/// records with the keys rustls extracted.
async fn serve_tls<S: Halves>(
    sock: S,
    peer: IpAddr,
    shared: &Arc<Shared>,
    deadline: Deadline,
    pass: Option<Pass>,
) -> io::Result<()> {
    let Some(door) = shared.bulk.get() else { return Ok(()) };
    let refused = &shared.metrics.bulk_refused;
    let hello = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), sock);
    let Some(mut start) = step(deadline, hello, refused).await? else { return Ok(()) };
    // QUIC requires its ALPN; so does the channel.
    let offers_ours = start.client_hello().alpn().is_some_and(|mut offered| offered.any(|p| p == BULK_ALPN));
    if !offers_ours {
        refused.inc();
        debug!(%peer, "a bulk ClientHello without ALPN kvpool-bulk/1; refused");
        let _ = tokio::time::timeout_at(deadline, start.io.write_all(&NO_APPLICATION_PROTOCOL)).await;
        return Ok(());
    }
    // A config of its own, whose key log keeps the connection's traffic secrets: the record
    // layer derives its next keys from them (key updates).
    let (config, secrets_log) = kvpool_net::bulk::SecretLog::server(&door.tls);
    let Some(mut tls) = step(deadline, start.into_stream(config), refused).await? else { return Ok(()) };
    let Some(bound) = bind(&mut tls, peer, true, shared, deadline, pass).await? else { return Ok(()) };
    // The client sends nothing after its token until it has read the status byte, so rustls
    // holds no bytes of the envelopes: from here on the records are ours.
    let (sock, mut conn) = tls.into_inner();
    let unread = conn.process_new_packets().map_err(io::Error::other)?.plaintext_bytes_to_read();
    if unread > 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bulk bytes sent before the status byte was read"));
    }
    let secrets = conn.dangerous_extract_secrets().map_err(io::Error::other)?;
    let (rd, wr) = kvpool_net::bulk::tls(sock, secrets, &secrets_log).map_err(io::Error::from)?;
    bound.run(rd, wr, "tls", shared).await
}

/// A bulk connection after its transport handshake, in plaintext (a trusted address; in the
/// fuzz driver an in-memory pipe standing for either): the token, then the envelopes.
pub async fn serve_stream<S: Halves>(stream: S, peer: IpAddr, tls: bool, shared: &Arc<Shared>) -> io::Result<()> {
    serve_plain(stream, peer, tls, shared, Deadline::now() + BIND_TIMEOUT, None).await
}

/// A connection that has not done its TLS handshake yet (the fuzz driver's pipes): the same path
/// as a TCP connection from an address that is not trusted.
pub async fn serve_tls_stream<S: Halves>(stream: S, peer: IpAddr, shared: &Arc<Shared>) -> io::Result<()> {
    serve_tls(stream, peer, shared, Deadline::now() + BIND_TIMEOUT, None).await
}

async fn serve_plain<S: Halves>(
    mut stream: S,
    peer: IpAddr,
    tls: bool,
    shared: &Arc<Shared>,
    deadline: Deadline,
    pass: Option<Pass>,
) -> io::Result<()> {
    let Some(bound) = bind(&mut stream, peer, tls, shared, deadline, pass).await? else { return Ok(()) };
    let (rd, wr) = kvpool_net::bulk::plain(stream);
    bound.run(rd, wr, if tls { "tls" } else { "tcp" }, shared).await
}

/// A connection bound to its session: its place among the session's bulk connections, and the
/// end of its QUIC connection.
struct Bound {
    session: std::sync::Weak<crate::service::Session>,
    life: crate::service::doors::Life,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// The token by `deadline`, then the status byte: `None` when the connection was refused (and
/// told why); `pass` (a place at the gate) is let go once the token is spent.
async fn bind<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: IpAddr,
    tls: bool,
    shared: &Arc<Shared>,
    deadline: Deadline,
    pass: Option<Pass>,
) -> io::Result<Option<Bound>> {
    let Some(door) = shared.bulk.get() else { return Ok(None) };
    let refused = &shared.metrics.bulk_refused;
    let mut token = [0u8; TOKEN_LEN];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut token)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return refuse(stream, refused, ErrorCode::Timeout, "no token in time".into()).await.map(|()| None),
    }
    let (session, life) = match door.tokens.redeem(&token, Some(peer), tls) {
        Ok(bound) => bound,
        Err(e) => return refuse(stream, refused, e.code(), format!("bulk {e}")).await.map(|()| None),
    };
    drop(pass);
    let Some(slot) = session.slot(Door::Bulk) else {
        let m = format!("at most {MAX_BOUND_PER_SESSION} bulk connections per QUIC connection");
        return refuse(stream, refused, ErrorCode::Rejected, m).await.map(|()| None);
    };
    stream.write_all(&[0]).await?;
    stream.flush().await?;
    shared.metrics.bulk_bound.inc();
    Ok(Some(Bound { session: Arc::downgrade(&session), life, _slot: slot }))
}

impl Bound {
    async fn run<R: BulkRead, W: BulkWrite>(
        self,
        rd: R,
        wr: W,
        transport: &'static str,
        shared: &Arc<Shared>,
    ) -> io::Result<()> {
        tokio::select! {
            r = run(rd, wr, self.session.clone(), transport, shared) => r,
            // The QUIC connection ended: its bulk connections go with it.
            _ = self.life.ended() => Ok(()),
        }
    }
}
