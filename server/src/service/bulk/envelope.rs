//! The envelopes of the TCP bulk channel (PROTOCOL.md 11.10), and the request stream halves
//! they make for the one request handler.
//!
//! A request envelope is its length (u64 LE) and that many bytes: the request frame and the
//! value bytes it declares, exactly as on a QUIC stream; its end is the stream's FIN. The
//! answer is streamed in chunks, each a u32 LE length under 2^31 and its bytes, ended by
//! `0xFFFF_FFFF`, a byte (0 finished, 1 reset) and a u32 LE code (the reset's). Values go from
//! the connection straight into their DRAM range (under TLS decrypted there), and out of DRAM
//! in one chunk each, several values' chunks to one system call.

use crate::service::dispatch::handle_stream;
use crate::service::doors::Door;
use crate::service::session::Session;
use crate::service::shared::Shared;
use crate::service::stream::{error, BoxFuture, RequestRecv, RequestSend};
use bytes::Bytes;
use kvpool_net::bulk::{BulkRead, BulkWrite, Cursor, Piece};
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorCode, Response};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// Chunk length that ends an answer.
pub const END: u32 = u32::MAX;
/// Largest chunk.
const MAX_CHUNK: usize = (END >> 1) as usize;
/// Request bytes the server still reads (and drops) after answering early, to keep the
/// connection; a client that would send more loses the connection instead.
const DRAIN_LIMIT: u64 = 64 << 20;
/// Answer bytes gathered before they go out as one chunk (frames; values go on their own).
const GATHER: usize = 64 << 10;
/// Value bytes queued before they are handed to the connection: the chunks of several small
/// values leave in one system call (the last ones with the end of the answer).
const COALESCE: usize = 256 << 10;

/// Serve envelopes until the client closes, the session is gone, or the framing breaks; a
/// connection given up on the client's bad records is told why (a TLS alert) before it closes.
pub(super) async fn run<R: BulkRead, W: BulkWrite>(
    mut rd: R,
    mut wr: W,
    session: Weak<Session>,
    transport: &'static str,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    let r = serve(&mut rd, &mut wr, session, transport, shared).await;
    kvpool_net::bulk::send_alert(&mut wr).await;
    r
}

async fn serve<R: BulkRead, W: BulkWrite>(
    rd: &mut R,
    wr: &mut W,
    session: Weak<Session>,
    transport: &'static str,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    let max_request = max_envelope(shared);
    loop {
        let mut head = [0u8; 8];
        match rd.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u64::from_le_bytes(head);
        let mut send = BulkSend::new(wr, transport);
        if len > max_request {
            let m = format!("a request envelope of {len} bytes; the limit is {max_request}");
            return send.fail(ErrorCode::FrameTooLarge, m).await;
        }
        let Some(session) = session.upgrade() else { return Ok(()) };
        // The handler reads the frame as on QUIC, and refuses (from the request table) what
        // must be asked on the QUIC connection.
        let mut recv = BulkRecv { inner: rd, left: len, transport };
        handle_stream(&mut recv, &mut send, &session, shared).await;
        drop(session);
        shared.metrics.bulk_requests.inc();
        if send.broken() {
            // A value was abandoned halfway through its chunk: the framing cannot go on.
            return Ok(());
        }
        let (end, code) = send.outcome();
        let by = shared.timeouts.transfer(send.queued as u64);
        match tokio::time::timeout(by, send.end(end, code)).await {
            Ok(r) => r?,
            // The client does not read its answer.
            Err(_) => return Ok(()),
        }
        if !drain(&mut recv, shared).await {
            return Ok(());
        }
    }
}

/// Largest request envelope: a full batch of the largest values behind the largest frame.
fn max_envelope(s: &Shared) -> u64 {
    let l = &s.limits;
    (l.max_value_size.saturating_mul(l.max_batch as u64)).saturating_add(l.max_frame as u64 + 4)
}

