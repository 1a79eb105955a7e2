//! The same-host control channel: requests of an authenticated QUIC connection sent over a Unix
//! socket instead of a QUIC stream.
//!
//! A request on QUIC costs a round trip through two userspace QUIC stacks, about 100 µs on a
//! loaded 2-core host; a Unix socket round trip is a fraction of that. A client on the server's
//! host asks `LocalAttach` on its QUIC connection and gets the socket path and a token. Each
//! socket connection presents the token once and then carries one request at a time, each in an
//! envelope that stands for one QUIC stream (`docs/PROTOCOL.md`, "Same-host control channel").
//! Requests run through the same handler, on the same session (tenant, leases, reservations,
//! shared buffers), as on QUIC. Peer credentials are checked as on the shm socket. The sockets of
//! a connection close when the QUIC connection ends or attaches again.

use super::control::BIND_TIMEOUT;
pub use super::control::{LocalControl, LocalTicket, MAX_SOCKETS_PER_CONNECTION, TOKEN_LEN};
use super::dispatch::handle_stream;
use super::memory::{MemRecv, MemSend};
use super::shared::Shared;
use super::stream::error;
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorCode, Response};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tracing::{debug, info, warn};

/// Accept control sockets until the runtime stops. Returns at once when the server has no
/// control channel or it is already served.
pub async fn serve(shared: Arc<Shared>) {
    let Some(local) = shared.data_path.as_ref().and_then(|d| d.local.as_ref()) else { return };
    let Some(std_listener) = local.listener.lock().take() else { return };
    let listener = match tokio::net::UnixListener::from_std(std_listener) {
        Ok(l) => l,
        Err(e) => return warn!(error = %e, "cannot serve the control socket"),
    };
    info!(socket = %local.path.display(), "same-host control channel offered");
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // Out of descriptors and the like: wait instead of spinning.
                debug!(error = %e, "control socket accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_socket(sock, &shared).await {
                debug!(error = %e, "control socket ended");
            }
        });
    }
}

/// A refusal: status 1, then an error frame; the server closes the socket after it.
async fn refuse(sock: &mut UnixStream, shared: &Shared, code: ErrorCode, message: String) -> io::Result<()> {
    shared.metrics.local_refused.inc();
    debug!(%message, "control socket refused");
    let mut out = vec![1u8];
    out.extend(encode_frame(&Response::Error(error(code, message))).map_err(io::Error::other)?);
    sock.write_all(&out).await
}

