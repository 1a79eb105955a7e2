//! `kvpool-bench master-scale`: the cluster master at pool scale (issue 22, item 5). In
//! process, a master is filled through `Master::report` (the entry point of the nodes'
//! reports) with N blocks over 8 nodes; the heap its map added per block is measured
//! (glibc's own count of bytes in use, chunk overhead included), and `Master::route` (what the
//! request handler calls) is timed on 64-key chains chosen at random. The baseline, in the
//! same run: one node's own index (`kvpool_core::Index::lookup`, the server's lookup path
//! without the network) filled with the same N blocks. Then one node goes silent past the
//! timeout and `Master::sweep` (the heartbeat timeout's path) forgets it, while other threads
//! route.

use anyhow::{Context, Result};
use clap::Args;
use hdrhistogram::Histogram;
use kvpool_core::{Granularity, Index, PinRequest, PutPlan, PutSpec};
use kvpool_proto::{KvEventKind, NodeBlock, NodeJoinRequest, NodeReportRequest, TierUse};
use kvpool_server::cluster::Master;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct MasterScaleArgs {
    /// Block counts (K and M suffixes), one master filled to each in turn
    #[arg(long, value_delimiter = ',', default_value = "1M,10M")]
    blocks: Vec<String>,
    /// Storage nodes the blocks are spread over
    #[arg(long, default_value_t = 8)]
    nodes: u32,
    /// Key length in bytes (as `scale`)
    #[arg(long, default_value_t = 40)]
    key_len: usize,
    /// Blocks per prefix chain; a timed lookup is one whole chain
    #[arg(long, default_value_t = 64)]
    chain: usize,
    /// Timed lookups per measurement
    #[arg(long, default_value_t = 20_000)]
    lookups: usize,
    /// Blocks per node report while filling
    #[arg(long, default_value_t = 4096)]
    report_batch: usize,
    /// Skip the single-node baseline (its index needs ~200 B per block more)
    #[arg(long)]
    no_baseline: bool,
    /// Write the results as JSON to this file
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ForgetResult {
    /// Copies the dead node held.
    pub copies: u64,
    /// Sweep call to the first route of one of its chains that no longer names it.
    pub unrouted_ms: f64,
    /// Sweep call to the sweep's return (every copy forgotten, memory released).
    pub forgotten_ms: f64,
    /// CPU time of the sweeping thread (what the forget costs on a host that is not busy).
    pub forgotten_cpu_ms: f64,
    /// Heap released by the forget, bytes (per copy forgotten).
    pub freed_bytes: i64,
    pub freed_per_copy: f64,
    /// Routes from another thread while the forget ran.
    pub routes_during: u64,
    pub route_p50_us_during: f64,
    pub route_p99_us_during: f64,
    pub route_max_us_during: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct MasterRow {
    pub blocks: u64,
    pub nodes: u32,
    pub heap_bytes: i64,
    pub bytes_per_block: f64,
    pub fill_seconds: f64,
    pub route_p50_us: f64,
    pub route_p99_us: f64,
    pub node_lookup_p50_us: Option<f64>,
    pub node_lookup_p99_us: Option<f64>,
    /// route p99 / single-node lookup p99, both measured in this run.
    pub p99_ratio: Option<f64>,
    pub forget: ForgetResult,
}

#[derive(Debug, Clone, Serialize)]
pub struct MasterScaleReport {
    pub key_len: usize,
    pub chain: usize,
    pub lookups: usize,
    pub rows: Vec<MasterRow>,
    pub goals: Vec<String>,
}

fn parse_count(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mul) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1_000),
        Some('M') => (&t[..t.len() - 1], 1_000_000),
        _ => (&t[..], 1),
    };
    let n: f64 = num.parse().with_context(|| format!("bad count {s:?}"))?;
    Ok((n * mul as f64) as u64)
}

/// Bytes the process's heap holds now, as glibc counts them (arenas and mmapped chunks).
fn heap() -> i64 {
    // SAFETY: mallinfo2 only reads the allocator's own statistics.
    let mi = unsafe { libc::mallinfo2() };
    (mi.uordblks + mi.hblkhd) as i64
}

/// Give freed memory back first, so that the next reading is not muddied by free lists.
fn settle() {
    // SAFETY: malloc_trim only returns free memory to the system.
    unsafe { libc::malloc_trim(0) };
}

fn key(chain: u64, pos: usize, len: usize) -> Vec<u8> {
    let mut k = format!("model-x/{chain:016x}/{pos:04}").into_bytes();
    k.resize(len.max(k.len()), b'.');
    k
}

