//! One direction's AEAD key, IV and sequence number (RFC 8446 5.3), and the layer's errors.

use super::secrets::{Secret, SecretLog};
use ring::aead::{self, Aad, LessSafeKey, Nonce, Tag, UnboundKey};
use ring::hkdf::{self, KeyType as _};
use rustls::ConnectionTrafficSecrets;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Bytes of a record header: content type, legacy version, length.
pub(super) const HEADER: usize = 5;
/// Bytes of the AEAD tag of every suite the layer takes.
pub(super) const TAG: usize = 16;
/// What follows a record's content when it has no padding: the inner content type and the tag.
pub(super) const TRAILER: usize = 1 + TAG;
/// Largest `TLSCiphertext.length` (RFC 8446 5.2).
pub(super) const MAX_CIPHERTEXT: usize = super::MAX_PLAINTEXT + 256;
/// Every record after the handshake says `application_data` outside (its true type is inside).
pub(super) const APPLICATION_DATA: u8 = 23;
pub(super) const ALERT: u8 = 21;
pub(super) const HANDSHAKE: u8 = 22;
/// A connection that has used this many records under one key fails rather than go on.
const HARD_LIMIT: u64 = 1 << 24;

/// Why the record layer gave up on a connection; every one closes it. Those that are the
/// peer's fault ([`RecordError::alert`]) send the matching fatal alert first.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("malformed TLS record or message: {0} (decode_error)")]
    Malformed(&'static str),
    #[error("a TLS record failed its authentication (bad_record_mac)")]
    BadRecordMac,
    #[error("a TLS record of {0} bytes, over the limit of its kind (record_overflow)")]
    Overflow(usize),
    #[error("unexpected TLS message after the handshake (content type {0}) (unexpected_message)")]
    Unexpected(u8),
    #[error("the peer sent the fatal TLS alert {0}")]
    Alert(u8),
    #[error("the connection ended inside a TLS record")]
    Truncated,
    #[error("the stream ended before the bytes asked for")]
    Ended,
    #[error("{0} records under one key, the limit (a peer must update its keys before): the connection cannot go on")]
    Worn(u64),
    #[error("a read was abandoned inside a TLS record: the stream cannot go on")]
    Abandoned,
    #[error("the bulk channel's record layer takes TLS 1.3 with AES-GCM or ChaCha20-Poly1305, not {0}")]
    Unsupported(&'static str),
    #[error("the TLS traffic secrets: {0}")]
    Secrets(&'static str),
    #[error("bulk channel I/O: {0}")]
    Io(#[from] io::Error),
}

impl RecordError {
    /// The fatal alert this error sends the peer before the connection closes (RFC 8446 6.2):
    /// only for what the peer sent wrong.
    pub fn alert(&self) -> Option<u8> {
        match self {
            RecordError::Unexpected(_) => Some(UNEXPECTED_MESSAGE),
            RecordError::BadRecordMac => Some(BAD_RECORD_MAC),
            RecordError::Overflow(_) => Some(RECORD_OVERFLOW),
            RecordError::Malformed(_) => Some(DECODE_ERROR),
            _ => None,
        }
    }
}

/// Alert descriptions the layer sends (RFC 8446 6).
pub(super) const UNEXPECTED_MESSAGE: u8 = 10;
pub(super) const BAD_RECORD_MAC: u8 = 20;
pub(super) const RECORD_OVERFLOW: u8 = 22;
pub(super) const DECODE_ERROR: u8 = 50;

impl From<RecordError> for io::Error {
    fn from(e: RecordError) -> io::Error {
        let kind = match &e {
            RecordError::Io(inner) => return io::Error::new(inner.kind(), e),
            RecordError::Truncated | RecordError::Ended => io::ErrorKind::UnexpectedEof,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// The AEAD and the hash of a TLS 1.3 cipher suite.
#[derive(Clone, Copy)]
pub(super) struct Suite {
    aead: &'static aead::Algorithm,
    hash: hkdf::Algorithm,
}

impl Suite {
    pub(super) const AES_128_GCM_SHA256: Suite = Suite { aead: &aead::AES_128_GCM, hash: hkdf::HKDF_SHA256 };
    pub(super) const AES_256_GCM_SHA384: Suite = Suite { aead: &aead::AES_256_GCM, hash: hkdf::HKDF_SHA384 };
    pub(super) const CHACHA20_POLY1305_SHA256: Suite =
        Suite { aead: &aead::CHACHA20_POLY1305, hash: hkdf::HKDF_SHA256 };
}

/// The keys of one direction of a connection, and the traffic secret they come from.
pub(super) struct Direction {
    key: LessSafeKey,
    iv: [u8; 12],
    /// Records under this key so far: the next record's sequence number.
    pub(super) seq: u64,
    suite: Suite,
    secret: Secret,
}

impl Direction {
    /// (transmit, receive) from rustls's extracted keys and the secrets `log` caught: each
    /// direction takes the secret whose key and IV are the ones rustls extracted.
    pub(super) fn pair(s: rustls::ExtractedSecrets, log: &SecretLog) -> Result<(Direction, Direction), RecordError> {
        let (client, server) = log.take();
        let mut caught: Vec<Vec<u8>> = client.into_iter().chain(server).collect();
        let (tx_seq, tx) = s.tx;
        let (rx_seq, rx) = s.rx;
        let pair = (Direction::matching(tx, tx_seq, &caught), Direction::matching(rx, rx_seq, &caught));
        for c in &mut caught {
            c.fill(0);
        }
        Ok((pair.0?, pair.1?))
    }

    /// The direction of the extracted `keys` from whichever of `caught` derives them.
    fn matching(keys: ConnectionTrafficSecrets, seq: u64, caught: &[Vec<u8>]) -> Result<Direction, RecordError> {
        let (suite, key, iv) = match &keys {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (Suite::AES_128_GCM_SHA256, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (Suite::AES_256_GCM_SHA384, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (Suite::CHACHA20_POLY1305_SHA256, key, iv),
            _ => return Err(RecordError::Unsupported("this cipher suite")),
        };
        for c in caught.iter().filter(|c| c.len() == suite.hash.len()) {
            let secret = Secret::new(suite.hash, c)?;
            let (k, i) = derive(suite, &secret)?;
            if k[..suite.aead.key_len()] == *key.as_ref() && i == *iv.as_ref() {
                let mut d = Direction::from_secret(suite, secret)?;
                d.seq = seq;
                return Ok(d);
            }
        }
        Err(RecordError::Secrets(
            "rustls did not log the secret behind its keys (is the config's key_log the SecretLog?)",
        ))
    }

    /// Keys from an application traffic secret, sequence number 0.
    pub(super) fn from_secret(suite: Suite, secret: Secret) -> Result<Direction, RecordError> {
        let (key, iv) = derive(suite, &secret)?;
        let key = UnboundKey::new(suite.aead, &key[..suite.aead.key_len()])
            .map_err(|_| RecordError::Unsupported("this key length"))?;
        Ok(Direction { key: LessSafeKey::new(key), iv, seq: 0, suite, secret })
    }

    /// The next keys (RFC 8446 7.2): `application_traffic_secret_N+1`, its key and IV, and
    /// sequence number 0.
    pub(super) fn update(&mut self) -> Result<(), RecordError> {
        *self = Direction::from_secret(self.suite, self.secret.next()?)?;
        Ok(())
    }

    /// The per-record nonce: the IV XORed with the sequence number (RFC 8446 5.3).
    fn nonce(&mut self) -> Result<Nonce, RecordError> {
        if self.seq >= HARD_LIMIT {
            return Err(RecordError::Worn(self.seq));
        }
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Decrypt `in_out` (the record's encrypted content and inner type) in place.
    pub(super) fn open(&mut self, header: &[u8], tag: &[u8], in_out: &mut [u8]) -> Result<(), RecordError> {
        let nonce = self.nonce()?;
        let tag = Tag::try_from(tag).map_err(|_| RecordError::Malformed("short tag"))?;
        self.key
            .open_in_place_separate_tag(nonce, Aad::from(header), tag, in_out, 0..)
            .map(|_| ())
            .map_err(|_| RecordError::BadRecordMac)
    }

    /// Encrypt `in_out` (content and inner type) in place; the tag to append.
    pub(super) fn seal(&mut self, header: &[u8], in_out: &mut [u8]) -> Result<Tag, RecordError> {
        let nonce = self.nonce()?;
        self.key
            .seal_in_place_separate_tag(nonce, Aad::from(header), in_out)
            .map_err(|_| RecordError::Malformed("seal"))
    }
}

/// A traffic secret's key (the first `key_len` bytes of the 32) and IV (RFC 8446 7.3).
fn derive(suite: Suite, secret: &Secret) -> Result<([u8; 32], [u8; 12]), RecordError> {
    let (mut key, mut iv) = ([0u8; 32], [0u8; 12]);
    secret.expand_label(b"key", &mut key[..suite.aead.key_len()])?;
    secret.expand_label(b"iv", &mut iv)?;
    Ok((key, iv))
}

/// What the reading half tells the writing half of the same connection (each is owned by its
/// own task): set by the reader, taken by the writer, atomics rather than a lock.
#[derive(Debug, Default)]
pub(super) struct Link {
    /// The peer sent `KeyUpdate(update_requested)`: the writer sends a `KeyUpdate` of its own
    /// before its next records (several requests while it is silent ask for one).
    update_requested: AtomicBool,
    /// The fatal alert the writer sends before the connection closes; 0 none (`close_notify`
    /// is never one).
    alert: AtomicU8,
}

impl Link {
    pub(super) fn request_update(&self) {
        self.update_requested.store(true, Ordering::Release);
    }

    /// Whether an update was asked for since the last call.
    pub(super) fn take_update(&self) -> bool {
        // A load first: the writer's hot path checks it for every batch.
        self.update_requested.load(Ordering::Relaxed) && self.update_requested.swap(false, Ordering::Acquire)
    }

    /// Note the alert `e` calls for (the first one stays).
    pub(super) fn failed(&self, e: &RecordError) {
        if let Some(d) = e.alert() {
            let _ = self.alert.compare_exchange(0, d, Ordering::Release, Ordering::Relaxed);
        }
    }

    /// The alert to send, once.
    pub(super) fn take_alert(&self) -> Option<u8> {
        match self.alert.load(Ordering::Relaxed) {
            0 => None,
            _ => Some(self.alert.swap(0, Ordering::Acquire)).filter(|d| *d != 0),
        }
    }
}

/// A record header for `len` bytes of ciphertext.
pub(super) fn header(len: usize) -> [u8; HEADER] {
    let l = (len as u16).to_be_bytes();
    [APPLICATION_DATA, 3, 3, l[0], l[1]]
}

/// The ciphertext length a header announces, once checked: outer type `application_data`,
/// legacy version 3.3, at least a type byte and a tag, at most 2^14 + 256.
pub(super) fn parse_header(h: &[u8]) -> Result<usize, RecordError> {
    if h[0] != APPLICATION_DATA {
        // Plaintext records (an alert before the keys, a stray handshake) have no place here.
        return Err(RecordError::Unexpected(h[0]));
    }
    if h[1] != 3 || h[2] != 3 {
        return Err(RecordError::Malformed("legacy version is not 3.3"));
    }
    let len = u16::from_be_bytes([h[3], h[4]]) as usize;
    if len < TRAILER {
        return Err(RecordError::Malformed("shorter than a content type and a tag"));
    }
    // Over 2^14 + 256 bytes, or (with the layer's 16-byte tags) an inner plaintext over
    // 2^14 + 1 (RFC 8446 5.2, 5.4).
    if len > MAX_CIPHERTEXT || len > super::MAX_PLAINTEXT + TRAILER {
        return Err(RecordError::Overflow(len));
    }
    Ok(len)
}

/// A decrypted `TLSInnerPlaintext` (content, type, zero padding): the content's length and
/// its type.
pub(super) fn inner(plain: &[u8]) -> Result<(usize, u8), RecordError> {
    match plain.iter().rposition(|b| *b != 0) {
        Some(at) => Ok((at, plain[at])),
        // RFC 8446 5.4: no content type at all is an unexpected_message.
        None => Err(RecordError::Unexpected(0)),
    }
}

/// What a non-data record asks of the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Control {
    /// Nothing (a warning, a session ticket).
    None,
    /// The peer closed (`close_notify`).
    Closed,
    /// A `KeyUpdate`: the peer's next records are under its next keys; `true` when it asks
    /// for ours to change too (`update_requested`).
    KeyUpdate(bool),
}

/// What a non-data record means; anything but an ignored message, `close_notify` or a
/// well-formed `KeyUpdate` that ends its record is an error.
pub(super) fn control(ty: u8, content: &[u8]) -> Result<Control, RecordError> {
    match ty {
        ALERT => match content {
            [_, 0] => Ok(Control::Closed),
            // user_canceled is a warning that a close_notify follows.
            [_, 90] => Ok(Control::None),
            [_, d] => Err(RecordError::Alert(*d)),
            _ => Err(RecordError::Malformed("an alert that is not two bytes")),
        },
        HANDSHAKE => {
            // Every handshake message in the record (type, u24 length, body).
            let mut rest = content;
            while !rest.is_empty() {
                let [t, a, b, c, ..] = *rest else { return Err(RecordError::Malformed("a cut handshake message")) };
                let len = u32::from_be_bytes([0, a, b, c]) as usize;
                if rest.len() < 4 + len {
                    // A handshake message across records: none is expected here.
                    return Err(RecordError::Malformed("a handshake message across records"));
                }
                let body = &rest[4..4 + len];
                rest = &rest[4 + len..];
                match t {
                    // NewSessionTicket: the channel does not resume sessions; a ticket is dropped.
                    4 => {}
                    24 => {
                        let requested = match body {
                            [0] => false,
                            [1] => true,
                            _ => return Err(RecordError::Malformed("a KeyUpdate that is not one byte of 0 or 1")),
                        };
                        if !rest.is_empty() {
                            // Messages before a key change end at a record boundary (RFC 8446 5.1).
                            return Err(RecordError::Unexpected(HANDSHAKE));
                        }
                        return Ok(Control::KeyUpdate(requested));
                    }
                    _ => return Err(RecordError::Unexpected(HANDSHAKE)),
                }
            }
            Ok(Control::None)
        }
        other => Err(RecordError::Unexpected(other)),
    }
}
