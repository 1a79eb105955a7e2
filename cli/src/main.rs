//! `kvpool`: command-line client of a kvpool server.

use bytesize::ByteSize;
use clap::{Parser, Subcommand, ValueEnum};
use kvpool_client::proto::{EventScope, PolicyInfo, PolicyKind};
use kvpool_client::{
    read_key_file, Client, ClientConfig, ClientError, ClusterClient, EndpointInfo, ErrorCode, PinSpec, PutEntry,
    PutMode, PutOptions, StatsReport, SubscribeOptions, Trust,
};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

const DEFAULT_SERVER: &str = "127.0.0.1:7100";
/// Data directory of a server started with the embedded default in the current directory.
const DEFAULT_DATA_DIR: &str = "kvpool-data";

#[derive(Debug, Parser)]
#[command(name = "kvpool", version, about = "Command-line client of a kvpool KV-cache pool")]
struct Cli {
    /// Server QUIC address, host:port [default: 127.0.0.1:7100, or the one in --data-dir]
    #[arg(long, env = "KVPOOL_SERVER", global = true)]
    server: Option<String>,
    /// API key
    #[arg(long, env = "KVPOOL_API_KEY", hide_env_values = true, global = true)]
    api_key: Option<String>,
    /// File holding the API key (first line)
    #[arg(long, env = "KVPOOL_API_KEY_FILE", global = true)]
    api_key_file: Option<PathBuf>,
    /// PEM file of the CA (or self-signed server certificate) to trust
    #[arg(long, env = "KVPOOL_CA", global = true)]
    ca: Option<PathBuf>,
    /// SHA-256 fingerprint of the server certificate to pin (hex, ':' separators allowed)
    #[arg(long, env = "KVPOOL_FINGERPRINT", global = true)]
    fingerprint: Option<String>,
    /// TLS server name [default: localhost, or the one in --data-dir]
    #[arg(long, env = "KVPOOL_SERVER_NAME", global = true)]
    server_name: Option<String>,
    /// Data directory of a local server: address, fingerprint and API key are read from its
    /// endpoint.json and api-key files (explicit options win). Without any trust or key option,
    /// ./kvpool-data is used when it exists.
    #[arg(long, env = "KVPOOL_DATA_DIR", global = true)]
    data_dir: Option<PathBuf>,
    /// Keys (and --parent) are hex-encoded bytes instead of UTF-8 text
    #[arg(long, global = true)]
    hex: bool,
    /// Request timeout in seconds
    #[arg(long, env = "KVPOOL_TIMEOUT", default_value_t = 30, global = true)]
    timeout: u64,
    /// The server is a cluster master: put, get, lookup, exists and rm go to the storage nodes it
    /// names. Not needed: the CLI asks the server what it is (one round trip) and routes through
    /// a master by itself; kept so that scripts that pass it keep working
    #[arg(long, global = true)]
    cluster: bool,
    /// Find the cluster's leading master in etcd (http://host:port, comma-separated); implies
    /// --cluster, and trusts the certificate fingerprint the leader published there
    #[arg(long, env = "KVPOOL_ETCD", global = true)]
    etcd: Option<String>,
    /// Key prefix of the cluster in etcd
    #[arg(long, default_value = "/kvpool/", global = true)]
    etcd_prefix: String,
    /// Cluster puts: copies of each block, on distinct storage nodes
    #[arg(long, default_value_t = 1, global = true)]
    replicas: u32,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PinArg {
    None,
    Soft,
    Hard,
}

#[derive(Debug, Subcommand)]
enum Cmd {
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
enum KindArg {
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
enum PolicyCmd {
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

fn parse_param(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// A failure with the exit code it maps to: 1 other, 2 usage, 3 not found.
#[derive(Debug)]
struct Failure {
    exit: u8,
    line: String,
}

impl Failure {
    fn usage(msg: impl std::fmt::Display) -> Self {
        Failure { exit: 2, line: format!("usage: {msg}") }
    }
    fn io(msg: impl std::fmt::Display) -> Self {
        Failure { exit: 1, line: format!("io: {msg}") }
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        let exit = match e.code() {
            ErrorCode::NotFound => 3,
            _ if matches!(e, ClientError::Config(_)) => 2,
            _ => 1,
        };
        // Messages from the server could hold newlines; the contract is one line.
        Failure { exit, line: e.to_string().replace('\n', " ") }
    }
}

type Outcome = Result<(), Failure>;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVPOOL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: io: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.line);
            ExitCode::from(f.exit)
        }
    }
}

fn parse_key(s: &str, hex: bool) -> Result<Vec<u8>, Failure> {
    if hex {
        hex::decode(s.trim_start_matches("0x")).map_err(|e| Failure::usage(format!("key {s:?} is not hex: {e}")))
    } else if s.is_empty() {
        Err(Failure::usage("empty key"))
    } else {
        Ok(s.as_bytes().to_vec())
    }
}

fn parse_keys(keys: &[String], hex: bool) -> Result<Vec<Vec<u8>>, Failure> {
    keys.iter().map(|k| parse_key(k, hex)).collect()
}

/// Build the client configuration from options, environment and an optional data directory.
fn client_config(cli: &Cli) -> Result<ClientConfig, Failure> {
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
    Ok(cfg)
}

/// Read a value to put; a file's size is checked against the server limit before reading it.
fn read_value(file: Option<&Path>, max: u64) -> Result<Vec<u8>, Failure> {
    let too_big = |n: u64| Failure {
        exit: 1,
        line: format!("{}: value is {n} bytes, the server limit is {max}", ErrorCode::ValueTooLarge),
    };
    match file {
        None => read_stdin(max, too_big),
        Some(p) if p.as_os_str() == "-" => read_stdin(max, too_big),
        Some(p) => {
            let meta = std::fs::metadata(p).map_err(|e| Failure::io(format!("{}: {e}", p.display())))?;
            if meta.is_file() && meta.len() > max {
                return Err(too_big(meta.len()));
            }
            std::fs::read(p).map_err(|e| Failure::io(format!("{}: {e}", p.display())))
        }
    }
}

fn read_stdin(max: u64, too_big: impl Fn(u64) -> Failure) -> Result<Vec<u8>, Failure> {
    let mut buf = Vec::new();
    // One byte past the limit is enough to know the value is too large.
    std::io::stdin()
        .lock()
        .take(max.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| Failure::io(format!("stdin: {e}")))?;
    if buf.len() as u64 > max {
        return Err(too_big(buf.len() as u64));
    }
    Ok(buf)
}

/// Write to stdout without `println!`'s panic on a closed pipe (`kvpool exists ... | head -1`).
fn out(args: std::fmt::Arguments<'_>) -> Outcome {
    let mut o = std::io::stdout().lock();
    match o.write_fmt(args).and_then(|_| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::io(format!("stdout: {e}"))),
    }
}

