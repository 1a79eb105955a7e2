//! The record layer against itself over streams cut at random, against tampering and
//! truncation; `updates.rs`: key updates, alerts and the key derivation; `rustls.rs`: against
//! rustls on the other end.

mod rustls;
mod updates;

use super::keys::{header, Direction, RecordError, Suite, ALERT, APPLICATION_DATA, HANDSHAKE, HEADER, TAG};
use super::layout::{Plan, DIRECT_MIN, READ_AHEAD};
use super::secrets::Secret;
use super::*;
use std::io::IoSliceMut;
use tokio::io::AsyncReadExt;

/// The same keys for a writer and a reader.
fn keys() -> Direction {
    let secret = Secret::new(ring::hkdf::HKDF_SHA384, &[7; 48]).unwrap();
    Direction::from_secret(Suite::AES_256_GCM_SHA384, secret).unwrap()
}

/// A tiny deterministic generator (xorshift), enough to cut streams at random.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// A stream that hands out `data` in pieces of 1 to `max` bytes, vectored reads included.
struct Trickle {
    data: Vec<u8>,
    at: usize,
    max: usize,
    rng: Rng,
}

impl Trickle {
    fn new(data: Vec<u8>, max: usize, seed: u64) -> Self {
        Trickle { data, at: 0, max, rng: Rng(seed | 1) }
    }
}

impl AsyncRead for Trickle {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        let n = (1 + me.rng.below(me.max)).min(buf.remaining()).min(me.data.len() - me.at);
        buf.put_slice(&me.data[me.at..me.at + n]);
        me.at += n;
        Poll::Ready(Ok(()))
    }
}

impl ReadV for Trickle {
    fn poll_read_vectored(&mut self, _: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let mut n = (1 + self.rng.below(self.max)).min(self.data.len() - self.at);
        let mut total = 0;
        for b in bufs.iter_mut() {
            let k = b.len().min(n);
            b[..k].copy_from_slice(&self.data[self.at..self.at + k]);
            self.at += k;
            n -= k;
            total += k;
        }
        Poll::Ready(Ok(total))
    }