/// Read what the handler left of the request (it answered early); `false`: close instead.
async fn drain<R: BulkRead>(recv: &mut BulkRecv<'_, R>, shared: &Shared) -> bool {
    if recv.left == 0 {
        return true;
    }
    if recv.left > DRAIN_LIMIT {
        return false;
    }
    let deadline = shared.timeouts.transfer(recv.left);
    let mut sink = tokio::io::sink();
    matches!(tokio::time::timeout(deadline, tokio::io::copy(recv, &mut sink)).await, Ok(Ok(_))) && recv.left == 0
}

/// The receiving half of one request: its envelope's bytes, then the end of the stream.
pub(super) struct BulkRecv<'a, R> {
    inner: &'a mut R,
    left: u64,
    transport: &'static str,
}

/// The connection closed inside an envelope: the client is gone.
fn gone() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "bulk connection closed")
}

impl<R: BulkRead> AsyncRead for BulkRecv<'_, R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.left == 0 || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let want = buf.remaining().min(usize::try_from(me.left).unwrap_or(usize::MAX));
        let mut part = buf.take(want);
        ready!(Pin::new(&mut *me.inner).poll_read(cx, &mut part))?;
        let n = part.filled().len();
        if n == 0 {
            return Poll::Ready(Err(gone()));
        }
        // SAFETY: `part` filled these bytes of `buf`'s unfilled part.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        me.left -= n as u64;
        Poll::Ready(Ok(()))
    }
}

impl<R: BulkRead> RequestRecv for BulkRecv<'_, R> {
    /// The rest of the envelope is drained (or the connection closed) after the answer.
    fn stop(&mut self, _code: u32) {}
    fn transport(&self) -> &'static str {
        self.transport
    }
    fn door(&self) -> Door {
        Door::Bulk
    }
    /// Straight into `buf` (under TLS decrypted there), hashed as it lands.
    fn read_hashed<'b>(&'b mut self, buf: &'b mut [u8]) -> BoxFuture<'b, io::Result<u64>> {
        Box::pin(async move {
            let n = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
            let mut h = xxhash_rust::xxh3::Xxh3Default::new();
            match self.inner.fill(&mut buf[..n], &mut |b| h.update(b)).await {
                Ok(()) => self.left -= n as u64,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(gone()),
                Err(e) => return Err(e),
            }
            if n < buf.len() {
                // The envelope ends inside the value.
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            Ok(h.digest())
        })
    }
}

/// Bytes waiting to go: closed chunks of small writes and chunk headers, and values.
enum Queued {
    Small(Vec<u8>),
    Value(Bytes),
}

/// The sending half of one answer: chunks, then the end.
pub(super) struct BulkSend<'a, W> {
    inner: &'a mut W,
    /// Small writes gathered into one chunk, its length first.
    gather: Vec<u8>,
    /// Chunks not yet handed to the connection, and how far it took them.
    queue: Vec<Queued>,
    at: Cursor,
    /// Value bytes queued.
    queued: usize,
    /// Bytes of a borrowed large write's chunk declared and not yet taken.
    in_chunk: usize,
    finished: bool,
    reset: Option<u32>,
    transport: &'static str,
}

impl<'a, W: BulkWrite> BulkSend<'a, W> {
    fn new(inner: &'a mut W, transport: &'static str) -> Self {
        BulkSend {
            inner,
            gather: Vec::new(),
            queue: Vec::new(),
            at: Cursor::default(),
            queued: 0,
            in_chunk: 0,
            finished: false,
            reset: None,
            transport,
        }
    }

    /// Some chunk is partly sent, and its caller gave up on it.
    fn broken(&self) -> bool {
        self.in_chunk > 0 || !self.at.at_start()
    }

    fn outcome(&self) -> (u8, u32) {
        match self.reset {
            Some(code) if !self.finished => (1, code),
            _ => (0, 0),
        }
    }

    /// Close the gathered bytes as a chunk and queue it.
    fn seal(&mut self) {
        if self.gather.len() > 4 {
            let n = (self.gather.len() - 4) as u32;
            self.gather[..4].copy_from_slice(&n.to_le_bytes());
            self.queue.push(Queued::Small(std::mem::take(&mut self.gather)));
        }
        self.gather.clear();
    }