fn parse_log_id(s: &str) -> Result<u64, String> {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).map_err(|e| format!("a log id is hex: {e}"))
}

fn display_key(k: &[u8], hex: bool) -> String {
    if hex {
        hex::encode(k)
    } else {
        String::from_utf8_lossy(k).into_owned()
    }
}

async fn run(cli: Cli) -> Outcome {
    // Validate keys before connecting so that usage errors do not depend on the server.
    match &cli.cmd {
        Cmd::Put { key, parent, .. } => {
            parse_key(key, cli.hex)?;
            if let Some(p) = parent {
                parse_key(p, cli.hex)?;
            }
        }
        Cmd::Get { key, .. } => {
            parse_key(key, cli.hex)?;
        }
        Cmd::Lookup { keys } | Cmd::Exists { keys } | Cmd::Rm { keys, .. } => {
            parse_keys(keys, cli.hex)?;
        }
        Cmd::Stats { .. } | Cmd::Ping { .. } | Cmd::Policy { .. } | Cmd::Events { .. } | Cmd::Nodes { .. } => {}
    }
    let cfg = client_config(&cli)?;
    let cc = match &cli.etcd {
        Some(e) => ClusterClient::connect_etcd(e, &cli.etcd_prefix, cfg).await?,
        None if cli.cluster => ClusterClient::connect(cfg).await?,
        None => {
            let client = Client::connect(cfg).await?;
            // Only the block, policy and stats commands differ on a cluster.
            let differs = !matches!(cli.cmd, Cmd::Ping { .. } | Cmd::Events { .. } | Cmd::Nodes { .. });
            if !differs || !client.is_cluster() {
                let result = command(&cli, &client).await;
                client.close().await;
                return result;
            }
            ClusterClient::from_master(client)
        }
    };
    let result = match &cli.cmd {
        Cmd::Put { .. } | Cmd::Get { .. } | Cmd::Lookup { .. } | Cmd::Exists { .. } | Cmd::Rm { all: false, .. } => {
            cluster_command(&cli, &cc).await
        }
        Cmd::Rm { all: true, .. } => Err(Failure::usage("rm --all is not offered on a cluster; name the keys")),
        Cmd::Policy { cmd } => cluster_policy(cmd, &cc).await,
        Cmd::Stats { json } => cluster_stats(*json, &cc).await,
        _ => command(&cli, &cc.master()).await,
    };
    cc.master().close().await;
    result
}

