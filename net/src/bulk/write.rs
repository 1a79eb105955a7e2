//! The sending half of a TLS bulk connection: records sealed into one buffer, a batch of them
//! written with one system call.

use super::keys::{header, Direction, Link, RecordError, ALERT, APPLICATION_DATA, HANDSHAKE, HEADER};
use super::layout::{predict, DIRECT_MIN};
use super::{BulkWrite, Cursor, Piece, MAX_PLAINTEXT, UPDATE_AFTER};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::AsyncWrite;

/// Sealed bytes gathered before they are written: one `write` per this many.
pub const BATCH: usize = 256 << 10;
/// The last bytes of what is being sent, up to this many, join the batch before them rather
/// than take a write of their own (a value's one-byte tail record and the end of an answer).
pub(super) const SLACK: usize = BATCH / 4;

pub struct RecordWriter<W> {
    io: W,
    keys: Direction,
    /// Shared with the reading half: key updates the peer asked for, the alert to send.
    link: Arc<Link>,
    /// Sealed records, `out[sent..]` not yet written, then the open record (header space and
    /// plaintext) from `open` on.
    out: Vec<u8>,
    sent: usize,
    open: Option<usize>,
    /// `close_notify` is sealed.
    closing: bool,
    /// A fatal alert is sealed.
    alerted: bool,
    writes: u64,
    updates: u64,
}

impl<W: AsyncWrite + Unpin> RecordWriter<W> {
    /// A writer of its own (tests); [`super::tls_halves`] links it to its reader.
    #[cfg(test)]
    pub(super) fn new(io: W, keys: Direction) -> Self {
        Self::linked(io, keys, Arc::default())
    }

    pub(super) fn linked(io: W, keys: Direction, link: Arc<Link>) -> Self {
        RecordWriter {
            io,
            keys,
            link,
            out: Vec::with_capacity(BATCH + 2 * MAX_PLAINTEXT),
            sent: 0,
            open: None,
            closing: false,
            alerted: false,
            writes: 0,
            updates: 0,
        }
    }

    /// Key updates sent so far.
    pub fn key_updates(&self) -> u64 {
        self.updates
    }

    /// Send a `KeyUpdate` (`update_requested` when `request`) and seal every record after it
    /// under the next keys (RFC 8446 4.6.3); what is open, not yet sealed, goes after it. The
    /// writer does this by itself when the peer asks and before its records under one key
    /// reach [`UPDATE_AFTER`].
    pub fn update_keys(&mut self, request: bool) -> Result<(), RecordError> {
        let open = self.open.take().map(|at| {
            let plain = self.out[at + HEADER..].to_vec();
            self.out.truncate(at);
            plain
        });
        self.open_record();
        self.out.extend_from_slice(&[24, 0, 0, 1, u8::from(request)]);
        self.seal_as(HANDSHAKE)?;
        self.keys.update()?;
        self.updates += 1;
        if let Some(plain) = open {
            self.open_record();
            self.out.extend_from_slice(&plain);
        }
        Ok(())
    }

    /// Before sealing data: the `KeyUpdate` the peer asked for, or one of our own when the
    /// key has sealed its share. (An atomic load; the swap only when asked.)
    fn keep_keys(&mut self) -> Result<(), RecordError> {
        if self.link.take_update() || self.keys.seq >= UPDATE_AFTER {
            self.update_keys(false)?;
        }
        Ok(())
    }

