use kvpool_proto::{close, ErrorCode, ProtoError};
use std::time::Duration;

/// Everything a client call can fail with. `Display` always starts with a short label
/// (`not-found: ...`, `tls: ...`) so that a CLI can print it as one line.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached or the QUIC handshake failed for a non-TLS reason.
    #[error("connect: {addr}: {message}")]
    Connect { addr: String, message: String },
    /// Certificate verification or TLS setup failed.
    #[error("tls: {0}")]
    Tls(String),
    /// The server answered with a typed error (or a per-item status of a single-item call).
    #[error("{code}: {message}")]
    Status { code: ErrorCode, message: String },
    /// The server's reply broke the protocol (bad frame, wrong message type, wrong item count).
    #[error("protocol: {0}")]
    Protocol(String),
    /// Stream or local I/O failed.
    #[error("io: {0}")]
    Io(String),
    /// A value's bytes did not match the checksum the server announced for them.
    #[error(
        "corrupt: checksum mismatch for key {key}: server said {expected:016x}, received bytes hash to {actual:016x}"
    )]
    Checksum { key: String, expected: u64, actual: u64 },
    /// A request would exceed a limit the server announced in its hello; nothing was sent.
    #[error("{code}: {what} is {value}, the server limit is {limit}")]
    LimitExceeded { code: ErrorCode, what: &'static str, value: u64, limit: u64 },
    /// The request did not complete within `ClientConfig::request_timeout`.
    #[error("timeout: no answer within {0:?}")]
    Timeout(Duration),
    /// The connection is gone (closed by the server, idle timeout, reset).
    #[error("closed: {0}")]
    Closed(String),
    /// The client configuration is unusable (bad address, unreadable CA file...).
    #[error("invalid-argument: {0}")]
    Config(String),
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

impl ClientError {
    /// The protocol error code closest to this error, for callers that branch on codes.
    pub fn code(&self) -> ErrorCode {
        match self {
            ClientError::Status { code, .. } | ClientError::LimitExceeded { code, .. } => *code,
            ClientError::Checksum { .. } => ErrorCode::Corrupt,
            ClientError::Timeout(_) => ErrorCode::Timeout,
            ClientError::Protocol(_) => ErrorCode::Malformed,
            ClientError::Config(_) => ErrorCode::InvalidArgument,
            ClientError::Tls(_) => ErrorCode::Unauthorized,
            ClientError::Connect { .. } | ClientError::Io(_) | ClientError::Closed(_) => ErrorCode::Internal,
        }
    }

    /// True when the server said the key (or keys) do not exist.
    pub fn is_not_found(&self) -> bool {
        self.code() == ErrorCode::NotFound
    }

    pub(crate) fn status(code: ErrorCode, message: impl Into<String>) -> Self {
        ClientError::Status { code, message: message.into() }
    }
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        match e {
            ProtoError::Io(m) | ProtoError::Cancelled(m) => ClientError::Io(m),
            other => ClientError::Protocol(other.to_string()),
        }
    }
}

impl From<quinn::ConnectionError> for ClientError {
    fn from(e: quinn::ConnectionError) -> Self {
        use quinn::ConnectionError as C;
        match &e {
            C::ApplicationClosed(a) if a.error_code.into_inner() == close::UNAUTHORIZED as u64 => {
                ClientError::status(ErrorCode::Unauthorized, format!("connection closed by the server: {e}"))
            }
            C::ApplicationClosed(a) if a.error_code.into_inner() == close::SHUTDOWN as u64 => {
                ClientError::status(ErrorCode::ShuttingDown, "the server is shutting down")
            }
            // QUIC carries TLS alerts as transport codes 0x100..=0x1ff.
            C::ConnectionClosed(c) if is_crypto(u64::from(c.error_code)) => ClientError::Tls(e.to_string()),
            C::TransportError(t) if is_crypto(u64::from(t.code)) => ClientError::Tls(e.to_string()),
            C::LocallyClosed => ClientError::Closed(
                "connection closed by this client (closed by its owner, or its server's port answered unreachable)"
                    .into(),
            ),
            _ => ClientError::Closed(e.to_string()),
        }
    }
}

fn is_crypto(code: u64) -> bool {
    (0x100..0x200).contains(&code)
}

impl From<quinn::WriteError> for ClientError {
    fn from(e: quinn::WriteError) -> Self {
        match e {
            quinn::WriteError::ConnectionLost(c) => c.into(),
            other => ClientError::Io(format!("write: {other}")),
        }
    }
}

impl From<quinn::ReadError> for ClientError {
    fn from(e: quinn::ReadError) -> Self {
        match e {
            quinn::ReadError::ConnectionLost(c) => c.into(),
            other => ClientError::Io(format!("read: {other}")),
        }
    }
}

impl From<quinn::ReadExactError> for ClientError {
    fn from(e: quinn::ReadExactError) -> Self {
        match e {
            quinn::ReadExactError::FinishedEarly(n) => {
                ClientError::Protocol(format!("stream ended early, {n} bytes short of a declared value size"))
            }
            quinn::ReadExactError::ReadError(r) => r.into(),
        }
    }
}

impl From<quinn::ReadToEndError> for ClientError {
    fn from(e: quinn::ReadToEndError) -> Self {
        match e {
            quinn::ReadToEndError::TooLong => ClientError::Protocol("reply longer than the allowed size".into()),
            quinn::ReadToEndError::Read(r) => r.into(),
        }
    }
}

impl From<quinn::ClosedStream> for ClientError {
    fn from(e: quinn::ClosedStream) -> Self {
        ClientError::Io(e.to_string())
    }
}
