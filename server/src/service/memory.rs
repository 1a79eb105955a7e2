//! In-memory stream halves for running the request handler without QUIC: the Unix control
//! socket hands each envelope's bytes to the handler this way, and the fuzz driver and unit
//! tests feed a request as bytes and read back what the server wrote.

use super::doors::Door;
use super::stream::{BoxFuture, RequestRecv, RequestSend};
use bytes::Bytes;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A request stream's receiving half over fixed bytes; the end of the bytes is the FIN.
#[derive(Debug, Clone, Default)]
pub struct MemRecv {
    data: Bytes,
    pos: usize,
    /// When set, reading past the bytes fails as a peer reset instead of a clean end.
    reset_at_end: bool,
    /// When set, reading past the bytes never completes (a stalled client).
    stall_at_end: bool,
    /// STOP_SENDING code the handler sent, if any.
    pub stopped: Option<u32>,
    /// The door the bytes stand for: QUIC (the fuzz driver and the tests) unless told.
    door: Option<Door>,
}

impl MemRecv {
    pub fn new(data: impl Into<Bytes>) -> MemRecv {
        MemRecv { data: data.into(), ..MemRecv::default() }
    }

    /// The client resets the stream after these bytes.
    pub fn reset_after(data: impl Into<Bytes>) -> MemRecv {
        MemRecv { data: data.into(), reset_at_end: true, ..MemRecv::default() }
    }

    /// The client sends these bytes, then nothing, and never finishes.
    pub fn stall_after(data: impl Into<Bytes>) -> MemRecv {
        MemRecv { data: data.into(), stall_at_end: true, ..MemRecv::default() }
    }

    /// The bytes came through `door` (the Unix control socket's envelopes).
    pub fn through(mut self, door: Door) -> MemRecv {
        self.door = Some(door);
        self
    }

    /// Bytes the handler did not consume.
    pub fn unread(&self) -> usize {
        self.data.len() - self.pos
    }
}

impl AsyncRead for MemRecv {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.pos == me.data.len() {
            if me.stall_at_end {
                return Poll::Pending;
            }
            if me.reset_at_end {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, "stream reset by peer")));
            }
            return Poll::Ready(Ok(()));
        }
        let n = buf.remaining().min(me.data.len() - me.pos);
        buf.put_slice(&me.data[me.pos..me.pos + n]);
        me.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl RequestRecv for MemRecv {
    fn stop(&mut self, code: u32) {
        self.stopped = Some(code);
    }
    /// In-memory streams carry the same-host control socket's requests.
    fn transport(&self) -> &'static str {
        "local"
    }
    fn door(&self) -> Door {
        self.door.unwrap_or(Door::Quic)
    }
}

/// A request stream's sending half that collects the response.
#[derive(Debug, Clone, Default)]
pub struct MemSend {
    pub written: Vec<u8>,
    pub finished: bool,
    /// RESET_STREAM code the handler sent, if any.
    pub reset: Option<u32>,
    /// Accept at most this many bytes, then block (a client that stopped reading).
    pub capacity: Option<usize>,
    /// Accept at most this many bytes, then fail the write (a bounded response buffer).
    pub limit: Option<usize>,
    /// A write failed because of `limit`.
    pub overflowed: bool,
}

impl MemSend {
    /// Collects at most `limit` bytes; a write past it fails and sets `overflowed`.
    pub fn bounded(limit: usize) -> MemSend {
        MemSend { limit: Some(limit), ..MemSend::default() }
    }
}

impl AsyncWrite for MemSend {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        if me.limit.is_some_and(|l| me.written.len() + buf.len() > l) {
            me.overflowed = true;
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::OutOfMemory, "response exceeds the buffer limit")));
        }
        let room = me.capacity.map_or(buf.len(), |c| c.saturating_sub(me.written.len()).min(buf.len()));
        if room == 0 && !buf.is_empty() {
            return Poll::Pending;
        }
        me.written.extend_from_slice(&buf[..room]);
        Poll::Ready(Ok(room))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.finished = true;
        Poll::Ready(Ok(()))
    }
}

impl RequestSend for MemSend {
    fn write_owned(&mut self, bytes: Bytes) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(async move { tokio::io::AsyncWriteExt::write_all(self, &bytes).await })
    }
    fn finish(&mut self) {
        self.finished = true;
    }
    fn reset(&mut self, code: u32) {
        self.reset = Some(code);
    }
    fn transport(&self) -> &'static str {
        "local"
    }
    /// Nobody follows an in-memory response past what it holds: a subscription writes its
    /// first frame and ends.
    fn stopped(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}