    fn poll_any(&mut self, _: &mut Context<'_>) -> Poll<()> {
        if self.at < self.data.len() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

fn value(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.below(256) as u8).collect()
}

/// What a writer puts on the wire for `pieces`, and its record sizes (content lengths).
async fn wire(pieces: &[Piece<'_>]) -> (Vec<u8>, Vec<usize>) {
    let mut w = RecordWriter::new(Vec::new(), keys());
    send_all(&mut w, pieces).await.unwrap();
    let out = w.get_ref().clone();
    let mut sizes = Vec::new();
    let mut at = 0;
    while at < out.len() {
        let len = u16::from_be_bytes([out[at + 3], out[at + 4]]) as usize;
        sizes.push(len - 1 - TAG);
        at += HEADER + len;
    }
    (out, sizes)
}

/// A record sealed by hand: `content`, inner type `ty`, `pad` zero bytes of padding.
fn record(keys: &mut Direction, content: &[u8], ty: u8, pad: usize) -> Vec<u8> {
    let mut inner = content.to_vec();
    inner.push(ty);
    inner.resize(inner.len() + pad, 0);
    let h = header(inner.len() + TAG);
    let tag = keys.seal(&h, &mut inner).unwrap();
    let mut r = h.to_vec();
    r.extend_from_slice(&inner);
    r.extend_from_slice(tag.as_ref());
    r
}

const SIZES: [usize; 13] =
    [1, 100, 1023, 1025, 4097, 16383, 16384, 16385, 65536, 65537, 300_000, 1 << 20, (4 << 20) + 3];

#[test]
fn the_writer_cuts_values_the_way_the_reader_plans() {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for len in SIZES {
        let v = value(len, len as u64);
        let (_, sizes) = rt.block_on(wire(&[Piece::Small(b"head"), Piece::Value(&v), Piece::Small(b"next")]));
        // The value's records, then its last byte with what follows.
        let (first, rest) = sizes.split_first().unwrap();
        if len - TAIL < DIRECT_MIN {
            assert_eq!(sizes, vec![4 + len + 4], "{len}: one record");
            continue;
        }
        assert_eq!(*first, 4, "{len}: what precedes a value is a record of its own");
        // The value's last bytes (one, or fewer than a record worth landing in place) travel
        // with what follows.
        let tail = rest.last().unwrap() - 4;
        assert!(tail == TAIL || (tail > TAIL && tail - TAIL < DIRECT_MIN), "{len}: a tail of {tail}");
        let value_records = &rest[..rest.len() - 1];
        assert_eq!(value_records.iter().sum::<usize>() + tail, len);
        // Batch after batch, the reader's plan names the same records, each leaving a byte of
        // room after it.
        let mut room = len;
        let mut i = 0;
        while let Some(plan) = Plan::new(room, None) {
            assert_eq!(plan.lens[..], value_records[i..i + plan.lens.len()], "{len}");
            i += plan.lens.len();
            room -= plan.lens.iter().sum::<usize>();
        }
        assert_eq!(i, value_records.len(), "{len}: every value record lands in place");
        assert_eq!(room, tail);
    }
}

/// Write `values` each behind a 4-byte length, read them back through `max`-byte pieces.
async fn round_trip(values: &[Vec<u8>], max: usize, seed: u64) -> RecordReader<Trickle> {
    let lens: Vec<[u8; 4]> = values.iter().map(|v| (v.len() as u32).to_le_bytes()).collect();
    let mut pieces = Vec::new();
    for (l, v) in lens.iter().zip(values) {
        pieces.push(Piece::Small(l));
        pieces.push(Piece::Value(v));
    }
    let (bytes, _) = wire(&pieces).await;
    let mut r = RecordReader::new(Trickle::new(bytes, max, seed), keys());
    read_values(&mut r, values).await;
    let mut end = [0u8; 1];
    assert_eq!(r.read(&mut end).await.unwrap(), 0);
    r
}

#[tokio::test]
async fn values_land_in_place_whatever_the_reads_return() {
    let values: Vec<Vec<u8>> = SIZES.iter().map(|&n| value(n, n as u64 ^ 5)).collect();
    for (max, seed) in [(1, 1), (7, 2), (5000, 3), (20_000, 4), (70_000, 5), (1 << 22, 6)] {
        let small: Vec<Vec<u8>> = values.iter().filter(|v| v.len() < 70_000 || max > 1).cloned().collect();
        let r = round_trip(&small, max, seed).await;
        // What did not land in place: small values, the read-ahead before a value, its tail.
        let bound: usize = small.iter().map(|v| if v.len() < 2 * DIRECT_MIN { v.len() } else { READ_AHEAD + 64 }).sum();
        assert!(r.copied() as usize <= bound, "max {max}: {} bytes copied, at most {bound}", r.copied());
    }
}

#[tokio::test]
async fn any_cutting_into_records_reads_the_same() {
    // Records as another writer may cut them: at each write, with padding, empty ones.
    let data = value(3 << 20, 77);
    let mut k = keys();
    let mut rng = Rng(3);
    let mut bytes = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let n = [0, 1, 17, 1000, 16_383, 16_384, 9000][rng.below(7)].min(data.len() - at);
        let pad = [0, 0, 0, 1, 200][rng.below(5)].min(MAX_PLAINTEXT - n);
        bytes.extend(record(&mut k, &data[at..at + n], APPLICATION_DATA, pad));
        at += n;
    }
    for (max, seed) in [(3, 9), (4000, 10), (1 << 22, 11)] {
        let mut r = RecordReader::new(Trickle::new(bytes.clone(), max, seed), keys());
        let mut got = vec![0u8; data.len()];
        let mut done = 0;
        while done < data.len() {
            // Reads of every size, values across record boundaries.
            let n = [1, 5, 16_384, 16_385, 100_000, 1 << 20][rng.below(6)].min(data.len() - done);
            if n < 100 {
                r.read_exact(&mut got[done..done + n]).await.unwrap();
            } else {
                r.fill(&mut got[done..done + n], &mut |_| {}).await.unwrap();
            }
            done += n;
        }
        assert!(got == data, "max {max}");
    }
}

#[tokio::test]
async fn tampering_truncation_and_alerts_end_the_stream() {
    let v = value(100_000, 4);
    let (bytes, _) = wire(&[Piece::Small(b"head"), Piece::Value(&v)]).await;
    let len = v.len();
    let read_all = |bytes: Vec<u8>| async move {
        let mut r = RecordReader::new(Trickle::new(bytes, 30_000, 8), keys());
        let mut head = [0u8; 4];
        let mut got = vec![0u8; len];
        let out = match r.read_exact(&mut head).await {
            Ok(_) => r.fill(&mut got, &mut |_| {}).await.map_err(io::Error::from),
            Err(e) => Err(e),
        };
        // Sticky: the stream does not go on after an error.
        if out.is_err() {
            assert!(r.read(&mut head).await.is_err());
        }
        out.map(|()| got)
    };
    assert_eq!(read_all(bytes.clone()).await.unwrap(), v);
    // A flipped bit anywhere (a header, the content, an inner type, a tag) fails the read.
    for at in [0, 3, 4, 5, 30, HEADER + 4 + 1, HEADER + 4 + TAG, bytes.len() / 2, bytes.len() - 1] {
        let mut bad = bytes.clone();
        bad[at] ^= 0x20;
        assert!(read_all(bad).await.is_err(), "a flip at byte {at} went unnoticed");
    }
    // Cut inside a record: truncated; at a record boundary: the stream ends short.
    let e = read_all(bytes[..bytes.len() - 10].to_vec()).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    let e = read_all(bytes[..HEADER + 4 + 1 + TAG].to_vec()).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);

