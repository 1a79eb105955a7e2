//! Key updates between two of the layer's own ends, the alert a reader's failure sends, and the
//! key derivation against known vectors.

use super::super::keys::Link;
use super::*;
use std::sync::Arc;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// HKDF-Expand-Label's key and IV from an application traffic secret, against the vectors of
/// rustls's key schedule tests (generated with OpenSSL; SHA-256, 16-byte keys). The next
/// secret ("traffic upd") is checked against rustls itself in `rustls.rs`.
#[test]
fn key_and_iv_derive_as_tls_does() {
    for (secret, key, iv) in [
        (
            "c14a6d7976d8102b5a0c9951493fee87dcaff82c24cab214e8be71a8206dbda5",
            "cc9f5f980b5f10306cbad7be98d7572e",
            "b80929e8d02c70f61162ed6b",
        ),
        (
            "2c907738d3f83702d1e4598f4848531d9f9365491b9f7f52c822290d4c232192",
            "0cb29562d8d88f48b02cbfbed7e62bb3",
            "0db28f988586a1b7e4d5c69c",
        ),
    ] {
        let s = Secret::new(ring::hkdf::HKDF_SHA256, &hex(secret)).unwrap();
        let (mut k, mut i) = ([0u8; 16], [0u8; 12]);
        s.expand_label(b"key", &mut k).unwrap();
        s.expand_label(b"iv", &mut i).unwrap();
        assert_eq!((k.to_vec(), i.to_vec()), (hex(key), hex(iv)));
    }
    // The next secret is the suite's hash long, and differs.
    let s = Secret::new(ring::hkdf::HKDF_SHA384, &[3; 48]).unwrap();
    let n = s.next().unwrap();
    assert_eq!(n.bytes().len(), 48);
    assert_ne!(n.bytes(), s.bytes());
    assert!(Secret::new(ring::hkdf::HKDF_SHA384, &[3; 32]).is_err(), "a secret of the wrong length");
}

/// The halves of one end, linked as `tls_halves` links them, reading `input`.
fn end(input: Vec<u8>) -> (RecordReader<Trickle>, RecordWriter<Vec<u8>>) {
    let link = Arc::new(Link::default());
    (
        RecordReader::linked(Trickle::new(input, 40, 5), keys(), link.clone()),
        RecordWriter::linked(Vec::new(), keys(), link),
    )
}

/// A `KeyUpdate` with `update_requested` switches the reader's keys and has the writer of the
/// same end send one of its own before its next data; one without does not.
#[tokio::test]
async fn a_requested_update_reaches_the_writer_and_the_records_read_on() {
    for requested in [true, false] {
        let mut peer = RecordWriter::new(Vec::new(), keys());
        send_all(&mut peer, &[Piece::Small(b"before")]).await.unwrap();
        peer.update_keys(requested).unwrap();
        send_all(&mut peer, &[Piece::Small(b"after"), Piece::Value(&value(70_000, 1))]).await.unwrap();
        // Twice more: the reader takes each, in order.
        peer.update_keys(false).unwrap();
        peer.update_keys(false).unwrap();
        send_all(&mut peer, &[Piece::Small(b"end")]).await.unwrap();

        let (mut rd, mut wr) = end(peer.get_ref().clone());
        let mut got = vec![0u8; 11];
        rd.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"beforeafter");
        let mut v = vec![0u8; 70_000];
        rd.fill(&mut v, &mut |_| {}).await.unwrap();
        assert!(v == value(70_000, 1));
        let mut rest = Vec::new();
        rd.read_to_end(&mut rest).await.unwrap();
        assert_eq!((&rest[..], rd.key_updates()), (&b"end"[..], 3));

        send_all(&mut wr, &[Piece::Small(b"answer")]).await.unwrap();
        assert_eq!(wr.key_updates(), u64::from(requested), "requested {requested}");
        // The peer's reader follows: the answer under our next keys when it asked for them.
        let mut r = RecordReader::new(Trickle::new(wr.get_ref().clone(), 40, 6), keys());
        let mut answer = Vec::new();
        r.read_to_end(&mut answer).await.unwrap();
        assert_eq!((&answer[..], r.key_updates()), (&b"answer"[..], u64::from(requested)));
    }
}