/// One control socket: credentials, token, then one envelope after another.
async fn serve_socket(mut sock: UnixStream, shared: &Arc<Shared>) -> io::Result<()> {
    let Some(local) = shared.data_path.as_ref().and_then(|d| d.local.as_ref()) else { return Ok(()) };
    let cred = sock.peer_cred()?;
    if !local.allowed_uids.contains(&cred.uid()) {
        let m = format!("user {} may not use the control socket of this server", cred.uid());
        return refuse(&mut sock, shared, ErrorCode::Forbidden, m).await;
    }
    let mut token = [0u8; TOKEN_LEN];
    match tokio::time::timeout(BIND_TIMEOUT, sock.read_exact(&mut token)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return refuse(&mut sock, shared, ErrorCode::Timeout, "no token in time".into()).await,
    }
    let Some(binding) = local.tokens.lock().get(&token).cloned() else {
        let m = "unknown token (the QUIC connection that got it has ended, or attached again)".to_string();
        return refuse(&mut sock, shared, ErrorCode::Unauthorized, m).await;
    };
    if binding.sockets.fetch_add(1, Ordering::AcqRel) >= MAX_SOCKETS_PER_CONNECTION {
        binding.sockets.fetch_sub(1, Ordering::AcqRel);
        let m = format!("at most {MAX_SOCKETS_PER_CONNECTION} control sockets per connection");
        return refuse(&mut sock, shared, ErrorCode::Rejected, m).await;
    }
    let _count = SocketCount(binding.sockets.clone());
    sock.write_all(&[0]).await?;
    let mut alive = binding.alive.clone();
    loop {
        let mut head = [0u8; 4];
        tokio::select! {
            r = sock.read_exact(&mut head) => match r {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            },
            // The QUIC connection ended: its sockets go with it.
            _ = alive.changed() => return Ok(()),
        }
        let len = u32::from_le_bytes(head);
        if len > local.max_request {
            let m = format!("a request envelope of {len} bytes; the limit is {}", local.max_request);
            let frame = encode_frame(&Response::Error(error(ErrorCode::FrameTooLarge, m))).map_err(io::Error::other)?;
            return answer(&mut sock, 0, 0, &frame).await;
        }
        // Memory follows the bytes that arrive, not the length a client claims.
        let mut body = Vec::with_capacity((len as usize).min(64 << 10));
        let mut limited = (&mut sock).take(len as u64);
        match tokio::time::timeout(shared.timeouts.request, limited.read_to_end(&mut body)).await {
            Ok(Ok(n)) if n == len as usize => {}
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "request envelope incomplete in time")),
        }
        let Some(session) = binding.session.upgrade() else { return Ok(()) };
        let tag = kvpool_proto::message_tag(body.get(4..).unwrap_or(&[]));
        let (end, code, bytes) = if tag == Some(LOCAL_ATTACH_TAG) || tag == Some(SUBSCRIBE_TAG) {
            // LocalAttach would close the socket that carries it, and a subscription is a stream
            // of answers, which an envelope is not: both are asked on QUIC.
            let m = "LocalAttach and Subscribe are asked on the QUIC connection, not on its control socket".to_string();
            (0, 0, encode_frame(&Response::Error(error(ErrorCode::InvalidArgument, m))).map_err(io::Error::other)?)
        } else {
            let mut recv = MemRecv::new(body);
            let mut send = MemSend::bounded(local.max_response as usize);
            handle_stream(&mut recv, &mut send, &session, shared).await;
            drop(recv);
            if send.overflowed {
                let m = format!(
                    "the answer exceeds the control channel's {} bytes (the request may have taken effect); \
                     move bulk bytes with GetInto or over QUIC",
                    local.max_response
                );
                (0, 0, encode_frame(&Response::Error(error(ErrorCode::ValueTooLarge, m))).map_err(io::Error::other)?)
            } else {
                match send.reset {
                    Some(code) => (1, code, send.written),
                    None => (0, 0, send.written),
                }
            }
        };
        drop(session);
        shared.metrics.local_requests.inc();
        // A client that does not read its answer loses the socket, as on QUIC it would lose the
        // stream; nor does the socket outlive its connection while it waits.
        tokio::select! {
            r = tokio::time::timeout(shared.timeouts.request, answer(&mut sock, end, code, &bytes)) => match r {
                Ok(r) => r?,
                Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "answer not read in time")),
            },
            _ = alive.changed() => return Ok(()),
        }
    }
}

/// Tag of `Request::LocalAttach` (section 11.2 of PROTOCOL.md).
const LOCAL_ATTACH_TAG: u32 = 21;
const SUBSCRIBE_TAG: u32 = 22;

/// One response envelope: end (0 finished, 1 reset), reset code, length, bytes.
async fn answer(sock: &mut UnixStream, end: u8, code: u32, bytes: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = end;
    head[1..5].copy_from_slice(&code.to_le_bytes());
    head[5..9].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    // One write for small answers: the client wakes once.
    if bytes.len() <= 64 << 10 {
        let mut out = Vec::with_capacity(9 + bytes.len());
        out.extend_from_slice(&head);
        out.extend_from_slice(bytes);
        sock.write_all(&out).await
    } else {
        sock.write_all(&head).await?;
        sock.write_all(bytes).await
    }
}

struct SocketCount(Arc<AtomicUsize>);

impl Drop for SocketCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_local_attach_tag_is_the_encoded_one() {
        let body = kvpool_proto::codec::encode(&kvpool_proto::Request::LocalAttach).unwrap();
        assert_eq!(kvpool_proto::message_tag(&body), Some(super::LOCAL_ATTACH_TAG));
        let sub = kvpool_proto::Request::Subscribe(kvpool_proto::SubscribeRequest {
            from: None,
            scope: kvpool_proto::EventScope::Tenant,
            max_batch: 0,
        });
        let body = kvpool_proto::codec::encode(&sub).unwrap();
        assert_eq!(kvpool_proto::message_tag(&body), Some(super::SUBSCRIBE_TAG));
    }
}
