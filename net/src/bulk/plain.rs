//! The halves of a plaintext bulk connection (a trusted network): values read straight into
//! their destination, pieces sent with one vectored write for as many as the socket takes.

use super::{BoxFuture, BulkRead, BulkWrite, Cursor, Piece, ReadV};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, AsyncWrite, BufReader, ReadBuf};

/// Bytes read at once for small reads (a frame and its envelope's length together): fewer
/// system calls; a value's first bytes may come through here, the rest land in place.
const SMALL_READS: usize = 4096;
/// A value is read in pieces of at most this many bytes, each handed to `landed` while it is
/// in cache.
const PIECE: usize = 256 << 10;
/// Slices per vectored write.
const IOV: usize = 64;

pub struct PlainReader<R> {
    inner: BufReader<R>,
}

impl<R: ReadV> PlainReader<R> {
    pub(super) fn new(io: R) -> Self {
        PlainReader { inner: BufReader::with_capacity(SMALL_READS, io) }
    }
}

impl<R: ReadV> AsyncRead for PlainReader<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<R: ReadV + 'static> BulkRead for PlainReader<R> {
    fn fill<'a>(
        &'a mut self,
        dst: &'a mut [u8],
        landed: &'a mut (dyn FnMut(&[u8]) + Send),
    ) -> BoxFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let have = self.inner.buffer();
            let mut filled = have.len().min(dst.len());
            dst[..filled].copy_from_slice(&have[..filled]);
            Pin::new(&mut self.inner).consume(filled);
            if filled > 0 {
                landed(&dst[..filled]);
            }
            while filled < dst.len() {
                let end = dst.len().min(filled + PIECE);
                // The buffer is empty: straight from the socket.
                let n = self.inner.get_mut().read(&mut dst[filled..end]).await?;
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
        if !self.inner.buffer().is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.inner.get_mut().poll_any(&mut cx).is_pending()
    }
}

pub struct PlainWriter<W> {
    io: W,
}

impl<W> PlainWriter<W> {
    pub(super) fn new(io: W) -> Self {
        PlainWriter { io }
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
