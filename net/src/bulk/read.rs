//! The receiving half of a TLS bulk connection: small reads through a buffer of its own, values
//! decrypted where they land ([`RecordReader::fill`]).

use super::keys::{
    self, control, inner, parse_header, Control, Direction, Link, RecordError, APPLICATION_DATA, HEADER, MAX_CIPHERTEXT,
};
use super::layout::{Plan, META, READ_AHEAD};
use super::{BoxFuture, BulkRead, ReadV};
use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, ReadBuf};

/// The reader's own buffer: a whole record and the read-ahead beside it.
const BUFFER: usize = 2 * (HEADER + MAX_CIPHERTEXT) + READ_AHEAD;

pub struct RecordReader<R> {
    io: R,
    keys: Direction,
    /// Shared with the writing half: key updates asked for, the alert to send.
    link: Arc<Link>,
    /// Received bytes: `buf[next..end]` not yet decrypted; `buf[plain]` decrypted content not
    /// yet handed out (it lies before `next`).
    buf: Vec<u8>,
    next: usize,
    end: usize,
    plain: Range<usize>,
    /// Headers and trailers of a batch landing in place.
    meta: Vec<u8>,
    /// The peer closed: `close_notify`, or the end of the stream at a record boundary.
    closed: bool,
    /// Why the stream cannot go on (a read abandoned inside a batch, a bad record): sticky.
    failed: Option<(io::ErrorKind, String)>,
    /// Records decrypted, and content bytes copied out of the buffer (not landed in place).
    records: u64,
    copied: u64,
    /// The peer's key updates so far.
    updates: u64,
}

impl<R: ReadV> RecordReader<R> {
    /// A reader of its own (tests); [`super::tls_halves`] links it to its writer.
    #[cfg(test)]
    pub(super) fn new(io: R, keys: Direction) -> Self {
        Self::linked(io, keys, Arc::default())
    }

    pub(super) fn linked(io: R, keys: Direction, link: Arc<Link>) -> Self {
        RecordReader {
            io,
            keys,
            link,
            buf: vec![0; BUFFER],
            next: 0,
            end: 0,
            plain: 0..0,
            meta: Vec::new(),
            closed: false,
            failed: None,
            records: 0,
            copied: 0,
            updates: 0,
        }
    }

    /// Key updates the peer made so far.
    pub fn key_updates(&self) -> u64 {
        self.updates
    }

    /// Records decrypted so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Bytes copied in user space so far: content handed out of the buffer, and bytes read
    /// ahead that a batch then moved into place. Everything else landed where it was read.
    pub fn copied(&self) -> u64 {
        self.copied
    }

    fn check(&self) -> Result<(), RecordError> {
        match &self.failed {
            None => Ok(()),
            Some((kind, why)) => Err(RecordError::Io(io::Error::new(*kind, why.clone()))),
        }
    }

    /// Remember `e` for every later call (and the alert it calls for, for the writer), and
    /// return it.
    fn fail(&mut self, e: RecordError) -> RecordError {
        self.link.failed(&e);
        let kind = match &e {
            RecordError::Io(i) => i.kind(),
            RecordError::Truncated | RecordError::Ended => io::ErrorKind::UnexpectedEof,
            _ => io::ErrorKind::InvalidData,
        };
        self.failed.get_or_insert((kind, e.to_string()));
        e
    }

    /// The ciphertext length of the next record when its header is buffered.
    fn known(&self) -> Result<Option<usize>, RecordError> {
        let have = &self.buf[self.next..self.end];
        if have.len() < HEADER {
            return Ok(None);
        }
        parse_header(have).map(Some)
    }

    /// Decrypt the next record if it is all buffered: `Ok(false)` when more bytes are needed.
    fn open_buffered(&mut self) -> Result<bool, RecordError> {
        let Some(len) = self.known()? else { return Ok(false) };
        let at = self.next;
        if self.end - at < HEADER + len {
            return Ok(false);
        }
        let (head, body) = self.buf[at..at + HEADER + len].split_at_mut(HEADER);
        let (content, tag) = body.split_at_mut(len - keys::TAG);
        self.keys.open(head, tag, content)?;
        self.records += 1;
        let (n, ty) = inner(content)?;
        self.next = at + HEADER + len;
        let content = at + HEADER..at + HEADER + n;
        if ty == APPLICATION_DATA {
            self.plain = content;
        } else {
            let c = control(ty, &self.buf[content])?;
            self.apply(c)?;
        }
        Ok(true)
    }

