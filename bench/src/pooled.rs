//! `kvpool-bench pooled`: N inference nodes each with a private cache of C blocks vs one pool of
//! N x C blocks, on the same trace, with round-robin and prefix-aware (hash of the first block)
//! routing.

use crate::replay::{parse_params, progress, resolve_trace};
use crate::sim::{policy_by_name, CacheSim};
use crate::trace::{Hits, Request, Trace, BLOCK_TOKENS};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvpool_policy_sdk::Params;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct PooledArgs {
    /// Mooncake-format trace (default: $KVPOOL_TRACE or shared/traces/mooncake-conversation.jsonl)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Inference nodes
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// Cache per node: blocks (`5860`), tokens (`3Mtok`, `500ktok`), or a percentage of the
    /// trace's distinct blocks (`3%`)
    #[arg(long, default_value = "3Mtok")]
    pub capacity_per_node: String,
    /// Eviction policy: a native standard one, wasm/<name>, or a .wasm file
    #[arg(long, default_value = "leaf-lru")]
    pub policy: String,
    /// Policy parameters k=v
    #[arg(long = "param")]
    pub params: Vec<String>,
    /// Replay only the first N requests
    #[arg(long)]
    pub limit: Option<usize>,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// How requests are spread over the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Routing {
    /// Request i goes to node i mod N
    RoundRobin,
    /// By a hash of the request's first block id (a prefix-aware router)
    PrefixHash,
}

impl Routing {
    pub fn name(self) -> &'static str {
        match self {
            Routing::RoundRobin => "round-robin",
            Routing::PrefixHash => "prefix-hash",
        }
    }

    pub fn node(self, i: usize, r: &Request, nodes: usize) -> usize {
        match self {
            Routing::RoundRobin => i % nodes,
            Routing::PrefixHash => (mix(r.hash_ids.first().copied().unwrap_or(0)) % nodes as u64) as usize,
        }
    }
}

/// splitmix64 finalizer: spreads sequential ids evenly.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Parse a per-node capacity into blocks.
pub fn parse_capacity(s: &str, distinct_blocks: usize) -> Result<usize> {
    let s = s.trim();
    let num = |t: &str| -> Result<f64> {
        let (n, mul) = match t.chars().last() {
            Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
            Some('m' | 'M') => (&t[..t.len() - 1], 1e6),
            Some('g' | 'G') => (&t[..t.len() - 1], 1e9),
            _ => (t, 1.0),
        };
        let v: f64 = n.trim().parse().with_context(|| format!("bad capacity {s:?}"))?;
        Ok(v * mul)
    };
    let blocks = if let Some(p) = s.strip_suffix('%') {
        num(p)? / 100.0 * distinct_blocks as f64
    } else if let Some(t) = s.strip_suffix("tok") {
        num(t)? / BLOCK_TOKENS as f64
    } else {
        num(s)?
    };
    if blocks.is_nan() || blocks < 1.0 {
        bail!("capacity {s:?} is less than one block");
    }
    Ok(blocks.round() as usize)
}

/// Per-request hits of the isolated nodes and of the pool.
pub struct PooledRun {
    pub local: Vec<Hits>,
    pub pool: Vec<Hits>,
    pub local_total: Hits,
    pub pool_total: Hits,
}

/// Replay `trace` through `nodes` private caches of `per_node` blocks (routed by `routing`)
/// and through one pool of `nodes * per_node` blocks.
pub fn run(
    trace: &Trace,
    nodes: usize,
    per_node: usize,
    routing: Routing,
    policy: &str,
    params: &Params,
    mut tick: impl FnMut(),
) -> Result<PooledRun> {
    let mut local: Vec<CacheSim> =
        (0..nodes).map(|_| Ok(CacheSim::new(policy_by_name(policy, params)?, per_node))).collect::<Result<_>>()?;
    let mut pool = CacheSim::new(policy_by_name(policy, params)?, per_node * nodes);
    let mut out =
        PooledRun { local: Vec::new(), pool: Vec::new(), local_total: Hits::default(), pool_total: Hits::default() };
    for (i, r) in trace.requests.iter().enumerate() {
        let n = routing.node(i, r, nodes);
        out.local.push(local[n].request(r));
        out.pool.push(pool.request(r));
        tick();
    }
    for l in &local {
        out.local_total.add(&l.hits);
    }
    out.pool_total = pool.hits;
    Ok(out)
}

