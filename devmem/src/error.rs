//! What a device runtime call can fail with.

use crate::Kind;

/// A failure of kvpool-devmem: loading a runtime, or one of its calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevmemError {
    /// The library could not be opened (absent, or a dependency of it is).
    #[error("{runtime}: could not load {library}: {reason}")]
    Load { runtime: Kind, library: String, reason: String },
    /// The library lacks a function this crate calls (not that runtime, or too old).
    #[error("{runtime}: {library} has no symbol {symbol} (is it the {runtime} runtime?)")]
    MissingSymbol { runtime: Kind, library: String, symbol: &'static str },
    /// A runtime call returned an error; `message` is the runtime's text for it.
    #[error("{runtime}: {call} failed with error {code}: {message}")]
    Call { runtime: Kind, call: &'static str, code: i32, message: String },
    /// Refused before calling the runtime.
    #[error("{runtime}: {what}")]
    Refused { runtime: Kind, what: String },
}

pub type Result<T> = std::result::Result<T, DevmemError>;
