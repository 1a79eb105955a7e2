//! `kvpool-bench`: throughput and latency of block puts and gets, beside an in-process memcpy
//! of the same bytes measured in the same run.

mod peers;
mod plot;
mod target;

// Trace replay, synthetic traces, pooled vs isolated caches, TTFT model.
mod cluster;
mod gen;
mod hitplot;
mod live;
mod master_scale;
mod pool;
mod pooled;
mod replay;
mod scale;
mod sim;
mod trace;
mod ttft;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use kvpool_client::ClientConfig;
use kvpool_client::TransportChoice;
use peers::{MooncakeCluster, MooncakeInstall, MooncakePath, RedisServer, RedisTarget};
use rand::{RngCore, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use target::{KvpoolShmTarget, KvpoolTarget, LocalServer, Target};

#[derive(Debug, Parser)]
#[command(name = "kvpool-bench", version, about = "kvpool benchmark harness")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Put then get blocks of several sizes, batch sizes and concurrencies
    Throughput(ThroughputArgs),
    /// Replay a Mooncake-format trace through every policy (native, Wasm, libCacheSim, Belady)
    Replay(replay::ReplayArgs),
    /// Hit rate of N node-local caches vs one pool of the same total size
    Pooled(pooled::PooledArgs),
    /// Time-to-first-token model without a cache, with node-local caches, with the pool
    Ttft(ttft::TtftArgs),
    /// Fill one server to growing block counts: RSS per block, lookup latency, restart time
    Scale(scale::ScaleArgs),
    /// The cluster master at pool scale: memory per block of its map, route latency against
    /// one node's lookup, and the time to forget a dead node (in process)
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
    ClusterFailover(cluster::FailoverArgs),
}

#[derive(Debug, Args)]
struct ThroughputArgs {
    /// Use a running server instead of starting one (needs --data-dir for its key and certificate)
    #[arg(long, env = "KVPOOL_SERVER", requires = "data_dir")]
    server: Option<String>,
    /// Data directory of a running server (endpoint.json and api-key are read from it)
    #[arg(long, env = "KVPOOL_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Block sizes
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,4MiB")]
    sizes: Vec<String>,
    /// Blocks per request
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    batches: Vec<usize>,
    /// Requests in flight on the one connection
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Bytes moved per phase (put or get) of each configuration, before rounding up to whole requests
    #[arg(long, default_value = "512MiB")]
    budget: String,
    /// Fewest requests per worker in a phase
    #[arg(long, default_value_t = 2)]
    min_ops: usize,
    /// DRAM segment of the server the bench starts; "auto" sizes it to hold the largest phase
    /// (every block of a configuration is resident before its gets start)
    #[arg(long, default_value = "auto")]
    dram: String,
    /// Tiny smoke run (small sizes, small budget)
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to this file
    #[arg(long)]
    json: Option<PathBuf>,
    /// Systems to measure, in order (kvpool, kvpool-shm, redis, mooncake, mooncake-shm); default:
    /// all whose peer is installed.
    /// A listed peer that is not installed is reported as skipped.
    #[arg(long, value_delimiter = ',', value_parser = TARGETS)]
    targets: Vec<String>,
    /// Systems that must run: a missing peer among them is an error instead of a skip
    #[arg(long, value_delimiter = ',', value_parser = TARGETS)]
    require: Vec<String>,
    /// Also draw MB/s per system per block size into this PNG file
    #[arg(long)]
    plot: Option<PathBuf>,
    /// How QUIC hands packets to the kernel, on both sides (auto, offload, large-datagrams)
    #[arg(long, default_value = "auto")]
    quic_segmentation: kvpool_client::Segmentation,
    /// Lookups of a 64-block chain to time after the kvpool (QUIC) run
    #[arg(long, default_value_t = 5000)]
    lookups: usize,
    /// Python interpreter that has Mooncake's client (`mooncake.store`) installed
    #[arg(long, env = "KVPOOL_BENCH_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// The Mooncake driver script
    #[arg(long, env = "KVPOOL_MOONCAKE_DRIVER", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/mooncake_driver.py"))]
    mooncake_driver: PathBuf,
}