#[derive(Debug, Serialize)]
struct PooledRow {
    routing: Routing,
    local: Hits,
    pool: Hits,
    local_block_hit_rate: f64,
    pool_block_hit_rate: f64,
    block_ratio: f64,
    local_token_hit_rate: f64,
    pool_token_hit_rate: f64,
    token_ratio: f64,
}

#[derive(Debug, Serialize)]
struct PooledReport {
    command: String,
    trace: String,
    requests: usize,
    distinct_blocks: usize,
    nodes: usize,
    policy: String,
    capacity_per_node_blocks: usize,
    pool_blocks: usize,
    rows: Vec<PooledRow>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::INFINITY
    }
}

pub fn pooled(a: PooledArgs) -> Result<()> {
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let path = resolve_trace(&a.trace)?;
    let trace = Trace::load(&path, a.limit)?;
    let params = parse_params(&a.params)?;
    let distinct = trace.distinct_blocks();
    let per_node = parse_capacity(&a.capacity_per_node, distinct)?;
    let routings = [Routing::RoundRobin, Routing::PrefixHash];
    let pb = progress((routings.len() * trace.requests.len()) as u64, "requests");
    let mut rows = Vec::new();
    for routing in routings {
        pb.set_message(routing.name());
        let r = run(&trace, a.nodes, per_node, routing, &a.policy, &params, || pb.inc(1))?;
        let (l, p) = (r.local_total, r.pool_total);
        rows.push(PooledRow {
            routing,
            local: l,
            pool: p,
            local_block_hit_rate: l.block_rate(),
            pool_block_hit_rate: p.block_rate(),
            block_ratio: ratio(p.block_rate(), l.block_rate()),
            local_token_hit_rate: l.token_rate(),
            pool_token_hit_rate: p.token_rate(),
            token_ratio: ratio(p.token_rate(), l.token_rate()),
        });
    }
    pb.finish_and_clear();
    println!(
        "trace {}: {} requests, {} distinct blocks; {} nodes x {} blocks ({} tokens, {:.2}% of distinct) each, pool {} blocks; policy {}",
        path.display(),
        trace.requests.len(),
        distinct,
        a.nodes,
        per_node,
        per_node as u64 * BLOCK_TOKENS,
        100.0 * per_node as f64 / distinct as f64,
        per_node * a.nodes,
        a.policy
    );
    println!(
        "{:<12} {:>12} {:>12} {:>8} {:>12} {:>12} {:>8}",
        "routing", "local block", "pool block", "ratio", "local token", "pool token", "ratio"
    );
    for r in &rows {
        println!(
            "{:<12} {:>12.3} {:>12.3} {:>7.2}x {:>12.3} {:>12.3} {:>7.2}x",
            r.routing.name(),
            r.local_block_hit_rate,
            r.pool_block_hit_rate,
            r.block_ratio,
            r.local_token_hit_rate,
            r.pool_token_hit_rate,
            r.token_ratio
        );
    }
    if let Some(p) = &a.json {
        let report = PooledReport {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            trace: path.display().to_string(),
            requests: trace.requests.len(),
            distinct_blocks: distinct,
            nodes: a.nodes,
            policy: a.policy.clone(),
            capacity_per_node_blocks: per_node,
            pool_blocks: per_node * a.nodes,
            rows,
        };
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_parse() {
        assert_eq!(parse_capacity("100", 1000).unwrap(), 100);
        assert_eq!(parse_capacity("3Mtok", 1000).unwrap(), 5859);
        assert_eq!(parse_capacity("5%", 1000).unwrap(), 50);
        assert!(parse_capacity("0", 1000).is_err());
        assert!(parse_capacity("lots", 1000).is_err());
    }

    #[test]
    fn pool_beats_isolated_nodes_on_shared_prefixes() {
        // Two nodes of 2 blocks; every request shares block 1: round-robin splits the reuse.
        let reqs: Vec<Request> = (0..8u64)
            .map(|i| Request { timestamp: i, input_length: 1024, output_length: 0, hash_ids: vec![1, 2 + (i % 2)] })
            .collect();
        let t = Trace::from_requests(reqs);
        let r = run(&t, 2, 2, Routing::RoundRobin, "lru", &Params::new(), || {}).unwrap();
        // Local: node 0 sees [1,2] x4 (hits 2 each after the first), node 1 [1,3] x4: 12 hits.
        assert_eq!(r.local_total.block_hits, 12);
        // Pool of 4 blocks holds 1, 2, 3: all but the first two requests' new blocks hit.
        assert_eq!(r.pool_total.block_hits, 13);
    }
}
