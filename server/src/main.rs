//! `kvpool-server`: run a kvpool node. With no arguments it starts the embedded default
//! (data in ./kvpool-data, self-signed TLS, a generated admin key).

use anyhow::Context;
use clap::Parser;
use kvpool_server::config::{self, Size};
use std::path::PathBuf;

// See server/Cargo.toml: small allocations stay cheap on a heap that has held millions of keys.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start (`_RJEM_MALLOC_CONF` in the environment still
/// overrides them). The heap holds the block index: freed pages (a table that doubled, a burst
/// of requests) are handed back by a background thread after 1 s instead of waiting in the
/// heap for the next allocation to purge them, so an idle node's resident memory is what its
/// blocks need (about 35 B a block more at 500K blocks otherwise), and no request pays for it.
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
static malloc_conf: &[u8; 60] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

/// jemalloc's own account of the heap, for `/metrics` (`kvpool_heap_bytes`).
fn jemalloc_stats() -> Option<kvpool_server::metrics::HeapStats> {
    use tikv_jemalloc_ctl::{epoch, stats};
    // The statistics are a snapshot taken at the last epoch advance.
    epoch::advance().ok()?;
    Some(kvpool_server::metrics::HeapStats {
        allocated: stats::allocated::read().ok()? as u64,
        active: stats::active::read().ok()? as u64,
        resident: stats::resident::read().ok()? as u64,
        retained: stats::retained::read().ok()? as u64,
    })
}

#[derive(Parser, Debug)]
#[command(name = "kvpool-server", version, about = "kvpool KV-cache pool server")]
struct Args {
    /// kvpool TOML config (a Mooncake JSON or HIXL TOML is recognised too).
    #[arg(long, env = "KVPOOL_CONFIG")]
    config: Option<PathBuf>,
    /// Mooncake `mooncake_store_config.json`, mapped onto kvpool settings.
    #[arg(long, env = "MOONCAKE_CONFIG_PATH")]
    mooncake_config: Option<PathBuf>,
    /// HIXL `hixl_transfer_config.toml`, mapped onto kvpool settings.
    #[arg(long, env = "HIXL_CONFIG_PATH")]
    hixl_config: Option<PathBuf>,
    /// Overrides server.data_dir.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Overrides server.listen (QUIC, UDP).
    #[arg(long)]
    listen: Option<String>,
    /// Overrides server.metrics_listen ("off" disables).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Overrides dram.size, e.g. "4GiB".
    #[arg(long)]
    dram_size: Option<String>,
    /// Overrides ssd.capacity ("0" disables the SSD tier).
    #[arg(long)]
    ssd_capacity: Option<String>,
    /// Overrides ssd.dir.
    #[arg(long)]
    ssd_dir: Option<PathBuf>,
    /// Overrides cache.store_threshold (tokens).
    #[arg(long)]
    store_threshold: Option<u64>,
    /// Overrides quic.segmentation (auto, offload, large-datagrams).
    #[arg(long)]
    quic_segmentation: Option<kvpool_net::Segmentation>,
    /// Overrides bulk.trusted_networks: CIDRs (comma-separated) whose clients may move bulk
    /// bytes over plaintext TCP.
    #[arg(long, value_delimiter = ',')]
    bulk_trusted_networks: Option<Vec<ipnet::IpNet>>,
    /// Overrides cluster.role: all (a pool of one), master, or storage.
    #[arg(long)]
    role: Option<config::Role>,
    /// Storage: the master's QUIC address (cluster.master).
    #[arg(long)]
    master: Option<String>,
    /// Storage: SHA-256 fingerprint of the master's certificate (cluster.master_fingerprint).
    #[arg(long)]
    master_fingerprint: Option<String>,
    /// Storage: file holding an admin API key of the master (cluster.master_key_file).
    #[arg(long)]
    master_key_file: Option<PathBuf>,
    /// etcd endpoints for leader election of masters, and where storage nodes find the leader
    /// (cluster.etcd).
    #[arg(long)]
    etcd: Option<String>,
    /// Storage: this node's name in the pool (cluster.node_name).
    #[arg(long)]
    node_name: Option<String>,
    /// Print the effective config (TOML) and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvpool_server::metrics::set_heap_probe(jemalloc_stats);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut loaded =
        config::load(args.config.as_deref(), args.mooncake_config.as_deref(), args.hixl_config.as_deref())?;
    let c = &mut loaded.config;
    if let Some(d) = args.data_dir {
        c.server.data_dir = d;
    }
    if let Some(l) = args.listen {
        c.server.listen = l;
    }
    if let Some(m) = args.metrics_listen {
        c.server.metrics_listen = m;
    }
    if let Some(s) = args.dram_size {
        c.dram.size = Size::parse(&s).map_err(anyhow::Error::msg).context("--dram-size")?;
    }
    if let Some(s) = args.ssd_capacity {
        c.ssd.capacity = Size::parse(&s).map_err(anyhow::Error::msg).context("--ssd-capacity")?;
    }
    if let Some(d) = args.ssd_dir {
        c.ssd.dir = Some(d);
    }
    if let Some(t) = args.store_threshold {
        c.cache.store_threshold = t;
    }
    if let Some(s) = args.quic_segmentation {
        c.quic.segmentation = s;
    }
    if let Some(n) = args.bulk_trusted_networks {
        c.bulk.trusted_networks = n;
    }
    if let Some(r) = args.role {
        c.cluster.role = r;
    }
    if let Some(m) = args.master {
        c.cluster.master = Some(m);
    }
    if let Some(f) = args.master_fingerprint {
        c.cluster.master_fingerprint = Some(f);
    }
    if let Some(f) = args.master_key_file {
        c.cluster.master_key_file = Some(f);
    }
    if let Some(e) = args.etcd {
        c.cluster.etcd = Some(e);
    }
    if let Some(n) = args.node_name {
        c.cluster.node_name = Some(n);
    }
    c.validate()?;
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    if args.print_config {
        print!("# effective kvpool config; sources: {}\n{}", loaded.sources.join(", "), loaded.config.to_toml());
        return Ok(());
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if loaded.config.server.worker_threads > 0 {
        rt.worker_threads(loaded.config.server.worker_threads as usize);
    }
    let rt = rt.enable_all().build()?;
    rt.block_on(async move {
        // Handlers first: a SIGTERM that arrives while the server starts (a supervisor giving
        // up, a test tearing down) must shut it down cleanly, not kill it mid-start.
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let handle = kvpool_server::start(loaded.config).await?;
        if let Some(k) = &handle.api_key_file {
            tracing::info!(
                "connect with: kvpool --data-dir {} ping   (or KVPOOL_SERVER={} KVPOOL_CA={} KVPOOL_API_KEY_FILE={})",
                handle.data_dir.display(),
                handle.quic_addr,
                handle.cert_path.display(),
                k.display()
            );
        }
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        handle.shutdown().await;
        anyhow::Ok(())
    })
}
