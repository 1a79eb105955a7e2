//! One direction's AEAD key, IV and sequence number (RFC 8446 5.3), and the layer's errors.

use ring::aead::{self, Aad, LessSafeKey, Nonce, Tag, UnboundKey};
use rustls::ConnectionTrafficSecrets;
use std::io;

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

/// Why the record layer gave up on a connection; every one closes it.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("malformed TLS record: {0}")]
    Malformed(&'static str),
    #[error("a TLS record failed its authentication (bad_record_mac)")]
    BadRecordMac,
    #[error("the peer sent a TLS KeyUpdate: the bulk channel does not update keys, so the connection is closed")]
    KeyUpdate,
    #[error("unexpected TLS message after the handshake (content type {0})")]
    Unexpected(u8),
    #[error("the peer sent the fatal TLS alert {0}")]
    Alert(u8),
    #[error("the connection ended inside a TLS record")]
    Truncated,
    #[error("the stream ended before the bytes asked for")]
    Ended,
    #[error("{0} records under one key: the connection must be retired")]
    Worn(u64),
    #[error("a read was abandoned inside a TLS record: the stream cannot go on")]
    Abandoned,
    #[error("the bulk channel's record layer takes TLS 1.3 with AES-GCM or ChaCha20-Poly1305, not {0}")]
    Unsupported(&'static str),
    #[error("bulk channel I/O: {0}")]
    Io(#[from] io::Error),
}

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

/// The keys of one direction of a connection.
pub(super) struct Direction {
    key: LessSafeKey,
    iv: [u8; 12],
    /// Records under this key so far: the next record's sequence number.
    pub(super) seq: u64,
}

impl Direction {
    /// (transmit, receive) from rustls's extracted secrets.
    pub(super) fn pair(s: rustls::ExtractedSecrets) -> Result<(Direction, Direction), RecordError> {
        let (tx_seq, tx) = s.tx;
        let (rx_seq, rx) = s.rx;
        Ok((Direction::new(tx, tx_seq)?, Direction::new(rx, rx_seq)?))
    }

    pub(super) fn new(secrets: ConnectionTrafficSecrets, seq: u64) -> Result<Direction, RecordError> {
        let (alg, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&aead::CHACHA20_POLY1305, key, iv),
            _ => return Err(RecordError::Unsupported("this cipher suite")),
        };
        let key = UnboundKey::new(alg, key.as_ref()).map_err(|_| RecordError::Unsupported("this key length"))?;
        let iv: [u8; 12] = iv.as_ref().try_into().map_err(|_| RecordError::Unsupported("this IV length"))?;
        Ok(Direction { key: LessSafeKey::new(key), iv, seq })
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
    if len > MAX_CIPHERTEXT {
        return Err(RecordError::Malformed("longer than 2^14 + 256 bytes"));
    }
    Ok(len)
}

/// A decrypted `TLSInnerPlaintext` (content, type, zero padding): the content's length and
/// its type.
pub(super) fn inner(plain: &[u8]) -> Result<(usize, u8), RecordError> {
    match plain.iter().rposition(|b| *b != 0) {
        Some(at) => Ok((at, plain[at])),
        None => Err(RecordError::Malformed("a record of padding only")),
    }
}

/// What a non-data record means: `Ok(true)` the peer closed (`close_notify`), `Ok(false)`
/// nothing to do (a warning, a session ticket); anything else is an error.
pub(super) fn control(ty: u8, content: &[u8]) -> Result<bool, RecordError> {
    match ty {
        ALERT => match content {
            [_, 0] => Ok(true),
            // user_canceled is a warning that a close_notify follows.
            [_, 90] => Ok(false),
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
                match t {
                    // NewSessionTicket: the channel does not resume sessions; a ticket is dropped.
                    4 => {}
                    24 => return Err(RecordError::KeyUpdate),
                    _ => return Err(RecordError::Unexpected(HANDSHAKE)),
                }
                rest = &rest[4 + len..];
            }
            Ok(false)
        }
        other => Err(RecordError::Unexpected(other)),
    }
}
