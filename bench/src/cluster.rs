//! `kvpool-bench cluster-replay`: the pooled replay of `pooled`, through a real cluster: a
//! master and N storage processes on this host, driven by `ClusterClient` (lookups and
//! placement at the master, bytes to and from the storage nodes). Printed beside the simulated
//! pool of the same total size and the node-local caches, with the ratio the goal is about:
//! the real cluster's block hit rate over the simulated pool's.

use crate::pool::{trace_key, PoolStats, PutItem, ReplayPool};
use crate::pooled::{self, parse_capacity, Routing};
use crate::replay::{parse_params, resolve_trace};
use crate::sim::CacheSim;
use crate::target::LocalServer;
use crate::trace::{Hits, Trace};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvpool_client::{ClientConfig, ClusterClient, ErrorCode, PutEntry, PutMode, PutOptions};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

/// Value size of every block: the DRAM tier's allocation unit (a block's size and footprint
/// agree, so a node of C units holds C blocks).
const BLOCK: usize = kvpool_server::store::dram::UNIT as usize;
pub(crate) const KEY: &str = "kvpool-bench-cluster-key";

#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Mooncake-format trace (default as for `replay`)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Storage processes
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// Cache per node, as for `pooled` (rounded up to a multiple of 64 blocks, at least 4096)
    #[arg(long, default_value = "3Mtok")]
    pub capacity_per_node: String,
    /// Replay only the first N requests
    #[arg(long)]
    pub limit: Option<usize>,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The cluster as a replay pool (one request at a time, like a single connector).
struct ClusterPool {
    rt: Rc<tokio::runtime::Runtime>,
    client: ClusterClient,
    value: Vec<u8>,
    max_batch: usize,
    error: Rc<RefCell<Option<anyhow::Error>>>,
    stats: PoolStats,
    /// Blocks a lookup reported that the get then did not find (evicted, or not yet reported
    /// gone, in between).
    stale: Rc<Cell<u64>>,
}

impl ClusterPool {
    fn fail(&self, e: impl Into<anyhow::Error>) {
        self.error.borrow_mut().get_or_insert(e.into());
    }
}

impl ReplayPool for ClusterPool {
    fn lookup(&mut self, chain: &[u64], _now_us: u64) -> usize {
        if self.error.borrow().is_some() || chain.is_empty() {
            return 0;
        }
        let keys: Vec<Vec<u8>> = chain.iter().map(|&k| trace_key(k)).collect();
        let mut n = 0;
        for part in keys.chunks(self.max_batch) {
            match self.rt.block_on(self.client.lookup(part)) {
                Ok(k) => {
                    n += k;
                    if k < part.len() {
                        break;
                    }
                }
                Err(e) => {
                    self.fail(e);
                    return 0;
                }
            }
        }
        n
    }

    fn get(&mut self, keys: &[u64], _now_us: u64) {
        if self.error.borrow().is_some() {
            return;
        }
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| trace_key(k)).collect();
        for part in names.chunks(self.max_batch) {
            match self.rt.block_on(self.client.get_batch(part)) {
                Ok(got) => {
                    for g in got {
                        match g.status {
                            ErrorCode::Ok if g.value.as_deref() == Some(self.value.as_slice()) => {}
                            ErrorCode::Ok => return self.fail(anyhow::anyhow!("a get returned wrong bytes")),
                            _ => self.stale.set(self.stale.get() + 1),
                        }
                    }
                }
                Err(e) => return self.fail(e),
            }
        }
    }

    fn put(&mut self, items: &[PutItem], _now_us: u64) {
        if self.error.borrow().is_some() {
            return;
        }
        for part in items.chunks(self.max_batch) {
            let keys: Vec<(Vec<u8>, Option<Vec<u8>>)> =
                part.iter().map(|it| (trace_key(it.key), it.parent.map(trace_key))).collect();
            let entries: Vec<PutEntry<'_>> = part
                .iter()
                .zip(&keys)
                .map(|(it, (k, p))| PutEntry {
                    key: k,
                    value: &self.value,
                    opts: PutOptions {
                        parent: p.clone(),
                        tokens: it.tokens,
                        seq_tokens: it.seq_tokens,
                        ..PutOptions::default()
                    },
                })
                .collect();
            match self.rt.block_on(self.client.put_batch(&entries, PutMode::Insert, 1)) {
                Ok(st) => self.stats.count_put(st),
                Err(e) => return self.fail(e),
            }
        }
    }

    fn release(&mut self) {}

    fn stats(&self) -> PoolStats {
        self.stats
    }
}

