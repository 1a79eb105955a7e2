//! `kvpool-bench scale`: how one node's cost grows with its block count. One server is filled
//! through a sequence of block counts; at each it reports resident memory per block and the
//! latency of a 64-block `lookup`. A second server with an SSD tier is filled, killed with
//! SIGKILL and restarted, timing how long until its blocks serve again.

use crate::target::LocalServer;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvpool_client::{Client, ClientConfig, PutEntry, PutMode, PutOptions, TransportChoice};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Block counts to fill one server to, in increasing order (1K, 100K, 1M, 10M, ...)
    #[arg(long, value_delimiter = ',', default_value = "1K,100K,1M")]
    counts: Vec<String>,
    /// Value bytes per block (small, so that metadata dominates)
    #[arg(long, default_value_t = 64)]
    value_size: usize,
    /// Key length in bytes (vLLM-style keys are a model tag plus a 64-bit hash or more)
    #[arg(long, default_value_t = 40)]
    key_len: usize,
    /// Blocks per prefix chain (each block's parent is the one before it)
    #[arg(long, default_value_t = 64)]
    chain: usize,
    /// Timed lookups of a whole resident chain at each count
    #[arg(long, default_value_t = 3000)]
    lookups: usize,
    /// Blocks on the SSD tier for the restart measurement ("0" skips it)
    #[arg(long, default_value = "1M")]
    restart_blocks: String,
    /// Put requests in flight while filling
    #[arg(long, default_value_t = 4)]
    fill_concurrency: usize,
    /// Transport of the client that fills the server (quic or shm). Lookups are timed on both
    /// paths: over QUIC (what a remote connector sees) and over the same-host control socket.
    #[arg(long, default_value = "quic")]
    transport: String,
    /// Tokio runtime of the measuring clients: "current" (one thread, the lowest latency) or
    /// "multi" (two workers, as the blocking client and the Python binding use)
    #[arg(long, default_value = "current")]
    client_runtime: String,
    /// Longest wait after a fill for the server's RSS to stop falling (its heap hands freed pages
    /// back within about a second), before RSS per block is taken; 0 takes it at once
    #[arg(long, default_value_t = 5.0)]
    settle_s: f64,
    /// Also write the results as JSON to this file
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw bytes per block and lookup p99 against the block count into this PNG file
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    pub blocks: u64,
    pub rss_bytes: u64,
    /// (RSS at this count - RSS of the empty server) / blocks.
    pub bytes_per_block: f64,
    /// The same right after the fill, before the heap handed back what the fill's requests
    /// left free (`rss_bytes` is measured once RSS stops falling, within `--settle-s`).
    pub bytes_per_block_just_filled: f64,
    /// Lookups over QUIC.
    pub lookup_p50_us: u64,
    pub lookup_p99_us: u64,
    /// Lookups over the same-host control socket (absent when the server offers none).
    pub local_p50_us: Option<u64>,
    pub local_p99_us: Option<u64>,
    /// Mean time the server spent on one lookup (from reading its frame to writing the answer),
    /// over this row's lookups on both paths.
    pub server_mean_us: f64,
    /// The server's own p50 and p99 of this row's lookups (both paths, the untimed warm-up
    /// included), from its latency histogram as its `stats` estimates them.
    pub server_p50_us: Option<f64>,
    pub server_p99_us: Option<f64>,
    /// The server's heap as jemalloc counts it, less the empty server's, per block: what the
    /// program holds, and the allocator's resident pages (holdings, fragmentation, free dirty
    /// pages not yet returned). Absent when the server reports no heap.
    pub heap_allocated_per_block: Option<f64>,
    pub heap_resident_per_block: Option<f64>,
    pub fill_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RestartResult {
    pub ssd_blocks: u64,
    /// SIGKILL to the endpoint file written again (recovery done, listening).
    pub ready_ms: u64,
    /// SIGKILL to a full-chain lookup answered by a fresh client.
    pub serving_ms: u64,
    /// Blocks the restarted server reports on its SSD tier.
    pub recovered: u64,
    pub rss_after_restart: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub value_size: usize,
    pub key_len: usize,
    pub chain: usize,
    pub dram_segment: u64,
    pub empty_rss: u64,
    pub rows: Vec<ScaleRow>,
    pub restart: Option<RestartResult>,
    pub goals: Vec<String>,
}

pub(crate) fn parse_count(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mul) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1_000),
        Some('M') => (&t[..t.len() - 1], 1_000_000),
        Some('G') => (&t[..t.len() - 1], 1_000_000_000),
        _ => (&t[..], 1),
    };
    let n: f64 = num.parse().with_context(|| format!("bad count {s:?}"))?;
    Ok((n * mul as f64) as u64)
}

