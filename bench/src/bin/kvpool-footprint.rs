//! Where a resident block's memory goes, part by part: the server's own structures (block
//! index, DRAM copy handles, leases, the default policies, sled records) filled with N blocks
//! in prefix chains, each part measured as the heap bytes it added, divided by N.
//!
//! A separate binary because it counts every allocation (a global counting allocator), which
//! the throughput benchmarks must not pay for.

use anyhow::Result;
use clap::Parser;
use kvpool_core::{BlockRecord, Commit, Granularity, Index, Native, PinRequest, Policies, PutPlan, PutSpec};
use kvpool_policies::{LeafLru, ThresholdAdmission};
use kvpool_server::store::dram::DramTier;
use kvpool_server::store::meta::Meta;
use kvpool_server::store::DramCopy;
use serde::Serialize;
use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[derive(Parser)]
#[command(about = "Per-block memory of a pool node, part by part (heap bytes per resident block)")]
struct Args {
    /// Resident blocks (K and M suffixes).
    #[arg(long, default_value = "1M")]
    blocks: String,
    /// Key length in bytes.
    #[arg(long, default_value_t = 40)]
    key_len: usize,
    /// Blocks per prefix chain (each block's parent is the one before).
    #[arg(long, default_value_t = 64)]
    chain: usize,
    /// Value size (DRAM allocation per block).
    #[arg(long, default_value_t = 64)]
    value_size: u64,
    /// Also write a sled record per block (the SSD tier's metadata) and measure sled's share.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    sled: bool,
    /// sled's cache capacity, bytes (the server's `ssd.metadata_cache`).
    #[arg(long, default_value_t = 64 << 20)]
    sled_cache: u64,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Part {
    part: &'static str,
    bytes: i64,
    per_block: f64,
}

/// Heap growth since the last mark, one part at a time.
struct Meter {
    n: u64,
    mark: i64,
    parts: Vec<Part>,
}

impl Meter {
    fn part(&mut self, name: &'static str) {
        self.part_less(name, 0);
    }

    /// A part, less `other` bytes that grew with it but belong to nobody's per-block cost.
    fn part_less(&mut self, name: &'static str, other: i64) {
        let now = live();
        let bytes = now - self.mark - other;
        self.parts.push(Part { part: name, bytes, per_block: bytes as f64 / self.n as f64 });
        self.mark = now - other;
    }

    /// Move the mark without a part (a transient the next part must not be charged for).
    fn skip(&mut self) {
        self.mark = live();
    }
}

fn count(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1_000),
        Some('M' | 'm') => (&s[..s.len() - 1], 1_000_000),
        _ => (s, 1),
    };
    Ok((num.parse::<f64>()? * mul as f64) as u64)
}

fn key(chain: u64, pos: usize, len: usize) -> Vec<u8> {
    let mut k = format!("model-x/{chain:016x}/{pos:04}").into_bytes();
    k.resize(len.max(k.len()), b'.');
    k.truncate(len.max(1));
    k
}

/// Bytes the heap holds now (stats_alloc counts a reallocation's growth or shrinkage in the
/// allocated and freed totals already).
fn live() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

