use crate::error::{ClientError, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How the client decides to trust the server's certificate. There is deliberately no
/// "accept anything" variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// PEM file with one or more CA certificates (or the server's self-signed certificate).
    CaFile(PathBuf),
    /// The same, already in memory.
    CaPem(Vec<u8>),
    /// SHA-256 of the server's end-entity certificate (DER). The handshake signature is still
    /// verified against that certificate's key; the server name is not checked.
    Fingerprint([u8; 32]),
}

/// Which data path block bytes take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory when the server is on this host and offers it, QUIC otherwise.
    #[default]
    Auto,
    /// QUIC only.
    Quic,
    /// Shared memory, or fail to connect.
    Shm,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "quic" | "tcp" => Ok(TransportChoice::Quic),
            "shm" => Ok(TransportChoice::Shm),
            other => Err(format!("{other:?}: expected auto, quic or shm")),
        }
    }
}

/// Which path puts and gets of bulk bytes take between hosts (the same-host shared memory,
/// when attached, comes first either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BulkChoice {
    /// The server's TCP bulk channel for a server on another host, QUIC on this host.
    #[default]
    Auto,
    /// QUIC streams only.
    Quic,
    /// The TCP bulk channel whenever the server offers it (QUIC when it does not).
    Tcp,
}

impl std::str::FromStr for BulkChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(BulkChoice::Auto),
            "quic" => Ok(BulkChoice::Quic),
            "tcp" => Ok(BulkChoice::Tcp),
            other => Err(format!("{other:?}: expected auto, quic or tcp")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `host:port` of the server's QUIC endpoint.
    pub server: String,
    /// TLS server name (SNI and, with a CA, the name checked against the certificate).
    pub server_name: String,
    pub api_key: String,
    pub trust: Trust,
    /// Free text the server logs, e.g. "vllm-connector/0.1".
    pub client_name: String,
    /// Bound on one whole request (open stream, send, receive everything).
    pub request_timeout: Duration,
    /// UDP and QUIC settings (the defaults are the measured choice).
    pub quic: kvpool_net::QuicTuning,
    /// Data path for block bytes.
    pub transport: TransportChoice,
    /// When the shared-memory transport is in use, send requests over the server's same-host
    /// control socket instead of QUIC streams (a fraction of QUIC's round trip).
    pub local_control: bool,
    /// Hash values again after the server copied them into registered buffers. The server
    /// already hashes each block as it lands in the buffer and answers `Corrupt` on a mismatch
    /// (PROTOCOL.md, `GetInto`), so this only guards against a faulty server, at the cost of a
    /// second pass over the bytes. Values that cross QUIC are always verified here.
    pub verify_shm_gets: bool,
    /// A connection that hears nothing from the server for this long is dead (a killed server
    /// sends no close): requests on it fail, and the next one connects again. Keep-alives go
    /// out at a third of it, so a live but idle server is never taken for dead.
    pub dead_after: Duration,
    /// Through a cluster master: a storage node that answers neither a call nor a ping within
    /// this long is taken for down. The call fails over to another holder (or misses), and the
    /// node is skipped, with no network round trip, until a background reconnect succeeds.
    /// Bounds what a killed node costs a read, where `dead_after` would cost a whole idle
    /// timeout.
    pub node_answer_within: Duration,
    /// Path of bulk bytes to servers on other hosts (PROTOCOL.md 11.10).
    pub bulk: BulkChoice,
    /// Networks (CIDRs) this client trusts: to a server there, the bulk channel may run in
    /// plaintext when the server trusts this client's network too. Empty: TLS always.
    pub trusted_networks: Vec<ipnet::IpNet>,
    /// Puts of at least this many value bytes take the bulk channel; smaller ones stay on QUIC.
    pub bulk_min_put: u64,
}

impl ClientConfig {
    pub fn new(server: impl Into<String>, api_key: impl Into<String>, trust: Trust) -> Self {
        ClientConfig {
            server: server.into(),
            server_name: "localhost".into(),
            api_key: api_key.into(),
            trust,
            client_name: concat!("kvpool-client/", env!("CARGO_PKG_VERSION")).into(),
            request_timeout: Duration::from_secs(30),
            quic: kvpool_net::QuicTuning { drivers: kvpool_net::Drivers::IoThread, ..Default::default() },
            transport: TransportChoice::Auto,
            local_control: true,
            verify_shm_gets: false,
            dead_after: Duration::from_secs(60),
            node_answer_within: Duration::from_millis(250),
            bulk: BulkChoice::Auto,
            trusted_networks: Vec::new(),
            bulk_min_put: 64 << 10,
        }
    }

