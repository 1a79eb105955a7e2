//! kvpool wire protocol, shared by the server and the clients. `docs/PROTOCOL.md` is the
//! language-neutral description of the same thing; keep both in step.

#![forbid(unsafe_code)]

pub mod codec;
mod facts;
pub mod frame;
mod messages;

pub use facts::{RequestFacts, REQUESTS, REQUEST_NAMES, REQUEST_TAGS, V1_REQUEST_TAGS};
pub use messages::*;

/// Serde glue for a list of keys: each key as a byte string (one length, then the bytes, as any
/// `Vec<u8>`), so decoding copies it in one piece instead of visiting it byte by byte.
pub(crate) mod key_list {
    use serde::{Deserialize, Deserializer, Serializer};
    use serde_bytes::{ByteBuf, Bytes};

    pub(crate) fn serialize<S: Serializer>(keys: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(keys.iter().map(|k| Bytes::new(k)))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        Ok(Vec::<ByteBuf>::deserialize(d)?.into_iter().map(ByteBuf::into_vec).collect())
    }
}

/// A hex dump as `docs/PROTOCOL.md` writes them (hex pairs, `#` starts a comment) back into
/// bytes, so that tests check the document's examples against the code; `None` on an odd digit.
#[doc(hidden)]
pub fn parse_hex_dump(text: &str) -> Option<Vec<u8>> {
    let digits: Vec<u8> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.bytes().filter(u8::is_ascii_hexdigit))
        .collect();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    digits.chunks(2).map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?)).collect()
}

/// QUIC ALPN of this protocol.
pub const ALPN: &[u8] = b"kvpool/1";
/// TLS ALPN of the TCP bulk channel (PROTOCOL.md 11.10).
pub const BULK_ALPN: &[u8] = b"kvpool-bulk/1";
/// Protocol version carried in `Hello`: the newest this build speaks. Servers accept 1 and 2.
pub const PROTOCOL_VERSION: u16 = 2;
/// The oldest version a server of this build still accepts.
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// Frame limit a client uses for server responses (headers only; bulk bytes are not framed).
pub const CLIENT_MAX_FRAME: u32 = 64 << 20;

/// QUIC application error codes used when closing a connection or resetting a stream.
pub mod close {
    /// Normal close by either side.
    pub const OK: u32 = 0;
    /// The hello failed (bad key, bad version, or no hello first).
    pub const UNAUTHORIZED: u32 = 1;
    /// The peer broke the protocol (stream reset after a typed error was sent where possible).
    pub const PROTOCOL: u32 = 2;
    /// The server is shutting down.
    pub const SHUTDOWN: u32 = 3;
    /// The server gave up waiting for the rest of a request (STOP_SENDING after a `timeout`
    /// answer), or for the client to read a response (RESET_STREAM).
    pub const TIMEOUT: u32 = 4;
}

/// Errors of framing and decoding, on either side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("stream ended in the middle of a frame")]
    Truncated,
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// The peer reset the stream, or the connection went away, mid-message.
    #[error("cancelled by the peer: {0}")]
    Cancelled(String),
    #[error("i/o: {0}")]
    Io(String),
}

impl From<std::io::Error> for ProtoError {
    /// Stream errors as quinn reports them through `AsyncRead`: a reset stream is
    /// `ConnectionReset`, a lost connection `NotConnected`.
    fn from(e: std::io::Error) -> ProtoError {
        use std::io::ErrorKind::*;
        match e.kind() {
            UnexpectedEof => ProtoError::Truncated,
            ConnectionReset | NotConnected | ConnectionAborted | BrokenPipe => ProtoError::Cancelled(e.to_string()),
            _ => ProtoError::Io(e.to_string()),
        }
    }
}

impl ProtoError {
    /// The wire error code a server answers this with.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtoError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            ProtoError::Truncated => ErrorCode::Malformed,
            ProtoError::Malformed(_) => ErrorCode::Malformed,
            ProtoError::Encode(_) | ProtoError::Io(_) | ProtoError::Cancelled(_) => ErrorCode::Internal,
        }
    }
}

/// Tag (u32 little endian) of the message in a body, if the body has one: lets a server tell an
/// unknown message type (newer client) from a malformed one.
pub fn message_tag(body: &[u8]) -> Option<u32> {
    body.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}
