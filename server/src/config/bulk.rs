//! `[bulk]`: the TCP bulk channel (PROTOCOL.md 11.10). Requests and small values stay on
//! QUIC; a client that asks may move its puts and gets over a TCP connection bound to its QUIC
//! session, TLS by default and plaintext only from networks listed here.

use serde::{Deserialize, Serialize};

/// How a storage node moves blocks to another node (offload, replicas).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerPath {
    /// QUIC streams.
    Quic,
    /// The peer's TCP bulk channel when it offers one (TLS, or plaintext when both nodes list
    /// each other's network as trusted), else QUIC.
    #[default]
    Tcp,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct BulkSection {
    /// Offer the channel (`BulkAttach`).
    pub tcp: bool,
    /// TCP address to listen on. Empty: the QUIC address's IP and port (TCP and UDP ports are
    /// apart), or a free port on that IP when the port is taken; the offer names the port.
    pub listen: String,
    /// Networks (CIDRs, e.g. `10.0.0.0/16`) whose clients may take a plaintext connection when
    /// they ask for one (clients list the server's network too). Empty: TLS always.
    pub trusted_networks: Vec<ipnet::IpNet>,
    /// How this node moves blocks to other storage nodes.
    pub peers: PeerPath,
}

impl Default for BulkSection {
    fn default() -> Self {
        BulkSection { tcp: true, listen: String::new(), trusted_networks: Vec::new(), peers: PeerPath::default() }
    }
}

impl BulkSection {
    /// Whether a client at `ip` may move bytes in plaintext.
    pub fn trusts(&self, ip: std::net::IpAddr) -> bool {
        trusted(&self.trusted_networks, ip)
    }
}

/// Whether `ip` lies in one of `nets` (an IPv4-mapped IPv6 address counts as its IPv4 one).
pub fn trusted(nets: &[ipnet::IpNet], ip: std::net::IpAddr) -> bool {
    let ip = ip.to_canonical();
    nets.iter().any(|n| n.contains(&ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_networks_are_trusted() {
        let nets: Vec<ipnet::IpNet> = vec!["10.1.0.0/16".parse().unwrap(), "fd00::/8".parse().unwrap()];
        assert!(trusted(&nets, "10.1.2.3".parse().unwrap()));
        assert!(trusted(&nets, "::ffff:10.1.2.3".parse().unwrap()));
        assert!(!trusted(&nets, "10.2.0.1".parse().unwrap()));
        assert!(trusted(&nets, "fd12::1".parse().unwrap()));
        assert!(!trusted(&[], "127.0.0.1".parse().unwrap()));
        let cfg: BulkSection = toml::from_str("trusted_networks = [\"192.168.0.0/24\"]\npeers = \"quic\"").unwrap();
        assert!(cfg.tcp && cfg.trusts("192.168.0.9".parse().unwrap()) && cfg.peers == PeerPath::Quic);
        assert!(toml::from_str::<BulkSection>("trusted_networks = [\"not-a-net\"]").is_err());
    }
}
