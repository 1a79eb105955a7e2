//! The envelopes of the TCP bulk channel (PROTOCOL.md 11.10), and the request stream halves
//! they make for the one request handler.
//!
//! A request envelope is its length (u64 LE) and that many bytes: the request frame and the
//! value bytes it declares, exactly as on a QUIC stream; its end is the stream's FIN. The
//! answer is streamed in chunks, each a u32 LE length under 2^31 and its bytes, ended by
//! `0xFFFF_FFFF`, a byte (0 finished, 1 reset) and a u32 LE code (the reset's). Values go
//! from the socket straight into their DRAM range, and from DRAM to the socket, in one chunk
//! each: no copy beyond TLS's own.

use crate::service::dispatch::handle_stream;
use crate::service::doors::Door;
use crate::service::session::Session;
use crate::service::shared::Shared;
use crate::service::stream::{error, BoxFuture, RequestRecv, RequestSend};
use bytes::Bytes;
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorCode, Response};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, WriteHalf};

/// Chunk length that ends an answer.
pub const END: u32 = u32::MAX;
/// Request bytes the server still reads (and drops) after answering early, to keep the
/// connection; a client that would send more loses the connection instead.
const DRAIN_LIMIT: u64 = 64 << 20;
/// Answer bytes gathered before they go out as one chunk (frames; values go on their own).
const GATHER: usize = 64 << 10;

/// Serve envelopes until the client closes, the session is gone, or the framing breaks.
pub(super) async fn run<S>(
    stream: S,
    session: Weak<Session>,
    transport: &'static str,
    shared: &Arc<Shared>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    wr.write_all(&[0]).await?;
    wr.flush().await?;
    let max_request = max_envelope(shared);
    loop {
        let mut head = [0u8; 8];
        match rd.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u64::from_le_bytes(head);
        let mut send = BulkSend::new(&mut wr, transport);
        if len > max_request {
            let m = format!("a request envelope of {len} bytes; the limit is {max_request}");
            return send.fail(ErrorCode::FrameTooLarge, m).await;
        }
        let Some(session) = session.upgrade() else { return Ok(()) };
        // The handler reads the frame as on QUIC, and refuses (from the request table) what
        // must be asked on the QUIC connection.
        let mut recv = BulkRecv { inner: &mut rd, left: len, transport };
        handle_stream(&mut recv, &mut send, &session, shared).await;
        drop(session);
        shared.metrics.bulk_requests.inc();
        if send.broken() {
            // A value was abandoned halfway through its chunk: the framing cannot go on.
            return Ok(());
        }
        let (end, code) = send.outcome();
        send.end(end, code).await?;
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
async fn drain<R: AsyncRead + Unpin>(recv: &mut BulkRecv<'_, R>, shared: &Shared) -> bool {
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
    inner: &'a mut ReadHalf<R>,
    left: u64,
    transport: &'static str,
}

impl<R: AsyncRead> AsyncRead for BulkRecv<'_, R> {
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
            // The connection closed inside an envelope: the client is gone.
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, "bulk connection closed")));
        }
        // SAFETY: `part` filled these bytes of `buf`'s unfilled part.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        me.left -= n as u64;
        Poll::Ready(Ok(()))
    }
}

impl<R: AsyncRead + Send> RequestRecv for BulkRecv<'_, R> {
    /// The rest of the envelope is drained (or the connection closed) after the answer.
    fn stop(&mut self, _code: u32) {}
    fn transport(&self) -> &'static str {
        self.transport
    }
    fn door(&self) -> Door {
        Door::Bulk
    }
}

/// The sending half of one answer: chunks, then the end.
pub(super) struct BulkSend<'a, W> {
    inner: &'a mut WriteHalf<W>,
    /// Small writes gathered into one chunk, header first.
    gather: Vec<u8>,
    /// Bytes of gathered data written out so far.
    flushed: usize,
    /// Bytes of a large chunk declared and not yet written.
    in_chunk: usize,
    finished: bool,
    reset: Option<u32>,
    transport: &'static str,
}

impl<'a, W: AsyncWrite> BulkSend<'a, W> {
    fn new(inner: &'a mut WriteHalf<W>, transport: &'static str) -> Self {
        BulkSend { inner, gather: Vec::new(), flushed: 0, in_chunk: 0, finished: false, reset: None, transport }
    }

    fn broken(&self) -> bool {
        self.in_chunk > 0
    }

    fn outcome(&self) -> (u8, u32) {
        match self.reset {
            Some(code) if !self.finished => (1, code),
            _ => (0, 0),
        }
    }

    /// Close the gathered bytes as a chunk (its header is at the front).
    fn seal(&mut self) {
        if self.gather.len() > 4 && self.flushed == 0 {
            let n = (self.gather.len() - 4) as u32;
            self.gather[..4].copy_from_slice(&n.to_le_bytes());
        }
    }