/// Resident set of a process, from /proc (bytes).
pub(crate) fn rss(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS in /proc status")?;
    let kb: u64 = line[6..].trim().trim_end_matches("kB").trim().parse()?;
    Ok(kb * 1024)
}

/// RSS once it has not fallen for a second (polled every 250 ms), or after `limit`.
async fn settled_rss(pid: u32, limit: Duration) -> Result<u64> {
    let start = Instant::now();
    let (mut low, mut low_at) = (rss(pid)?, Instant::now());
    while start.elapsed() < limit && low_at.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let r = rss(pid)?;
        if r < low {
            (low, low_at) = (r, Instant::now());
        }
    }
    Ok(low)
}

/// Key of block `pos` of chain `chain`, exactly `len` bytes.
pub(crate) fn key(chain: u64, pos: usize, len: usize) -> Vec<u8> {
    let mut k = format!("{chain:x}/{pos:x}/").into_bytes();
    k.resize(len.max(k.len()), b'k');
    k
}

async fn connect(dir: &std::path::Path, transport: &str) -> Result<Client> {
    let mut cfg = ClientConfig::from_data_dir(dir)?;
    if transport == "local" {
        // Same-host: shared memory with the control socket, or fail.
        cfg.transport = TransportChoice::Shm;
        cfg.client_name = "kvpool-bench-scale".into();
        let c = Client::connect(cfg).await?;
        if c.control_in_use() != "local" {
            bail!("the server offers no same-host control channel");
        }
        return Ok(c);
    }
    cfg.client_name = "kvpool-bench-scale".into();
    cfg.request_timeout = Duration::from_secs(120);
    cfg.transport = match transport {
        "shm" => TransportChoice::Shm,
        "quic" => TransportChoice::Quic,
        other => bail!("unknown transport {other} (quic or shm)"),
    };
    Ok(Client::connect(cfg).await?)
}