    /// Hand the queue to the connection.
    fn poll_queue(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.queue.is_empty() {
            return Poll::Ready(Ok(()));
        }
        let pieces: Vec<Piece<'_>> = self
            .queue
            .iter()
            .map(|q| match q {
                Queued::Small(b) => Piece::Small(b),
                Queued::Value(b) => Piece::Value(b),
            })
            .collect();
        ready!(self.inner.poll_send(cx, &pieces, &mut self.at))?;
        drop(pieces);
        self.queue.clear();
        self.at = Cursor::default();
        self.queued = 0;
        Poll::Ready(Ok(()))
    }

    /// Answer a typed error, whole.
    async fn fail(&mut self, code: ErrorCode, message: String) -> io::Result<()> {
        let frame = encode_frame(&Response::Error(error(code, message))).map_err(io::Error::other)?;
        self.write_all(&frame).await?;
        self.end(0, 0).await
    }

    /// The end of the answer, after what is gathered and queued.
    async fn end(&mut self, end: u8, code: u32) -> io::Result<()> {
        self.seal();
        let mut tail = vec![0u8; 9];
        tail[..4].copy_from_slice(&END.to_le_bytes());
        tail[4] = end;
        tail[5..].copy_from_slice(&code.to_le_bytes());
        self.queue.push(Queued::Small(tail));
        std::future::poll_fn(|cx| self.poll_queue(cx)).await?;
        self.inner.flush().await
    }
}

impl<W: BulkWrite> AsyncWrite for BulkSend<'_, W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        if me.in_chunk == 0 {
            if buf.is_empty() {
                return Poll::Ready(Ok(0));
            }
            if buf.len() < GATHER && me.gather.len() + buf.len() <= GATHER {
                if me.gather.is_empty() {
                    me.gather.extend_from_slice(&[0; 4]);
                }
                me.gather.extend_from_slice(buf);
                return Poll::Ready(Ok(buf.len()));
            }
            // A large borrowed write: a chunk of its own, open from here (a caller that gives
            // up on it breaks the framing, and the connection is closed).
            let len = buf.len().min(MAX_CHUNK);
            me.seal();
            me.queue.push(Queued::Small((len as u32).to_le_bytes().to_vec()));
            me.in_chunk = len;
        }
        ready!(me.poll_queue(cx))?;
        let want = buf.len().min(me.in_chunk);
        let mut at = Cursor::default();
        let sent = me.inner.poll_send(cx, &[Piece::Value(&buf[..want])], &mut at)?;
        let n = if at.piece > 0 { want } else { at.offset };
        if n == 0 && sent.is_pending() {
            return Poll::Pending;
        }
        me.in_chunk -= n;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        // Gathered bytes go out as a chunk of their own; an open chunk's header goes as is.
        if me.in_chunk == 0 {
            me.seal();
        }
        ready!(me.poll_queue(cx))?;
        Pin::new(&mut *me.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.finished = true;
        Poll::Ready(Ok(()))
    }
}

impl<W: BulkWrite> RequestSend for BulkSend<'_, W> {
    /// Queued, and sent with the values before and after it (a chunk each).
    fn write_owned(&mut self, bytes: Bytes) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(async move {
            if self.in_chunk > 0 {
                return Err(io::Error::other("a value written inside an open chunk"));
            }
            self.seal();
            // What is queued goes before this value is added, not after: the last value of an
            // answer leaves with the answer's end, in the same write.
            if self.queued >= COALESCE {
                std::future::poll_fn(|cx| self.poll_queue(cx)).await?;
            }
            let mut rest = bytes;
            while !rest.is_empty() {
                let part = rest.split_to(rest.len().min(MAX_CHUNK));
                self.queue.push(Queued::Small((part.len() as u32).to_le_bytes().to_vec()));
                self.queued += part.len();
                self.queue.push(Queued::Value(part));
            }
            Ok(())
        })
    }
    fn finish(&mut self) {
        self.finished = true;
    }
    fn reset(&mut self, code: u32) {
        self.reset = Some(code);
    }
    fn transport(&self) -> &'static str {
        self.transport
    }
}

#[cfg(test)]
mod tests;