    /// Everything needed to reach a local server from its data directory: `endpoint.json`
    /// (address, server name, certificate fingerprint) and the `api-key` file it generated.
    pub fn from_data_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let ep = EndpointInfo::read(dir)?;
        let key_path = dir.join("api-key");
        let api_key = read_key_file(&key_path)?;
        let mut cfg = ClientConfig::new(ep.quic_addr.clone(), api_key, ep.trust()?);
        cfg.server_name = ep.server_name.clone();
        Ok(cfg)
    }
}

/// Read an API key file: the first line, surrounding whitespace removed.
pub fn read_key_file(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ClientError::Config(format!("cannot read API key file {}: {e}", path.display())))?;
    let key = text.lines().next().unwrap_or("").trim().to_string();
    if key.is_empty() {
        return Err(ClientError::Config(format!("API key file {} is empty", path.display())));
    }
    Ok(key)
}

/// `<data_dir>/endpoint.json`, written by the server when it is ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointInfo {
    pub quic_addr: String,
    /// Absent or null when metrics are off.
    #[serde(default)]
    pub metrics_addr: Option<String>,
    #[serde(default)]
    pub fingerprint: Option<String>,
    #[serde(default)]
    pub cert_path: Option<String>,
    #[serde(default = "default_server_name")]
    pub server_name: String,
}

fn default_server_name() -> String {
    "localhost".into()
}

impl EndpointInfo {
    pub const FILE: &'static str = "endpoint.json";

    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(Self::FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ClientError::Config(format!("cannot read {}: {e}", path.display())))?;
        serde_json::from_str(&text).map_err(|e| ClientError::Config(format!("bad {}: {e}", path.display())))
    }

    /// The pinned fingerprint when present, else the certificate file.
    pub fn trust(&self) -> Result<Trust> {
        if let Some(fp) = self.fingerprint.as_deref().filter(|f| !f.is_empty()) {
            return Ok(Trust::Fingerprint(parse_fingerprint(fp)?));
        }
        if let Some(p) = self.cert_path.as_deref().filter(|p| !p.is_empty()) {
            return Ok(Trust::CaFile(PathBuf::from(p)));
        }
        Err(ClientError::Config("endpoint.json names neither a fingerprint nor a certificate".into()))
    }
}

/// Parse a SHA-256 fingerprint written as 64 hex digits, optionally with `:` separators
/// (the form openssl prints) and an optional `sha256:` prefix.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32]> {
    let s = s.trim();
    let s = s.strip_prefix("sha256:").or_else(|| s.strip_prefix("SHA256:")).unwrap_or(s);
    let digits: String = s.chars().filter(|c| *c != ':').collect();
    let bytes = hex::decode(&digits).map_err(|e| ClientError::Config(format!("fingerprint is not hex: {e}")))?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| ClientError::Config(format!("fingerprint has {} bytes, a SHA-256 has 32", b.len())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_parse_in_common_forms() {
        let hex64 = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let want = parse_fingerprint(hex64).unwrap();
        assert_eq!(want[1], 0x11);
        let colons: Vec<String> = want.iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(parse_fingerprint(&colons.join(":")).unwrap(), want);
        assert_eq!(parse_fingerprint(&format!("sha256:{hex64}")).unwrap(), want);
        assert!(parse_fingerprint("abcd").is_err());
        assert!(parse_fingerprint("zz").is_err());
    }

    #[test]
    fn data_dir_config() {
        let dir = std::env::temp_dir().join(format!("kvpool-client-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fp = "ab".repeat(32);
        std::fs::write(
            dir.join("endpoint.json"),
            format!(r#"{{"quic_addr":"127.0.0.1:7999","metrics_addr":null,"fingerprint":"{fp}","cert_path":"/x.pem","server_name":"localhost"}}"#),
        )
        .unwrap();
        std::fs::write(dir.join("api-key"), "secret-key\n").unwrap();
        let cfg = ClientConfig::from_data_dir(&dir).unwrap();
        assert_eq!(cfg.server, "127.0.0.1:7999");
        assert_eq!(cfg.api_key, "secret-key");
        assert_eq!(cfg.trust, Trust::Fingerprint([0xab; 32]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
