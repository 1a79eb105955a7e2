//! The TCP bulk channel's byte streams (PROTOCOL.md 11.10), shared by the server and the client:
//! plaintext TCP, or TLS 1.3 whose records this module reads and writes itself once rustls has
//! done the handshake.
//!
//! # Why a record layer of our own
//! Through rustls's buffered connection every received byte was copied three times in user
//! space (a read buffer under rustls, rustls's plaintext queue, the read out), and every record
//! sent was a heap buffer of its own. rustls's unbuffered API decrypts in place but leaves each
//! record's plaintext between its 5-byte header and its 17-byte trailer, so joining a value is a
//! copy again; kTLS, which would decrypt in the kernel's copy, is not on every kernel (not on
//! this project's machines). So after the handshake the channel takes the traffic keys from
//! rustls (`enable_secret_extraction`, the way kTLS integrations do) and does RFC 8446 section 5
//! itself, with the AEAD of the same crypto provider (`ring`):
//! - [`RecordReader::fill`] reads a value's records with one vectored read per batch: each
//!   record's payload straight into its final place in the destination (a DRAM block, a
//!   caller's buffer), its header and trailer beside it, and decrypts it there. No user-space
//!   copy; the kernel's receive copy is the only one. Records that do not fit that plan (the
//!   last bytes of a value, small frames, a peer that cuts records differently) are read into
//!   a small buffer and copied out: correct for any TLS 1.3 peer, only slower.
//! - [`RecordWriter`] seals records of 16 KiB into one buffer and writes a batch of them with
//!   one system call; the last few bytes of what it is given (a value's tail record, the end
//!   of an answer) join the batch before them rather than take a write of their own. A value
//!   starts a record of its own, and its last record is cut one byte short ([`TAIL`]) so that
//!   the receiver has room for the inner content type after every record it decrypts in place.
//!
//! What the layer keeps of TLS: sequence numbers and nonces, the inner content type and its
//! padding, alerts (`close_notify` ends the stream, any other alert is an error), session
//! tickets (passed over; the server sends none on the channel), and key updates (RFC 8446
//! 4.6.3), both ways:
//! - A peer's `KeyUpdate` switches the reader to the peer's next keys from the next record on
//!   (`application_traffic_secret_N+1`, its key and IV, sequence number 0). One with
//!   `update_requested` is passed to the writer through the `keys::Link` the halves share
//!   (atomics, no lock): before its next records the writer sends a `KeyUpdate` of its own
//!   (`update_not_requested`) and seals everything after it under its next keys.
//! - A writer whose key has sealed [`UPDATE_AFTER`] records updates its keys the same way, so
//!   a connection never nears AES-GCM's limit on records under one key; a key that reaches
//!   2^24 records all the same fails ([`RecordError::Worn`]) rather than reuse a nonce.
//!
//! The next keys come from the traffic secrets, which rustls's buffered connections do not
//! hand over: each connection's config logs them to a [`SecretLog`] of its own (`secrets.rs`).
//!
//! When the reader gives up on what the peer sent ([`RecordError::alert`]: `bad_record_mac`,
//! `decode_error`, `unexpected_message`, `record_overflow`), the writer sends that fatal alert,
//! encrypted, before the connection closes ([`BulkWrite::poll_alert`]): best effort, a failed
//! write ignored. The server waits for it at most [`ALERT_WAIT`] as a connection ends
//! ([`send_alert`]); the client tries one write that does not wait as it drops a connection
//! ([`try_alert`]).

mod keys;
mod layout;
mod plain;
mod read;
mod secrets;
mod write;

#[cfg(test)]
mod tests;

pub use keys::RecordError;
pub use read::RecordReader;
pub use secrets::SecretLog;
pub use write::RecordWriter;