/// Every system `throughput` knows how to drive: kvpool over QUIC, kvpool over same-host
/// shared memory (zero-copy buffers), Redis, Mooncake over TCP, and Mooncake's own same-host
/// path (a dummy client of `mooncake_client` over shared memory).
const TARGETS: [&str; 5] = ["kvpool", "kvpool-shm", "redis", "mooncake", "mooncake-shm"];

fn parse_size(s: &str) -> Result<usize> {
    let b: bytesize::ByteSize = s.parse().map_err(|e| anyhow::anyhow!("bad size {s:?}: {e}"))?;
    Ok(b.as_u64() as usize)
}

#[derive(Debug, Clone, Serialize)]
struct OpResult {
    ops: u64,
    bytes: u64,
    seconds: f64,
    mb_per_s: f64,
    p50_us: u64,
    p99_us: u64,
}

#[derive(Debug, Clone, Serialize)]
struct Row {
    target: String,
    block_size: usize,
    batch: usize,
    concurrency: usize,
    op: &'static str,
    result: OpResult,
    memcpy: OpResult,
    /// Target MB/s divided by memcpy MB/s of the same bytes.
    ratio: f64,
}

#[derive(Debug, Serialize)]
struct Skipped {
    target: String,
    reason: String,
}

#[derive(Debug, Serialize)]
struct Report {
    command: String,
    /// The systems measured, comma-separated, in run order.
    target: String,
    /// Systems asked for whose peer is not installed here.
    skipped: Vec<Skipped>,
    /// Version strings of the peers that ran.
    peers: Vec<String>,
    server: String,
    cpus: usize,
    mem_total: String,
    started_unix: u64,
    /// Client-side QUIC path statistics at the end of the run.
    quic: String,
    rows: Vec<Row>,
    /// Lookup latency of a 64-block chain (kvpool over QUIC).
    lookup: Option<LookupLatency>,
    /// The data-path goals, each as a ratio measured in this run.
    goals: Vec<Goal>,
}

/// One goal of the data path, checked against this run's own measurements.
#[derive(Debug, Clone, Serialize)]
struct Goal {
    goal: String,
    /// Measured value (a ratio, or microseconds for latency goals); `None` when a side of the
    /// comparison did not run.
    measured: Option<f64>,
    /// Needed value: at least this for ratios, at most this for latencies.
    needed: f64,
    at_most: bool,
}

impl Goal {
    fn met(&self) -> Option<bool> {
        self.measured.map(|m| if self.at_most { m <= self.needed } else { m >= self.needed })
    }
}

/// Best MB/s of a target for a block size and operation (optionally one batch size).
fn best<'a>(rows: &'a [Row], target: &str, size: usize, op: &str, batch: Option<usize>) -> Option<&'a Row> {
    rows.iter()
        .filter(|r| r.target == target && r.block_size == size && r.op == op && batch.is_none_or(|b| r.batch == b))
        .max_by(|a, b| a.result.mb_per_s.total_cmp(&b.result.mb_per_s))
}

