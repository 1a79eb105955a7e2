//! The halves of a plaintext bulk connection (a trusted network): values read straight into
//! their destination (a value's last piece with what follows it, in one vectored read), pieces
//! sent with one vectored write for as many as the socket takes.

use super::{BoxFuture, BulkRead, BulkWrite, Cursor, Piece, ReadV};
use std::io::{self, IoSlice, IoSliceMut};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read at once for small reads (a frame and its envelope's length together): fewer
/// system calls; a value's first bytes may come through here, the rest land in place.
const SMALL_READS: usize = 4096;
/// A value is read in pieces of at most this many bytes, each handed to `landed` while it is
/// in cache.
const PIECE: usize = 256 << 10;
/// Slices per vectored write.
const IOV: usize = 64;
/// Bytes read past a value's end in the read that takes its last piece: the next chunk's
/// length or the end of an answer (9 bytes), and no more than a few bytes of a next value
/// (copied, where the rest of it lands in place).
const AHEAD: usize = 64;

pub struct PlainReader<R> {
    io: R,
    /// Bytes read ahead: `buf[at..end]` not yet handed out.
    buf: Box<[u8]>,
    at: usize,
    end: usize,
    /// System calls that read from the socket (the test of the read-ahead counts them).
    reads: u64,
}

impl<R: ReadV> PlainReader<R> {
    pub(super) fn new(io: R) -> Self {
        PlainReader { io, buf: vec![0; SMALL_READS].into_boxed_slice(), at: 0, end: 0, reads: 0 }
    }

    /// Reads from the socket so far.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// Read into `dst` and, in the same system call, up to [`AHEAD`] bytes that follow it into
    /// the (empty) buffer: what comes after a value (a chunk header, the end of an answer)
    /// needs no read of its own. Returns the bytes that went to `dst`.
    async fn read_ahead(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        debug_assert_eq!(self.at, self.end);
        let (io, buf) = (&mut self.io, &mut self.buf);
        let n = std::future::poll_fn(|cx| {
            let mut iov = [IoSliceMut::new(dst), IoSliceMut::new(&mut buf[..AHEAD])];
            io.poll_read_vectored(cx, &mut iov)
        })
        .await?;
        self.reads += 1;
        let k = n.min(dst.len());
        self.at = 0;
        self.end = n - k;
        Ok(k)
    }
}

impl<R: ReadV> AsyncRead for PlainReader<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.at == me.end {
            if out.remaining() >= SMALL_READS {
                // Large reads bypass the buffer.
                ready!(Pin::new(&mut me.io).poll_read(cx, out))?;
                me.reads += 1;
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut me.buf);
            ready!(Pin::new(&mut me.io).poll_read(cx, &mut rb))?;
            me.reads += 1;
            me.at = 0;
            me.end = rb.filled().len();
        }
        let n = (me.end - me.at).min(out.remaining());
        out.put_slice(&me.buf[me.at..me.at + n]);
        me.at += n;
        Poll::Ready(Ok(()))
    }
}

impl<R: ReadV + 'static> BulkRead for PlainReader<R> {
    fn fill<'a>(
        &'a mut self,
        dst: &'a mut [u8],
        landed: &'a mut (dyn FnMut(&[u8]) + Send),
    ) -> BoxFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let mut filled = (self.end - self.at).min(dst.len());
            dst[..filled].copy_from_slice(&self.buf[self.at..self.at + filled]);
            self.at += filled;
            if filled > 0 {
                landed(&dst[..filled]);
            }
            while filled < dst.len() {
                let end = dst.len().min(filled + PIECE);
                // The buffer is empty: straight from the socket, and the value's last piece
                // with what follows it.
                let n = if end == dst.len() {
                    self.read_ahead(&mut dst[filled..end]).await?
                } else {
                    self.reads += 1;
                    tokio::io::AsyncReadExt::read(&mut self.io, &mut dst[filled..end]).await?
                };
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the bulk connection ended inside a value",
                    ));
                }
                landed(&dst[filled..filled + n]);
                filled += n;
            }
            Ok(())
        })
    }

    fn idle(&mut self) -> bool {
        if self.at != self.end {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.io.poll_any(&mut cx).is_pending()
    }
}

pub struct PlainWriter<W> {
    io: W,
    writes: u64,
}

impl<W> PlainWriter<W> {
    pub(super) fn new(io: W) -> Self {
        PlainWriter { io, writes: 0 }
    }

    /// Writes handed to the connection so far by [`BulkWrite::poll_send`] (each one system
    /// call on a socket).
    pub fn writes(&self) -> u64 {
        self.writes
    }
}

impl<W: AsyncWrite + Unpin + Send> BulkWrite for PlainWriter<W> {
    fn poll_send(&mut self, cx: &mut Context<'_>, pieces: &[Piece<'_>], at: &mut Cursor) -> Poll<io::Result<()>> {
        loop {
            advance(pieces, at, 0);
            let Some(p) = pieces.get(at.piece) else { return Poll::Ready(Ok(())) };
            let slices: Vec<IoSlice<'_>> = std::iter::once(&p.bytes()[at.offset..])
                .chain(pieces[at.piece + 1..].iter().map(|p| p.bytes()))
                .filter(|b| !b.is_empty())
                .take(IOV)
                .map(IoSlice::new)
                .collect();
            let n = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices))?;
            self.writes += 1;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            advance(pieces, at, n);
        }
    }
}

/// Move `at` forward by `n` bytes, past pieces finished or empty.
fn advance(pieces: &[Piece<'_>], at: &mut Cursor, mut n: usize) {
    while let Some(p) = pieces.get(at.piece) {
        let left = p.bytes().len() - at.offset;
        if n < left {
            at.offset += n;
            return;
        }
        n -= left;
        *at = Cursor { piece: at.piece + 1, offset: 0 };
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for PlainWriter<W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
