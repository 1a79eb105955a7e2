//! Rows, goals, the memcpy baseline, timed phases and their printing.

use super::*;

#[derive(Debug, Clone, Serialize)]
pub(super) struct OpResult {
    pub(super) ops: u64,
    pub(super) bytes: u64,
    pub(super) seconds: f64,
    pub(super) mb_per_s: f64,
    pub(super) p50_us: u64,
    pub(super) p99_us: u64,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct Row {
    pub(super) target: String,
    pub(super) block_size: usize,
    pub(super) batch: usize,
    pub(super) concurrency: usize,
    pub(super) op: &'static str,
    pub(super) result: OpResult,
    pub(super) memcpy: OpResult,
    /// Target MB/s divided by memcpy MB/s of the same bytes.
    pub(super) ratio: f64,
    /// What the UDP sockets of both ends did in this phase (kvpool over QUIC only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) udp: Option<UdpSides>,
}

/// UDP counters of one phase, on the client (this process) and on the server.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct UdpSides {
    pub(super) client: kvpool_client::UdpStats,
    pub(super) server: kvpool_client::UdpStats,
}

impl UdpSides {
    /// Now, from the client's counters and the server's `/metrics`.
    pub(super) fn now(server: Option<&crate::target::LocalServer>) -> UdpSides {
        let server = server.and_then(|s| s.udp_stats().map_err(|e| tracing::warn!("server UDP counters: {e:#}")).ok());
        UdpSides { client: kvpool_client::udp_stats(), server: server.unwrap_or_default() }
    }

    pub(super) fn since(&self, earlier: &UdpSides) -> UdpSides {
        UdpSides { client: self.client.since(&earlier.client), server: self.server.since(&earlier.server) }
    }

    /// (sender, receiver) of the value bytes of `op`: a put's go from client to server.
    pub(super) fn data_path(&self, op: &str) -> (&kvpool_client::UdpStats, &kvpool_client::UdpStats) {
        if op == "put" {
            (&self.client, &self.server)
        } else {
            (&self.server, &self.client)
        }
    }
}

#[derive(Debug, Serialize)]
pub(super) struct Skipped {
    pub(super) target: String,
    pub(super) reason: String,
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    /// Loopback, or which link across hosts.
    pub(super) link: String,
    pub(super) command: String,
    /// The systems measured, comma-separated, in run order.
    pub(super) target: String,
    /// Systems asked for whose peer is not installed here.
    pub(super) skipped: Vec<Skipped>,
    /// Version strings of the peers that ran.
    pub(super) peers: Vec<String>,
    pub(super) server: String,
    pub(super) cpus: usize,
    pub(super) mem_total: String,
    pub(super) started_unix: u64,
    /// Client-side QUIC path statistics at the end of the run.
    pub(super) quic: String,
    pub(super) rows: Vec<Row>,
    /// Lookup latency of a 64-block chain (kvpool over QUIC).
    pub(super) lookup: Option<LookupLatency>,
    /// The data-path goals, each as a ratio measured in this run.
    pub(super) goals: Vec<Goal>,
}

/// One goal of the data path, checked against this run's own measurements.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Goal {
    pub(super) goal: String,
    /// Measured value (a ratio, or microseconds for latency goals); `None` when a side of the
    /// comparison did not run.
    pub(super) measured: Option<f64>,
    /// Needed value: at least this for ratios, at most this for latencies.
    pub(super) needed: f64,
    pub(super) at_most: bool,
}

impl Goal {
    fn met(&self) -> Option<bool> {
        self.measured.map(|m| if self.at_most { m <= self.needed } else { m >= self.needed })
    }
}

/// Best MB/s of a target for a block size and operation (optionally one batch size).
pub(super) fn best<'a>(rows: &'a [Row], target: &str, size: usize, op: &str, batch: Option<usize>) -> Option<&'a Row> {
    rows.iter()
        .filter(|r| r.target == target && r.block_size == size && r.op == op && batch.is_none_or(|b| r.batch == b))
        .max_by(|a, b| a.result.mb_per_s.total_cmp(&b.result.mb_per_s))
}

/// A single 64 KiB put over QUIC (batch 1, one in flight): p50 at most 1 ms.
fn single_put_goal(rows: &[Row], goal: &str) -> Goal {
    let single = rows.iter().find(|r| {
        r.target == "kvpool" && r.block_size == 64 << 10 && r.batch == 1 && r.concurrency == 1 && r.op == "put"
    });
    Goal { goal: goal.into(), measured: single.map(|r| r.result.p50_us as f64), needed: 1000.0, at_most: true }
}