/// The block commands on a cluster: through the master to the storage nodes.
async fn cluster_command(cli: &Cli, cc: &ClusterClient) -> Outcome {
    let hex = cli.hex;
    match &cli.cmd {
        Cmd::Put { key, file, parent, tokens, seq_tokens, pin, pin_ttl_ms, upsert } => {
            let key = parse_key(key, hex)?;
            let value = read_value(file.as_deref(), cc.master().limits().max_value_size)?;
            let opts = PutOptions {
                parent: parent.as_deref().map(|p| parse_key(p, hex)).transpose()?,
                tokens: *tokens,
                seq_tokens: *seq_tokens,
                pin: pin_spec(*pin, *pin_ttl_ms),
            };
            let mode = if *upsert { PutMode::Upsert } else { PutMode::Insert };
            let entry = PutEntry { key: &key, value: &value, opts };
            match cc.put_batch(std::slice::from_ref(&entry), mode, cli.replicas).await?[0] {
                ErrorCode::Ok => {}
                code => {
                    return Err(Failure { exit: 1, line: format!("{code}: put of key {}", display_key(&key, hex)) })
                }
            }
        }
        Cmd::Get { key, output } => {
            let Some(value) = cc.get(parse_key(key, hex)?).await? else {
                return Err(Failure { exit: 3, line: format!("{}: key {key}", ErrorCode::NotFound) });
            };
            write_value(output.as_deref(), &value)?;
        }
        Cmd::Lookup { keys } => out(format_args!("{}\n", cc.lookup(&parse_keys(keys, hex)?).await?))?,
        Cmd::Exists { keys } => {
            let ks = parse_keys(keys, hex)?;
            report_exists(&ks, &cc.exists(&ks).await?, hex)?;
        }
        Cmd::Rm { keys, force, .. } => {
            let ks = parse_keys(keys, hex)?;
            report_removed(&ks, &cc.remove_batch(&ks, *force).await?, hex)?;
        }
        _ => unreachable!("only block commands come here"),
    }
    Ok(())
}

/// Statistics of every live storage node, one block each (as JSON: a map by node name).
async fn cluster_stats(json: bool, cc: &ClusterClient) -> Outcome {
    let per_node = cc.stats().await?;
    if json {
        let map: serde_json::Map<String, serde_json::Value> = per_node
            .iter()
            .map(|(n, r)| {
                let v = match r {
                    Ok(s) => serde_json::to_value(s).unwrap_or_default(),
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                };
                (n.clone(), v)
            })
            .collect();
        let text = serde_json::to_string_pretty(&map).map_err(|e| Failure::io(e.to_string()))?;
        return out(format_args!("{text}\n"));
    }
    let tenant = cc.master().tenant();
    for (n, r) in &per_node {
        match r {
            Ok(s) => out(format_args!("== {n}\n{}", render_stats(s, &tenant)))?,
            Err(e) => out(format_args!("== {n}\n{e}\n"))?,
        }
    }
    if per_node.is_empty() {
        out(format_args!("(no live storage node)\n"))?;
    }
    Ok(())
}

