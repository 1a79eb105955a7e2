//! `KvpoolError`, and what a binding call fails with before it becomes one.

use crate::regions::RegionError;
use kvpool_client::{ClientError, ErrorCode};
use kvpool_devmem::DevmemError;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    KvpoolError,
    PyException,
    "A kvpool call failed. `args` is `(message, code)`; `code` is kvpool's error code name \
     (`not-found`, `no-space`, `invalid-argument`, `timeout`, ...)."
);

/// What a binding call can fail with, before it becomes a Python exception.
#[derive(Debug, thiserror::Error)]
pub(super) enum Error {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("invalid-argument: {0}")]
    Region(#[from] RegionError),
    #[error("invalid-argument: {0}")]
    Argument(String),
    /// A device runtime refused a range (`invalid-argument`) or failed (`device-error`).
    #[error("{code}: {0}", code = device_code(.0))]
    Device(#[from] DevmemError),
    #[error("closed: the client was closed")]
    Closed,
}

impl Error {
    fn code(&self) -> &'static str {
        match self {
            // The server could not be reached or the connection died: callers that keep working
            // without the pool (an engine's connector) tell this apart from other failures.
            Error::Client(ClientError::Connect { .. } | ClientError::Io(_) | ClientError::Closed(_)) => "unavailable",
            Error::Client(e) => e.code().name(),
            Error::Region(_) | Error::Argument(_) => ErrorCode::InvalidArgument.name(),
            Error::Device(e) => device_code(e),
            Error::Closed => "closed",
        }
    }
}

fn device_code(e: &DevmemError) -> &'static str {
    match e {
        DevmemError::Refused { .. } => ErrorCode::InvalidArgument.name(),
        _ => super::device::DEVICE_ERROR,
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let code = e.code();
        KvpoolError::new_err((e.to_string(), code))
    }
}

pub(super) type Res<T> = Result<T, Error>;
