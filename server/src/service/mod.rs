//! The request service: hello/auth on a connection's first stream, then one request per stream.
//!
//! A request is exactly one frame, the value bytes it declares (put, policy load), then the end of
//! the stream. Every wait on the client has a deadline ([`Timeouts`]): a stalled or slow client
//! is answered `timeout`, its stream is stopped, and everything the request held (DRAM
//! reservations, leased blocks) is released when the handler returns. A client that resets its
//! stream or loses its connection cancels the request quietly.
//!
//! By file: `stream` (stream traits, deadlines, `Fail`), `quic` (the QUIC front door),
//! [`local`] (the Unix-socket front door, its state in `control`), [`bulk`] (the TCP bulk
//! channel's front door: its offer, its accept and its envelopes), `doors` (what the two extra
//! doors share: tokens, caps, the end of a session, the refusal), `dispatch` (the checks the
//! request table asks for, and one arm per request), then one file per verb: `put` (with the
//! value sources in `source`), `get`, `attach`, `admin`, `cluster`, `connector`, `subscribe`.
//! `docs/SERVER-MAP.md` walks the routes.

mod admin;
mod attach;
pub mod bulk;
mod cluster;
mod connector;
mod control;
mod dispatch;
pub mod doors;
mod get;
pub mod local;
pub mod memory;
mod put;
mod quic;
mod session;
mod shared;
mod shm;
mod source;
mod staged;
mod stream;
mod subscribe;
#[cfg(test)]
mod tests;

pub use dispatch::handle_stream;
pub use quic::{serve, QuicServerConfigs};
pub use session::Session;
pub use shared::{PathTally, Role, Shared};
pub use shm::DataPath;
pub use stream::{BoxFuture, RequestRecv, RequestSend, Timeouts};