    /// After the reading half failed on the peer's records: the fatal alert that calls for,
    /// sealed after what is sealed (what is open is dropped), and written. `Ready(Ok)` at once
    /// when there is none.
    pub fn poll_alert(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.alerted {
            let Some(d) = self.link.take_alert() else { return Poll::Ready(Ok(())) };
            if let Some(at) = self.open.take() {
                self.out.truncate(at);
            }
            self.open_record();
            self.out.extend_from_slice(&[2, d]);
            self.seal_as(ALERT)?;
            self.alerted = true;
        }
        ready!(self.poll_out(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Records sealed so far under this key.
    pub fn records(&self) -> u64 {
        self.keys.seq
    }

    /// Writes handed to the connection so far (each one system call on a socket that takes
    /// it whole).
    pub fn writes(&self) -> u64 {
        self.writes
    }

    pub fn get_ref(&self) -> &W {
        &self.io
    }

    /// Seal one record of inner content type `ty` holding `content` and `padding` zero bytes,
    /// after what is open: any record a TLS 1.3 peer may send, for the fuzz driver and the
    /// tests (the channel itself sends only data and `close_notify`).
    pub fn seal_record(&mut self, ty: u8, content: &[u8], padding: usize) -> Result<(), RecordError> {
        self.seal()?;
        let at = self.open_record();
        self.out.extend_from_slice(content);
        self.out.push(ty);
        self.out.resize(self.out.len() + padding.min(MAX_PLAINTEXT - content.len().min(MAX_PLAINTEXT)), 0);
        // The inner type and padding are in place: seal the bytes as they are.
        self.open = None;
        let n = self.out.len() - at - HEADER;
        let h = header(n + super::keys::TAG);
        self.out[at..at + HEADER].copy_from_slice(&h);
        let tag = self.keys.seal(&h, &mut self.out[at + HEADER..])?;
        self.out.extend_from_slice(tag.as_ref());
        Ok(())
    }

    fn sealed_end(&self) -> usize {
        self.open.unwrap_or(self.out.len())
    }

    /// Sealed bytes not yet written.
    fn pending(&self) -> usize {
        self.sealed_end() - self.sent
    }

    /// Start a record unless one is open.
    fn open_record(&mut self) -> usize {
        *self.open.get_or_insert_with(|| {
            let at = self.out.len();
            self.out.extend_from_slice(&[0; HEADER]);
            at
        })
    }

    /// Seal the open record (an empty one is dropped), its inner content type `ty`.
    fn seal_as(&mut self, ty: u8) -> Result<(), RecordError> {
        let Some(at) = self.open.take() else { return Ok(()) };
        let n = self.out.len() - at - HEADER;
        if n == 0 && ty == APPLICATION_DATA {
            self.out.truncate(at);
            return Ok(());
        }
        self.out.push(ty);
        let h = header(n + 1 + super::keys::TAG);
        self.out[at..at + HEADER].copy_from_slice(&h);
        let tag = self.keys.seal(&h, &mut self.out[at + HEADER..])?;
        self.out.extend_from_slice(tag.as_ref());
        Ok(())
    }

    fn seal(&mut self) -> Result<(), RecordError> {
        self.seal_as(APPLICATION_DATA)
    }

    /// Plaintext into the open record, sealing it each time it is full.
    fn push(&mut self, mut data: &[u8]) -> Result<(), RecordError> {
        while !data.is_empty() {
            let at = self.open_record();
            let room = MAX_PLAINTEXT - (self.out.len() - at - HEADER);
            let k = room.min(data.len());
            self.out.extend_from_slice(&data[..k]);
            data = &data[k..];
            if k == room {
                self.seal()?;
            }
        }
        Ok(())
    }

    /// The rest of a value (`data`: every byte of it left) in records of its own, cut the way
    /// the receiver plans ([`predict`]), as long as the batch has room; its last [`TAIL`]
    /// bytes (or all of a small value) go into an open record that what follows joins.
    /// Returns the bytes taken; it stops once `limit` sealed bytes wait.
    ///
    /// [`TAIL`]: super::TAIL
    fn push_value(&mut self, data: &[u8], limit: usize) -> Result<usize, RecordError> {
        let mut taken = 0;
        while taken < data.len() && self.pending() < limit {
            let n = predict(data.len() - taken);
            if n < DIRECT_MIN {
                self.push(&data[taken..])?;
                return Ok(data.len());
            }
            // The value's records start at a record boundary.
            self.seal()?;
            self.open_record();
            self.out.extend_from_slice(&data[taken..taken + n]);
            self.seal()?;
            taken += n;
        }
        Ok(taken)
    }

    /// Write the sealed records.
    fn poll_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let end = self.sealed_end();
        while self.sent < end {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.sent..end]))?;
            self.writes += 1;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        // The open record (at most one record's plaintext) moves to the front.
        self.out.drain(..end);
        self.open = self.open.map(|o| o - end);
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin + Send> BulkWrite for RecordWriter<W> {
    fn poll_send(&mut self, cx: &mut Context<'_>, pieces: &[Piece<'_>], at: &mut Cursor) -> Poll<io::Result<()>> {
        loop {
            self.keep_keys().map_err(io::Error::from)?;
            let left: usize =
                pieces.iter().skip(at.piece).map(|p| p.bytes().len()).sum::<usize>().saturating_sub(at.offset);
            let limit = if left <= SLACK { usize::MAX } else { BATCH };
            if self.pending() >= limit {
                ready!(self.poll_out(cx))?;
            }
            let Some(p) = pieces.get(at.piece) else { return Poll::Ready(Ok(())) };
            let rest = &p.bytes()[at.offset..];
            let n = match p {
                Piece::Small(_) => self.push(rest).map(|()| rest.len()),
                Piece::Value(_) => self.push_value(rest, limit),
            }
            .map_err(io::Error::from)?;
            at.offset += n;
            if at.offset == p.bytes().len() {
                *at = Cursor { piece: at.piece + 1, offset: 0 };
            }
        }
    }

    fn poll_alert(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        RecordWriter::poll_alert(self, cx)
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for RecordWriter<W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        if me.pending() >= BATCH {
            ready!(me.poll_out(cx))?;
        }
        me.keep_keys()?;
        let take = buf.len().min(BATCH);
        me.push(&buf[..take])?;
        Poll::Ready(Ok(take))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        me.keep_keys()?;
        me.seal()?;
        ready!(me.poll_out(cx))?;
        Pin::new(&mut me.io).poll_flush(cx)
    }

    /// `close_notify`, then the end of the stream.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if !me.closing {
            me.seal()?;
            me.open_record();
            me.out.extend_from_slice(&[1, 0]);
            me.seal_as(ALERT)?;
            me.closing = true;
        }
        ready!(me.poll_out(cx))?;
        Pin::new(&mut me.io).poll_shutdown(cx)
    }
}
