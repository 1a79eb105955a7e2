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

pub use super::control::LocalControl;
use super::dispatch::handle_stream;
use super::doors::{refuse, Door, Pass, Peer, BIND_TIMEOUT, MAX_BOUND_PER_SESSION, TOKEN_LEN};
use super::memory::{MemRecv, MemSend};
use super::shared::Shared;
use super::stream::error;
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorCode, Response};
use std::io;
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
        // A process is counted by its pid (a socket without one counts as pid 0).
        let pid = sock.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
        let Some(pass) = local.gate.enter(Peer::Process(pid)) else {
            // Full of sockets that have not shown a token: this one is closed unanswered.
            shared.metrics.local_refused.inc();
            debug!(pid, "control sockets wait for their token; closing a new one");
            continue;
        };
        let shared = shared.clone();
        let deadline = tokio::time::Instant::now() + BIND_TIMEOUT;
        tokio::spawn(async move {
            if let Err(e) = serve_socket(sock, &shared, pass, deadline).await {
                debug!(error = %e, "control socket ended");
            }
        });
    }
}

/// One control socket: credentials and token by `deadline` (holding a place at the gate until
/// then), then one envelope after another.
async fn serve_socket(
    mut sock: UnixStream,
    shared: &Arc<Shared>,
    pass: Pass,
    deadline: tokio::time::Instant,
) -> io::Result<()> {
    let Some(local) = shared.data_path.as_ref().and_then(|d| d.local.as_ref()) else { return Ok(()) };
    let refused = &shared.metrics.local_refused;
    let cred = sock.peer_cred()?;
    if !local.allowed_uids.contains(&cred.uid()) {
        let m = format!("user {} may not use the control socket of this server", cred.uid());
        return refuse(&mut sock, refused, ErrorCode::Forbidden, m).await;
    }
    let mut token = [0u8; TOKEN_LEN];
    match tokio::time::timeout_at(deadline, sock.read_exact(&mut token)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return refuse(&mut sock, refused, ErrorCode::Timeout, "no token in time".into()).await,
    }
    let (session, life) = match local.tokens.redeem(&token, None, false) {
        Ok(bound) => bound,
        Err(e) => return refuse(&mut sock, refused, e.code(), e.to_string()).await,
    };
    drop(pass);
    let Some(_slot) = session.slot(Door::Control) else {
        let m = format!("at most {MAX_BOUND_PER_SESSION} control sockets per connection");
        return refuse(&mut sock, refused, ErrorCode::Rejected, m).await;
    };
    let session = Arc::downgrade(&session);
    sock.write_all(&[0]).await?;
    loop {
        let mut head = [0u8; 4];
        tokio::select! {
            r = sock.read_exact(&mut head) => match r {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            },
            // The QUIC connection ended, or attached again: its sockets go with it.
            _ = life.ended() => return Ok(()),
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
        let Some(session) = session.upgrade() else { return Ok(()) };
        // What must be asked on QUIC is refused by the handler, from the request table.
        let mut recv = MemRecv::new(body).through(Door::Control);
        let mut send = MemSend::bounded(local.max_response as usize);
        handle_stream(&mut recv, &mut send, &session, shared).await;
        drop((recv, session));
        let (end, code, bytes) = if send.overflowed {
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
        };
        shared.metrics.local_requests.inc();
        // A client that does not read its answer loses the socket, as on QUIC it would lose the
        // stream; nor does the socket outlive its connection while it waits.
        tokio::select! {
            r = tokio::time::timeout(shared.timeouts.request, answer(&mut sock, end, code, &bytes)) => match r {
                Ok(r) => r?,
                Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "answer not read in time")),
            },
            _ = life.ended() => return Ok(()),
        }
    }
}

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