/// The goals of the data-path work, from this run's rows.
fn goals(rows: &[Row], lookup: Option<&LookupLatency>) -> Vec<Goal> {
    let mb = |t: &str, size, op, batch| best(rows, t, size, op, batch).map(|r| r.result.mb_per_s);
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    let mut out = Vec::new();
    for size in [1usize << 20, 4 << 20] {
        for op in ["get", "put"] {
            let label = bytesize::ByteSize(size as u64).to_string_as(true).replace(' ', "");
            let kv = mb("kvpool", size, op, None);
            out.push(Goal {
                goal: format!("quic {label} {op}: kvpool / Redis (best of each)"),
                measured: ratio(kv, mb("redis", size, op, None)),
                needed: 1.0,
                at_most: false,
            });
            out.push(Goal {
                goal: format!("quic {label} {op}: kvpool / Mooncake TCP (best of each)"),
                measured: ratio(kv, mb("mooncake", size, op, None)),
                needed: 2.0,
                at_most: false,
            });
        }
    }
    let single = rows.iter().find(|r| {
        r.target == "kvpool" && r.block_size == 64 << 10 && r.batch == 1 && r.concurrency == 1 && r.op == "put"
    });
    out.push(Goal {
        goal: "quic 64KiB single put: p50 (us)".into(),
        measured: single.map(|r| r.result.p50_us as f64),
        needed: 1000.0,
        at_most: true,
    });
    for op in ["get", "put"] {
        let shm = best(rows, "kvpool-shm", 1 << 20, op, Some(64));
        out.push(Goal {
            goal: format!("shm 1MiB x64 {op}: kvpool-shm / memcpy of the same bytes"),
            measured: shm.map(|r| r.ratio),
            needed: 0.5,
            at_most: false,
        });
        out.push(Goal {
            goal: format!("shm 1MiB x64 {op}: kvpool-shm / Mooncake TCP (best 1MiB)"),
            measured: ratio(shm.map(|r| r.result.mb_per_s), mb("mooncake", 1 << 20, op, None)),
            needed: 10.0,
            at_most: false,
        });
        // Not in the list: a same-host path should not lose to the peer's own one.
        out.push(Goal {
            goal: format!("shm 1MiB x64 {op}: kvpool-shm / Mooncake shm (same batch)"),
            measured: ratio(shm.map(|r| r.result.mb_per_s), mb("mooncake-shm", 1 << 20, op, Some(64))),
            needed: 1.0,
            at_most: false,
        });
    }
    out.push(Goal {
        goal: "lookup of a 64-block chain: p99 (us)".into(),
        measured: lookup.map(|l| l.p99_us as f64),
        needed: 200.0,
        at_most: true,
    });
    out
}

fn print_goals(goals: &[Goal]) {
    println!("\ngoals (measured in this run):");
    for g in goals {
        let (m, verdict) = match (g.measured, g.met()) {
            (Some(m), Some(true)) => (format!("{m:.2}"), "met"),
            (Some(m), _) => (format!("{m:.2}"), "MISSED"),
            (None, _) => ("-".into(), "not measured (a side did not run)"),
        };
        let need = if g.at_most { format!("<= {}", g.needed) } else { format!(">= {}", g.needed) };
        println!("  {:<62} {:>10}  need {:<9} {}", g.goal, m, need, verdict);
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static histogram bounds")
}

fn summarize(h: &Histogram<u64>, bytes: u64, seconds: f64) -> OpResult {
    OpResult {
        ops: h.len(),
        bytes,
        seconds,
        mb_per_s: if seconds > 0.0 { bytes as f64 / seconds / 1e6 } else { 0.0 },
        p50_us: h.value_at_quantile(0.50),
        p99_us: h.value_at_quantile(0.99),
    }
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).max(1)
}

/// Buffers of one worker: one destination per item of a batch.
type WorkerBufs = Vec<Vec<u8>>;

