//! A batch of records planned to land in place: where each byte of the coming stream goes.
//!
//! Record `i` is its 5-byte header, `n_i` bytes of encrypted content, and a 17-byte trailer
//! (the encrypted inner content type and the tag). The plan puts the content straight into the
//! destination, one record after another with no gap, and the headers and trailers into `meta`
//! in stream order (trailer `i` and header `i + 1` are adjacent there, as on the wire), so that
//! one vectored read takes the whole batch. After the last record, `tail` bytes of read-ahead go
//! to the reader's own buffer.

use super::keys::{HEADER, TRAILER};
use super::{MAX_PLAINTEXT, TAIL};
use std::io::IoSliceMut;

/// Content bytes of one batch, at most (one vectored read, then the batch is decrypted and
/// hashed while it is in cache).
pub(super) const BATCH: usize = 256 << 10;
/// A record smaller than this is read into the reader's buffer and copied: landing it in place
/// would save less than the vectored read costs.
pub(super) const DIRECT_MIN: usize = 1024;
/// Bytes read past a value's last planned record: its tail record and whatever small records
/// follow (the next frame), without a read of their own.
pub(super) const READ_AHEAD: usize = 4096;
/// Header and trailer bytes of one record.
pub(super) const META: usize = HEADER + TRAILER;

/// The content size a writer gives its next record when `left` bytes of a value remain (the
/// writer's rule in `write.rs`): full records, then all but the last [`TAIL`] bytes.
pub(super) fn predict(left: usize) -> usize {
    if left > MAX_PLAINTEXT {
        MAX_PLAINTEXT
    } else {
        left.saturating_sub(TAIL)
    }
}

pub(super) struct Plan {
    /// Content length of each record; record `i`'s content lands right after record `i - 1`'s.
    pub(super) lens: Vec<usize>,
    /// Bytes of read-ahead into the reader's buffer after the last record.
    pub(super) tail: usize,
}

impl Plan {
    /// The records that can land in place in a destination of `room` bytes. `known`: the next
    /// record's ciphertext length when its header is already in hand. `None`: the next record
    /// goes through the reader's buffer.
    ///
    /// A record lands in place only when one byte of the destination follows its content: the
    /// decryption writes the inner content type there (and the byte is put back).
    pub(super) fn new(room: usize, known: Option<usize>) -> Option<Plan> {
        let mut lens = Vec::new();
        let mut at = 0;
        let mut next = match known {
            Some(len) => len - TRAILER,
            None => predict(room),
        };
        while next >= DIRECT_MIN && at + next < room && at + next <= BATCH {
            lens.push(next);
            at += next;
            next = predict(room - at);
        }
        if lens.is_empty() {
            return None;
        }
        // Mid-value the next batch reads the next header itself; at a value's end, read ahead.
        let tail = if next >= DIRECT_MIN && at + next < room { 0 } else { READ_AHEAD };
        Some(Plan { lens, tail })
    }

    /// Bytes of the stream the records take.
    pub(super) fn record_bytes(&self) -> usize {
        self.lens.iter().map(|n| n + META).sum()
    }

    /// Where record `i` starts in the stream.
    pub(super) fn start(&self, i: usize) -> usize {
        self.lens[..i].iter().map(|n| n + META).sum()
    }

    /// Content bytes of the records before `i`: where record `i`'s content lands.
    pub(super) fn landing(&self, i: usize) -> usize {
        self.lens[..i].iter().sum()
    }

    /// The segments of the stream in order: `(Where, length)`.
    fn segments(&self) -> impl Iterator<Item = (Where, usize)> + '_ {
        let k = self.lens.len();
        std::iter::once((Where::Meta, HEADER))
            .chain(self.lens.iter().enumerate().flat_map(move |(i, n)| {
                // Trailer `i`, then the next header, adjacent in `meta` as on the wire.
                let meta = if i + 1 < k { META } else { TRAILER };
                [(Where::Dst, *n), (Where::Meta, meta)]
            }))
            .chain(std::iter::once((Where::Buf, self.tail)))
    }

    /// Slices of `meta`, `dst` and `buf` for the stream bytes from `got` on, in order.
    pub(super) fn iovecs<'a>(
        &self,
        got: usize,
        mut meta: &'a mut [u8],
        mut dst: &'a mut [u8],
        mut buf: &'a mut [u8],
    ) -> Vec<IoSliceMut<'a>> {
        let mut out = Vec::with_capacity(2 * self.lens.len() + 2);
        let mut pos = 0;
        for (w, len) in self.segments() {
            let part = match w {
                Where::Meta => take(&mut meta, len),
                Where::Dst => take(&mut dst, len),
                Where::Buf => take(&mut buf, len),
            };
            let skip = got.saturating_sub(pos);
            pos += len;
            if let Some(rest) = part.get_mut(skip..).filter(|r| !r.is_empty()) {
                out.push(IoSliceMut::new(rest));
            }
        }
        out
    }

    /// Copy `bytes` (read ahead earlier: fewer than the records take) into the stream
    /// positions from the start.
    pub(super) fn place(&self, mut bytes: &[u8], meta: &mut [u8], dst: &mut [u8]) {
        for mut io in self.iovecs(0, meta, dst, &mut []) {
            let n = io.len().min(bytes.len());
            io[..n].copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
        }
        debug_assert!(bytes.is_empty(), "more bytes read ahead than the plan takes");
    }

    /// The stream bytes `from..got`, in order (the plan failed from `from` on).
    pub(super) fn collect(&self, from: usize, got: usize, meta: &[u8], dst: &[u8], buf: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(got - from);
        let (mut pos, mut m, mut d, mut b) = (0, 0, 0, 0);
        for (w, len) in self.segments() {
            let (src, at) = match w {
                Where::Meta => (meta, &mut m),
                Where::Dst => (dst, &mut d),
                Where::Buf => (buf, &mut b),
            };
            let (lo, hi) = (from.max(pos), got.min(pos + len));
            if lo < hi {
                out.extend_from_slice(&src[*at + lo - pos..*at + hi - pos]);
            }
            *at += len;
            pos += len;
        }
        out
    }
}

#[derive(Clone, Copy)]
enum Where {
    Meta,
    Dst,
    Buf,
}

/// The first `n` bytes of `*s` (fewer if it is shorter), leaving the rest in `*s`.
fn take<'a>(s: &mut &'a mut [u8], n: usize) -> &'a mut [u8] {
    let s_len = s.len();
    let (a, b) = std::mem::take(s).split_at_mut(n.min(s_len));
    *s = b;
    a
}
