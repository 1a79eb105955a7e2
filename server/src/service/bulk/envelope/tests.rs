use super::*;
use kvpool_net::bulk;

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
    let (_rd, mut wr) = bulk::plain(a);
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
    let (_rd, mut wr) = bulk::plain(a);
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
    let (mut rd, mut wr) = bulk::plain(a);
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

#[tokio::test]
async fn a_value_is_hashed_as_it_lands_and_may_not_pass_its_envelope() {
    let (a, mut b) = tokio::io::duplex(1 << 20);
    let (mut rd, _wr) = bulk::plain(a);
    let value: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
    b.write_all(&value).await.unwrap();
    b.write_all(b"NEXT").await.unwrap();
    let mut recv = BulkRecv { inner: &mut rd, left: value.len() as u64 + 2, transport: "tcp" };
    let mut got = vec![0u8; value.len()];
    assert_eq!(recv.read_hashed(&mut got).await.unwrap(), xxhash_rust::xxh3::xxh3_64(&value));
    assert_eq!(got, value);
    // Two bytes are left of the envelope: a value of four runs past it.
    let e = recv.read_hashed(&mut [0u8; 4]).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
}

/// A connection that counts how many times it is handed bytes.
#[derive(Default)]
struct Counting {
    sends: usize,
    wire: Vec<u8>,
}

impl AsyncWrite for Counting {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        self.wire.extend_from_slice(b);
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl BulkWrite for Counting {
    fn poll_send(&mut self, _: &mut Context<'_>, pieces: &[Piece<'_>], at: &mut Cursor) -> Poll<io::Result<()>> {
        self.sends += 1;
        for p in &pieces[at.piece..] {
            self.wire.extend_from_slice(p.bytes());
        }
        *at = Cursor { piece: pieces.len(), offset: 0 };
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn the_chunks_of_small_values_leave_together() {
    let mut c = Counting::default();
    let mut send = BulkSend::new(&mut c, "tcp");
    send.write_all(b"frame").await.unwrap();
    let values: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 64 << 10]).collect();
    for v in &values {
        send.write_owned(Bytes::from(v.clone())).await.unwrap();
    }
    send.finish();
    send.end(0, 0).await.unwrap();
    // 8 x 64 KiB: one hand-over per 256 KiB, the last with the end (before: one more for the
    // end alone).
    assert_eq!(c.sends, 2);
    let (body, end, _) = unchunk(&c.wire);
    assert_eq!((body, end), ([b"frame".to_vec(), values.concat()].concat(), 0));
}

/// An answer of one value of any size is one hand-over: its frame, the value and the end.
#[tokio::test]
async fn the_end_of_an_answer_leaves_with_its_last_value() {
    for size in [64 << 10, 256 << 10, 1 << 20] {
        let mut c = Counting::default();
        let mut send = BulkSend::new(&mut c, "tcp");
        send.write_all(b"frame").await.unwrap();
        let value = vec![7u8; size];
        send.write_owned(Bytes::from(value.clone())).await.unwrap();
        send.finish();
        send.end(0, 0).await.unwrap();
        assert_eq!(c.sends, 1, "{size}");
        let (body, end, _) = unchunk(&c.wire);
        assert_eq!((body, end), ([b"frame".to_vec(), value].concat(), 0));
    }
}