/// memcpy of the same bytes with the same parallelism: each "op" copies one batch from the
/// shared source into the worker's own buffers. One untimed pass first, so that first touches
/// of the pages (which a VM host may have to map in) do not make the baseline look slow.
fn run_memcpy(pool: &[u8], size: usize, batch: usize, bufs: &mut [WorkerBufs], ops_per_worker: usize) -> OpResult {
    for wb in bufs.iter_mut() {
        for (j, dst) in wb.iter_mut().enumerate().take(batch) {
            dst.copy_from_slice(&pool[j * size..(j + 1) * size]);
        }
    }
    let start = Instant::now();
    let hists: Vec<Histogram<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = bufs
            .iter_mut()
            .map(|wb| {
                s.spawn(move || {
                    let mut h = hist();
                    for _ in 0..ops_per_worker {
                        let t = Instant::now();
                        for (j, dst) in wb.iter_mut().enumerate().take(batch) {
                            dst.copy_from_slice(&pool[j * size..(j + 1) * size]);
                        }
                        std::hint::black_box(&wb);
                        let _ = h.record(micros(t.elapsed()));
                    }
                    h
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("memcpy thread")).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let mut all = hist();
    for h in &hists {
        all.add(h).expect("same bounds");
    }
    let bytes = (bufs.len() * ops_per_worker * batch * size) as u64;
    summarize(&all, bytes, secs)
}

fn key(run: &str, size: usize, batch: usize, conc: usize, worker: usize, op: usize, item: usize) -> Vec<u8> {
    format!("bench/{run}/{size}/{batch}/{conc}/w{worker}/o{op}/i{item}").into_bytes()
}

struct Phase<'a> {
    target: &'a Arc<dyn Target>,
    pool: &'a Arc<Vec<u8>>,
    run: &'a Arc<String>,
    size: usize,
    batch: usize,
    ops_per_worker: usize,
    progress: &'a ProgressBar,
}

impl Phase<'_> {
    async fn put(&self, conc: usize) -> Result<OpResult> {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..conc {
            let (target, pool, run, pb) =
                (self.target.clone(), self.pool.clone(), self.run.clone(), self.progress.clone());
            let (size, batch, ops) = (self.size, self.batch, self.ops_per_worker);
            tasks.push(tokio::spawn(async move {
                let values: Vec<&[u8]> = (0..batch).map(|j| &pool[j * size..(j + 1) * size]).collect();
                let mut h = hist();
                for op in 0..ops {
                    let keys: Vec<Vec<u8>> = (0..batch).map(|j| key(&run, size, batch, conc, w, op, j)).collect();
                    let t = Instant::now();
                    target.put_batch(&keys, &values).await?;
                    let _ = h.record(micros(t.elapsed()));
                    pb.inc(1);
                }
                Ok::<_, anyhow::Error>(h)
            }));
        }
        let mut all = hist();
        for t in tasks {
            all.add(t.await??).expect("same bounds");
        }
        let secs = start.elapsed().as_secs_f64();
        Ok(summarize(&all, (conc * self.ops_per_worker * self.batch * self.size) as u64, secs))
    }

    async fn get(&self, bufs: Vec<WorkerBufs>) -> Result<(OpResult, Vec<WorkerBufs>)> {
        let conc = bufs.len();
        let start = Instant::now();
        let mut tasks = Vec::new();
        for (w, mut wb) in bufs.into_iter().enumerate() {
            let (target, run, pb) = (self.target.clone(), self.run.clone(), self.progress.clone());
            let (size, batch, ops) = (self.size, self.batch, self.ops_per_worker);
            tasks.push(tokio::spawn(async move {
                let mut h = hist();
                let mut bytes = 0u64;
                for op in 0..ops {
                    let keys: Vec<Vec<u8>> = (0..batch).map(|j| key(&run, size, batch, conc, w, op, j)).collect();
                    let mut views: Vec<&mut [u8]> = wb.iter_mut().map(|b| &mut b[..]).collect();
                    let t = Instant::now();
                    bytes += target.get_batch(&keys, &mut views).await?;
                    let _ = h.record(micros(t.elapsed()));
                    pb.inc(1);
                }
                Ok::<_, anyhow::Error>((h, bytes, wb))
            }));
        }
        let mut all = hist();
        let mut bytes = 0;
        let mut back = Vec::new();
        for t in tasks {
            let (h, b, wb) = t.await??;
            all.add(h).expect("same bounds");
            bytes += b;
            back.push(wb);
        }
        let secs = start.elapsed().as_secs_f64();
        let expect = (conc * self.ops_per_worker * self.batch * self.size) as u64;
        if bytes != expect {
            bail!("get returned {bytes} bytes, expected {expect}");
        }
        Ok((summarize(&all, bytes, secs), back))
    }

    fn all_keys(&self, conc: usize) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        for w in 0..conc {
            for op in 0..self.ops_per_worker {
                for j in 0..self.batch {
                    keys.push(key(self.run, self.size, self.batch, conc, w, op, j));
                }
            }
        }
        keys
    }
}

/// Blocks per chain in the lookup benchmark (a 32K-token prompt in 512-token blocks).
const LOOKUP_CHAIN: usize = 64;

/// Latency of `lookup` of a whole resident chain, one request at a time.
#[derive(Debug, Clone, Serialize)]
struct LookupLatency {
    count: u64,
    resident: u64,
    p50_us: u64,
    p99_us: u64,
}