/// Policy administration of a cluster: placement on the master, eviction and admission on
/// every live storage node; one block of output per place, and exit 1 if any place failed.
async fn cluster_policy(cmd: &PolicyCmd, cc: &ClusterClient) -> Outcome {
    let per_place: Vec<(String, Result<Vec<PolicyInfo>, ClientError>)> = match cmd {
        PolicyCmd::Load { kind, file, name, params } => {
            let wasm = std::fs::read(file).map_err(|e| Failure::io(format!("{}: {e}", file.display())))?;
            let name = name.clone().unwrap_or_else(|| {
                file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into())
            });
            cc.policy_load((*kind).into(), &name, params, &wasm)
                .await?
                .into_iter()
                .map(|(n, r)| (n, r.map(|i| vec![i])))
                .collect()
        }
        PolicyCmd::Rollback { kind } => {
            cc.policy_rollback((*kind).into()).await?.into_iter().map(|(n, r)| (n, r.map(|i| vec![i]))).collect()
        }
        PolicyCmd::List { .. } => cc.policy_list().await?,
    };
    let mut failed = Vec::new();
    for (place, r) in &per_place {
        match r {
            Ok(list) => out(format_args!("== {place}\n{}", render_policies(list)))?,
            Err(e) => {
                out(format_args!("== {place}\n{e}\n"))?;
                failed.push(format!("{place}: {e}"));
            }
        }
    }
    if per_place.is_empty() {
        return Err(Failure { exit: 1, line: "no live storage node to load the module on".into() });
    }
    if !failed.is_empty() {
        return Err(Failure {
            exit: 1,
            line: format!("{} of {} places failed: {}", failed.len(), per_place.len(), failed.join("; ")),
        });
    }
    Ok(())
}

fn pin_spec(pin: PinArg, ttl_ms: u64) -> PinSpec {
    match pin {
        PinArg::None => PinSpec::None,
        PinArg::Soft => PinSpec::Soft { ttl_ms },
        PinArg::Hard => PinSpec::Hard,
    }
}