use std::future::Future;
use std::io::{self, IoSliceMut};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Largest plaintext of one record (RFC 8446 5.1).
pub const MAX_PLAINTEXT: usize = 16_384;
/// Value bytes a writer leaves for a value's last record (see the module docs).
pub const TAIL: usize = 1;
/// A writer whose key has sealed this many records updates its keys: far below AES-GCM's limit
/// of 2^24.5 records under one key (RFC 8446 5.5).
pub const UPDATE_AFTER: u64 = 1 << 23;
/// How long [`send_alert`] waits for the alert to be written.
pub const ALERT_WAIT: Duration = Duration::from_millis(250);

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Something to send: bytes a writer may gather with others, or a value's bytes (TLS: records
/// of their own, cut for in-place decryption at the other end; plaintext: from where they are).
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    Small(&'a [u8]),
    Value(&'a [u8]),
}

impl Piece<'_> {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Piece::Small(b) | Piece::Value(b) => b,
        }
    }
}

/// How far a writer got through a list of pieces: the piece, and the bytes of it taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    pub piece: usize,
    pub offset: usize,
}

impl Cursor {
    /// Nothing taken yet.
    pub fn at_start(&self) -> bool {
        *self == Cursor::default()
    }
}

/// The receiving half of a bulk connection.
pub trait BulkRead: AsyncRead + Unpin + Send {
    /// Fill all of `dst` with the next bytes of the stream; `landed` sees each part once it is
    /// final, in order (to hash it while it is in cache). An error leaves the stream unusable.
    fn fill<'a>(
        &'a mut self,
        dst: &'a mut [u8],
        landed: &'a mut (dyn FnMut(&[u8]) + Send),
    ) -> BoxFuture<'a, io::Result<()>>;

    /// True when nothing is buffered and the peer has sent nothing, not even its end: an idle
    /// connection that may carry the next request.
    fn idle(&mut self) -> bool;
}

/// The sending half of a bulk connection.
pub trait BulkWrite: AsyncWrite + Unpin + Send {
    /// Take `pieces` from `at` on, advancing it; `Ready(Ok)` once every piece is taken (a TLS
    /// writer may still hold up to a batch of records: flush to send them).
    fn poll_send(&mut self, cx: &mut Context<'_>, pieces: &[Piece<'_>], at: &mut Cursor) -> Poll<io::Result<()>>;

    /// After the receiving half failed on the peer's input: send the fatal alert that calls
    /// for (TLS), after what is already sealed; `Ready(Ok)` at once when there is none (and
    /// always in plaintext).
    fn poll_alert(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let _ = cx;
        Poll::Ready(Ok(()))
    }
}

/// Before closing a connection: the fatal alert its reader's failure calls for, if any, within
/// [`ALERT_WAIT`]; a write that fails or takes longer is given up.
pub async fn send_alert<W: BulkWrite + ?Sized>(w: &mut W) {
    let _ = tokio::time::timeout(ALERT_WAIT, std::future::poll_fn(|cx| w.poll_alert(cx))).await;
}

/// As [`send_alert`] where nothing may wait (a `Drop`): one try, on a socket one write that
/// does not block.
pub fn try_alert<W: BulkWrite + ?Sized>(w: &mut W) {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let _ = w.poll_alert(&mut cx);
}

/// Fill `dst` from `r` and return the xxh3-64 of its bytes, hashed piece by piece as they land
/// (pieces small enough to be hashed from L2) rather than in a second pass: the value reads of
/// QUIC streams on both ends. A stream that ends first is `UnexpectedEof`, naming the bytes
/// missing.
pub async fn read_hashed<R: AsyncRead + Unpin + ?Sized>(r: &mut R, dst: &mut [u8]) -> io::Result<u64> {
    use tokio::io::AsyncReadExt;
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    let mut filled = 0;
    while filled < dst.len() {
        let end = dst.len().min(filled + (128 << 10));
        match r.read(&mut dst[filled..end]).await? {
            0 => {
                let missing = dst.len() - filled;
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("stream ended early, {missing} bytes short of a declared value size"),
                ));
            }
            n => {
                h.update(&dst[filled..filled + n]);
                filled += n;
            }
        }
    }
    Ok(h.digest())
}