    // close_notify in the middle of a value: what came before it, then the end.
    let mut k = keys();
    let mut s = record(&mut k, b"abc", APPLICATION_DATA, 0);
    s.extend(record(&mut k, &[1, 0], ALERT, 0));
    s.extend(record(&mut k, b"ignored after close_notify", APPLICATION_DATA, 0));
    let mut r = RecordReader::new(Trickle::new(s.clone(), 100, 1), keys());
    let mut all = Vec::new();
    r.read_to_end(&mut all).await.unwrap();
    assert_eq!(all, b"abc");
    let mut r = RecordReader::new(Trickle::new(s, 100, 1), keys());
    let mut dst = vec![0u8; 5000];
    let e = r.fill(&mut dst, &mut |_| {}).await.unwrap_err();
    assert!(matches!(e, RecordError::Ended), "{e}");

    // A KeyUpdate of another body than one byte of 0 or 1, or not at the end of its record, is
    // an error; a session ticket is passed over; any other alert is fatal.
    for (ty, content, want) in [
        (HANDSHAKE, vec![24, 0, 0, 1, 2], "Malformed"),
        (HANDSHAKE, vec![24, 0, 0, 0], "Malformed"),
        (HANDSHAKE, vec![24, 0, 0, 2, 0, 0], "Malformed"),
        (HANDSHAKE, vec![24, 0, 0, 1], "Malformed"),
        (HANDSHAKE, vec![24, 0, 0, 1, 0, 4, 0, 0, 0], "Unexpected(22)"),
        (HANDSHAKE, vec![2, 0, 0, 0], "Unexpected"),
        (ALERT, vec![2, 40], "Alert(40)"),
        (20, vec![1], "Unexpected(20)"),
    ] {
        let mut k = keys();
        let mut s = record(&mut k, &[4, 0, 0, 2, 9, 9], HANDSHAKE, 0);
        s.extend(record(&mut k, b"data", APPLICATION_DATA, 0));
        s.extend(record(&mut k, &content, ty, 3));
        let mut r = RecordReader::new(Trickle::new(s, 100, 1), keys());
        let mut d = [0u8; 4];
        r.read_exact(&mut d).await.unwrap();
        assert_eq!(&d, b"data");
        let e = r.fill(&mut [0u8; 10], &mut |_| {}).await.unwrap_err();
        assert!(format!("{e:?}").contains(want), "{e:?}, wanted {want}");
    }
}

