//! The extension module proper (built with the `extension` feature; see the crate docs).
//!
//! `client` is the `Client` class (the store), with its raw-address transfers in `ranges` and
//! device memory (CUDA, Ascend) in `device`;
//! `buffer` the `SharedBuffer` class, `events` the `EventSubscription` class; `args` turns
//! Python arguments into the client's, and `error` is `KvpoolError` and how failures become it.

mod args;
mod buffer;
mod client;
mod device;
mod error;
mod events;
mod ranges;

use buffer::SharedBuffer;
use client::Client;
use error::KvpoolError;
use events::EventSubscription;
use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<SharedBuffer>()?;
    m.add_class::<EventSubscription>()?;
    m.add("KvpoolError", m.py().get_type::<KvpoolError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