    fn poll_gathered(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.flushed < self.gather.len() {
            let n = ready!(Pin::new(&mut *self.inner).poll_write(cx, &self.gather[self.flushed..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.flushed += n;
        }
        self.gather.clear();
        self.flushed = 0;
        Poll::Ready(Ok(()))
    }

    /// Answer a typed error, whole.
    async fn fail(&mut self, code: ErrorCode, message: String) -> io::Result<()> {
        let frame = encode_frame(&Response::Error(error(code, message))).map_err(io::Error::other)?;
        self.write_all(&frame).await?;
        self.end(0, 0).await
    }

    /// The end of the answer, after what is gathered.
    async fn end(&mut self, end: u8, code: u32) -> io::Result<()> {
        self.seal();
        let mut tail = [0u8; 9];
        tail[..4].copy_from_slice(&END.to_le_bytes());
        tail[4] = end;
        tail[5..].copy_from_slice(&code.to_le_bytes());
        self.gather.extend_from_slice(&tail);
        std::future::poll_fn(|cx| self.poll_gathered(cx)).await?;
        self.inner.flush().await
    }
}

impl<W: AsyncWrite> AsyncWrite for BulkSend<'_, W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        // What is gathered goes out first: earlier chunks, and an open chunk's header.
        if me.flushed > 0 || (me.in_chunk > 0 && !me.gather.is_empty()) {
            ready!(me.poll_gathered(cx))?;
        }
        if me.in_chunk > 0 {
            let want = buf.len().min(me.in_chunk);
            let n = ready!(Pin::new(&mut *me.inner).poll_write(cx, &buf[..want]))?;
            me.in_chunk -= n;
            return Poll::Ready(Ok(n));
        }
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
        // A value: what is gathered, then this chunk's header, then its bytes straight from the
        // caller's buffer. The chunk is open from here: a caller that gives up on it breaks the
        // framing, and the connection is closed.
        let len = buf.len().min((END >> 1) as usize);
        me.seal();
        me.gather.extend_from_slice(&(len as u32).to_le_bytes());
        me.in_chunk = len;
        ready!(me.poll_gathered(cx))?;
        let n = ready!(Pin::new(&mut *me.inner).poll_write(cx, &buf[..len]))?;
        me.in_chunk -= n;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        // Gathered bytes go out as a chunk of their own; an open chunk's header goes out as is.
        if me.in_chunk == 0 {
            me.seal();
        }
        ready!(me.poll_gathered(cx))?;
        Pin::new(&mut *me.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.finished = true;
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Send> RequestSend for BulkSend<'_, W> {
    fn write_owned(&mut self, bytes: Bytes) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(async move { self.write_all(&bytes).await })
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
mod tests {
    use super::*;

    /// Join an answer's chunks; the end byte and code.
    fn unchunk(mut b: &[u8]) -> (Vec<u8>, u8, u32) {
        let mut out = Vec::new();
        loop {
            let n = u32::from_le_bytes(b[..4].try_into().unwrap());
            b = &b[4..];
            if n == END {
                assert_eq!(b.len(), 5, "nothing after the end");
                return (out, b[0], u32::from_le_bytes(b[1..5].try_into().unwrap()));
            }
            out.extend_from_slice(&b[..n as usize]);
            b = &b[n as usize..];
        }
    }

    #[tokio::test]
    async fn small_writes_gather_and_values_go_as_their_own_chunk() {
        let (a, mut b) = tokio::io::duplex(1 << 10);
        let (_rd, mut wr) = tokio::io::split(a);
        let value: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let reader = tokio::spawn(async move {
            let mut all = Vec::new();
            b.read_to_end(&mut all).await.unwrap();
            all
        });
        let mut send = BulkSend::new(&mut wr, "tcp");
        send.write_all(b"frame").await.unwrap();
        send.write_all(b"-more").await.unwrap();
        send.write_owned(Bytes::from(value.clone())).await.unwrap();
        send.write_all(b"tail").await.unwrap();
        send.finish();
        assert!(!send.broken());
        let (end, code) = send.outcome();
        send.end(end, code).await.unwrap();
        wr.shutdown().await.unwrap();
        drop(wr);
        let wire = reader.await.unwrap();
        // Three chunks: the gathered frame, the value on its own, the tail.
        assert_eq!(u32::from_le_bytes(wire[..4].try_into().unwrap()), 10);
        assert_eq!(u32::from_le_bytes(wire[14..18].try_into().unwrap()), 300_000);
        let (body, end, code) = unchunk(&wire);
        let mut want = b"frame-more".to_vec();
        want.extend_from_slice(&value);
        want.extend_from_slice(b"tail");
        assert_eq!((body, end, code), (want, 0, 0));
    }

    #[tokio::test]
    async fn a_flush_sends_what_is_gathered_as_a_chunk() {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let (_rd, mut wr) = tokio::io::split(a);
        let mut send = BulkSend::new(&mut wr, "tcp");
        send.write_all(b"head").await.unwrap();
        send.flush().await.unwrap();
        // On the wire now, before the answer goes on: a chunk of its own.
        let mut first = [0u8; 8];
        b.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"\x04\0\0\0head");
        send.write_all(b"rest").await.unwrap();
        send.end(0, 0).await.unwrap();
        let mut wire = vec![0u8; 8 + 9];
        b.read_exact(&mut wire).await.unwrap();
        assert_eq!(unchunk(&wire), (b"rest".to_vec(), 0, 0));
    }

    #[tokio::test]
    async fn a_reset_answer_says_so_and_a_request_ends_at_its_envelope() {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let (mut rd, mut wr) = tokio::io::split(a);
        let mut send = BulkSend::new(&mut wr, "tcp");
        send.write_all(b"partial").await.unwrap();
        send.reset(7);
        let (end, code) = send.outcome();
        send.end(end, code).await.unwrap();
        let mut wire = vec![0u8; 4 + 7 + 9];
        b.read_exact(&mut wire).await.unwrap();
        assert_eq!(unchunk(&wire), (b"partial".to_vec(), 1, 7));

        b.write_all(b"abcdefNEXT").await.unwrap();
        let mut recv = BulkRecv { inner: &mut rd, left: 6, transport: "tcp" };
        let mut got = Vec::new();
        recv.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"abcdef", "the next envelope's bytes are not this request's");
    }
}
