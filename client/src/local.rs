//! The same-host control channel: requests without bulk bytes sent over the server's Unix control
//! socket instead of a QUIC stream (`docs/PROTOCOL.md`, "Same-host control channel").
//!
//! A request on QUIC crosses two userspace QUIC stacks and their tasks; on the control socket it is
//! one write and one read each way. Sockets are kept open and reused, one request at a time each;
//! concurrent calls open more, up to the server's limit per connection.

use crate::error::{ClientError, Result};
use kvpool_proto::{frame, ErrorCode, LocalOffer, Response, CLIENT_MAX_FRAME};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Idle sockets kept for reuse; more are closed when they come back.
const MAX_IDLE: usize = 16;
/// Sockets in use at once. The server binds at most 64 per connection and counts a socket until
/// it sees it close; staying below that leaves room for sockets still closing.
const MAX_OPEN: usize = 48;

/// The control channel of one QUIC connection.
pub(crate) struct LocalLink {
    path: PathBuf,
    token: Vec<u8>,
    max_request: u32,
    max_response: u32,
    idle: Mutex<Vec<UnixStream>>,
    /// A socket failed: later calls go over QUIC.
    broken: AtomicBool,
    /// One permit per socket in use.
    open: tokio::sync::Semaphore,
}

impl std::fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLink").field("path", &self.path).field("broken", &self.broken).finish()
    }
}

fn io(what: &str, e: std::io::Error) -> ClientError {
    ClientError::Io(format!("control socket {what}: {e}"))
}

impl LocalLink {
    /// Bind a first socket with the offer's token (a refusal is an error).
    pub(crate) async fn open(offer: LocalOffer) -> Result<LocalLink> {
        let link = LocalLink {
            path: PathBuf::from(offer.socket_path),
            token: offer.token,
            max_request: offer.max_request,
            max_response: offer.max_response,
            idle: Mutex::new(Vec::new()),
            broken: AtomicBool::new(false),
            open: tokio::sync::Semaphore::new(MAX_OPEN),
        };
        let first = link.connect().await?;
        link.put_back(first);
        Ok(link)
    }

    pub(crate) fn usable(&self) -> bool {
        !self.broken.load(Ordering::Relaxed)
    }

    /// Whether a request frame of this many bytes fits an envelope.
    pub(crate) fn fits(&self, len: usize) -> bool {
        len <= self.max_request as usize
    }

    async fn connect(&self) -> Result<UnixStream> {
        let mut s = UnixStream::connect(&self.path).await.map_err(|e| io("connect", e))?;
        s.write_all(&self.token).await.map_err(|e| io("write", e))?;
        let mut status = [0u8; 1];
        s.read_exact(&mut status).await.map_err(|e| io("read", e))?;
        if status[0] == 0 {
            return Ok(s);
        }
        match frame::read_message::<_, Response>(&mut s, CLIENT_MAX_FRAME).await {
            Ok(Response::Error(b)) => Err(ClientError::Status { code: b.code, message: b.message }),
            Ok(_) => Err(ClientError::Protocol("control socket refused with a non-error frame".into())),
            Err(e) => Err(e.into()),
        }
    }

    fn take(&self) -> Option<UnixStream> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    fn put_back(&self, s: UnixStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(s);
        }
    }

    /// Send one request frame (no raw bytes follow it) and read its one-frame answer. `None`:
    /// nothing was sent (no socket could be bound), the caller sends the request over QUIC.
    pub(crate) async fn call(&self, request: &[u8]) -> Result<Option<Response>> {
        let Ok(_permit) = self.open.acquire().await else { return Ok(None) };
        let mut s = match self.take() {
            Some(s) => s,
            None => match self.connect().await {
                Ok(s) => s,
                // Too many sockets for now (some still closing on the server): not broken.
                Err(ClientError::Status { code: ErrorCode::Rejected, .. }) => return Ok(None),
                Err(e) => {
                    tracing::debug!(error = %e, "control socket unavailable; requests go over QUIC");
                    self.broken.store(true, Ordering::Relaxed);
                    return Ok(None);
                }
            },
        };
        match self.exchange(&mut s, request).await {
            Ok(r) => {
                self.put_back(s);
                r.map(Some)
            }
            Err(e) => {
                // The socket is in an unknown state; a server that went away takes the QUIC
                // connection with it, and the next call reconnects there.
                self.broken.store(true, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Outer error: the socket broke. Inner: the answer (a typed error keeps the socket usable).
    async fn exchange(&self, s: &mut UnixStream, request: &[u8]) -> Result<Result<Response>> {
        let mut out = Vec::with_capacity(4 + request.len());
        out.extend_from_slice(&(request.len() as u32).to_le_bytes());
        out.extend_from_slice(request);
        s.write_all(&out).await.map_err(|e| io("write", e))?;
        let mut head = [0u8; 9];
        s.read_exact(&mut head).await.map_err(|e| io("read", e))?;
        let end = head[0];
        let code = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
        let len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]);
        if len > self.max_response {
            return Err(ClientError::Protocol(format!(
                "control answer of {len} bytes; the server announced at most {}",
                self.max_response
            )));
        }
        let mut body = vec![0u8; len as usize];
        s.read_exact(&mut body).await.map_err(|e| io("read", e))?;
        match end {
            0 => {}
            1 => {
                return Ok(Err(ClientError::Io(format!("request reset by the server (code {code})"))));
            }
            other => return Err(ClientError::Protocol(format!("control answer with end marker {other}"))),
        }
        let mut rest = &body[..];
        let resp = frame::read_message::<_, Response>(&mut rest, CLIENT_MAX_FRAME).await?;
        if !rest.is_empty() {
            return Err(ClientError::Protocol("bytes after the last declared value".into()));
        }
        Ok(match resp {
            Response::Error(b) => Err(ClientError::Status { code: b.code, message: b.message }),
            r => Ok(r),
        })
    }
}

/// Whether a refusal means the channel is not offered (use QUIC) rather than a fault.
pub(crate) fn not_offered(e: &ClientError) -> bool {
    matches!(e, ClientError::Status { code: ErrorCode::Unsupported, .. })
}
