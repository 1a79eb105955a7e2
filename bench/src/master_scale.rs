//! `kvpool-bench master-scale`: what a cluster master costs as the pool grows. A real master
//! process is fed the reports of N storage nodes (this process plays the nodes: it joins them,
//! reports every copy they would hold, and keeps them alive); at each block count it measures
//! the master's resident memory per block and the latency of a 64-key `Route`, beside a single
//! node's 64-key `Lookup` at the same count (a real server filled in the same run, up to
//! `--baseline-max` blocks). Then one node stops reporting, as a dead node does: how long until
//! its copies are no longer routed, and what routes of the other nodes' keys cost meanwhile.

use crate::scale::{key, rss, timed_chains};
use crate::target::LocalServer;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvpool_client::proto::{KvEventKind, NodeBlock, NodeJoinRequest, NodeReportRequest, TierUse};
use kvpool_client::{Client, ClientConfig, PutEntry, PutMode, PutOptions, Trust};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct MasterScaleArgs {
    /// Block counts to fill the pool to, in increasing order
    #[arg(long, value_delimiter = ',', default_value = "1M,10M")]
    counts: Vec<String>,
    /// Storage nodes (played by this process)
    #[arg(long, default_value_t = 8)]
    nodes: u32,
    /// Key length in bytes
    #[arg(long, default_value_t = 40)]
    key_len: usize,
    /// Blocks per prefix chain; a chain is on one node
    #[arg(long, default_value_t = 64)]
    chain: usize,
    /// Timed 64-key routes (and single-node lookups) at each count
    #[arg(long, default_value_t = 3000)]
    lookups: usize,
    /// Copies per report request
    #[arg(long, default_value_t = 20_000)]
    report_batch: usize,
    /// Largest single node filled for the baseline (filling one through puts is slow)
    #[arg(long, default_value = "1M")]
    baseline_max: String,
    /// Also write the results as JSON to this file
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MasterRow {
    pub blocks: u64,
    pub master_rss_bytes: u64,
    pub master_bytes_per_block: f64,
    pub route_p50_us: u64,
    pub route_p99_us: u64,
    /// The single node's figures at `baseline_blocks` (the largest count at most `baseline_max`).
    pub baseline_blocks: u64,
    pub lookup_p50_us: u64,
    pub lookup_p99_us: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ForgetResult {
    pub node_blocks: u64,
    /// From the node's last report to the first route that no longer names it (includes the
    /// master's `node_timeout_ms`).
    pub unrouted_after_ms: u64,
    pub node_timeout_ms: u64,
    /// Routes of other nodes' keys while the node is forgotten.
    pub route_p99_during_us: u64,
    pub route_max_during_us: u64,
    pub master_rss_after_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct MasterScaleResult {
    pub nodes: u32,
    pub key_len: usize,
    pub empty_rss_bytes: u64,
    pub rows: Vec<MasterRow>,
    pub forget: ForgetResult,
}

const NODE_TIMEOUT_MS: u64 = 1000;
const REPORT_MS: u64 = 100;
const TENANT: &str = "default";

fn tiers() -> Vec<TierUse> {
    vec![TierUse { tier: 1, capacity: 1 << 50, used: 0 }]
}

pub fn master_scale(a: MasterScaleArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run(a))
}

async fn run(a: MasterScaleArgs) -> Result<()> {
    let counts: Vec<u64> = a.counts.iter().map(|c| crate::scale::parse_count(c)).collect::<Result<_>>()?;
    let baseline_max = crate::scale::parse_count(&a.baseline_max)?;
    let dir = tempfile::tempdir()?;
    let (_key_file, auth) = crate::cluster::cluster_auth(dir.path())?;
    let cfg_path = dir.path().join("master.toml");
    std::fs::write(
        &cfg_path,
        format!("{auth}\n[cluster]\nrole = \"master\"\nreport_ms = {REPORT_MS}\nnode_timeout_ms = {NODE_TIMEOUT_MS}\n"),
    )?;
    let master = LocalServer::start("1MiB", &["--config".into(), cfg_path.display().to_string()])?;
    let mcfg = admin_config(master.path())?;
    let m = Client::connect_direct(mcfg.clone()).await?;
    // The nodes join; a task keeps them alive with empty reports until told to stop.
    let mut ids = Vec::new();
    for i in 0..a.nodes {
        let j = m
            .node_join(NodeJoinRequest {
                name: format!("n{i}"),
                addr: format!("127.0.0.{}:7100", i + 2),
                server_name: "localhost".into(),
                fingerprint: vec![0; 32],
                incarnation: 1,
                tiers: tiers(),
            })
            .await?;
        ids.push(j.node);
    }
    warm_up(&m, ids[0], &a).await?;
    let empty_rss = rss(master.pid())?;
    let alive: Arc<Vec<AtomicBool>> = Arc::new(ids.iter().map(|_| AtomicBool::new(true)).collect());
    let beat = {
        let (m, ids, alive) = (m.clone(), ids.clone(), alive.clone());
        tokio::spawn(async move {
            loop {
                for (i, &node) in ids.iter().enumerate() {
                    if alive[i].load(Ordering::Relaxed) {
                        let r =
                            NodeReportRequest { node, incarnation: 1, reset: false, tiers: tiers(), blocks: vec![] };
                        let _ = m.node_report(r).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(REPORT_MS)).await;
            }
        })
    };
    let single = LocalServer::start("4GiB", &[])?;
    // Over QUIC, as the routes: a remote connector's view of both.
    let mut scfg = ClientConfig::from_data_dir(single.path())?;
    scfg.transport = kvpool_client::TransportChoice::Quic;
    let s = Client::connect_direct(scfg).await?;
    let mut rows = Vec::new();
    let (mut filled, mut single_filled) = (0u64, 0u64);
    let (mut base_p50, mut base_p99) = (0, 0);
    for &n in &counts {
        let chains = n / a.chain as u64;
        let t = Instant::now();
        report_chains(&m, &ids, &a, filled / a.chain as u64, chains).await?;
        filled = chains * a.chain as u64;
        eprintln!("master: {filled} blocks reported in {:.1} s", t.elapsed().as_secs_f64());
        let master_rss = rss(master.pid())?;
        let (p50, p99) = timed_chains(a.lookups, a.chain, a.key_len, chains, |keys| {
            let m = m.clone();
            async move { Ok(m.route(&keys).await?.items.iter().take_while(|h| !h.is_empty()).count()) }
        })
        .await?;
        let base = (n.min(baseline_max) / a.chain as u64) * a.chain as u64;
        if base > single_filled {
            fill_single(&s, &a, single_filled / a.chain as u64, base / a.chain as u64).await?;
            single_filled = base;
            (base_p50, base_p99) = timed_chains(a.lookups, a.chain, a.key_len, base / a.chain as u64, |keys| {
                let s = s.clone();
                async move { Ok(s.lookup(&keys).await?) }
            })
            .await?;
        }
        let row = MasterRow {
            blocks: filled,
            master_rss_bytes: master_rss,
            master_bytes_per_block: master_rss.saturating_sub(empty_rss) as f64 / filled as f64,
            route_p50_us: p50,
            route_p99_us: p99,
            baseline_blocks: single_filled,
            lookup_p50_us: base_p50,
            lookup_p99_us: base_p99,
        };
        println!(
            "{:>10} blocks: master {:.1} B/block (goal <= 64: {}), route p50 {} us p99 {} us; one node at {} blocks: \
             lookup p50 {} us p99 {} us; route p99 / lookup p99 = {:.2} (goal <= 2: {})",
            row.blocks,
            row.master_bytes_per_block,
            if row.master_bytes_per_block <= 64.0 { "met" } else { "NOT met" },
            p50,
            p99,
            single_filled,
            base_p50,
            base_p99,
            p99 as f64 / base_p99.max(1) as f64,
            if p99 <= 2 * base_p99 { "met" } else { "NOT met" },
        );
        rows.push(row);
    }
    drop(s);
    drop(single);
    let forget = forget_one(&m, &alive, &a, &master, filled).await?;
    beat.abort();
    let out = MasterScaleResult { nodes: a.nodes, key_len: a.key_len, empty_rss_bytes: empty_rss, rows, forget };
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

fn admin_config(dir: &std::path::Path) -> Result<ClientConfig> {
    let ep = kvpool_client::EndpointInfo::read(dir)?;
    let fp = ep.fingerprint.clone().context("no certificate fingerprint")?;
    let mut cfg = ClientConfig::new(
        ep.quic_addr.clone(),
        crate::cluster::KEY,
        Trust::Fingerprint(kvpool_client::parse_fingerprint(&fp)?),
    );
    cfg.server_name = ep.server_name.clone();
    cfg.transport = kvpool_client::TransportChoice::Quic;
    Ok(cfg)
}

/// Report chains `from..to` as the nodes would: chain c on node c % nodes.
async fn report_chains(m: &Client, ids: &[u32], a: &MasterScaleArgs, from: u64, to: u64) -> Result<()> {
    let mut pending: Vec<Vec<NodeBlock>> = ids.iter().map(|_| Vec::new()).collect();
    for c in from..to {
        let i = (c % ids.len() as u64) as usize;
        for p in 0..a.chain {
            pending[i].push(NodeBlock {
                kind: KvEventKind::Stored,
                tier: 1,
                tenant: TENANT.into(),
                key: key(c, p, a.key_len),
                parent: (p > 0).then(|| key(c, p - 1, a.key_len)),
                size: 64 << 10,
            });
        }
        for (i, blocks) in pending.iter_mut().enumerate() {
            if blocks.len() >= a.report_batch || (c + 1 == to && !blocks.is_empty()) {
                let r = NodeReportRequest {
                    node: ids[i],
                    incarnation: 1,
                    reset: false,
                    tiers: tiers(),
                    blocks: std::mem::take(blocks),
                };
                m.node_report(r).await.context("report")?;
            }
        }
    }
    Ok(())
}

/// Fill what the master keeps whatever the pool's size, so that it is not charged to the map:
/// its event ring (bounded by `[events] buffer`, 65,536 events by default) and the buffers of
/// report-sized requests. Twice the ring's events are reported and then removed, under a tenant
/// of their own; the map is empty again afterwards.
async fn warm_up(m: &Client, node: u32, a: &MasterScaleArgs) -> Result<()> {
    const EVENTS: u64 = 2 * 65_536;
    for kind in [KvEventKind::Stored, KvEventKind::Removed] {
        let mut c = 0;
        while c < EVENTS {
            let n = (a.report_batch as u64).min(EVENTS - c);
            let blocks = (c..c + n)
                .map(|i| NodeBlock {
                    kind,
                    tier: 1,
                    tenant: "warm-up".into(),
                    key: key(i, 0, a.key_len),
                    parent: None,
                    size: 64 << 10,
                })
                .collect();
            let r = NodeReportRequest { node, incarnation: 1, reset: false, tiers: tiers(), blocks };
            m.node_report(r).await.context("warm-up report")?;
            c += n;
        }
    }
    Ok(())
}

/// Fill the single node with chains `from..to` (64-byte values: metadata dominates).
async fn fill_single(s: &Client, a: &MasterScaleArgs, from: u64, to: u64) -> Result<()> {
    let value = vec![7u8; 64];
    let max = s.limits().max_batch as usize;
    let t = Instant::now();
    for c in from..to {
        let keys: Vec<Vec<u8>> = (0..a.chain).map(|p| key(c, p, a.key_len)).collect();
        for part in (0..a.chain).collect::<Vec<_>>().chunks(max) {
            let entries: Vec<PutEntry<'_>> = part
                .iter()
                .map(|&p| PutEntry {
                    key: &keys[p],
                    value: &value,
                    opts: PutOptions { parent: (p > 0).then(|| keys[p - 1].clone()), tokens: 16, ..Default::default() },
                })
                .collect();
            let st = s.put_batch(&entries, PutMode::Insert).await?;
            if st.iter().any(|c| *c != kvpool_client::ErrorCode::Ok) {
                bail!("single node refused a put: {st:?}");
            }
        }
    }
    eprintln!("single node: {} blocks put in {:.1} s", (to - from) * a.chain as u64, t.elapsed().as_secs_f64());
    Ok(())
}

/// Node 0 stops reporting. Until its copies are no longer routed, routes of the other nodes'
/// chains are timed from a second task.
async fn forget_one(
    m: &Client,
    alive: &Arc<Vec<AtomicBool>>,
    a: &MasterScaleArgs,
    master: &LocalServer,
    filled: u64,
) -> Result<ForgetResult> {
    let chains = filled / a.chain as u64;
    let nodes = alive.len() as u64;
    alive[0].store(false, Ordering::Relaxed);
    let silent_from = Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let probe = {
        let (m, done, chain, key_len) = (m.clone(), done.clone(), a.chain, a.key_len);
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut h = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
            while !done.load(Ordering::Relaxed) {
                // A chain of another node.
                let c = rng.gen_range(0..chains / nodes) * nodes + rng.gen_range(1..nodes);
                let keys: Vec<Vec<u8>> = (0..chain).map(|p| key(c, p, key_len)).collect();
                let t = Instant::now();
                let _ = m.route(&keys).await;
                let _ = h.record((t.elapsed().as_micros() as u64).max(1));
            }
            h
        })
    };
    // A chain of node 0: routed until the master forgets the node.
    let keys: Vec<Vec<u8>> = (0..a.chain).map(|p| key(0, p, a.key_len)).collect();
    loop {
        let r = m.route(&keys).await?;
        if r.items.iter().all(|h| h.is_empty()) {
            break;
        }
        if silent_from.elapsed() > Duration::from_secs(120) {
            bail!("the master still routes to a node silent for 2 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let unrouted_after = silent_from.elapsed();
    // Routes go on a moment longer, while the master frees what it forgot.
    tokio::time::sleep(Duration::from_millis(500)).await;
    done.store(true, Ordering::Relaxed);
    let h = probe.await?;
    let r = ForgetResult {
        node_blocks: filled / nodes,
        unrouted_after_ms: unrouted_after.as_millis() as u64,
        node_timeout_ms: NODE_TIMEOUT_MS,
        route_p99_during_us: h.value_at_quantile(0.99),
        route_max_during_us: h.max(),
        master_rss_after_bytes: rss(master.pid())?,
    };
    println!(
        "forget a dead node holding {} blocks: unrouted {} ms after its last report (node_timeout {} ms: {} ms \
         beyond it; goal < 1000: {}), route p99 {} us (max {} us) meanwhile",
        r.node_blocks,
        r.unrouted_after_ms,
        NODE_TIMEOUT_MS,
        r.unrouted_after_ms.saturating_sub(NODE_TIMEOUT_MS),
        if r.unrouted_after_ms.saturating_sub(NODE_TIMEOUT_MS) < 1000 { "met" } else { "NOT met" },
        r.route_p99_during_us,
        r.route_max_during_us
    );
    Ok(r)
}