#[derive(Debug, Serialize)]
struct ClusterReport {
    command: String,
    trace: String,
    requests: usize,
    nodes: usize,
    capacity_per_node_blocks: usize,
    node_local_round_robin: Hits,
    simulated_pool: Hits,
    cluster: Hits,
    /// cluster block hit rate / simulated pool block hit rate.
    cluster_over_pool: f64,
    cluster_stats: PoolStats,
    stale_lookups: u64,
    cluster_seconds: f64,
    /// Copies per node at the end (the master's view).
    copies_per_node: Vec<u64>,
}

pub fn cluster_replay(a: ClusterArgs) -> Result<()> {
    let path = resolve_trace(&a.trace)?;
    let trace = Trace::load(&path, a.limit)?;
    let per_node = parse_capacity(&a.capacity_per_node, trace.distinct_blocks())?.div_ceil(64).max(64) * 64;
    let per_node = per_node.max(4096);
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let params = parse_params(&[])?;
    eprintln!("simulating {} node-local caches and one pool of {} blocks...", a.nodes, a.nodes * per_node);
    let sim = pooled::run(&trace, a.nodes, per_node, Routing::RoundRobin, "leaf-lru", &params, || {})?;

    let dir = tempfile::tempdir()?;
    // Storage nodes run as `live-replay` runs its server: eviction only when a reservation
    // needs room, no lease past a request.
    let (master, _nodes, cfg) =
        start_cluster(a.nodes, &(per_node * BLOCK).to_string(), crate::live::SERVER_CONFIG, dir.path())?;
    let rt = Rc::new(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?);
    let client = rt.block_on(ClusterClient::connect(cfg))?;
    let started = Instant::now();
    loop {
        let n = rt.block_on(client.nodes())?;
        if n.iter().filter(|n| n.live).count() == a.nodes {
            break;
        }
        if started.elapsed().as_secs() > 30 {
            bail!("only {} of {} storage nodes joined: {n:?}", n.len(), a.nodes);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let max_batch = client.master().limits().max_batch as usize;
    let error = Rc::new(RefCell::new(None));
    let stale = Rc::new(Cell::new(0));
    let pool = ClusterPool {
        rt: rt.clone(),
        client: client.clone(),
        value: vec![0x5a; BLOCK],
        max_batch,
        error: error.clone(),
        stats: PoolStats::default(),
        stale: stale.clone(),
    };
    let mut live = CacheSim::over(Box::new(pool), crate::sim::Clock::default());
    eprintln!("replaying {} requests through a master and {} storage processes...", trace.requests.len(), a.nodes);
    let started = Instant::now();
    for (i, r) in trace.requests.iter().enumerate() {
        live.request(r);
        if let Some(e) = error.borrow_mut().take() {
            return Err(e.context(format!("at request {i}; master log:\n{}", master.log_tail())));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let copies: Vec<u64> = rt.block_on(client.nodes())?.iter().map(|n| n.copies).collect();
    let ratio = live.hits.block_rate() / sim.pool_total.block_rate().max(f64::MIN_POSITIVE);
    let report = ClusterReport {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        trace: path.display().to_string(),
        requests: trace.requests.len(),
        nodes: a.nodes,
        capacity_per_node_blocks: per_node,
        node_local_round_robin: sim.local_total,
        simulated_pool: sim.pool_total,
        cluster: live.hits,
        cluster_over_pool: ratio,
        cluster_stats: live.stats(),
        stale_lookups: stale.get(),
        cluster_seconds: seconds,
        copies_per_node: copies,
    };
    println!(
        "{} nodes x {} blocks ({} requests, {:.1} s through the cluster)",
        a.nodes, per_node, report.requests, seconds
    );
    println!("{:<28} {:>10} {:>10}", "setup", "block hit", "token hit");
    for (name, h) in [
        ("node-local (round-robin)", &report.node_local_round_robin),
        ("simulated pool", &report.simulated_pool),
        ("real cluster", &report.cluster),
    ] {
        println!("{name:<28} {:>10.4} {:>10.4}", h.block_rate(), h.token_rate());
    }
    println!(
        "cluster / simulated pool: {:.4} (goal >= 0.98: {}); stale lookups {}; copies per node {:?}",
        ratio,
        if ratio >= 0.98 { "met" } else { "MISSED" },
        report.stale_lookups,
        report.copies_per_node
    );
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

// ---- cluster-transfer -------------------------------------------------------------------------

#[derive(Debug, Args)]
pub struct TransferArgs {
    /// Block sizes
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,4MiB")]
    pub sizes: Vec<String>,
    /// Blocks per request
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Bytes moved per size and direction
    #[arg(long, default_value = "256MiB")]
    pub bytes: String,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Across hosts: storage node i on host i (a network namespace on a bridge, at `--mtu`),
    /// the master and the client on the root namespace (needs root)
    #[arg(long)]
    pub hosts: bool,
    /// Link MTU with `--hosts`
    #[arg(long, default_value_t = 1500)]
    pub mtu: u32,
    /// Path of bulk bytes from the client to the nodes: quic, tcp (the TCP bulk channel, TLS)
    /// or auto (tcp to nodes on other hosts)
    #[arg(long, default_value = "quic")]
    pub bulk: kvpool_client::BulkChoice,
}

#[derive(Debug, Serialize)]
struct TransferRow {
    path: String,
    size: u64,
    batch: usize,
    op: &'static str,
    mb_s: f64,
    p50_us: u64,
    p99_us: u64,
    /// MB/s over memcpy's MB/s of the same bytes.
    of_memcpy: f64,
    /// MB/s over the single storage node's (direct) MB/s.
    of_single_node: f64,
}

fn parse_size(s: &str) -> Result<u64> {
    Ok(s.parse::<bytesize::ByteSize>().map_err(|e| anyhow::anyhow!("bad size {s:?}: {e}"))?.as_u64())
}

struct Timed {
    mb_s: f64,
    hist: hdrhistogram::Histogram<u64>,
}

impl Timed {
    fn new() -> Timed {
        Timed { mb_s: 0.0, hist: hdrhistogram::Histogram::new(3).expect("3 digits") }
    }
}

/// The cluster's one admin key, in `dir`: its file, and the `[[auth.keys]]` entry every node
/// gets (all nodes must accept the clients' key).
pub(crate) fn cluster_auth(dir: &std::path::Path) -> Result<(PathBuf, String)> {
    let key_file = dir.join("admin-key");
    std::fs::write(&key_file, format!("{KEY}\n"))?;
    let auth = format!(
        "[[auth.keys]]\ntenant = \"default\"\nsha256 = \"{}\"\nadmin = true\n",
        hex::encode(Sha256::digest(KEY.as_bytes()))
    );
    Ok((key_file, auth))
}

/// A master and `n` storage nodes on this host with `dram` each and `storage_extra` in their
/// config; the returned config reaches the master with the admin key.
fn start_cluster(
    n: usize,
    dram: &str,
    storage_extra: &str,
    dir: &std::path::Path,
) -> Result<(LocalServer, Vec<LocalServer>, ClientConfig)> {
    start_cluster_at(n, dram, storage_extra, dir, None)
}

/// [`start_cluster`], with `hosts`: the master on the root namespace's address, storage node i
/// on host i + 1.
fn start_cluster_at(
    n: usize,
    dram: &str,
    storage_extra: &str,
    dir: &std::path::Path,
    hosts: Option<&kvpool_netns::Hosts>,
) -> Result<(LocalServer, Vec<LocalServer>, ClientConfig)> {
    let root = hosts.map_or_else(crate::peers::Place::local, crate::peers::Place::root);
    let (key_file, auth) = cluster_auth(dir)?;
    let master_cfg = dir.join("master.toml");
    std::fs::write(&master_cfg, format!("{auth}\n[cluster]\nrole = \"master\"\nreport_ms = 200\n"))?;
    let master = LocalServer::start_at(&root, "1MiB", &["--config".into(), master_cfg.display().to_string()])?;
    let ep = kvpool_client::EndpointInfo::read(master.path())?;
    let storage_cfg = dir.join("storage.toml");
    std::fs::write(&storage_cfg, format!("{auth}\n{storage_extra}"))?;
    let fp = ep.fingerprint.clone().context("the master wrote no certificate fingerprint")?;
    let mut nodes = Vec::new();
    for i in 0..n {
        let args: Vec<String> = [
            "--config",
            &storage_cfg.display().to_string(),
            "--role",
            "storage",
            "--master",
            &ep.quic_addr,
            "--master-fingerprint",
            &fp,
            "--master-key-file",
            &key_file.display().to_string(),
            "--node-name",
            &format!("s{i}"),
        ]
        .map(String::from)
        .to_vec();
        let at = match hosts {
            Some(h) => crate::peers::Place::host(h, i + 1)?,
            None => root.clone(),
        };
        nodes.push(LocalServer::start_at(&at, dram, &args)?);
    }
    let mut cfg = ClientConfig::new(ep.quic_addr.clone(), KEY, ep.trust()?);
    cfg.server_name = ep.server_name.clone();
    Ok((master, nodes, cfg))
}

pub fn cluster_transfer(a: TransferArgs) -> Result<()> {
    let sizes: Vec<u64> = a.sizes.iter().map(|s| parse_size(s)).collect::<Result<_>>()?;
    let total = parse_size(&a.bytes)?;
    let dir = tempfile::tempdir()?;
    // Room for every block of every size in each node (node 0 takes the direct puts, half of
    // the cluster's and a copy of every replicated one): nothing is evicted while measuring.
    let dram = format!("{}", 3 * total * sizes.len() as u64 + (256 << 20));
    let hosts = if a.hosts {
        if let Some(why) = kvpool_netns::unavailable() {
            bail!("--hosts: {why}");
        }
        println!("across hosts, link MTU {}: storage nodes on hosts 1 and 2, master and client on the root", a.mtu);
        Some(kvpool_netns::Hosts::new(2, a.mtu)?)
    } else {
        None
    };
    let (_master, nodes, mut cfg) = start_cluster_at(2, &dram, "", dir.path(), hosts.as_ref())?;
    cfg.transport = kvpool_client::TransportChoice::Quic;
    cfg.bulk = a.bulk;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let cluster = rt.block_on(ClusterClient::connect(cfg.clone()))?;
    let started = Instant::now();
    while rt.block_on(cluster.nodes())?.iter().filter(|n| n.live).count() < 2 {
        if started.elapsed().as_secs() > 30 {
            bail!("the storage nodes did not join");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let ep0 = kvpool_client::EndpointInfo::read(nodes[0].path())?;
    let mut direct_cfg = ClientConfig::new(ep0.quic_addr.clone(), KEY, ep0.trust()?);
    direct_cfg.server_name = ep0.server_name.clone();
    direct_cfg.transport = kvpool_client::TransportChoice::Quic;
    direct_cfg.bulk = a.bulk;
    let direct = rt.block_on(kvpool_client::Client::connect(direct_cfg))?;

    let mut rows = Vec::new();
    for (si, &size) in sizes.iter().enumerate() {
        let rounds = (total / (size * a.batch as u64)).max(4) as usize;
        let value: Vec<u8> = (0..size).map(|i| (i * 131 % 251) as u8).collect();
        // memcpy of the same batches, from a pool larger than the caches.
        let src = vec![7u8; (size as usize * a.batch).max(64 << 20)];
        let mut dst = vec![0u8; size as usize * a.batch];
        let mut mc = Timed::new();
        let t0 = Instant::now();
        for r in 0..rounds {
            let s = Instant::now();
            for b in 0..a.batch {
                let off = ((r * a.batch + b) * size as usize) % (src.len() - size as usize + 1);
                dst[b * size as usize..(b + 1) * size as usize].copy_from_slice(&src[off..off + size as usize]);
            }
            std::hint::black_box(&dst);
            mc.hist.record(s.elapsed().as_micros() as u64)?;
        }
        mc.mb_s = (rounds as u64 * a.batch as u64 * size) as f64 / t0.elapsed().as_secs_f64() / 1e6;
        let mut results: Vec<(&str, &'static str, Timed)> = Vec::new();
        let paths = match a.bulk {
            kvpool_client::BulkChoice::Quic => [
                ("single node (direct QUIC)", 0u32),
                ("cluster (master + 2 nodes, QUIC)", 1),
                ("cluster, 2 replicas", 2),
            ],
            _ => [
                ("single node (direct, bulk TCP)", 0u32),
                ("cluster (master + 2 nodes, bulk TCP)", 1),
                ("cluster, 2 replicas, bulk TCP", 2),
            ],
        };
        for (path, replicas) in paths {
            let cl = replicas > 0;
            for op in ["put", "get"] {
                let mut t = Timed::new();
                let t0 = Instant::now();
                for r in 0..rounds {
                    let keys: Vec<Vec<u8>> =
                        (0..a.batch).map(|b| format!("x{si}-{replicas}-{r}-{b}").into_bytes()).collect();
                    let s = Instant::now();
                    if op == "put" {
                        let entries: Vec<PutEntry<'_>> = keys.iter().map(|k| PutEntry::new(k, &value)).collect();
                        let st = if cl {
                            rt.block_on(cluster.put_batch(&entries, PutMode::Insert, replicas))?
                        } else {
                            rt.block_on(direct.put_batch(&entries, PutMode::Insert))?
                        };
                        if st.iter().any(|s| *s != ErrorCode::Ok) {
                            bail!("{path}: put answered {st:?}");
                        }
                    } else {
                        let got = if cl {
                            rt.block_on(cluster.get_batch(&keys))?
                        } else {
                            rt.block_on(direct.get_batch(&keys))?
                        };
                        if got.iter().any(|g| g.status != ErrorCode::Ok) {
                            bail!("{path}: a get missed");
                        }
                    }
                    t.hist.record(s.elapsed().as_micros() as u64)?;
                }
                t.mb_s = (rounds as u64 * a.batch as u64 * size) as f64 / t0.elapsed().as_secs_f64() / 1e6;
                if cl && op == "put" {
                    // The cluster's gets need the master to know the blocks: wait for the reports.
                    let last: Vec<Vec<u8>> =
                        (0..a.batch).map(|b| format!("x{si}-{replicas}-{}-{b}", rounds - 1).into_bytes()).collect();
                    while rt.block_on(cluster.lookup(&last))? < last.len() {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                }
                results.push((path, op, t));
            }
        }
        rows.push(TransferRow {
            path: "memcpy".into(),
            size,
            batch: a.batch,
            op: "copy",
            mb_s: mc.mb_s,
            p50_us: mc.hist.value_at_quantile(0.5),
            p99_us: mc.hist.value_at_quantile(0.99),
            of_memcpy: 1.0,
            of_single_node: f64::NAN,
        });
        for (path, op, t) in &results {
            let single =
                results.iter().find(|(p, o, _)| p.starts_with("single") && o == op).map_or(f64::NAN, |r| r.2.mb_s);
            rows.push(TransferRow {
                path: path.to_string(),
                size,
                batch: a.batch,
                op,
                mb_s: t.mb_s,
                p50_us: t.hist.value_at_quantile(0.5),
                p99_us: t.hist.value_at_quantile(0.99),
                of_memcpy: t.mb_s / mc.mb_s,
                of_single_node: t.mb_s / single,
            });
        }
    }
    println!(
        "{:<34} {:>8} {:>5} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "path", "size", "batch", "op", "MB/s", "p50 us", "p99 us", "/memcpy", "/single"
    );
    for r in &rows {
        println!(
            "{:<34} {:>8} {:>5} {:>4} {:>9.0} {:>9} {:>9} {:>9.3} {:>9.2}",
            r.path,
            bytesize::ByteSize(r.size).to_string_as(true),
            r.batch,
            r.op,
            r.mb_s,
            r.p50_us,
            r.p99_us,
            r.of_memcpy,
            r.of_single_node
        );
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