fn chain_keys(c: u64, a: &MasterScaleArgs) -> Vec<Vec<u8>> {
    (0..a.chain).map(|p| key(c, p, a.key_len)).collect()
}

/// Chain `c` lives on one node, as a prefix-affine placement puts it.
fn node_of(c: u64, nodes: u32) -> u32 {
    (c % u64::from(nodes)) as u32 + 1
}

fn join_req(i: u32) -> NodeJoinRequest {
    NodeJoinRequest {
        name: format!("node-{i}"),
        addr: format!("10.0.0.{i}:7000"),
        server_name: "localhost".into(),
        fingerprint: vec![0; 32],
        incarnation: 1,
        tiers: tiers(),
    }
}

fn tiers() -> Vec<TierUse> {
    vec![TierUse { tier: 1, capacity: 1 << 40, used: 0 }]
}

fn heartbeat(m: &Master, node: u32) {
    let _ = m.report(NodeReportRequest { node, incarnation: 1, reset: false, tiers: tiers(), blocks: Vec::new() });
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn us(d: Duration) -> u64 {
    d.as_nanos().div_ceil(1000) as u64
}

fn pct(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds")
}

/// Stored events with keys and parents of the bench's shape, more than the ring keeps.
fn full_ring(a: &MasterScaleArgs) -> Vec<kvpool_core::Change> {
    (0..70_000u64)
        .map(|i| kvpool_core::Change {
            kind: kvpool_core::ChangeKind::Stored,
            tier: kvpool_policy_sdk::Tier::Dram,
            tenant: 1,
            key: key(u64::MAX - i, 1, a.key_len).into(),
            parent: Some(key(u64::MAX - i, 0, a.key_len).into()),
            size: 64 << 10,
            time_ms: 0,
            node: 1,
        })
        .collect()
}

/// `lookups` routes of random whole chains, each chain also looked up in the single node's
/// index right before or after (alternately), so that both see the same moments of a busy
/// host; the key lists are built before the clock starts.
fn time_both(
    m: &Master,
    mut index: Option<&mut Index<u64>>,
    chains: u64,
    a: &MasterScaleArgs,
) -> (Histogram<u64>, Histogram<u64>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (mut routes, mut lookups) = (new_hist(), new_hist());
    for i in 0..a.lookups {
        let keys = chain_keys(rng.gen_range(0..chains), a);
        for first in [i % 2 == 0, i % 2 == 1] {
            if first {
                let t = Instant::now();
                let r = m.route("t", &keys);
                routes.record(us(t.elapsed()).max(1)).ok();
                assert!(r.items.iter().all(|n| !n.is_empty()), "a stored chain was not routed");
            } else if let Some(index) = index.as_deref_mut() {
                let t = Instant::now();
                let hit = index.lookup(0, &keys, 0);
                lookups.record(us(t.elapsed()).max(1)).ok();
                assert_eq!(hit, a.chain, "a stored chain was not found");
                let _ = index.take_events();
            }
        }
    }
    (routes, lookups)
}

fn fill_master(m: &Master, n: u64, a: &MasterScaleArgs) {
    let chains = n.div_ceil(a.chain as u64);
    let mut pending: Vec<Vec<NodeBlock>> = vec![Vec::new(); a.nodes as usize];
    let mut done = 0u64;
    let flush = |node: u32, blocks: Vec<NodeBlock>| {
        m.report(NodeReportRequest { node, incarnation: 1, reset: false, tiers: tiers(), blocks })
            .expect("a live node's report");
    };
    'fill: for c in 0..chains {
        let node = node_of(c, a.nodes);
        let ks = chain_keys(c, a);
        for p in 0..a.chain {
            if done == n {
                break 'fill;
            }
            let b = NodeBlock {
                kind: KvEventKind::Stored,
                tier: 1,
                tenant: "t".into(),
                key: ks[p].clone(),
                parent: (p > 0).then(|| ks[p - 1].clone()),
                size: 64 << 10,
            };
            let q = &mut pending[node as usize - 1];
            q.push(b);
            if q.len() >= a.report_batch {
                flush(node, std::mem::take(q));
            }
            done += 1;
        }
    }
    for (i, q) in pending.into_iter().enumerate() {
        if !q.is_empty() {
            flush(i as u32 + 1, q);
        }
    }
}