fn main() -> Result<()> {
    let a = Args::parse();
    let n = count(&a.blocks)?;
    let chains = n.div_ceil(a.chain as u64);
    let mut m = Meter { n, mark: live(), parts: Vec::new() };

    let tier = DramTier::new((n * a.value_size.max(256) * 2).next_power_of_two(), false)?;
    m.part("DRAM segment allocator (sized to the segment, not per block)");
    let mut copies: Vec<DramCopy> = Vec::with_capacity(n as usize);
    for _ in 0..n {
        copies.push(DramCopy(tier.allocate(a.value_size).expect("segment sized for the blocks").commit()));
    }
    // The list holding the handles until they move into the index is not theirs.
    let list = (n as usize * std::mem::size_of::<DramCopy>()) as i64;
    m.part_less("DRAM copy handle (a DramRef inline in the record: no heap)", list);

    let gran = Granularity { dram: 256, ssd: 4096 };
    let mut index: Index<DramCopy> = Index::new(gran, false);
    index.set_miss_memory(0);
    let now = Instant::now();
    let mut copies = copies.into_iter();
    let mut done = 0u64;
    'fill: for c in 0..chains {
        let ks: Vec<Vec<u8>> = (0..a.chain).map(|p| key(c, p, a.key_len)).collect();
        for p in 0..a.chain {
            if done == n {
                break 'fill;
            }
            let spec = PutSpec {
                key: &ks[p],
                size: a.value_size,
                parent: (p > 0).then(|| &ks[p - 1][..]),
                tokens: 512,
                seq_tokens: 512 * (p as u64 + 1),
                pin: PinRequest::None,
            };
            let (pending, batch) = index.plan_put(0, &[spec], false, u64::MAX);
            let plans = index.decide_put(0, &pending, &batch, &[], None);
            let PutPlan::Store(planned) = plans[0] else { anyhow::bail!("put {c}/{p} refused") };
            let copy = copies.next().expect("one per block");
            if index
                .publish(Commit {
                    planned,
                    spec,
                    checksum: 0,
                    dram: Some(copy),
                    ssd: None,
                    now,
                    wall_ms: 0,
                    soft_pin_ttl_ms: 0,
                })
                .is_err()
            {
                anyhow::bail!("commit {c}/{p} refused");
            }
            done += 1;
        }
        // The server hands events to the policies as it goes; here they wait for the policy
        // part, so drop them to keep them out of the index's figure.
        let _ = index.take_events();
    }
    drop(copies);
    // The handles moved into the index and their list is gone (it was never counted).
    m.part("block index (records, key table, keys, chain links)");

    let lease = now + Duration::from_secs(3600);
    for c in 0..chains {
        let ks: Vec<Vec<u8>> = (0..a.chain).map(|p| key(c, p, a.key_len)).collect();
        let _ = index.plan_get(0, &ks, lease, 0);
        let _ = index.take_events();
    }
    m.part("leases (every block leased at once)");

    let mut policies = Policies::new(Box::new(Native(LeafLru::new())), Box::new(Native(ThresholdAdmission::new(0))));
    // The snapshot is transient: taken after the mark and dropped before the part is read.
    m.skip();
    let snap = index.snapshot();
    policies.feed(&snap);
    drop(snap);
    m.part("default policies (native leaf-lru + threshold admission)");

    if a.sled {
        let dir = tempfile::tempdir()?;
        let meta = Meta::open(dir.path(), a.sled_cache)?;
        m.part("sled, opened empty");
        for c in 0..chains {
            for p in 0..a.chain {
                if c * a.chain as u64 + p as u64 >= n {
                    break;
                }
                let k = key(c, p, a.key_len);
                let rec = BlockRecord {
                    size: a.value_size,
                    tokens: 512,
                    seq_tokens: 512 * (p as u64 + 1),
                    parent: (p > 0).then(|| key(c, p - 1, a.key_len)),
                    checksum: 0,
                    created_ms: 0,
                    pin: 0,
                    pin_until_ms: 0,
                    ssd_file: Some((c * a.chain as u64 + p as u64) * 4096),
                    in_dram: false,
                };
                meta.put_now(0, &k, &rec)?;
            }
        }
        meta.flush()?;
        m.part("sled records of SSD blocks (sled's page cache)");
        drop(meta);
    }

    println!("{n} blocks, {}-byte keys, chains of {}, {}-byte values", a.key_len, a.chain, a.value_size);
    println!("{:<66} {:>14} {:>10}", "part", "heap bytes", "per block");
    let mut per_block_total = 0.0;
    for p in &m.parts {
        println!("{:<66} {:>14} {:>10.1}", p.part, p.bytes, p.per_block);
        if !p.part.starts_with("sled") && !p.part.starts_with("leases") && !p.part.starts_with("DRAM segment") {
            per_block_total += p.per_block;
        }
    }
    println!("{:<66} {:>14} {:>10.1}", "resident DRAM block, no lease, no SSD record", "", per_block_total);
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&m.parts)?)?;
    }
    Ok(())
}
