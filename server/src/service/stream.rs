//! What every request handler stands on: the two halves of a request stream, the deadlines of
//! a request, why a request failed ([`Fail`]), and reading and writing under a deadline.
//!
//! The handlers are generic over the two halves ([`RequestRecv`], [`RequestSend`]), so the
//! three front doors (QUIC, the Unix control socket, the TCP bulk channel), the fuzz driver and
//! the unit tests all run the same code.

use super::doors::Door;
pub use crate::store::BoxFuture;
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorBody, ErrorCode, Limits, ProtoError, Response};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant as Deadline;

/// The receiving half of a request stream.
pub trait RequestRecv: AsyncRead + Unpin + Send {
    /// Stop reading: the peer's further writes fail (QUIC STOP_SENDING with `code`).
    fn stop(&mut self, code: u32);
    /// What carries the stream, for the transfer metrics.
    fn transport(&self) -> &'static str;
    /// The front door the request came through (the request table says what each carries).
    fn door(&self) -> Door;
    /// Fill `buf` from the stream and return the xxh3-64 of its bytes, hashed piece by piece
    /// as they land (while they are in cache) rather than in a second pass. The TCP bulk
    /// channel lands values in place through its own (under TLS decrypting there).
    fn read_hashed<'a>(&'a mut self, buf: &'a mut [u8]) -> BoxFuture<'a, std::io::Result<u64>> {
        Box::pin(kvpool_net::bulk::read_hashed(self, buf))
    }
}

/// The sending half of a request stream.
pub trait RequestSend: AsyncWrite + Unpin + Send {
    /// Send bytes the stream may keep (QUIC sends them from where they are, without a copy).
    fn write_owned(&mut self, bytes: bytes::Bytes) -> BoxFuture<'_, std::io::Result<()>>;
    /// End the response (QUIC FIN).
    fn finish(&mut self);
    /// Abandon the response; bytes not yet delivered are dropped (QUIC RESET_STREAM).
    fn reset(&mut self, code: u32);
    /// What carries the stream, for the transfer metrics.
    fn transport(&self) -> &'static str;
    /// Resolves when the peer no longer wants the response (QUIC STOP_SENDING, or the
    /// connection is gone); a long-lived response (a subscription) waits on it between writes.
    fn stopped(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::pending())
    }
}

/// How long the server waits on a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From stream open to the whole request frame (and, for requests without value bytes, its
    /// end of stream); also the fixed part of every transfer deadline.
    pub request: Duration,
    /// Slowest transfer waited for, bytes per second.
    pub min_rate: u64,
}

impl Timeouts {
    /// Time allowed to move `bytes` of values (either way), on top of the request time.
    pub fn transfer(&self, bytes: u64) -> Duration {
        self.request + Duration::from_secs_f64(bytes as f64 / self.min_rate.max(1) as f64)
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { request: Duration::from_secs(10), min_rate: 8 << 20 }
    }
}

pub(super) fn error(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody { code, message: message.into() }
}

/// Why a request ended without its normal answer.
#[derive(Debug)]
pub(super) enum Fail {
    /// Answer this typed error, then stop reading the stream.
    Reply(ErrorBody),
    /// The client reset the stream or the connection went away: nothing to answer.
    Cancelled,
    /// The client did not deliver the request in time: answer `timeout`, stop reading.
    Timeout(String),
    /// The client did not read the response in time: abandon (reset) the stream.
    Stalled,
}

pub(super) fn malformed(message: impl Into<String>) -> Fail {
    Fail::Reply(error(ErrorCode::Malformed, message))
}

pub(super) fn read_fail(e: std::io::Error, what: &str) -> Fail {
    match ProtoError::from(e) {
        ProtoError::Truncated => malformed(format!("stream ended before {what}")),
        ProtoError::Cancelled(_) => Fail::Cancelled,
        other => Fail::Reply(error(ErrorCode::Internal, other.to_string())),
    }
}

/// Fill `buf` from the stream by `deadline`.
pub(super) async fn read_exact_by<R: RequestRecv>(
    r: &mut R,
    buf: &mut [u8],
    deadline: Deadline,
    what: &str,
) -> Result<(), Fail> {
    match tokio::time::timeout_at(deadline, r.read_exact(buf)).await {
        Err(_) => Err(Fail::Timeout(format!("{what} did not arrive in time"))),
        Ok(Err(e)) => Err(read_fail(e, what)),
        Ok(Ok(_)) => Ok(()),
    }
}