#[tokio::test]
async fn a_fill_given_up_inside_a_batch_leaves_the_reader_unusable() {
    let v = value(1 << 20, 6);
    let (bytes, _) = wire(&[Piece::Value(&v)]).await;
    let (mut a, b) = tokio::io::duplex(1 << 22);
    tokio::io::AsyncWriteExt::write_all(&mut a, &bytes[..bytes.len() / 2]).await.unwrap();
    let (rd, _wr) = tokio::io::split(b);
    let mut r = RecordReader::new(rd, keys());
    let mut dst = vec![0u8; v.len()];
    let waited = tokio::time::timeout(std::time::Duration::from_millis(50), r.fill(&mut dst, &mut |_| {})).await;
    assert!(waited.is_err(), "half a value cannot fill it");
    tokio::io::AsyncWriteExt::write_all(&mut a, &bytes[bytes.len() / 2..]).await.unwrap();
    let e = r.fill(&mut dst, &mut |_| {}).await.unwrap_err();
    assert!(matches!(e, RecordError::Io(ref i) if i.to_string().contains("abandoned")), "{e}");
}

/// A writer updates its keys once a key has sealed `UPDATE_AFTER` records (a reader from the
/// same keys reads on), and no key ever seals or opens a record past AES-GCM's limit: the
/// nonce is never reused, the error is typed.
#[tokio::test]
async fn records_under_one_key_are_bounded() {
    let mut k = keys();
    k.seq = UPDATE_AFTER - 1;
    let mut w = RecordWriter::new(Vec::new(), k);
    send_all(&mut w, &[Piece::Small(b"one")]).await.unwrap();
    assert_eq!((w.key_updates(), w.records()), (0, UPDATE_AFTER), "the last record under the first key");
    send_all(&mut w, &[Piece::Value(&[1u8; 100])]).await.unwrap();
    assert_eq!((w.key_updates(), w.records()), (1, 1), "a KeyUpdate, then the value under the next key");
    let mut k = keys();
    k.seq = UPDATE_AFTER - 1;
    let mut r = RecordReader::new(Trickle::new(w.get_ref().clone(), 50, 3), k);
    let mut all = Vec::new();
    r.read_to_end(&mut all).await.unwrap();
    assert!(all.len() == 103 && all.starts_with(b"one") && all[3..].iter().all(|b| *b == 1));
    assert_eq!(r.key_updates(), 1);

    let mut k = keys();
    k.seq = (1 << 24) - 1;
    let h = header(1 + TAG);
    let mut last = [0u8; 1];
    let tag = k.seal(&h, &mut last).expect("the last record under the key");
    assert!(matches!(k.seal(&h, &mut [0u8; 1]), Err(RecordError::Worn(n)) if n == 1 << 24));
    assert!(matches!(k.open(&h, tag.as_ref(), &mut last), Err(RecordError::Worn(_))), "nor opened");
}

/// A stream that hands out all it has to every read: the fewest reads a reader can make.
struct Pipe(Vec<u8>, usize);

impl AsyncRead for Pipe {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        let n = buf.remaining().min(me.0.len() - me.1);
        buf.put_slice(&me.0[me.1..me.1 + n]);
        me.1 += n;
        Poll::Ready(Ok(()))
    }
}

impl ReadV for Pipe {
    fn poll_read_vectored(&mut self, _: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let mut total = 0;
        for b in bufs.iter_mut() {
            let k = b.len().min(self.0.len() - self.1);
            b[..k].copy_from_slice(&self.0[self.1..self.1 + k]);
            self.1 += k;
            total += k;
        }
        Poll::Ready(Ok(total))
    }