/// The single node's baseline: its own index with the same blocks.
fn node_index(n: u64, a: &MasterScaleArgs) -> Result<Index<u64>> {
    let chains = n.div_ceil(a.chain as u64);
    let mut index: Index<u64> = Index::new(Granularity { dram: 256, ssd: 4096 }, false);
    index.set_miss_memory(0);
    let now = Instant::now();
    let mut done = 0u64;
    'fill: for c in 0..chains {
        let ks = chain_keys(c, a);
        for p in 0..a.chain {
            if done == n {
                break 'fill;
            }
            let spec = PutSpec {
                key: &ks[p],
                size: 64 << 10,
                parent: (p > 0).then(|| &ks[p - 1][..]),
                tokens: 512,
                seq_tokens: 512 * (p as u64 + 1),
                pin: PinRequest::None,
            };
            let (pending, batch) = index.plan_put(0, &[spec], false, u64::MAX);
            let plans = index.decide_put(0, &pending, &batch, &[], None);
            let PutPlan::Store { id, .. } = plans[0] else { anyhow::bail!("put {c}/{p} refused") };
            if index.commit(0, id, &spec, false, 0, Some(done), None, now, 0, 0).is_err() {
                anyhow::bail!("commit {c}/{p} refused");
            }
            done += 1;
        }
        let _ = index.take_events();
    }
    Ok(index)
}