/// A value to a file, or to stdout when `output` is none or `-`.
fn write_value(output: Option<&Path>, value: &[u8]) -> Outcome {
    match output {
        Some(path) if path.as_os_str() != "-" => {
            std::fs::write(path, value).map_err(|e| Failure::io(format!("{}: {e}", path.display())))?
        }
        _ => {
            let mut o = std::io::stdout().lock();
            match o.write_all(value).and_then(|_| o.flush()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(Failure::io(format!("stdout: {e}")))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// One line per key; exit 3 when any is absent.
fn report_exists(ks: &[Vec<u8>], present: &[bool], hex: bool) -> Outcome {
    for (k, p) in ks.iter().zip(present) {
        out(format_args!("{}\t{}\n", display_key(k, hex), if *p { "yes" } else { "no" }))?;
    }
    if present.iter().any(|p| !p) {
        return Err(Failure {
            exit: 3,
            line: format!(
                "{}: {} of {} keys absent",
                ErrorCode::NotFound,
                present.iter().filter(|p| !**p).count(),
                present.len()
            ),
        });
    }
    Ok(())
}

/// Exit 3 when only missing keys were not removed, 1 for any other refusal.
fn report_removed(ks: &[Vec<u8>], st: &[ErrorCode], hex: bool) -> Outcome {
    let failed: Vec<(String, ErrorCode)> =
        ks.iter().zip(st).filter(|(_, c)| **c != ErrorCode::Ok).map(|(k, c)| (display_key(k, hex), *c)).collect();
    if let Some((_, code)) = failed.first() {
        let names: Vec<String> = failed.iter().map(|(k, c)| format!("{k} ({c})")).collect();
        return Err(Failure {
            exit: if failed.iter().all(|(_, c)| *c == ErrorCode::NotFound) { 3 } else { 1 },
            line: format!("{code}: {} of {} keys not removed: {}", failed.len(), ks.len(), names.join(", ")),
        });
    }
    Ok(())
}

async fn command(cli: &Cli, client: &Client) -> Outcome {
    let hex = cli.hex;
    match &cli.cmd {
        Cmd::Put { key, file, parent, tokens, seq_tokens, pin, pin_ttl_ms, upsert } => {
            let key = parse_key(key, hex)?;
            let value = read_value(file.as_deref(), client.limits().max_value_size)?;
            let opts = PutOptions {
                parent: parent.as_deref().map(|p| parse_key(p, hex)).transpose()?,
                tokens: *tokens,
                seq_tokens: *seq_tokens,
                pin: pin_spec(*pin, *pin_ttl_ms),
            };
            if *upsert {
                client.upsert_with(&key, &value, opts).await?;
            } else {
                client.put_with(&key, &value, opts).await?;
            }
        }
        Cmd::Get { key, output } => {
            let k = parse_key(key, hex)?;
            let Some(value) = client.get(&k).await? else {
                return Err(Failure { exit: 3, line: format!("{}: key {key}", ErrorCode::NotFound) });
            };
            write_value(output.as_deref(), &value)?;
        }
        Cmd::Lookup { keys } => {
            let chain = parse_keys(keys, hex)?;
            out(format_args!("{}\n", client.lookup(&chain).await?))?;
        }
        Cmd::Exists { keys } => {
            let ks = parse_keys(keys, hex)?;
            report_exists(&ks, &client.exists(&ks).await?, hex)?;
        }
        Cmd::Rm { keys, all: true, force } => {
            debug_assert!(keys.is_empty());
            let r = client.remove_all(*force).await?;
            out(format_args!("removed {} blocks, kept {} leased\n", r.removed, r.skipped))?;
        }
        Cmd::Rm { keys, all: false, force } => {
            let ks = parse_keys(keys, hex)?;
            report_removed(&ks, &client.remove_batch(&ks, *force).await?, hex)?;
        }
        Cmd::Events { from, log_id, all, count, idle_ms } => {
            let scope = if *all { EventScope::All } else { EventScope::Tenant };
            let opts = SubscribeOptions { from: *from, scope, max_batch: 0, log_id: *log_id };
            let mut sub = client.subscribe(opts).await?;
            let idle = idle_ms.map(Duration::from_millis).unwrap_or(Duration::MAX);
            let (mut seen, mut last_seq) = (0u64, None);
            while count.is_none_or(|c| seen < c) {
                let Some(b) = sub.next_within(idle).await? else { break };
                if b.lagged > 0 {
                    let line = serde_json::json!({ "lagged": b.lagged, "next": b.next, "log_id": format!("{:016x}", b.log_id) });
                    out(format_args!("{line}\n"))?;
                }
                for e in b.events.iter().take(count.map_or(usize::MAX, |c| (c - seen) as usize)) {
                    last_seq = Some(e.seq);
                    let line = serde_json::json!({
                        "seq": e.seq,
                        "kind": format!("{:?}", e.kind).to_lowercase(),
                        "tier": match e.tier { 0 => "device", 1 => "dram", 2 => "ssd", _ => "unknown" },
                        "node": e.node,
                        "tenant": e.tenant,
                        "key": display_key(&e.key, hex),
                        "parent": e.parent.as_deref().map(|p| display_key(p, hex)),
                        "size": e.size,
                        "time_ms": e.time_ms,
                    });
                    out(format_args!("{line}\n"))?;
                    seen += 1;
                }
            }
            // Resume after the last event printed (not past events of a batch cut by --count).
            let next = last_seq.map_or(sub.resume_from(), |s| s + 1);
            let line = serde_json::json!({ "next": next, "log_id": format!("{:016x}", sub.log_id()) });
            out(format_args!("{line}\n"))?;
        }
        Cmd::Nodes { json } => {
            let nodes = client.nodes().await?;
            if *json {
                let text = serde_json::to_string_pretty(&nodes).map_err(|e| Failure::io(e.to_string()))?;
                out(format_args!("{text}\n"))?;
            } else {
                out(format_args!("{}", render_nodes(&nodes)))?;
            }
        }
        Cmd::Stats { json } => {
            let s = client.stats().await?;
            if *json {
                out(format_args!("{}\n", serde_json::to_string_pretty(&s).map_err(|e| Failure::io(e.to_string()))?))?;
            } else {
                out(format_args!("{}", render_stats(&s, &client.tenant())))?;
            }
        }
        Cmd::Policy { cmd: PolicyCmd::Load { kind, file, name, params } } => {
            let wasm = std::fs::read(file).map_err(|e| Failure::io(format!("{}: {e}", file.display())))?;
            let name = name.clone().unwrap_or_else(|| {
                file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into())
            });
            let info = client.policy_load((*kind).into(), &name, params, &wasm).await?;
            out(format_args!("{}", render_policies(std::slice::from_ref(&info))))?;
        }
        Cmd::Policy { cmd: PolicyCmd::List { json } } => {
            let list = client.policy_list().await?;
            if *json {
                let text = serde_json::to_string_pretty(&list).map_err(|e| Failure::io(e.to_string()))?;
                out(format_args!("{text}\n"))?;
            } else {
                out(format_args!("{}", render_policies(&list)))?;
            }
        }
        Cmd::Policy { cmd: PolicyCmd::Rollback { kind } } => {
            let info = client.policy_rollback((*kind).into()).await?;
            out(format_args!("{}", render_policies(std::slice::from_ref(&info))))?;
        }
        Cmd::Ping { count } => {
            let mut times = Vec::new();
            for i in 0..(*count).max(1) {
                if i > 0 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let rtt = client.ping().await?;
                out(format_args!("pong from {}: time={:.3} ms\n", client.config().server, rtt.as_secs_f64() * 1e3))?;
                times.push(rtt.as_secs_f64() * 1e3);
            }
            if times.len() > 1 {
                let min = times.iter().cloned().fold(f64::INFINITY, f64::min);
                let max = times.iter().cloned().fold(0.0, f64::max);
                let avg = times.iter().sum::<f64>() / times.len() as f64;
                out(format_args!("{} pings: min/avg/max = {min:.3}/{avg:.3}/{max:.3} ms\n", times.len()))?;
            }
        }
    }
    Ok(())
}

fn render_policies(list: &[PolicyInfo]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<10} {:<18} {:<11} {:<12} {:>10} {:>9} {:>7} {:>9}  params",
        "kind", "name", "state", "sha256", "answered", "fallback", "faults", "swap"
    );
    for p in list {
        let state = if p.quarantined {
            "quarantined"
        } else if p.active {
            "active"
        } else {
            "-"
        };
        let sha = if p.builtin { "built-in".to_string() } else { p.sha256.chars().take(12).collect() };
        let params: Vec<String> = p.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            o,
            "{:<10} {:<18} {:<11} {:<12} {:>10} {:>9} {:>7} {:>9}  {}",
            p.kind.name(),
            p.name,
            state,
            sha,
            p.answered,
            p.fallback_answers,
            p.faults_trap + p.faults_timeout + p.faults_invalid,
            micros(p.swap_us as f64),
            params.join(" ")
        );
    }
    o
}

