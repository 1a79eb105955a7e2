//! Version 2, the TCP bulk channel (PROTOCOL.md 11.10): requests of an authenticated QUIC
//! connection sent over a TCP connection (TLS, or plaintext on a network the server's operator
//! lists as trusted), so that bulk bytes ride TCP's segmentation and receive offloads.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkAttachRequest {
    /// The client would take a plaintext TCP connection: it lists the server's address as a
    /// trusted network too. The server grants it only when it lists the client's address.
    pub plaintext: bool,
}

/// Answer to `BulkAttach`: where to connect and the one-time token that binds one TCP
/// connection to this QUIC connection's session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkOffer {
    /// TCP port on the address the QUIC connection reached.
    pub port: u16,
    /// 32 bytes; valid for one TCP connection, from the QUIC connection's own address, until
    /// `expires_ms` have passed or the QUIC connection ends.
    pub token: Vec<u8>,
    /// `true`: the TCP connection must be TLS 1.3 (the server's QUIC certificate, ALPN
    /// `kvpool-bulk/1`); `false`: plaintext was asked for and granted.
    pub tls: bool,
    pub expires_ms: u32,
}