/// Kill node `victim` (silence past the timeout, then the sweep), routing from another thread.
fn forget(m: &Arc<Master>, victim: u32, chains: u64, a: &MasterScaleArgs) -> ForgetResult {
    let copies = m.nodes().nodes[victim as usize - 1].copies;
    // Everyone else heartbeats; the victim has been silent since the fill.
    std::thread::sleep(m.timeout + Duration::from_millis(50));
    for i in 1..=a.nodes {
        if i != victim {
            heartbeat(m, i);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let victim_chain = (0..chains).find(|&c| node_of(c, a.nodes) == victim).expect("the victim holds a chain");
    let router = {
        let (m, stop) = (m.clone(), stop.clone());
        let (chain, len, nodes) = (a.chain, a.key_len, a.nodes);
        std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(11);
            // (start, duration) of every route, probes too; (start, end, names the victim) of probes.
            let mut routes: Vec<(Instant, Duration)> = Vec::new();
            let mut probes: Vec<(Instant, Instant, bool)> = Vec::new();
            let probe: Vec<Vec<u8>> = (0..chain).map(|p| key(victim_chain, p, len)).collect();
            while !stop.load(Ordering::Acquire) {
                // Alternate: a random chain of a live node, then the victim's probe chain.
                let c = loop {
                    let c = rng.gen_range(0..chains);
                    if node_of(c, nodes) != victim {
                        break c;
                    }
                };
                let keys: Vec<Vec<u8>> = (0..chain).map(|p| key(c, p, len)).collect();
                let t = Instant::now();
                let _ = m.route("t", &keys);
                routes.push((t, t.elapsed()));
                let t = Instant::now();
                let r = m.route("t", &probe);
                let e = Instant::now();
                routes.push((t, e - t));
                probes.push((t, e, r.items.iter().any(|n| n.contains(&victim))));
            }
            (routes, probes)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    settle();
    let before = heap();
    let cpu0 = thread_cpu();
    let t0 = Instant::now();
    let dead = m.sweep(Instant::now());
    let forgotten = t0.elapsed();
    let forget_cpu = thread_cpu() - cpu0;
    // Let the router see the end, then stop it.
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, Ordering::Release);
    let (routes, probes) = router.join().expect("router thread");
    settle();
    let freed = before - heap();
    let t1 = t0 + forgotten;
    // Routes in flight at any time during the forget.
    let mut h = new_hist();
    for (_, d) in routes.iter().filter(|(s, d)| *s < t1 && *s + *d > t0) {
        h.record(us(*d).max(1)).ok();
    }
    if std::env::var_os("MS_DEBUG").is_some() {
        let mut slow: Vec<_> = routes.iter().filter(|(s, d)| *s < t1 && *s + *d > t0).collect();
        slow.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
        for (s, d) in slow.iter().take(15) {
            eprintln!("slow route at {:?} from t0: {:?}", s.saturating_duration_since(t0), d);
        }
        eprintln!("forget took {forgotten:?}, {} routes during", slow.len());
    }
    // The first probe asked after the sweep began that no longer names the victim: its answer.
    let unrouted = probes.iter().find(|(s, _, named)| *s >= t0 && !named).map(|(_, e, _)| *e);
    assert_eq!(dead, 1, "exactly the silent node is declared dead");
    ForgetResult {
        copies,
        unrouted_ms: unrouted.map_or(f64::NAN, |u| u.saturating_duration_since(t0).as_secs_f64() * 1e3),
        forgotten_ms: forgotten.as_secs_f64() * 1e3,
        forgotten_cpu_ms: forget_cpu.as_secs_f64() * 1e3,
        freed_bytes: freed,
        freed_per_copy: freed as f64 / copies.max(1) as f64,
        routes_during: h.len(),
        route_p50_us_during: pct(&h, 0.5),
        route_p99_us_during: pct(&h, 0.99),
        route_max_us_during: h.max() as f64,
    }
}

pub fn master_scale(a: MasterScaleArgs) -> Result<()> {
    let mut rows = Vec::new();
    for spec in &a.blocks {
        let n = parse_count(spec)?;
        let chains = (n / a.chain as u64).max(1);
        // The default server configuration: KV events on, 65,536 of them kept. The ring is
        // filled with events of the same shape first, so that its (bounded) bytes are in the
        // empty master's reading, not charged to the map.
        let metrics = Arc::new(kvpool_server::metrics::Metrics::new());
        let events = Arc::new(kvpool_server::events::EventLog::new(65_536, 64, metrics));
        events.publish(full_ring(&a));
        settle();
        let empty = heap();
        let ids = parking_lot::Mutex::new(std::collections::HashMap::<String, u32>::new());
        let resolve = move |name: &str| {
            let mut ids = ids.lock();
            let next = ids.len() as u32 + 1;
            *ids.entry(name.to_string()).or_insert(next)
        };
        let m = Arc::new(Master::new(100, Duration::from_millis(300), Box::new(resolve), Some(events)));
        for i in 1..=a.nodes {
            m.join(join_req(i));
        }
        let t = Instant::now();
        fill_master(&m, n, &a);
        let fill_seconds = t.elapsed().as_secs_f64();
        settle();
        let heap_bytes = heap() - empty;
        let bytes_per_block = heap_bytes as f64 / n as f64;
        eprintln!("{n} blocks: master filled in {fill_seconds:.1} s, {bytes_per_block:.1} B/block");
        // After the reading: the baseline's index is not the master's.
        let mut index = if a.no_baseline { None } else { Some(node_index(n, &a)?) };
        let (h, base) = time_both(&m, index.as_mut(), chains, &a);
        let (route_p50_us, route_p99_us) = (pct(&h, 0.5), pct(&h, 0.99));
        eprintln!("  route p50 {route_p50_us} us, p99 {route_p99_us} us");
        let (node_lookup_p50_us, node_lookup_p99_us) = match index {
            Some(_) => (Some(pct(&base, 0.5)), Some(pct(&base, 0.99))),
            None => (None, None),
        };
        eprintln!("  single node lookup p50 {node_lookup_p50_us:?} us, p99 {node_lookup_p99_us:?} us");
        let victim = 1 + (a.nodes / 2);
        let forget = forget(&m, victim, chains, &a);
        eprintln!("  forget: {forget:?}");
        drop(m);
        drop(index);
        settle();
        rows.push(MasterRow {
            blocks: n,
            nodes: a.nodes,
            heap_bytes,
            bytes_per_block,
            fill_seconds,
            route_p50_us,
            route_p99_us,
            node_lookup_p50_us,
            node_lookup_p99_us,
            p99_ratio: node_lookup_p99_us.map(|b| route_p99_us / b),
            forget,
        });
    }
    let mut goals = Vec::new();
    for r in &rows {
        goals.push(format!(
            "{} blocks: {:.1} B/block on the master (goal <= 64): {}",
            r.blocks,
            r.bytes_per_block,
            if r.bytes_per_block <= 64.0 { "met" } else { "NOT met" }
        ));
        if let Some(x) = r.p99_ratio {
            goals.push(format!(
                "{} blocks: route p99 {:.0} us = {x:.2}x a single node's lookup p99 (goal <= 2x): {}",
                r.blocks,
                r.route_p99_us,
                if x <= 2.0 { "met" } else { "NOT met" }
            ));
        }
        let f = &r.forget;
        goals.push(format!(
            "{} blocks: a dead node of {} copies unrouted in {:.1} ms, forgotten in {:.0} ms ({:.0} ms of CPU; \
             goal < 1 s: {}), route p99 during the forget {:.0} us = {:.1}x the idle route p99",
            r.blocks,
            f.copies,
            f.unrouted_ms,
            f.forgotten_ms,
            f.forgotten_cpu_ms,
            if f.forgotten_ms < 1000.0 { "met" } else { "NOT met" },
            f.route_p99_us_during,
            f.route_p99_us_during / r.route_p99_us.max(1.0)
        ));
    }
    for g in &goals {
        println!("{g}");
    }
    let report = MasterScaleReport { key_len: a.key_len, chain: a.chain, lookups: a.lookups, rows, goals };
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)?;
    }
    Ok(())
}
