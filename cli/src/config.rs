//! The client configuration: from options, environment and a local server's data directory.

use crate::args::Cli;
use crate::Failure;
use kvpool_client::{read_key_file, ClientConfig, EndpointInfo, Trust};
use std::path::{Path, PathBuf};
use std::time::Duration;

const DEFAULT_SERVER: &str = "127.0.0.1:7100";
/// Data directory of a server started with the embedded default in the current directory.
const DEFAULT_DATA_DIR: &str = "kvpool-data";

/// Build the client configuration from options, environment and an optional data directory.
pub(crate) fn client_config(cli: &Cli) -> Result<ClientConfig, Failure> {
    if cli.ca.is_some() && cli.fingerprint.is_some() {
        return Err(Failure::usage("give either --ca or --fingerprint, not both"));
    }
    if cli.api_key.is_some() && cli.api_key_file.is_some() {
        return Err(Failure::usage("give either --api-key or --api-key-file, not both"));
    }
    let explicit_trust = cli.ca.is_some() || cli.fingerprint.is_some();
    let explicit_key = cli.api_key.is_some() || cli.api_key_file.is_some();
    let data_dir = match &cli.data_dir {
        Some(d) => Some(d.clone()),
        None if !(explicit_trust && explicit_key) && Path::new(DEFAULT_DATA_DIR).join(EndpointInfo::FILE).exists() => {
            Some(PathBuf::from(DEFAULT_DATA_DIR))
        }
        None => None,
    };
    let endpoint = data_dir.as_deref().map(EndpointInfo::read).transpose()?;

    let trust = if let Some(ca) = &cli.ca {
        Trust::CaFile(ca.clone())
    } else if let Some(fp) = &cli.fingerprint {
        Trust::Fingerprint(kvpool_client::parse_fingerprint(fp).map_err(|e| Failure::usage(e.to_string()))?)
    } else if let Some(ep) = &endpoint {
        ep.trust()?
    } else if cli.etcd.is_some() {
        // Replaced by the fingerprint the leader publishes in etcd.
        Trust::Fingerprint([0; 32])
    } else {
        return Err(Failure::usage(
            "no way to verify the server: pass --ca FILE or --fingerprint HEX (or --data-dir of a local server)",
        ));
    };

    let api_key = if let Some(k) = &cli.api_key {
        k.clone()
    } else if let Some(f) = &cli.api_key_file {
        read_key_file(f)?
    } else if let Some(d) = &data_dir {
        read_key_file(&d.join("api-key"))?
    } else {
        return Err(Failure::usage("no API key: pass --api-key, --api-key-file or --data-dir"));
    };

    let server = cli
        .server
        .clone()
        .or_else(|| endpoint.as_ref().map(|e| e.quic_addr.clone()))
        .unwrap_or_else(|| DEFAULT_SERVER.to_string());
    let mut cfg = ClientConfig::new(server, api_key, trust);
    cfg.client_name = concat!("kvpool-cli/", env!("CARGO_PKG_VERSION")).into();
    if let Some(name) = cli.server_name.clone().or_else(|| endpoint.as_ref().map(|e| e.server_name.clone())) {
        cfg.server_name = name;
    }
    cfg.request_timeout = Duration::from_secs(cli.timeout.max(1));
    cfg.bulk = cli.bulk;
    cfg.trusted_networks = cli.trusted_networks.clone();
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse;

    #[test]
    fn trust_options() {
        let c = parse(&["--api-key", "k", "--fingerprint", &"aa".repeat(32), "ping"]).unwrap();
        let cfg = client_config(&c).unwrap();
        assert_eq!(cfg.trust, Trust::Fingerprint([0xaa; 32]));
        assert_eq!(cfg.server, DEFAULT_SERVER);
        let c = parse(&["--api-key", "k", "--fingerprint", "aa", "ping"]).unwrap();
        assert_eq!(client_config(&c).unwrap_err().exit, 2);
        let c = parse(&["--api-key", "k", "--ca", "x.pem", "--fingerprint", &"aa".repeat(32), "ping"]).unwrap();
        assert_eq!(client_config(&c).unwrap_err().exit, 2);
    }
}
