//! A bulk connection from its accept to its first envelope: a place at the gate, TLS (with the
//! channel's ALPN) unless a trusted address starts in plaintext, the token, a place among its
//! session's connections; then the envelopes, until the connection or its session ends.

use super::door::TLS_READ_BUFFER;
use super::envelope::run;
use crate::service::doors::{refuse, Door, Pass, Peer, BIND_TIMEOUT, MAX_BOUND_PER_SESSION, TLS_HANDSHAKE, TOKEN_LEN};
use crate::service::shared::Shared;
use kvpool_proto::{ErrorCode, BULK_ALPN};
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
        return bind_and_run(sock, peer, false, shared, deadline, Some(pass)).await;
    }
    // rustls reads the socket 4 KiB at a time: a buffer under it turns that into one read per
    // 256 KiB (a copy in memory instead of 60 system calls).
    let sock = tokio::io::BufReader::with_capacity(TLS_READ_BUFFER, sock);
    let hello = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), sock);
    let mut start = match tokio::time::timeout_at(deadline, hello).await {
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
    // QUIC requires its ALPN; so does the channel.
    let offers_ours = start.client_hello().alpn().is_some_and(|mut offered| offered.any(|p| p == BULK_ALPN));
    if !offers_ours {
        shared.metrics.bulk_refused.inc();
        debug!(%peer, "a bulk ClientHello without ALPN kvpool-bulk/1; refused");
        let _ = tokio::time::timeout_at(deadline, start.io.write_all(&NO_APPLICATION_PROTOCOL)).await;
        return Ok(());
    }
    let tls = match tokio::time::timeout_at(deadline, start.into_stream(door.tls.clone())).await {
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
    bind_and_run(tls, peer, true, shared, deadline, Some(pass)).await
}

/// A bulk connection after its transport handshake (TLS or plaintext TCP; an in-memory pipe
/// in the fuzz driver): the token, then one envelope after another.
pub async fn serve_stream<S>(stream: S, peer: IpAddr, tls: bool, shared: &Arc<Shared>) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    bind_and_run(stream, peer, tls, shared, Deadline::now() + BIND_TIMEOUT, None).await
}

/// The token by `deadline`, then the envelopes; `pass` (a place at the gate) is let go once the
/// token is spent.
async fn bind_and_run<S>(
    mut stream: S,
    peer: IpAddr,
    tls: bool,
    shared: &Arc<Shared>,
    deadline: Deadline,
    pass: Option<Pass>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let Some(door) = shared.bulk.get() else { return Ok(()) };
    let refused = &shared.metrics.bulk_refused;
    let mut token = [0u8; TOKEN_LEN];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut token)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return refuse(&mut stream, refused, ErrorCode::Timeout, "no token in time".into()).await,
    }
    let (session, life) = match door.tokens.redeem(&token, Some(peer), tls) {
        Ok(bound) => bound,
        Err(e) => return refuse(&mut stream, refused, e.code(), format!("bulk {e}")).await,
    };
    drop(pass);
    let Some(_slot) = session.slot(Door::Bulk) else {
        let m = format!("at most {MAX_BOUND_PER_SESSION} bulk connections per QUIC connection");
        return refuse(&mut stream, refused, ErrorCode::Rejected, m).await;
    };
    shared.metrics.bulk_bound.inc();
    let weak = Arc::downgrade(&session);
    drop(session);
    tokio::select! {
        r = run(stream, weak, if tls { "tls" } else { "tcp" }, shared) => r,
        // The QUIC connection ended: its bulk connections go with it.
        _ = life.ended() => Ok(()),
    }
}