/// Updates between and inside values that one fill reads: records landing in place and
/// through the buffer, each under its key.
#[tokio::test]
async fn values_read_on_across_updates_whatever_the_reads_return() {
    let (a, b) = (value(100_000, 2), value(70_001, 3));
    let mut peer = RecordWriter::new(Vec::new(), keys());
    send_all(&mut peer, &[Piece::Value(&a)]).await.unwrap();
    peer.update_keys(false).unwrap();
    send_all(&mut peer, &[Piece::Value(&b[..30_000])]).await.unwrap();
    peer.update_keys(true).unwrap();
    send_all(&mut peer, &[Piece::Value(&b[30_000..])]).await.unwrap();
    for (max, seed) in [(1, 1), (100, 2), (20_000, 3), (1 << 20, 4)] {
        let mut r = RecordReader::new(Trickle::new(peer.get_ref().clone(), max, seed), keys());
        let mut got = vec![0u8; a.len() + b.len()];
        r.fill(&mut got, &mut |_| {}).await.unwrap();
        assert!(got[..a.len()] == a[..] && got[a.len()..] == b[..], "max {max}");
        assert_eq!(r.key_updates(), 2);
    }
}

/// Data left open when the update is due goes after the `KeyUpdate`, under the next keys.
#[tokio::test]
async fn an_update_seals_what_is_open_after_it() {
    let mut w = RecordWriter::new(Vec::new(), keys());
    tokio::io::AsyncWriteExt::write_all(&mut w, b"open").await.unwrap();
    w.update_keys(false).unwrap();
    tokio::io::AsyncWriteExt::flush(&mut w).await.unwrap();
    assert_eq!(w.records(), 1, "one record under the next key: the open bytes");
    let mut r = RecordReader::new(Trickle::new(w.get_ref().clone(), 40, 6), keys());
    let mut all = Vec::new();
    r.read_to_end(&mut all).await.unwrap();
    assert_eq!((&all[..], r.key_updates()), (&b"open"[..], 1));
}

/// What the peer sees after our reader gave up on its input: the alert, decrypted by a reader
/// of our writer's keys.
async fn alert_after(input: Vec<u8>) -> (RecordError, Option<RecordError>) {
    let (mut rd, mut wr) = end(input);
    // An answer in progress (sealed, not yet written) goes first; what is open is dropped.
    send_all(&mut wr, &[Piece::Small(b"sent")]).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut wr, b"dropped").await.unwrap();
    let mut all = Vec::new();
    let e = match rd.read_to_end(&mut all).await {
        Ok(_) => panic!("read {} bytes without an error", all.len()),
        Err(e) => e,
    };
    let e = *e.into_inner().unwrap().downcast::<RecordError>().unwrap();
    send_alert(&mut wr).await;
    send_alert(&mut wr).await;
    let mut peer = RecordReader::new(Trickle::new(wr.get_ref().clone(), 40, 7), keys());
    let mut got = [0u8; 4];
    peer.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"sent");
    let seen = peer.fill(&mut [0u8; 1], &mut |_| {}).await.err();
    (e, seen)
}

#[tokio::test]
async fn a_reader_that_gives_up_on_the_peer_has_the_writer_send_the_alert() {
    let mut k = keys();
    let good = record(&mut k, b"fine", APPLICATION_DATA, 0);
    let mut flipped = good.clone();
    flipped[HEADER + 1] ^= 1;
    let mut huge = header(MAX_PLAINTEXT + 2 + TAG).to_vec();
    huge.resize(HEADER + MAX_PLAINTEXT + 2 + TAG, 0);
    let mut k = keys();
    let bad_alert = record(&mut k, &[2, 40, 0], ALERT, 0);
    let mut k = keys();
    let ccs = record(&mut k, &[1], 20, 0);
    for (input, sent, alert) in [
        (flipped, "BadRecordMac", 20),
        (huge, "Overflow", 22),
        (bad_alert, "Malformed", 50),
        (ccs, "Unexpected(20)", 10),
    ] {
        let (e, seen) = alert_after(input).await;
        assert!(format!("{e:?}").contains(sent), "{e:?}, wanted {sent}");
        assert_eq!(e.alert(), Some(alert));
        assert!(matches!(seen, Some(RecordError::Alert(d)) if d == alert), "{sent}: the peer saw {seen:?}");
    }
    // No alert for what is not the peer's fault (a stream cut), nor for the peer's own alert.
    let mut k = keys();
    let theirs = record(&mut k, &[2, 40], ALERT, 0);
    for input in [good[..good.len() - 3].to_vec(), theirs] {
        let (mut rd, mut wr) = end(input);
        assert!(rd.read_to_end(&mut Vec::new()).await.is_err());
        send_alert(&mut wr).await;
        assert!(wr.get_ref().is_empty(), "nothing sent");
    }
}
