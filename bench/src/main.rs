//! `kvpool-bench`: throughput and latency of block puts and gets, beside an in-process memcpy
//! of the same bytes measured in the same run.

mod peers;
mod plot;
mod target;

// Trace replay, synthetic traces, pooled vs isolated caches, TTFT model.
mod cluster;
mod failover;
mod gen;
mod hitplot;
mod live;
mod master_scale;
mod pool;
mod pooled;
mod replay;
mod scale;
mod scrape;
mod sim;
mod trace;
mod ttft;

mod bulkcost;
mod throughput;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "kvpool-bench", version, about = "kvpool benchmark harness")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Put then get blocks of several sizes, batch sizes and concurrencies
    Throughput(throughput::ThroughputArgs),
    /// A fixed transfer over the TCP bulk channel to a running server, with hooks around the
    /// measured requests (for instruction, system call and copy counters)
    BulkCost(bulkcost::BulkCostArgs),
    /// Replay a Mooncake-format trace through every policy (native, Wasm, libCacheSim, Belady)
    Replay(replay::ReplayArgs),
    /// Hit rate of N node-local caches vs one pool of the same total size
    Pooled(pooled::PooledArgs),
    /// Time-to-first-token model without a cache, with node-local caches, with the pool
    Ttft(ttft::TtftArgs),
    /// Fill one server to growing block counts: RSS per block, lookup latency, restart time
    Scale(scale::ScaleArgs),
    /// A cluster master's memory per block, route latency and dead-node forgetting at pool scale
    MasterScale(master_scale::MasterScaleArgs),
    /// Write a synthetic request trace (Mooncake format)
    Gen(gen::GenArgs),
    /// Replay a trace prefix through a live server and through the core, and check that they
    /// agree request by request for every policy pair
    LiveReplay(live::LiveArgs),
    /// The pooled replay through a real cluster (a master and N storage processes), beside the
    /// simulated pool and node-local caches
    ClusterReplay(cluster::ClusterArgs),
    /// Put and get through a cluster (master + 2 storage processes) beside one storage node
    /// reached directly and beside memcpy
    ClusterTransfer(cluster::TransferArgs),
    /// Failover of an etcd-elected master: time from a leader's SIGKILL to the first answered
    /// request
    ClusterFailover(failover::FailoverArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVPOOL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = std::env::var("KVPOOL_BENCH_THREADS").ok().and_then(|v| v.parse::<usize>().ok()) {
        rt.worker_threads(n.max(1));
    }
    let rt = rt.enable_all().build()?;
    match cli.cmd {
        Cmd::Throughput(a) => rt.block_on(throughput::throughput(a)),
        Cmd::BulkCost(a) => rt.block_on(bulkcost::bulk_cost(a)),
        Cmd::Replay(a) => replay::replay(a),
        Cmd::Pooled(a) => pooled::pooled(a),
        Cmd::Ttft(a) => ttft::ttft(a),
        Cmd::Scale(a) => scale::scale(a),
        Cmd::MasterScale(a) => master_scale::master_scale(a),
        Cmd::Gen(a) => gen::gen(a),
        Cmd::LiveReplay(a) => live::live_replay(a),
        Cmd::ClusterReplay(a) => cluster::cluster_replay(a),
        Cmd::ClusterTransfer(a) => cluster::cluster_transfer(a),
        Cmd::ClusterFailover(a) => failover::cluster_failover(a),
    }
}

#[cfg(test)]
#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }
}
