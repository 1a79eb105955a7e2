//! `kvpool._native`: the Python binding of the kvpool client.
//!
//! A thin layer over [`kvpool_client::blocking::Client`]: every call that talks to the server
//! releases the GIL, and one `Client` object may be used from many Python threads at once (the
//! class is frozen; the connection multiplexes one QUIC stream per request). The Python package
//! `kvpool` builds Mooncake's API (`kvpool.mooncake`) and the vLLM connector (`kvpool.vllm`) on
//! top of this module.
//!
//! Raw addresses (Mooncake's `put_from(key, ptr, size)` and friends) are accepted only inside
//! ranges registered with `Client.register`; see [`regions`]. The binding itself is built only
//! with the `extension` feature (maturin turns it on).

pub mod devstage;
pub mod hostmem;
pub mod regions;

#[cfg(feature = "extension")]
mod binding;
