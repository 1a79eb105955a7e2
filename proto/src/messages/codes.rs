//! Status and error codes, as every answer carries them.

use serde::{Deserialize, Serialize};

/// Status and error codes; the wire value is the declaration index (u32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    Ok,
    Unauthorized,
    UnsupportedVersion,
    Malformed,
    UnknownMessage,
    FrameTooLarge,
    KeyTooLong,
    ValueTooLarge,
    BatchTooLarge,
    NotFound,
    AlreadyExists,
    NoSpace,
    Leased,
    Rejected,
    Corrupt,
    Forbidden,
    Internal,
    Timeout,
    ShuttingDown,
    HelloRequired,
    InvalidArgument,
    /// A policy module failed to load (not a component, wrong world, refused its parameters,
    /// trapped while its state was rebuilt).
    PolicyError,
    /// The server does not offer what was asked (a transport it lacks, a version 2 request on
    /// a version 1 connection).
    Unsupported,
    /// The reservation or lease named does not exist (expired, released, committed, or never
    /// granted to this connection).
    Expired,
    /// This master does not lead the cluster (another master does; etcd names it): ask the
    /// leader.
    NotLeader,
}

impl ErrorCode {
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Ok => "ok",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::Malformed => "malformed",
            ErrorCode::UnknownMessage => "unknown-message",
            ErrorCode::FrameTooLarge => "frame-too-large",
            ErrorCode::KeyTooLong => "key-too-long",
            ErrorCode::ValueTooLarge => "value-too-large",
            ErrorCode::BatchTooLarge => "batch-too-large",
            ErrorCode::NotFound => "not-found",
            ErrorCode::AlreadyExists => "already-exists",
            ErrorCode::NoSpace => "no-space",
            ErrorCode::Leased => "leased",
            ErrorCode::Rejected => "rejected",
            ErrorCode::Corrupt => "corrupt",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::Internal => "internal",
            ErrorCode::Timeout => "timeout",
            ErrorCode::ShuttingDown => "shutting-down",
            ErrorCode::HelloRequired => "hello-required",
            ErrorCode::InvalidArgument => "invalid-argument",
            ErrorCode::PolicyError => "policy-error",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Expired => "expired",
            ErrorCode::NotLeader => "not-leader",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