    /// Act on a non-data record: the peer's end, or its next keys from the next record on.
    fn apply(&mut self, c: Control) -> Result<(), RecordError> {
        match c {
            Control::None => {}
            Control::Closed => self.closed = true,
            Control::KeyUpdate(requested) => {
                self.keys.update()?;
                self.updates += 1;
                if requested {
                    self.link.request_update();
                }
            }
        }
        Ok(())
    }

    /// Read and decrypt the next record into the buffer (or note the peer's end).
    fn poll_record(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), RecordError>> {
        loop {
            if self.open_buffered()? {
                return Poll::Ready(Ok(()));
            }
            if self.next > 0 {
                // Less than a record is left: move it to the front.
                self.buf.copy_within(self.next..self.end, 0);
                self.end -= self.next;
                self.next = 0;
                self.plain = 0..0;
            }
            // This record and a little more: what follows a frame is often a value, which
            // should land in place rather than here.
            let want = match self.known()? {
                Some(len) => HEADER + len + READ_AHEAD,
                None => HEADER + READ_AHEAD,
            };
            let lim = want.max(self.end + 1).min(self.buf.len());
            let mut rb = ReadBuf::new(&mut self.buf[self.end..lim]);
            ready!(Pin::new(&mut self.io).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                if self.end > 0 {
                    return Poll::Ready(Err(RecordError::Truncated));
                }
                // The end of the stream at a record boundary: the layers above see it and
                // check it against their own framing.
                self.closed = true;
                return Poll::Ready(Ok(()));
            }
            self.end += n;
        }
    }