fn pct(n: u64, d: u64) -> String {
    if d == 0 {
        "-".into()
    } else {
        format!("{:.1}%", n as f64 * 100.0 / d as f64)
    }
}

fn micros(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.2} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{us:.0} us")
    }
}

fn uptime(s: u64) -> String {
    let (d, h, m, sec) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h}h {m}m")
    } else if h > 0 {
        format!("{h}h {m}m {sec}s")
    } else {
        format!("{m}m {sec}s")
    }
}

/// The report for a person: sizes, hit rates, latency percentiles.
fn render_nodes(nodes: &[kvpool_client::proto::NodeInfo]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<5} {:<20} {:<22} {:<5} {:>9} {:>8}  tiers (used / capacity)",
        "node", "name", "address", "state", "silent", "copies"
    );
    for n in nodes {
        let tiers: Vec<String> = n
            .tiers
            .iter()
            .map(|t| {
                let name = match t.tier {
                    0 => "device",
                    1 => "dram",
                    2 => "ssd",
                    _ => "?",
                };
                format!("{name} {} / {}", ByteSize(t.used).to_string_as(true), ByteSize(t.capacity).to_string_as(true))
            })
            .collect();
        let _ = writeln!(
            o,
            "{:<5} {:<20} {:<22} {:<5} {:>7}ms {:>8}  {}",
            n.node,
            n.name,
            n.addr,
            if n.live { "live" } else { "dead" },
            n.silent_ms,
            n.copies,
            tiers.join(", ")
        );
    }
    if nodes.is_empty() {
        o.push_str("(no storage node has joined)\n");
    }
    o
}