/// Store 16 chains of 64 small blocks, then time `count` lookups of whole chains (every block
/// resident, so the server walks all 64).
async fn lookup_latency(client: &kvpool_client::Client, run: &str, count: usize) -> Result<LookupLatency> {
    let chains: Vec<Vec<Vec<u8>>> =
        (0..16).map(|c| (0..LOOKUP_CHAIN).map(|i| format!("lookup/{run}/{c}/{i}").into_bytes()).collect()).collect();
    let value = vec![7u8; 4096];
    for chain in &chains {
        let entries: Vec<kvpool_client::PutEntry<'_>> = chain
            .iter()
            .enumerate()
            .map(|(i, k)| kvpool_client::PutEntry {
                key: k,
                value: &value,
                opts: kvpool_client::PutOptions { parent: (i > 0).then(|| chain[i - 1].clone()), ..Default::default() },
            })
            .collect();
        client.put_batch(&entries, kvpool_client::PutMode::Upsert).await?;
    }
    let mut h = hist();
    for i in 0..count {
        let chain = &chains[i % chains.len()];
        let t = Instant::now();
        let n = client.lookup(chain).await?;
        let _ = h.record(micros(t.elapsed()));
        if n != LOOKUP_CHAIN {
            bail!("lookup found {n} of {LOOKUP_CHAIN} blocks");
        }
    }
    let resident = client.stats().await.map(|s| s.blocks).unwrap_or(0);
    for chain in &chains {
        client.remove_batch(chain, true).await?;
    }
    Ok(LookupLatency { count: h.len(), resident, p50_us: h.value_at_quantile(0.5), p99_us: h.value_at_quantile(0.99) })
}

/// What the client's side of the connection saw: path MTU reached, losses, congestion events.
fn quic_summary(client: &kvpool_client::Client) -> String {
    format!("quic (client side): {}", client.path_report())
}

fn mem_total() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("MemTotal:")).map(|l| l[9..].trim().to_string()))
        .unwrap_or_else(|| "unknown".into())
}

fn fmt_us(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.1} ms", us as f64 / 1e3)
    } else if us >= 1_000 {
        format!("{:.2} ms", us as f64 / 1e3)
    } else {
        format!("{us} us")
    }
}

fn print_header() {
    println!(
        "{:<8} {:>7} {:>5} {:>4} {:<4} {:>6} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10} {:>7}",
        "target",
        "block",
        "batch",
        "conc",
        "op",
        "reqs",
        "MB/s",
        "p50",
        "p99",
        "memcpy MB/s",
        "memcpy p50",
        "memcpy p99",
        "ratio"
    );
}

fn print_row(r: &Row) {
    println!(
        "{:<8} {:>7} {:>5} {:>4} {:<4} {:>6} {:>10.0} {:>10} {:>10} {:>12.0} {:>10} {:>10} {:>6.1}%",
        r.target,
        bytesize::ByteSize(r.block_size as u64).to_string_as(true).replace(' ', ""),
        r.batch,
        r.concurrency,
        r.op,
        r.result.ops,
        r.result.mb_per_s,
        fmt_us(r.result.p50_us),
        fmt_us(r.result.p99_us),
        r.memcpy.mb_per_s,
        fmt_us(r.memcpy.p50_us),
        fmt_us(r.memcpy.p99_us),
        r.ratio * 100.0
    );
}