    /// Fill `dst` from the stream: records landing in place where a batch fits, the rest
    /// through the buffer. Errors are sticky.
    pub async fn fill(&mut self, dst: &mut [u8], landed: &mut (dyn FnMut(&[u8]) + Send)) -> Result<(), RecordError> {
        self.check()?;
        let mut filled = 0;
        while filled < dst.len() {
            if !self.plain.is_empty() {
                let n = self.plain.len().min(dst.len() - filled);
                let from = self.plain.start;
                dst[filled..filled + n].copy_from_slice(&self.buf[from..from + n]);
                landed(&dst[filled..filled + n]);
                self.plain.start += n;
                self.copied += n as u64;
                filled += n;
                continue;
            }
            if self.closed {
                return Err(self.fail(RecordError::Ended));
            }
            let known = self.known().map_err(|e| self.fail(e))?;
            let buffered = self.end - self.next;
            let plan = match known {
                // A record that is all here already is decrypted here and copied.
                Some(len) if buffered >= HEADER + len => None,
                _ => Plan::new(dst.len() - filled, known),
            };
            match plan {
                None => {
                    let r = std::future::poll_fn(|cx| self.poll_record(cx)).await;
                    r.map_err(|e| self.fail(e))?;
                }
                Some(plan) => {
                    // Until the batch is through, the stream is between two records: a caller
                    // that drops this future leaves it unusable.
                    self.failed = Some((io::ErrorKind::InvalidData, RecordError::Abandoned.to_string()));
                    let r = self.land(plan, &mut dst[filled..], landed).await;
                    match r {
                        Ok(n) => {
                            self.failed = None;
                            filled += n;
                        }
                        Err(e) => {
                            self.failed = None;
                            return Err(self.fail(e));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// One batch in place: returns the content bytes landed at the front of `dst`.
    async fn land(
        &mut self,
        plan: Plan,
        dst: &mut [u8],
        landed: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<usize, RecordError> {
        let k = plan.lens.len();
        let records = plan.record_bytes();
        let mut meta = std::mem::take(&mut self.meta);
        meta.clear();
        meta.resize(k * META, 0);
        // What was read ahead comes first (fewer bytes than the first record).
        let mut got = self.end - self.next;
        plan.place(&self.buf[self.next..self.end], &mut meta, dst);
        self.copied += got as u64;
        self.next = 0;
        self.end = 0;
        let mut done = 0;
        let mut filled = 0;
        let mut spill_from = None;
        loop {
            // Every record whose bytes are all here, in order.
            let from = filled;
            while done < k {
                let start = plan.start(done);
                if got < start + HEADER {
                    break;
                }
                let m = &meta[done * META..(done + 1) * META];
                let n = plan.lens[done];
                if parse_header(&m[..HEADER])? != n + keys::TRAILER {
                    // Not the record the plan expected: everything from it on goes through the
                    // buffer.
                    spill_from = Some(start);
                    break;
                }
                if got < start + META + n {
                    break;
                }
                let at = plan.landing(done);
                match self.open_in_place(&m[..HEADER], &m[HEADER..], &mut dst[at..=at + n])? {
                    InPlace::Data => filled += n,
                    InPlace::Short(c) => {
                        filled += c;
                        spill_from = Some(start + META + n);
                    }
                    InPlace::Control => spill_from = Some(start + META + n),
                }
                done += 1;
                if spill_from.is_some() {
                    break;
                }
            }
            if filled > from {
                landed(&dst[from..filled]);
            }
            if spill_from.is_some() || done == k || self.closed {
                break;
            }
            let mut iov = plan.iovecs(got, &mut meta, dst, &mut self.buf[..plan.tail]);
            let io = &mut self.io;
            let n = std::future::poll_fn(|cx| io.poll_read_vectored(cx, &mut iov)).await?;
            drop(iov);
            if n == 0 {
                if got == plan.start(done) {
                    // The peer ended between records: the caller sees the stream short.
                    self.closed = true;
                    break;
                }
                return Err(RecordError::Truncated);
            }
            got += n;
        }
        if let Some(from) = spill_from {
            let rest = plan.collect(from, got, &meta, dst, &self.buf[..plan.tail]);
            if self.buf.len() < rest.len() {
                self.buf.resize(rest.len(), 0);
            }
            self.buf[..rest.len()].copy_from_slice(&rest);
            self.end = rest.len();
        } else {
            self.end = got.saturating_sub(records);
        }
        self.meta = meta;
        Ok(filled)
    }

    /// Decrypt one record whose content sits at `dst[..n]` (`n = dst.len() - 1`), its trailer
    /// in `trailer`: the encrypted content type goes in the byte after the content for the
    /// decryption, and that byte (the next record's) is put back after.
    fn open_in_place(&mut self, head: &[u8], trailer: &[u8], dst: &mut [u8]) -> Result<InPlace, RecordError> {
        let n = dst.len() - 1;
        let saved = dst[n];
        dst[n] = trailer[0];
        let opened = self.keys.open(head, &trailer[1..], dst);
        let ty = dst[n];
        dst[n] = saved;
        opened?;
        self.records += 1;
        if ty == APPLICATION_DATA {
            return Ok(InPlace::Data);
        }
        // Padding, or a record that is not data: its content is shorter than planned.
        let mut inner_plain = dst[..n].to_vec();
        inner_plain.push(ty);
        let (c, ty) = inner(&inner_plain)?;
        if ty == APPLICATION_DATA {
            return Ok(InPlace::Short(c));
        }
        let c = control(ty, &inner_plain[..c])?;
        self.apply(c)?;
        Ok(InPlace::Control)
    }
}

enum InPlace {
    /// All `n` content bytes are data, in place.
    Data,
    /// Data, `c` bytes of it (the rest was padding).
    Short(usize),
    /// Not data (an alert, a ticket, a key update): nothing landed.
    Control,
}

impl<R: ReadV> AsyncRead for RecordReader<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        me.check()?;
        loop {
            if !me.plain.is_empty() {
                let n = me.plain.len().min(out.remaining());
                out.put_slice(&me.buf[me.plain.start..me.plain.start + n]);
                me.plain.start += n;
                me.copied += n as u64;
                return Poll::Ready(Ok(()));
            }
            if me.closed || out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if let Err(e) = ready!(me.poll_record(cx)) {
                return Poll::Ready(Err(me.fail(e).into()));
            }
        }
    }
}

impl<R: ReadV + 'static> BulkRead for RecordReader<R> {
    fn fill<'a>(
        &'a mut self,
        dst: &'a mut [u8],
        landed: &'a mut (dyn FnMut(&[u8]) + Send),
    ) -> BoxFuture<'a, io::Result<()>> {
        Box::pin(async move { RecordReader::fill(self, dst, landed).await.map_err(io::Error::from) })
    }

    fn idle(&mut self) -> bool {
        if self.failed.is_some() || self.closed || !self.plain.is_empty() || self.next != self.end {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.io.poll_any(&mut cx).is_pending()
    }
}