fn render_stats(s: &StatsReport, tenant: &str) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "server     {}  (up {}, tenant {tenant})", s.server, uptime(s.uptime_s));
    // Tier hit/miss counters fall through: a read missing the first tier is counted again below,
    // so the first tier's hits + misses is the number of block reads.
    let reads = s.tiers.first().map(|t| t.hits + t.misses).unwrap_or(0);
    let hits: u64 = s.tiers.iter().map(|t| t.hits).sum();
    let _ = writeln!(o, "blocks     {}", s.blocks);
    let _ = writeln!(o, "hit rate   {} ({hits} of {reads} reads)", pct(hits, reads));
    let _ = writeln!(
        o,
        "moves      {} demotions, {} promotions; {} rejected puts, {} corrupt blocks",
        s.demotions, s.promotions, s.rejected_puts, s.corrupt_blocks
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<6} {:>11} {:>11} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "tier", "used", "capacity", "used%", "blocks", "hits", "misses", "hit%", "evicted"
    );
    for t in &s.tiers {
        let _ = writeln!(
            o,
            "{:<6} {:>11} {:>11} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9}",
            t.tier,
            ByteSize(t.used_bytes).to_string_as(true),
            ByteSize(t.capacity_bytes).to_string_as(true),
            pct(t.used_bytes, t.capacity_bytes),
            t.blocks,
            t.hits,
            t.misses,
            pct(t.hits, t.hits + t.misses),
            t.evictions
        );
    }
    if !s.ops.is_empty() {
        let _ = writeln!(o);
        let _ = writeln!(o, "{:<10} {:>10} {:>8} {:>10} {:>10} {:>10}", "op", "count", "errors", "p50", "p99", "mean");
        for op in &s.ops {
            let _ = writeln!(
                o,
                "{:<10} {:>10} {:>8} {:>10} {:>10} {:>10}",
                op.op,
                op.count,
                op.errors,
                micros(op.p50_us),
                micros(op.p99_us),
                micros(op.mean_us)
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kvpool").chain(args.iter().copied()))
    }

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

    #[test]
    fn keys_text_and_hex() {
        assert_eq!(parse_key("abc", false).unwrap(), b"abc");
        assert_eq!(parse_key("00ff", true).unwrap(), vec![0, 255]);
        assert_eq!(parse_key("0x01", true).unwrap(), vec![1]);
        assert_eq!(parse_key("xyz", true).unwrap_err().exit, 2);
        assert_eq!(parse_key("", false).unwrap_err().exit, 2);
    }

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

    #[test]
    fn stats_render() {
        let s = StatsReport {
            server: "kvpool-server 0.1.0".into(),
            uptime_s: 3725,
            blocks: 3,
            tiers: vec![
                kvpool_client::TierStats {
                    tier: "dram".into(),
                    capacity_bytes: 1 << 30,
                    used_bytes: 3 << 20,
                    blocks: 3,
                    hits: 3,
                    misses: 1,
                    evictions: 0,
                },
                kvpool_client::TierStats {
                    tier: "ssd".into(),
                    capacity_bytes: 0,
                    used_bytes: 0,
                    blocks: 0,
                    hits: 0,
                    misses: 1,
                    evictions: 0,
                },
            ],
            demotions: 0,
            promotions: 0,
            rejected_puts: 0,
            corrupt_blocks: 0,
            ops: vec![kvpool_client::OpStats {
                op: "get".into(),
                count: 4,
                errors: 0,
                p50_us: 120.0,
                p99_us: 2500.0,
                mean_us: 300.0,
            }],
        };
        let text = render_stats(&s, "default");
        assert!(text.contains("75.0%"), "{text}");
        assert!(text.contains("1.0 GiB"), "{text}");
        assert!(text.contains("2.50 ms"), "{text}");
        assert!(text.contains("1h 2m 5s"), "{text}");
    }
}
