//! `kvpool-bench bulk-cost`: a fixed transfer over the TCP bulk channel (TLS or plaintext) to
//! a running server, with hooks around the measured part, so that deterministic counters
//! (callgrind's instructions, `strace -c` system calls, the copy counter of
//! `bench/scripts/copycount.c`) can be read for exactly those requests. `bench/scripts/bulk-cost.sh`
//! drives it.

use anyhow::{bail, Context, Result};
use clap::Args;
use kvpool_client::{BulkChoice, Client, ClientConfig, ErrorCode, PutEntry, PutMode, TransportChoice};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct BulkCostArgs {
    /// Data directory of the running server (endpoint.json and api-key are read from it)
    #[arg(long)]
    data_dir: PathBuf,
    /// `tls`, or `tcp` (plaintext: the client trusts 127.0.0.0/8, the server must too)
    #[arg(long, default_value = "tls")]
    channel: String,
    /// `put` or `get`
    #[arg(long)]
    op: String,
    /// Value size
    #[arg(long, default_value = "1MiB")]
    size: String,
    /// Values per request
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Requests measured
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Requests before the measured ones (connection opened, caches warm)
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Shell command run just before the measured requests (`KVPOOL_BENCH_PID` is this process)
    #[arg(long)]
    before: Option<String>,
    /// Shell command run just after them
    #[arg(long)]
    after: Option<String>,
}

fn hook(cmd: &Option<String>) -> Result<()> {
    let Some(cmd) = cmd else { return Ok(()) };
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .env("KVPOOL_BENCH_PID", std::process::id().to_string())
        .status()
        .with_context(|| format!("running {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

pub async fn bulk_cost(a: BulkCostArgs) -> Result<()> {
    let size = a.size.parse::<bytesize::ByteSize>().map_err(|e| anyhow::anyhow!("--size: {e}"))?.as_u64() as usize;
    let mut cfg = ClientConfig::from_data_dir(&a.data_dir)?;
    cfg.client_name = "kvpool-bench bulk-cost".into();
    cfg.transport = TransportChoice::Quic;
    cfg.bulk = BulkChoice::Tcp;
    // Slow processes (valgrind) must not time out.
    cfg.request_timeout = Duration::from_secs(600);
    match a.channel.as_str() {
        "tls" => {}
        "tcp" => cfg.trusted_networks = vec!["127.0.0.0/8".parse()?],
        other => bail!("--channel {other}: tls or tcp"),
    }
    let c = Client::connect(cfg).await?;
    let value: Vec<u8> = (0..size).map(|i| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes()[7]).collect();
    let keys = |round: usize| -> Vec<Vec<u8>> {
        (0..a.batch).map(|i| format!("bulk-cost-{}-{round}-{i}", std::process::id()).into_bytes()).collect()
    };
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; size]; a.batch];
    let is_get = match a.op.as_str() {
        "put" => false,
        "get" => true,
        other => bail!("--op {other}: put or get"),
    };
    // Gets read what these puts stored; puts rewrite the same few keys (upsert), so that the
    // server's memory does not grow with the request count.
    let rounds = 4;
    for r in 0..rounds {
        one(&c, &keys(r), &value, None).await?;
    }
    for i in 0..a.warmup {
        one(&c, &keys(i % rounds), &value, is_get.then_some(&mut bufs)).await?;
    }
    if c.transport_in_use() != a.channel {
        bail!("the bulk channel is not in use (transport {}); the server must offer it", c.transport_in_use());
    }
    hook(&a.before)?;
    let started = Instant::now();
    for i in 0..a.requests {
        one(&c, &keys(i % rounds), &value, is_get.then_some(&mut bufs)).await?;
    }
    let secs = started.elapsed().as_secs_f64();
    hook(&a.after)?;
    if is_get && bufs.iter().any(|b| *b != value) {
        bail!("a get returned other bytes");
    }
    let bytes = (a.requests * a.batch * size) as u64;
    println!(
        "bulk-cost channel={} op={} size={size} batch={} requests={} bytes={bytes} seconds={secs:.6} mb_per_s={:.1}",
        a.channel,
        a.op,
        a.batch,
        a.requests,
        bytes as f64 / secs / 1e6
    );
    Ok(())
}

/// One request: a put of `value` under every key, or (with `bufs`) a get of them.
async fn one(c: &Client, keys: &[Vec<u8>], value: &[u8], bufs: Option<&mut Vec<Vec<u8>>>) -> Result<()> {
    match bufs {
        None => {
            let entries: Vec<PutEntry<'_>> = keys.iter().map(|k| PutEntry::new(k, value)).collect();
            let st = c.put_batch(&entries, PutMode::Upsert).await?;
            if st.iter().any(|s| *s != ErrorCode::Ok) {
                bail!("put failed: {st:?}");
            }
        }
        Some(bufs) => {
            let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let r = c.get_batch_into(keys, &mut views).await?;
            if r.iter().any(|g| g.status != ErrorCode::Ok) {
                bail!("get failed: {r:?}");
            }
        }
    }
    Ok(())
}