/// Take every piece and send it all.
pub async fn send_all<W: BulkWrite + ?Sized>(w: &mut W, pieces: &[Piece<'_>]) -> io::Result<()> {
    let mut at = Cursor::default();
    std::future::poll_fn(|cx| w.poll_send(cx, pieces, &mut at)).await?;
    tokio::io::AsyncWriteExt::flush(w).await
}

/// A socket's receiving half that can read into several buffers at once (`readv`); anything
/// else reads into the first non-empty one.
pub trait ReadV: AsyncRead + Unpin + Send {
    fn poll_read_vectored(&mut self, cx: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let Some(first) = bufs.iter_mut().find(|b| !b.is_empty()) else { return Poll::Ready(Ok(0)) };
        let mut rb = ReadBuf::new(first);
        ready!(Pin::new(self).poll_read(cx, &mut rb))?;
        Poll::Ready(Ok(rb.filled().len()))
    }

    /// Peek whether the peer sent anything (or its end); `Pending` when nothing is there.
    fn poll_any(&mut self, cx: &mut Context<'_>) -> Poll<()>;
}

impl ReadV for tokio::net::tcp::OwnedReadHalf {
    fn poll_read_vectored(&mut self, cx: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let tcp: &tokio::net::TcpStream = self.as_ref();
        loop {
            ready!(tcp.poll_read_ready(cx))?;
            // A would-block clears the readiness, so the next poll waits for data.
            match tcp.try_read_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    fn poll_any(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut b = [0u8; 1];
        let mut rb = ReadBuf::new(&mut b);
        self.poll_peek(cx, &mut rb).map(|_| ())
    }
}

impl<T: AsyncRead + Send> ReadV for tokio::io::ReadHalf<T> {
    fn poll_any(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // No peek on a generic stream: only in tests and the fuzz driver, whose connections
        // are never kept idle.
        let _ = cx;
        Poll::Ready(())
    }
}

/// A stream that splits into a [`ReadV`] half and a writing half: TCP without a lock between
/// the halves, anything else (in-memory pipes of tests and the fuzz driver) through tokio's
/// `split`.
pub trait Halves: AsyncRead + AsyncWrite + Unpin + Send + Sized {
    type Rd: ReadV + 'static;
    type Wr: AsyncWrite + Unpin + Send + 'static;
    fn halves(self) -> (Self::Rd, Self::Wr);
}

impl Halves for tokio::net::TcpStream {
    type Rd = tokio::net::tcp::OwnedReadHalf;
    type Wr = tokio::net::tcp::OwnedWriteHalf;
    fn halves(self) -> (Self::Rd, Self::Wr) {
        self.into_split()
    }
}

impl Halves for tokio::io::DuplexStream {
    type Rd = tokio::io::ReadHalf<Self>;
    type Wr = tokio::io::WriteHalf<Self>;
    fn halves(self) -> (Self::Rd, Self::Wr) {
        tokio::io::split(self)
    }
}

/// Both halves of a plaintext connection.
pub fn plain<S: Halves>(stream: S) -> (plain::PlainReader<S::Rd>, plain::PlainWriter<S::Wr>) {
    let (r, w) = stream.halves();
    (plain::PlainReader::new(r), plain::PlainWriter::new(w))
}

/// The two halves of a TLS connection under this layer.
pub type TlsHalves<R, W> = (RecordReader<R>, RecordWriter<W>);

/// Both halves of a TLS connection whose handshake is done, from the traffic keys rustls
/// extracted (`dangerous_extract_secrets`, with nothing buffered in rustls either way) and the
/// secrets behind them that the connection's config logged to `log` ([`SecretLog::server`],
/// [`SecretLog::client`]).
pub fn tls<S: Halves>(
    stream: S,
    secrets: rustls::ExtractedSecrets,
    log: &SecretLog,
) -> Result<TlsHalves<S::Rd, S::Wr>, RecordError> {
    let (r, w) = stream.halves();
    tls_halves(r, w, secrets, log)
}

/// As [`tls`], over halves of any kind (the fuzz driver harms what its half sends).
pub fn tls_halves<R: ReadV, W: AsyncWrite + Unpin>(
    r: R,
    w: W,
    secrets: rustls::ExtractedSecrets,
    log: &SecretLog,
) -> Result<TlsHalves<R, W>, RecordError> {
    let (tx, rx) = keys::Direction::pair(secrets, log)?;
    let link = std::sync::Arc::new(keys::Link::default());
    Ok((RecordReader::linked(r, rx, link.clone()), RecordWriter::linked(w, tx, link)))
}

pub use plain::{PlainReader, PlainWriter};