async fn throughput(mut a: ThroughputArgs) -> Result<()> {
    if a.quick {
        a.sizes = vec!["64KiB".into(), "1MiB".into()];
        a.batches = vec![1, 16];
        a.concurrency = vec![1, 4];
        a.budget = "16MiB".into();
        a.min_ops = 1;
    }
    let sizes: Vec<usize> = a.sizes.iter().map(|s| parse_size(s)).collect::<Result<_>>()?;
    let budget = parse_size(&a.budget)?;
    if sizes.contains(&0) || a.batches.contains(&0) || a.concurrency.contains(&0) {
        bail!("sizes, batches and concurrency must be positive");
    }

    // Plan every configuration first so that the progress bar knows the total.
    let mut plan = Vec::new();
    for &size in &sizes {
        for &batch in &a.batches {
            for &conc in &a.concurrency {
                let per_op = size * batch;
                let ops = budget.div_ceil(per_op).max(conc * a.min_ops).div_ceil(conc);
                plan.push((size, batch, conc, ops));
            }
        }
    }
    let max_phase = plan.iter().map(|(size, batch, conc, ops)| size * batch * conc * ops).max().unwrap_or(0);
    let dram = if a.dram == "auto" {
        // Stay below the server's eviction watermark (95%) with room for allocator slack.
        let want = (max_phase as f64 / 0.8) as u64;
        let step = 256u64 << 20;
        format!("{}", want.div_ceil(step).max(2) * step)
    } else {
        a.dram.clone()
    };

    let (targets, skipped) = select_targets(&a)?;
    for s in &skipped {
        tracing::warn!(target = %s.target, "skipped: {}", s.reason);
    }

    let max_size = *sizes.iter().max().expect("at least one size");
    let max_batch = *a.batches.iter().max().expect("at least one batch");
    let max_conc = *a.concurrency.iter().max().expect("at least one concurrency");
    let mut pool = vec![0u8; max_size * max_batch];
    rand::rngs::StdRng::seed_from_u64(0x6b76706f6f6c).fill_bytes(&mut pool);
    let pool = Arc::new(pool);
    // Unique per run, so that runs against a shared server never collide.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let run = Arc::new(format!("{:x}-{nanos:x}", std::process::id()));

    let per_target: u64 = plan.iter().map(|(_, _, c, o)| (2 * c * o) as u64).sum();
    let pb = ProgressBar::new(per_target * targets.len() as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}")
            .expect("static template"),
    );

    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let mut peers_seen = Vec::new();
    let mut server = String::new();
    let mut lookup = None;
    print_header();
    for name in &targets {
        match name.as_str() {
            "kvpool" | "kvpool-shm" => {
                // Start our own server unless pointed at one.
                let (_server, mut cfg) = match (&a.server, &a.data_dir) {
                    (_, Some(dir)) => {
                        let mut cfg = ClientConfig::from_data_dir(dir)?;
                        if let Some(s) = &a.server {
                            cfg.server = s.clone();
                        }
                        (None, cfg)
                    }
                    (None, None) => {
                        let seg = a.quic_segmentation.to_string();
                        let s = LocalServer::start(&dram, &["--quic-segmentation".into(), seg])?;
                        let cfg = ClientConfig::from_data_dir(s.path())?;
                        (Some(s), cfg)
                    }
                    (Some(_), None) => unreachable!("clap requires --data-dir with --server"),
                };
                cfg.client_name = "kvpool-bench".into();
                cfg.quic.segmentation = a.quic_segmentation;
                cfg.request_timeout = Duration::from_secs(300);
                let shm = name == "kvpool-shm";
                cfg.transport = if shm { TransportChoice::Shm } else { TransportChoice::Quic };
                let (client, target): (kvpool_client::Client, Arc<dyn Target>) = if shm {
                    let t = KvpoolShmTarget::connect(cfg, &pool, max_conc, max_size * max_batch).await?;
                    (t.client().clone(), Arc::new(t))
                } else {
                    let t = KvpoolTarget::connect(cfg).await?;
                    (t.client().clone(), Arc::new(t))
                };
                server = client.hello().server;
                let limits = client.limits();
                if max_batch as u64 > limits.max_batch as u64 || max_size as u64 > limits.max_value_size {
                    bail!(
                        "the server limits (batch {}, value {}) are below this run's",
                        limits.max_batch,
                        limits.max_value_size
                    );
                }
                run_in_process(&target, &plan, &pool, &run, &pb, &mut rows).await?;
                if !shm {
                    notes.push(quic_summary(&client));
                    let l = lookup_latency(&client, &run, a.lookups).await?;
                    notes.push(format!(
                        "lookup of a {}-block chain ({} resident blocks, {} lookups, one request each): p50 {} us, p99 {} us",
                        LOOKUP_CHAIN, l.resident, l.count, l.p50_us, l.p99_us
                    ));
                    lookup = Some(l);
                }
            }
            "redis" => {
                let srv = RedisServer::start().await?;
                peers_seen.push(srv.version());
                let target: Arc<dyn Target> = Arc::new(RedisTarget::connect(srv.port).await?);
                run_in_process(&target, &plan, &pool, &run, &pb, &mut rows).await?;
            }
            "mooncake" | "mooncake-shm" => {
                let (install, path, how) = if name == "mooncake" {
                    (MooncakeInstall::find(&a.python, &a.mooncake_driver), MooncakePath::Tcp, "tcp")
                } else {
                    let how = "same-host shared memory through mooncake_client, batch_put_from / batch_get_into";
                    (MooncakeInstall::find_shm(&a.python, &a.mooncake_driver), MooncakePath::Shm, how)
                };
                let install = install.map_err(anyhow::Error::msg)?;
                // Same room as kvpool's DRAM tier; the client buffer holds every batch in flight.
                let segment = parse_size(&dram)? as u64;
                let local_buffer = ((max_size * max_batch * max_conc) as u64).max(64 << 20) + (64 << 20);
                let mut mc = tokio::task::block_in_place(|| {
                    MooncakeCluster::start(
                        &install,
                        path,
                        segment,
                        local_buffer,
                        (max_size * max_batch) as u64,
                        max_conc,
                    )
                })?;
                peers_seen.push(format!("mooncake-transfer-engine-non-cuda {} (python client, {how})", mc.version));
                for &(size, batch, conc, ops) in &plan {
                    let label = config_label(size, batch, conc);
                    pb.set_message(format!("{name} {label}"));
                    let mut bufs: Vec<WorkerBufs> =
                        (0..conc).map(|_| (0..batch).map(|_| vec![1u8; size]).collect()).collect();
                    let memcpy = run_memcpy(&pool, size, batch, &mut bufs, ops);
                    drop(bufs);
                    let (put, get) = tokio::task::block_in_place(|| mc.run(size, batch, conc, ops, &run))
                        .with_context(|| format!("{name} {label}"))?;
                    pb.inc((2 * conc * ops) as u64);
                    let bytes = (conc * ops * batch * size) as u64;
                    for (op, ph) in [("put", put), ("get", get)] {
                        let mut h = hist();
                        for l in &ph.lat_us {
                            let _ = h.record((*l).max(1));
                        }
                        let row = make_row(name, size, batch, conc, op, summarize(&h, bytes, ph.seconds), &memcpy);
                        pb.suspend(|| print_row(&row));
                        rows.push(row);
                    }
                }
            }
            other => bail!("unknown target {other}"),
        }
    }
    pb.finish_and_clear();
    for s in &skipped {
        println!("skipped {}: {}", s.target, s.reason);
    }
    for n in &notes {
        println!("{n}");
    }
    let goals = goals(&rows, lookup.as_ref());
    print_goals(&goals);

    if let Some(path) = &a.plot {
        let mut points: Vec<plot::Point> = rows
            .iter()
            .map(|r| plot::Point {
                system: r.target.clone(),
                op: r.op,
                block_size: r.block_size,
                mb_per_s: r.result.mb_per_s,
            })
            .collect();
        points.extend(rows.iter().map(|r| plot::Point {
            system: "memcpy".into(),
            op: r.op,
            block_size: r.block_size,
            mb_per_s: r.memcpy.mb_per_s,
        }));
        match plot::write_png(path, &points, "kvpool-bench throughput (loopback)") {
            Ok(()) => println!("plot: {}", path.display()),
            // A missing font must not throw away a long run's numbers.
            Err(e) => tracing::warn!("no plot written: {e:#}"),
        }
    }

    if let Some(path) = &a.json {
        let report = Report {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            target: targets.join(","),
            skipped,
            peers: peers_seen,
            server,
            cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            mem_total: mem_total(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            quic: notes.join("\n"),
            rows,
            lookup,
            goals,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Which targets run and which are skipped (peer not installed); a required one that is
/// missing is an error.
fn select_targets(a: &ThroughputArgs) -> Result<(Vec<String>, Vec<Skipped>)> {
    let asked: Vec<String> = if a.targets.is_empty() {
        // Default: everything, plus whatever --require names (already in TARGETS).
        TARGETS.iter().map(|s| s.to_string()).collect()
    } else {
        let mut t = a.targets.clone();
        for r in &a.require {
            if !t.contains(r) {
                t.push(r.clone());
            }
        }
        t
    };
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    for t in asked {
        if run.contains(&t) {
            continue;
        }
        let missing = match t.as_str() {
            "redis" => RedisServer::available().is_none().then(|| "redis-server not found on PATH".to_string()),
            "mooncake" => MooncakeInstall::find(&a.python, &a.mooncake_driver).err(),
            "mooncake-shm" => MooncakeInstall::find_shm(&a.python, &a.mooncake_driver).err(),
            _ => None,
        };
        match missing {
            None => run.push(t),
            Some(reason) if a.require.contains(&t) => {
                bail!("required target {t} is not available: {reason} (install it with bench/peers/setup.sh)")
            }
            Some(reason) => skipped.push(Skipped { target: t, reason }),
        }
    }
    Ok((run, skipped))
}

fn config_label(size: usize, batch: usize, conc: usize) -> String {
    format!("{} x{batch} c{conc}", bytesize::ByteSize(size as u64).to_string_as(true))
}

fn make_row(
    target: &str,
    size: usize,
    batch: usize,
    conc: usize,
    op: &'static str,
    r: OpResult,
    memcpy: &OpResult,
) -> Row {
    let ratio = if memcpy.mb_per_s > 0.0 { r.mb_per_s / memcpy.mb_per_s } else { 0.0 };
    Row {
        target: target.into(),
        block_size: size,
        batch,
        concurrency: conc,
        op,
        result: r,
        memcpy: memcpy.clone(),
        ratio,
    }
}

/// Every configuration of the plan against a target driven from this process: memcpy of the
/// same bytes first (so the ratio compares like with like, at that moment), then put, get,
/// cleanup.
async fn run_in_process(
    target: &Arc<dyn Target>,
    plan: &[(usize, usize, usize, usize)],
    pool: &Arc<Vec<u8>>,
    run: &Arc<String>,
    pb: &ProgressBar,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let name = target.name();
    for &(size, batch, conc, ops) in plan {
        let label = config_label(size, batch, conc);
        pb.set_message(format!("{name} {label}"));
        let mut bufs: Vec<WorkerBufs> = (0..conc).map(|_| (0..batch).map(|_| vec![1u8; size]).collect()).collect();
        let memcpy = run_memcpy(pool, size, batch, &mut bufs, ops);
        let phase = Phase { target, pool, run, size, batch, ops_per_worker: ops, progress: pb };
        let put = phase.put(conc).await.with_context(|| format!("{name}: put phase of {label}"))?;
        let (get, _bufs) = phase.get(bufs).await.with_context(|| format!("{name}: get phase of {label}"))?;
        target.cleanup(&phase.all_keys(conc)).await.with_context(|| format!("{name}: cleanup of {label}"))?;
        for (op, r) in [("put", put), ("get", get)] {
            let row = make_row(&name, size, batch, conc, op, r, &memcpy);
            pb.suspend(|| print_row(&row));
            rows.push(row);
        }
    }
    Ok(())
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
        Cmd::Throughput(a) => rt.block_on(throughput(a)),
        Cmd::Replay(a) => replay::replay(a),
        Cmd::Pooled(a) => pooled::pooled(a),
        Cmd::Ttft(a) => ttft::ttft(a),
        Cmd::Scale(a) => scale::scale(a),
        Cmd::MasterScale(a) => master_scale::master_scale(a),
        Cmd::Gen(a) => gen::gen(a),
        Cmd::LiveReplay(a) => live::live_replay(a),
        Cmd::ClusterReplay(a) => cluster::cluster_replay(a),
        Cmd::ClusterTransfer(a) => cluster::cluster_transfer(a),
        Cmd::ClusterFailover(a) => cluster::cluster_failover(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn memcpy_baseline_counts_bytes() {
        let pool = vec![3u8; 4 * 1024];
        let mut bufs = vec![vec![vec![0u8; 1024]; 4]; 2];
        let r = run_memcpy(&pool, 1024, 4, &mut bufs, 3);
        assert_eq!(r.ops, 6);
        assert_eq!(r.bytes, 2 * 3 * 4 * 1024);
        assert!(bufs.iter().flatten().all(|b| b.iter().all(|x| *x == 3)));
    }
}