    fn poll_any(&mut self, _: &mut Context<'_>) -> Poll<()> {
        if self.1 < self.0.len() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// Values each behind a 4-byte length, then `tail`: a get's answer on a plaintext connection.
fn chunked(values: &[Vec<u8>], tail: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for v in values {
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        out.extend_from_slice(v);
    }
    out.extend_from_slice(tail);
    out
}

/// Read `values`, each after its 4-byte length, and check what came back and what was hashed.
async fn read_values<R: BulkRead>(r: &mut R, values: &[Vec<u8>]) {
    for v in values {
        let mut l = [0u8; 4];
        r.read_exact(&mut l).await.unwrap();
        assert_eq!(u32::from_le_bytes(l) as usize, v.len());
        let mut got = vec![0u8; v.len()];
        let mut hashed = Vec::new();
        BulkRead::fill(r, &mut got, &mut |b| hashed.extend_from_slice(b)).await.unwrap();
        assert!(got == *v && hashed == *v, "a value of {} bytes came back changed", v.len());
    }
}

/// Read what [`chunked`] wrote; the reader after it.
async fn read_chunked<R: ReadV + 'static>(r: &mut PlainReader<R>, values: &[Vec<u8>], tail: &[u8]) {
    read_values(r, values).await;
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await.unwrap();
    assert_eq!(rest, tail);
}

#[tokio::test]
async fn plaintext_values_read_the_same_whatever_the_reads_return() {
    let values: Vec<Vec<u8>> = SIZES.iter().map(|&n| value(n, n as u64 ^ 3)).collect();
    let bytes = chunked(&values, b"end of the answer");
    for (max, seed) in [(1, 1), (7, 2), (5000, 3), (70_000, 5), (1 << 22, 6)] {
        let small: Vec<Vec<u8>> = values.iter().filter(|v| v.len() < 70_000 || max > 1).cloned().collect();
        let bytes = chunked(&small, b"end of the answer");
        let mut r = PlainReader::new(Trickle::new(bytes, max, seed));
        read_chunked(&mut r, &small, b"end of the answer").await;
    }
    let mut r = PlainReader::new(Pipe(bytes, 0));
    read_chunked(&mut r, &values, b"end of the answer").await;
}

/// What follows a value (the next chunk's length, the end of an answer) comes in the read that
/// takes the value's last bytes: a get of two 64 KiB values is four reads (the last finds the
/// end of the stream), not six.
#[tokio::test]
async fn plaintext_reads_take_what_follows_a_value_with_it() {
    let values = vec![value(65_536, 1), value(65_536, 2)];
    let tail = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0];
    let mut r = PlainReader::new(Pipe(chunked(&values, &tail), 0));
    read_chunked(&mut r, &values, &tail).await;
    // The first length (with the first bytes of the value), each value's rest with what
    // follows it, and the end of the stream. Before: a read of its own for each length and the
    // tail.
    assert_eq!(r.reads(), 4, "reads of a two-value answer");
}

/// A request's last bytes (a value's one-byte tail record, the end of an answer) join the batch
/// before them instead of a write of their own; no write but the last is under a batch.
#[tokio::test]
async fn the_last_bytes_of_a_request_join_the_batch_before_them() {
    for len in [65_536, 262_144, 300_000, 1 << 20, (4 << 20) + 3] {
        let v = value(len, 9);
        let head = [1u8; 100];
        let mut w = RecordWriter::new(Written::default(), keys());
        send_all(&mut w, &[Piece::Small(&head), Piece::Value(&v), Piece::Small(&[2u8; 9])]).await.unwrap();
        let sizes = &w.get_ref().sizes;
        assert_eq!(w.writes() as usize, sizes.len());
        if len <= 300_000 {
            // Before: 256 KiB was a batch, then a write of 32 bytes (the value's last byte
            // and what follows).
            assert_eq!(sizes.len(), 1, "{len}: one write, not {sizes:?}");
        }
        let (last, rest) = sizes.split_last().unwrap();
        assert!(rest.iter().all(|&n| n >= write::BATCH), "{len}: {sizes:?}");
        assert!(rest.is_empty() || *last > MAX_PLAINTEXT, "{len}: a small last write {sizes:?}");
    }
}

/// A connection that takes every write whole and remembers the sizes.
#[derive(Default)]
struct Written {
    sizes: Vec<usize>,
}

impl AsyncWrite for Written {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.sizes.push(buf.len());
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
