//! The TCP bulk channel's front door: requests of an authenticated QUIC connection carried by a
//! TCP connection, so that bulk bytes ride the kernel's TCP segmentation and receive offloads
//! (one 64 KB `sendmsg`/`recvmsg` where QUIC pays per 1,500-byte packet in user space).
//!
//! A client asks `BulkAttach` on its QUIC connection and gets a port and a one-use token
//! ([`door`]: the offer and the tokens). It connects (TLS 1.3 with ALPN `kvpool-bulk/1` and the
//! server's QUIC certificate, or plaintext when it asked for that and its address is in
//! `bulk.trusted_networks`), presents the token ([`accept`]), and then sends one request at a
//! time in envelopes ([`envelope`], PROTOCOL.md 11.10). After the bind, TLS records are read
//! and written by `kvpool_net::bulk` (values decrypted where they land in DRAM). A token binds
//! one TCP connection, from the QUIC connection's own address, to that connection's session
//! (tenant, leases, reservations): a connection without a valid token, with a used one, or
//! from another address is refused before it can read or store anything. Its connections close
//! when the QUIC connection ends. The token table, the caps and the refusal are the ones the
//! Unix control socket uses too (`super::doors`).

mod accept;
// What `Shared` holds: reached below this module, so that holding it imports nothing that
// serves connections (which take `Shared`).
pub(crate) mod door;
mod envelope;

pub use accept::{serve, serve_stream, serve_tls_stream};
pub use door::{BulkDoor, TOKEN_TTL};