/// As [`read_exact_by`], and return the xxh3-64 of the bytes ([`RequestRecv::read_hashed`]).
pub(super) async fn read_hashed_by<R: RequestRecv>(
    r: &mut R,
    buf: &mut [u8],
    deadline: Deadline,
    what: &str,
) -> Result<u64, Fail> {
    match tokio::time::timeout_at(deadline, r.read_hashed(buf)).await {
        Err(_) => Err(Fail::Timeout(format!("{what} did not arrive in time"))),
        Ok(Err(e)) => Err(read_fail(e, what)),
        Ok(Ok(sum)) => Ok(sum),
    }
}

/// Read and drop `n` bytes of a value that will not be stored.
pub(super) async fn discard<R: RequestRecv>(r: &mut R, mut n: u64, deadline: Deadline) -> Result<(), Fail> {
    let mut buf = [0u8; 16 * 1024];
    while n > 0 {
        let want = n.min(buf.len() as u64) as usize;
        read_exact_by(r, &mut buf[..want], deadline, "the declared value bytes").await?;
        n -= want as u64;
    }
    Ok(())
}

/// The request must end here: anything more is malformed (and nothing of it takes effect).
pub(super) async fn expect_end<R: RequestRecv>(r: &mut R, deadline: Deadline) -> Result<(), Fail> {
    let mut probe = [0u8; 64];
    match tokio::time::timeout_at(deadline, r.read(&mut probe)).await {
        Err(_) => Err(Fail::Timeout("the request stream was not finished (no FIN) in time".into())),
        Ok(Ok(0)) => Ok(()),
        Ok(Ok(_)) => Err(malformed(
            "bytes after the end of the request: a request is one frame, then exactly the declared value \
             bytes (put, policy load), then the end of the stream",
        )),
        Ok(Err(e)) => Err(read_fail(e, "the end of the stream")),
    }
}

pub(super) async fn write_owned_by<W: RequestSend>(
    w: &mut W,
    bytes: bytes::Bytes,
    deadline: Deadline,
) -> Result<(), Fail> {
    match tokio::time::timeout_at(deadline, w.write_owned(bytes)).await {
        Err(_) => Err(Fail::Stalled),
        Ok(Err(_)) => Err(Fail::Cancelled),
        Ok(Ok(())) => Ok(()),
    }
}

pub(super) async fn write_by<W: RequestSend>(w: &mut W, bytes: &[u8], deadline: Deadline) -> Result<(), Fail> {
    match tokio::time::timeout_at(deadline, w.write_all(bytes)).await {
        Err(_) => Err(Fail::Stalled),
        // Stopped by the peer or connection lost: the client no longer wants the answer.
        Ok(Err(_)) => Err(Fail::Cancelled),
        Ok(Ok(())) => Ok(()),
    }
}

/// Write one response frame and end the stream.
pub(super) async fn reply<W: RequestSend>(w: &mut W, resp: &Response, deadline: Deadline) -> Result<(), Fail> {
    let frame = encode_frame(resp).map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    write_by(w, &frame, deadline).await?;
    w.finish();
    Ok(())
}

pub(super) fn check_keys<'a>(
    keys: impl IntoIterator<Item = &'a Vec<u8>>,
    count: usize,
    l: &Limits,
) -> Result<(), Fail> {
    if count > l.max_batch as usize {
        return Err(Fail::Reply(error(
            ErrorCode::BatchTooLarge,
            format!("{count} items; the limit is {}", l.max_batch),
        )));
    }
    for k in keys {
        if k.len() > l.max_key_len as usize {
            return Err(Fail::Reply(error(
                ErrorCode::KeyTooLong,
                format!("key of {} bytes; the limit is {}", k.len(), l.max_key_len),
            )));
        }
        if k.is_empty() {
            return Err(Fail::Reply(error(ErrorCode::InvalidArgument, "empty key")));
        }
    }
    Ok(())
}

pub(super) fn unsupported(message: impl Into<String>) -> Fail {
    Fail::Reply(error(ErrorCode::Unsupported, message))
}

pub(super) fn invalid(message: impl Into<String>) -> Fail {
    Fail::Reply(error(ErrorCode::InvalidArgument, message))
}