/// The goals of the data-path work, from this run's rows.
pub(super) fn goals(rows: &[Row], lookup: Option<&LookupLatency>) -> Vec<Goal> {
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
    out.push(single_put_goal(rows, "quic 64KiB single put: p50 (us)"));
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

/// The goals across hosts (issue 23), from this run's rows: kvpool against the better of Redis
/// and Mooncake's TCP for each size and direction, and a single 64 KiB put's p50. kvpool's path
/// across hosts is QUIC so far: its best is the best of one connection and striped batches.
pub(super) fn hosts_goals(rows: &[Row]) -> Vec<Goal> {
    let mb = |t: &str, size, op| best(rows, t, size, op, None).map(|r| r.result.mb_per_s);
    // Every encrypted kvpool path across hosts: QUIC on one connection or a batch striped over
    // several, and the TLS bulk channel.
    let kvpool = |size, op| {
        rows.iter()
            .filter(|r| {
                (r.target == "kvpool" || r.target == "kvpool-tls" || r.target.ends_with("conn"))
                    && r.block_size == size
                    && r.op == op
            })
            .map(|r| r.result.mb_per_s)
            .max_by(f64::total_cmp)
    };
    let mut out = Vec::new();
    for size in [1usize << 20, 4 << 20] {
        for op in ["get", "put"] {
            let label = bytesize::ByteSize(size as u64).to_string_as(true).replace(' ', "");
            let peer = match (mb("redis", size, op), mb("mooncake", size, op)) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            for (what, kv, needed) in [
                ("best encrypted kvpool path", kvpool(size, op), 1.0),
                ("plaintext TCP channel (trusted network)", mb("kvpool-tcp", size, op), 1.5),
                ("QUIC alone, one connection", mb("kvpool", size, op), 0.8),
            ] {
                out.push(Goal {
                    goal: format!("{label} {op}: {what} / the better of Redis and Mooncake TCP (best of each)"),
                    measured: kv.zip(peer).map(|(k, p)| k / p),
                    needed,
                    at_most: false,
                });
            }
        }
    }
    out.push(single_put_goal(rows, "64KiB single put across hosts: p50 (us)"));
    out
}

pub(super) fn print_goals(goals: &[Goal]) {
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

pub(super) fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static histogram bounds")
}

pub(super) fn summarize(h: &Histogram<u64>, bytes: u64, seconds: f64) -> OpResult {
    OpResult {
        ops: h.len(),
        bytes,
        seconds,
        mb_per_s: if seconds > 0.0 { bytes as f64 / seconds / 1e6 } else { 0.0 },
        p50_us: h.value_at_quantile(0.50),
        p99_us: h.value_at_quantile(0.99),
    }
}

pub(super) fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).max(1)
}

/// Buffers of one worker: one destination per item of a batch.
pub(super) type WorkerBufs = Vec<Vec<u8>>;

/// memcpy of the same bytes with the same parallelism: each "op" copies one batch from the
/// shared source into the worker's own buffers. One untimed pass first, so that first touches
/// of the pages (which a VM host may have to map in) do not make the baseline look slow.
pub(super) fn run_memcpy(
    pool: &[u8],
    size: usize,
    batch: usize,
    bufs: &mut [WorkerBufs],
    ops_per_worker: usize,
) -> OpResult {
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

pub(super) fn key(run: &str, size: usize, batch: usize, conc: usize, worker: usize, op: usize, item: usize) -> Vec<u8> {
    format!("bench/{run}/{size}/{batch}/{conc}/w{worker}/o{op}/i{item}").into_bytes()
}

pub(super) struct Phase<'a> {
    pub(super) target: &'a Arc<dyn Target>,
    pub(super) pool: &'a Arc<Vec<u8>>,
    pub(super) run: &'a Arc<String>,
    pub(super) size: usize,
    pub(super) batch: usize,
    pub(super) ops_per_worker: usize,
    pub(super) progress: &'a ProgressBar,
}

impl Phase<'_> {
    pub(super) async fn put(&self, conc: usize) -> Result<OpResult> {
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

    pub(super) async fn get(&self, bufs: Vec<WorkerBufs>) -> Result<(OpResult, Vec<WorkerBufs>)> {
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

    pub(super) fn all_keys(&self, conc: usize) -> Vec<Vec<u8>> {
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
pub(super) const LOOKUP_CHAIN: usize = 64;

/// Latency of `lookup` of a whole resident chain, one request at a time.
#[derive(Debug, Clone, Serialize)]
pub(super) struct LookupLatency {
    pub(super) count: u64,
    pub(super) resident: u64,
    pub(super) p50_us: u64,
    pub(super) p99_us: u64,
}

/// Store 16 chains of 64 small blocks, then time `count` lookups of whole chains (every block
/// resident, so the server walks all 64).
pub(super) async fn lookup_latency(client: &kvpool_client::Client, run: &str, count: usize) -> Result<LookupLatency> {
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
pub(super) fn quic_summary(client: &kvpool_client::Client) -> String {
    format!("quic (client side): {}", client.path_report())
}

pub(super) fn mem_total() -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("MemTotal:")).map(|l| l[9..].trim().to_string()))
        .unwrap_or_else(|| "unknown".into())
}

pub(super) fn fmt_us(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.1} ms", us as f64 / 1e3)
    } else if us >= 1_000 {
        format!("{:.2} ms", us as f64 / 1e3)
    } else {
        format!("{us} us")
    }
}

pub(super) fn print_header() {
    println!(
        "{:<12} {:>7} {:>5} {:>4} {:<4} {:>6} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10} {:>7} {:>7} {:>7}",
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
        "ratio",
        "dg/send",
        "dg/recv"
    );
}

pub(super) fn print_row(r: &Row) {
    // Datagrams per sendmsg at the data's sender and per recvmsg at its receiver (GSO and GRO
    // batches), for rows whose value bytes went over QUIC.
    let (send, recv) = match &r.udp {
        Some(u) => {
            let (tx, rx) = u.data_path(r.op);
            (format!("{:.1}", tx.datagrams_per_send()), format!("{:.1}", rx.datagrams_per_recv()))
        }
        None => ("-".into(), "-".into()),
    };
    println!(
        "{:<12} {:>7} {:>5} {:>4} {:<4} {:>6} {:>10.0} {:>10} {:>10} {:>12.0} {:>10} {:>10} {:>6.1}% {:>7} {:>7}",
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
        r.ratio * 100.0,
        send,
        recv
    );
}