/// Put chains `from..to` (whole chains of `a.chain` blocks), `fill_concurrency` requests in flight.
async fn fill(client: &Client, a: &ScaleArgs, from: u64, to: u64) -> Result<()> {
    let value = Arc::new(vec![0x5au8; a.value_size]);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(from));
    let (chain, key_len) = (a.chain, a.key_len);
    let mut tasks = Vec::new();
    for _ in 0..a.fill_concurrency.max(1) {
        let (client, value, next) = (client.clone(), value.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if c >= to {
                    return anyhow::Ok(());
                }
                let keys: Vec<Vec<u8>> = (0..chain).map(|p| key(c, p, key_len)).collect();
                let entries: Vec<PutEntry<'_>> = keys
                    .iter()
                    .enumerate()
                    .map(|(p, k)| PutEntry {
                        key: k,
                        value: &value,
                        opts: PutOptions {
                            parent: (p > 0).then(|| keys[p - 1].clone()),
                            tokens: 512,
                            seq_tokens: 512 * (p as u64 + 1),
                            ..Default::default()
                        },
                    })
                    .collect();
                let codes = client.put_batch(&entries, PutMode::Insert).await?;
                if let Some(bad) = codes.iter().find(|c| **c != kvpool_client::ErrorCode::Ok) {
                    bail!("put of chain {c} answered {bad}");
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// (count, count x mean µs) of the server's lookups so far, from its stats.
async fn lookup_totals(client: &Client) -> Result<(u64, f64)> {
    let stats = client.stats().await?;
    Ok(stats.ops.iter().find(|o| o.op == "lookup").map_or((0, 0.0), |o| (o.count, o.count as f64 * o.mean_us)))
}

/// Lookups of random resident chains (one request each, one at a time): p50 and p99 in µs.
async fn lookups(client: &Client, a: &ScaleArgs, chains: u64) -> Result<(u64, u64)> {
    timed_chains(a.lookups, a.chain, a.key_len, chains, |keys| async move { Ok(client.lookup(&keys).await?) }).await
}

/// `n` calls of `f` on random whole chains of `chain` keys, one at a time after 100 untimed
/// (connection and caches warm, as in a running pool): p50 and p99 in µs. Each call must find
/// the whole chain (else: evicted, the DRAM segment is too small).
pub(crate) async fn timed_chains<F, Fut>(
    n: usize,
    chain: usize,
    key_len: usize,
    chains: u64,
    f: F,
) -> Result<(u64, u64)>
where
    F: Fn(Vec<Vec<u8>>) -> Fut,
    Fut: std::future::Future<Output = Result<usize>>,
{
    let mut rng = rand::rngs::StdRng::seed_from_u64(chains);
    let mut h = hdrhistogram::Histogram::<u64>::new(3)?;
    for i in 0..n + 100 {
        let c = rng.gen_range(0..chains);
        let keys: Vec<Vec<u8>> = (0..chain).map(|p| key(c, p, key_len)).collect();
        let t = Instant::now();
        let found = f(keys).await?;
        let us = t.elapsed().as_micros() as u64;
        if found != chain {
            bail!("chain {c}: {found} of {chain} blocks found (evicted? the DRAM segment is too small)");
        }
        if i >= 100 {
            h.record(us.max(1))?;
        }
    }
    Ok((h.value_at_quantile(0.5), h.value_at_quantile(0.99)))
}

pub fn scale(a: ScaleArgs) -> Result<()> {
    let rt = match a.client_runtime.as_str() {
        "current" => tokio::runtime::Builder::new_current_thread().enable_all().build()?,
        "multi" => tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?,
        other => bail!("unknown client runtime {other} (current or multi)"),
    };
    rt.block_on(run(a))
}

async fn run(a: ScaleArgs) -> Result<()> {
    let mut counts: Vec<u64> = a.counts.iter().map(|s| parse_count(s)).collect::<Result<_>>()?;
    counts.sort_unstable();
    counts.dedup();
    let chain = a.chain.max(1) as u64;
    let max = *counts.last().context("no counts")?;
    // Room for every block at the DRAM tier's 256-byte granularity, plus slack: nothing may be
    // evicted, or the per-block figures would be wrong.
    let per_block = (a.value_size as u64).div_ceil(256).max(1) * 256;
    let dram = (max.div_ceil(chain) * chain * per_block * 5 / 4).max(64 << 20);
    let server = LocalServer::start(&dram.to_string(), &[])?;
    // The server's own lookup histogram (None when its /metrics cannot be read).
    let scrape = || server.metrics().map(|t| crate::scrape::op_buckets(&t, "lookup")).ok();
    let client = connect(server.path(), &a.transport).await?;
    let quic = connect(server.path(), "quic").await?;
    let local = match connect(server.path(), "local").await {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!("lookups over QUIC only: {e:#}");
            None
        }
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let empty_rss = rss(server.pid())?;
    let heap = || {
        let text = server.metrics().ok()?;
        let g = |k| crate::scrape::kind_gauge(&text, "kvpool_heap_bytes", k);
        Some((g("allocated")?, g("resident")?))
    };
    let empty_heap = heap();
    println!(
        "scale: {} B values, {} B keys, chains of {}, DRAM segment {} MiB; empty server RSS {:.1} MiB",
        a.value_size,
        a.key_len,
        a.chain,
        dram >> 20,
        empty_rss as f64 / (1 << 20) as f64
    );
    println!(
        "{:>12} {:>10} {:>16} {:>11} {:>10} {:>10} {:>10} {:>10} {:>12} {:>11} {:>11} {:>8}",
        "blocks",
        "RSS MiB",
        "B/block (filled)",
        "heap a/r",
        "QUIC p50",
        "QUIC p99",
        "local p50",
        "local p99",
        "server mean",
        "server p50",
        "server p99",
        "fill s"
    );
    let mut rows = Vec::new();
    let mut have = 0u64;
    for &n in &counts {
        let chains = n.div_ceil(chain);
        let t = Instant::now();
        fill(&client, &a, have, chains).await?;
        let fill_seconds = t.elapsed().as_secs_f64();
        have = chains;
        let blocks = chains * chain;
        let stats = client.stats().await?;
        if stats.blocks != blocks {
            bail!("the server holds {} blocks, expected {blocks}", stats.blocks);
        }
        // RSS first: the shared buffers of a same-host client are mapped into the server too.
        let just_filled = rss(server.pid())?;
        let r = settled_rss(server.pid(), Duration::from_secs_f64(a.settle_s)).await?;
        // One scrape for both figures.
        let heap_now = heap();
        let per_block = |f: fn((f64, f64)) -> f64| {
            let (now, empty) = (heap_now?, empty_heap?);
            Some((f(now) - f(empty)) / blocks as f64)
        };
        let (heap_allocated_per_block, heap_resident_per_block) = (per_block(|h| h.0), per_block(|h| h.1));
        let before = lookup_totals(&client).await?;
        let buckets_before = scrape();
        let (p50, p99) = lookups(&quic, &a, chains).await?;
        let (l50, l99) = match &local {
            Some(c) => {
                let (a50, a99) = lookups(c, &a, chains).await?;
                (Some(a50), Some(a99))
            }
            None => (None, None),
        };
        let after = lookup_totals(&client).await?;
        let server_mean_us = (after.1 - before.1) / (after.0 - before.0).max(1) as f64;
        let server_lookups = match (buckets_before, scrape()) {
            (Some(b), Some(a)) => Some(a.since(&b)),
            _ => None,
        };
        let server_q = |q: f64| server_lookups.as_ref().and_then(|b| b.quantile_us(q));
        let row = ScaleRow {
            blocks,
            rss_bytes: r,
            bytes_per_block: r.saturating_sub(empty_rss) as f64 / blocks as f64,
            bytes_per_block_just_filled: just_filled.saturating_sub(empty_rss) as f64 / blocks as f64,
            lookup_p50_us: p50,
            lookup_p99_us: p99,
            local_p50_us: l50,
            local_p99_us: l99,
            server_mean_us,
            server_p50_us: server_q(0.5),
            server_p99_us: server_q(0.99),
            heap_allocated_per_block,
            heap_resident_per_block,
            fill_seconds,
        };
        let us = |v: Option<u64>| v.map_or("-".to_string(), |v| format!("{v} us"));
        let fus = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} us"));
        println!(
            "{:>12} {:>10.1} {:>16} {:>11} {:>10} {:>10} {:>10} {:>10} {:>9.1} us {:>11} {:>11} {:>8.1}",
            row.blocks,
            r as f64 / (1 << 20) as f64,
            format!("{:.0} ({:.0})", row.bytes_per_block, row.bytes_per_block_just_filled),
            match (heap_allocated_per_block, heap_resident_per_block) {
                (Some(a), Some(r)) => format!("{a:.0} / {r:.0}"),
                _ => "-".to_string(),
            },
            us(Some(p50)),
            us(Some(p99)),
            us(l50),
            us(l99),
            server_mean_us,
            fus(row.server_p50_us),
            fus(row.server_p99_us),
            fill_seconds
        );
        rows.push(row);
    }
    client.close().await;
    quic.close().await;
    if let Some(c) = &local {
        c.close().await;
    }
    drop(server);

    let restart_blocks = parse_count(&a.restart_blocks)?;
    let restart = if restart_blocks > 0 { Some(restart(&a, restart_blocks).await?) } else { None };

    let mut goals = Vec::new();
    // Issue 34: every count a host really holds (from 500K blocks up), not only the largest.
    for r in rows.iter().filter(|r| r.blocks >= 500_000 || Some(r.blocks) == rows.last().map(|l| l.blocks)) {
        goals.push(goal(&format!("bytes per resident block at {} blocks <= 200", r.blocks), r.bytes_per_block, 200.0));
        if let Some(p99) = r.server_p99_us {
            goals.push(goal(&format!("server-side lookup p99 at {} blocks <= 200 us", r.blocks), p99, 200.0));
        }
    }
    if let Some(last) = rows.last() {
        goals.push(goal(
            &format!("QUIC lookup p99 at {} blocks <= 200 us", last.blocks),
            last.lookup_p99_us as f64,
            200.0,
        ));
        if let Some(l99) = last.local_p99_us {
            goals.push(goal(&format!("same-host lookup p99 at {} blocks <= 200 us", last.blocks), l99 as f64, 200.0));
        }
        if let Some(first) = rows.first().filter(|f| f.blocks < last.blocks) {
            goals.push(goal(
                &format!("QUIC lookup p99 at {} blocks within 2x of {} blocks", last.blocks, first.blocks),
                last.lookup_p99_us as f64 / first.lookup_p99_us.max(1) as f64,
                2.0,
            ));
            if let (Some(l), Some(f)) = (last.local_p99_us, first.local_p99_us) {
                goals.push(goal(
                    &format!("same-host lookup p99 at {} blocks within 2x of {} blocks", last.blocks, first.blocks),
                    l as f64 / f.max(1) as f64,
                    2.0,
                ));
            }
        }
    }
    if let Some(r) = &restart {
        goals.push(goal(
            &format!("restart with {} SSD blocks serving within 5 s (ms)", r.ssd_blocks),
            r.serving_ms as f64,
            5000.0,
        ));
    }
    for g in &goals {
        println!("goal: {g}");
    }
    let report = ScaleReport {
        value_size: a.value_size,
        key_len: a.key_len,
        chain: a.chain,
        dram_segment: dram,
        empty_rss,
        rows,
        restart,
        goals,
    };
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
        println!("json: {}", p.display());
    }
    if let Some(p) = &a.plot {
        match crate::plot::scale_plot(p, &report) {
            Ok(()) => println!("plot: {}", p.display()),
            Err(e) => tracing::warn!("no plot written: {e:#}"),
        }
    }
    Ok(())
}

fn goal(what: &str, value: f64, limit: f64) -> String {
    let verdict = if value <= limit { "met" } else { "MISSED" };
    format!("{what}: {value:.1} -> {verdict}")
}

/// Fill an SSD-backed server whose DRAM is small (blocks are demoted to the SSD tier), SIGKILL
/// it and restart it on the same directory.
async fn restart(a: &ScaleArgs, n: u64) -> Result<RestartResult> {
    let chain = a.chain.max(1) as u64;
    let chains = n.div_ceil(chain);
    let blocks = chains * chain;
    // SSD extents are 4 KiB: room for every block plus slack.
    let ssd = blocks * (a.value_size as u64).div_ceil(4096).max(1) * 4096 * 5 / 4 + (64 << 20);
    let mut server = LocalServer::start("1MiB", &["--ssd-capacity".into(), ssd.to_string()])?;
    let client = connect(server.path(), &a.transport).await?;
    let t = Instant::now();
    fill(&client, a, 0, chains).await?;
    // Demotions run in the background: wait until the SSD tier stops growing. The blocks that
    // still fit in DRAM stay there only (a restart drops DRAM copies by design).
    let ssd_blocks = |s: &kvpool_client::StatsReport| s.tiers.iter().find(|t| t.tier == "ssd").map_or(0, |t| t.blocks);
    let mut last = u64::MAX;
    loop {
        let now = ssd_blocks(&client.stats().await?);
        if now == last {
            break;
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let on_ssd = last;
    if on_ssd < chain {
        let s = client.stats().await?;
        bail!("only {on_ssd} of {blocks} blocks reached the SSD tier: {:?}\n{}", s.tiers, server.log_tail());
    }
    println!("restart: {on_ssd} of {blocks} blocks on the SSD tier after {:.1} s of puts", t.elapsed().as_secs_f64());
    client.close().await;
    // Recovery only trusts what sled has made durable; give its periodic flush a moment (a
    // crash loses at most that window, by design).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let killed = Instant::now();
    server.kill_and_restart(Duration::from_secs(120))?;
    let ready_ms = killed.elapsed().as_millis() as u64;
    let client = connect(server.path(), &a.transport).await?;
    // A chain whose blocks all live on SSD (the first ones were demoted first).
    let keys: Vec<Vec<u8>> = (0..a.chain).map(|p| key(0, p, a.key_len)).collect();
    let found = client.lookup(&keys).await?;
    let serving_ms = killed.elapsed().as_millis() as u64;
    if found != a.chain {
        bail!("after the restart a lookup of chain 0 found {found} of {} blocks", a.chain);
    }
    // First reads verify checksums lazily: a get must return the exact bytes.
    let v = client.get(&keys[0]).await?.context("block 0 missing after the restart")?;
    if v != vec![0x5au8; a.value_size] {
        bail!("block 0 read back wrong after the restart");
    }
    let s = client.stats().await?;
    let recovered = ssd_blocks(&s);
    let rss_after_restart = rss(server.pid())?;
    println!(
        "restart after SIGKILL with {on_ssd} SSD blocks: ready in {ready_ms} ms, serving (full-chain lookup) in {serving_ms} ms, {recovered} blocks recovered, RSS {:.1} MiB",
        rss_after_restart as f64 / (1 << 20) as f64
    );
    client.close().await;
    if let Ok(log) = std::fs::read_to_string(server.path().join("server.log")) {
        for l in log.lines().filter(|l| l.contains("recovered")) {
            println!("server: {l}");
        }
    }
    Ok(RestartResult { ssd_blocks: on_ssd, ready_ms, serving_ms, recovered, rss_after_restart })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_keys() {
        assert_eq!(parse_count("1K").unwrap(), 1000);
        assert_eq!(parse_count("2.5m").unwrap(), 2_500_000);
        assert_eq!(parse_count("10M").unwrap(), 10_000_000);
        assert_eq!(parse_count("17").unwrap(), 17);
        assert!(parse_count("lots").is_err());
        assert_eq!(key(0xab, 3, 40).len(), 40);
        assert_ne!(key(1, 2, 40), key(2, 1, 40));
        assert_ne!(key(0x12, 3, 8), key(0x1, 0x23, 8));
    }
}
