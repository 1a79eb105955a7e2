//! `kvpool`: command-line client of a kvpool server.
//!
//! `args` is the command line, `config` the client configuration it gives, `io` keys, values and
//! stdout, `commands` what each command does (`commands::cluster` on a cluster), and `render`
//! the tables printed for a person.

mod args;
mod commands;
mod config;
mod io;
mod render;

use args::{Cli, Cmd};
use clap::Parser;
use commands::{cluster_command, cluster_policy, cluster_stats, command};
use config::client_config;
use io::{parse_key, parse_keys};
use kvpool_client::{Client, ClientError, ClusterClient, ErrorCode};
use std::process::ExitCode;

/// A failure with the exit code it maps to: 1 other, 2 usage, 3 not found.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) exit: u8,
    pub(crate) line: String,
}

impl Failure {
    pub(crate) fn usage(msg: impl std::fmt::Display) -> Self {
        Failure { exit: 2, line: format!("usage: {msg}") }
    }
    pub(crate) fn io(msg: impl std::fmt::Display) -> Self {
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

pub(crate) type Outcome = Result<(), Failure>;

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
