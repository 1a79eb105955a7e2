//! The command line: global options, the commands and their flags.

use clap::{Parser, Subcommand, ValueEnum};
use kvpool_client::proto::PolicyKind;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(name = "kvpool", version, about = "Command-line client of a kvpool KV-cache pool")]
pub(crate) struct Cli {
    /// Server QUIC address, host:port [default: 127.0.0.1:7100, or the one in --data-dir]
    #[arg(long, env = "KVPOOL_SERVER", global = true)]
    pub(crate) server: Option<String>,
    /// API key
    #[arg(long, env = "KVPOOL_API_KEY", hide_env_values = true, global = true)]
    pub(crate) api_key: Option<String>,
    /// File holding the API key (first line)
    #[arg(long, env = "KVPOOL_API_KEY_FILE", global = true)]
    pub(crate) api_key_file: Option<PathBuf>,
    /// PEM file of the CA (or self-signed server certificate) to trust
    #[arg(long, env = "KVPOOL_CA", global = true)]
    pub(crate) ca: Option<PathBuf>,
    /// SHA-256 fingerprint of the server certificate to pin (hex, ':' separators allowed)
    #[arg(long, env = "KVPOOL_FINGERPRINT", global = true)]
    pub(crate) fingerprint: Option<String>,
    /// TLS server name [default: localhost, or the one in --data-dir]
    #[arg(long, env = "KVPOOL_SERVER_NAME", global = true)]
    pub(crate) server_name: Option<String>,
    /// Data directory of a local server: address, fingerprint and API key are read from its
    /// endpoint.json and api-key files (explicit options win). Without any trust or key option,
    /// ./kvpool-data is used when it exists.
    #[arg(long, env = "KVPOOL_DATA_DIR", global = true)]
    pub(crate) data_dir: Option<PathBuf>,
    /// Keys (and --parent) are hex-encoded bytes instead of UTF-8 text
    #[arg(long, global = true)]
    pub(crate) hex: bool,
    /// Request timeout in seconds
    #[arg(long, env = "KVPOOL_TIMEOUT", default_value_t = 30, global = true)]
    pub(crate) timeout: u64,
    /// Path of bulk bytes: auto (the server's TCP bulk channel to another host, QUIC on this
    /// one), quic, or tcp
    #[arg(long, env = "KVPOOL_BULK", default_value = "auto", global = true)]
    pub(crate) bulk: kvpool_client::BulkChoice,
    /// Networks (CIDRs, comma-separated) trusted for plaintext bulk bytes, when the server
    /// trusts this client's network too
    #[arg(long, env = "KVPOOL_TRUSTED_NETWORKS", value_delimiter = ',', global = true)]
    pub(crate) trusted_networks: Vec<ipnet::IpNet>,
    /// The server is a cluster master: put, get, lookup, exists and rm go to the storage nodes it
    /// names. Not needed: the CLI asks the server what it is (one round trip) and routes through
    /// a master by itself; kept so that scripts that pass it keep working
    #[arg(long, global = true)]
    pub(crate) cluster: bool,
    /// Find the cluster's leading master in etcd (http://host:port, comma-separated); implies
    /// --cluster, and trusts the certificate fingerprint the leader published there
    #[arg(long, env = "KVPOOL_ETCD", global = true)]
    pub(crate) etcd: Option<String>,
    /// Key prefix of the cluster in etcd
    #[arg(long, default_value = "/kvpool/", global = true)]
    pub(crate) etcd_prefix: String,
    /// Cluster puts: copies of each block, on distinct storage nodes
    #[arg(long, default_value_t = 1, global = true)]
    pub(crate) replicas: u32,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PinArg {
    None,
    Soft,
    Hard,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Cmd {
    /// Store a block from FILE, or from stdin when FILE is '-' or absent
    Put {
        key: String,
        file: Option<PathBuf>,
        /// Key of the previous block of the prefix chain
        #[arg(long)]
        parent: Option<String>,
        /// Tokens held by this block
        #[arg(long, default_value_t = 0)]
        tokens: u32,
        /// Length in tokens of the prefix this block completes
        #[arg(long, default_value_t = 0)]
        seq_tokens: u64,
        /// Pin the block: soft (evicted last) or hard (never evicted)
        #[arg(long, value_enum, default_value_t = PinArg::None)]
        pin: PinArg,
        /// Soft pin lifetime in milliseconds (0: server default)
        #[arg(long, default_value_t = 0)]
        pin_ttl_ms: u64,
        /// Replace an existing value instead of reporting already-exists
        #[arg(long)]
        upsert: bool,
    },
    /// Fetch a block to stdout or to a file
    Get {
        key: String,
        /// Write the value to this file instead of stdout
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Number of leading blocks of a chain (root first) that are in the pool
    Lookup {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Whether each key is in the pool (exit 3 if any is missing)
    Exists {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Remove blocks, or every block of the tenant with --all
    Rm {
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        keys: Vec<String>,
        /// Remove all blocks of this tenant
        #[arg(long)]
        all: bool,
        /// Remove even leased blocks
        #[arg(long)]
        force: bool,
    },
    /// Pool statistics
    Stats {
        /// Print the raw report as JSON
        #[arg(long)]
        json: bool,
    },
    /// Policy modules (admin key only)
    Policy {
        #[command(subcommand)]
        cmd: PolicyCmd,
    },
    /// Follow KV events (block copies stored, removed, evicted) as JSON lines; the last line
    /// gives the `next` sequence number and `log_id` to resume from
    Events {
        /// Resume from this sequence number (the `next` of an earlier run); default: from now
        #[arg(long)]
        from: Option<u64>,
        /// The `log_id` that --from belongs to (hex): refuse to resume if the server restarted
        #[arg(long, value_parser = parse_log_id)]
        log_id: Option<u64>,
        /// Every tenant's events (admin key)
        #[arg(long)]
        all: bool,
        /// Stop after this many events
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this many milliseconds without an event (default: follow until killed)
        #[arg(long)]
        idle_ms: Option<u64>,
    },
    /// The storage nodes of a cluster pool, their tiers, use and liveness (ask the master)
    Nodes {
        /// Print as JSON
        #[arg(long)]
        json: bool,
    },
    /// Measure round-trip time
    Ping {
        /// Number of pings
        #[arg(short = 'c', long, default_value_t = 1)]
        count: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum KindArg {
    Eviction,
    Admission,
    Placement,
}

impl From<KindArg> for PolicyKind {
    fn from(k: KindArg) -> Self {
        match k {
            KindArg::Eviction => PolicyKind::Eviction,
            KindArg::Admission => PolicyKind::Admission,
            KindArg::Placement => PolicyKind::Placement,
        }
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum PolicyCmd {
    /// Load a Wasm policy component and make it active for KIND
    Load {
        #[arg(value_enum)]
        kind: KindArg,
        /// The component (.wasm)
        file: PathBuf,
        /// Name shown by `policy list` [default: the file name without extension]
        #[arg(long)]
        name: Option<String>,
        /// Module parameter, repeatable
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_param)]
        params: Vec<(String, String)>,
    },
    /// Active and previous modules of every kind
    List {
        /// Print as JSON
        #[arg(long)]
        json: bool,
    },
    /// Re-activate the module that was active before the current one of KIND
    Rollback {
        #[arg(value_enum)]
        kind: KindArg,
    },
}

pub(crate) fn parse_param(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

fn parse_log_id(s: &str) -> Result<u64, String> {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).map_err(|e| format!("a log id is hex: {e}"))
}

/// The command line `kvpool ARGS...` parsed (tests).
#[cfg(test)]
pub(crate) fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("kvpool").chain(args.iter().copied()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_commands() {
        let c = parse(&["--server", "h:1", "put", "k", "-", "--pin", "soft", "--parent", "p", "--upsert"]).unwrap();
        assert_eq!(c.server.as_deref(), Some("h:1"));
        match c.cmd {
            Cmd::Put { key, file, pin, parent, upsert, .. } => {
                assert_eq!(key, "k");
                assert_eq!(file, Some(PathBuf::from("-")));
                assert_eq!(pin, PinArg::Soft);
                assert_eq!(parent.as_deref(), Some("p"));
                assert!(upsert);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse(&["rm", "--all", "--force"]).unwrap().cmd, Cmd::Rm { all: true, force: true, .. }));
        assert!(parse(&["rm"]).is_err());
        assert!(parse(&["rm", "a", "--all"]).is_err());
        assert!(parse(&["lookup"]).is_err());
        assert!(parse(&["put", "k", "--pin", "medium"]).is_err());
        assert!(matches!(parse(&["ping", "-c", "3"]).unwrap().cmd, Cmd::Ping { count: 3 }));
        assert!(matches!(parse(&["get", "k", "-o", "f"]).unwrap().cmd, Cmd::Get { output: Some(_), .. }));
        match parse(&["policy", "load", "eviction", "s3fifo.wasm", "--param", "k=v", "--param", "x="]).unwrap().cmd {
            Cmd::Policy { cmd: PolicyCmd::Load { kind, params, .. } } => {
                assert_eq!(kind, KindArg::Eviction);
                assert_eq!(params, vec![("k".into(), "v".into()), ("x".into(), String::new())]);
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["policy", "load", "eviction", "f.wasm", "--param", "novalue"]).is_err());
        assert!(parse(&["policy", "rollback", "sideways"]).is_err());
    }
}
