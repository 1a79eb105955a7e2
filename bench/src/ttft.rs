//! `kvpool-bench ttft`: a time-to-first-token model over a trace. Per request,
//! prefill = uncached tokens x per-token prefill cost + cached bytes / link bandwidth
//!         + cached blocks x per-block transfer latency,
//! without any cache, with node-local caches, and with the pool (hits from `pooled`).

use crate::pooled::{self, parse_capacity, Routing};
use crate::replay::{parse_params, progress, resolve_trace};
use crate::trace::{Hits, Request, Trace};
use anyhow::{bail, Context, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct TtftArgs {
    /// Mooncake-format trace (default: $KVPOOL_TRACE or shared/traces/mooncake-conversation.jsonl)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Prefill cost per uncached token, microseconds (32K tokens -> 3.2 s)
    #[arg(long, default_value_t = 98.0)]
    pub prefill_us_per_token: f64,
    /// KV cache bytes per token (320 KiB: LLaMA3-70B)
    #[arg(long, default_value_t = 327_680)]
    pub kv_bytes_per_token: u64,
    /// Link bandwidth for cached KV, Gbit/s
    #[arg(long, default_value_t = 100.0)]
    pub link_gbps: f64,
    /// Fixed latency per cached block transferred, microseconds (replaced by the measured get
    /// latency distribution when --throughput-json is given)
    #[arg(long, default_value_t = 50.0)]
    pub transfer_us: f64,
    /// JSON written by `kvpool-bench throughput --json`: its kvpool get latency (batch 1,
    /// concurrency 1, smallest block size) is sampled per cached block
    #[arg(long)]
    pub throughput_json: Option<PathBuf>,
    /// System whose rows are read from --throughput-json
    #[arg(long, default_value = "kvpool")]
    pub throughput_target: String,
    /// Inference nodes
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// Cache per node (blocks, `3Mtok`, or `3%` of distinct blocks)
    #[arg(long, default_value = "3Mtok")]
    pub capacity_per_node: String,
    /// Request routing for the node-local caches
    #[arg(long, value_enum, default_value_t = Routing::RoundRobin)]
    pub routing: Routing,
    /// Eviction policy (native standard name, wasm/<name>, or a .wasm file)
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

/// Latency per cached block: a constant, or sampled from a measured (p50, p99) distribution.
#[derive(Debug, Clone, Serialize)]
pub enum BlockLatency {
    Fixed {
        us: f64,
    },
    /// Log-linear between p50 and p99, flat at p50 below the median and at p99 above it.
    Measured {
        source: String,
        block_size: u64,
        p50_us: f64,
        p99_us: f64,
    },
}

impl BlockLatency {
    pub fn sample(&self, rng: &mut impl Rng) -> f64 {
        match *self {
            BlockLatency::Fixed { us } => us,
            BlockLatency::Measured { p50_us, p99_us, .. } => {
                let q: f64 = rng.gen();
                if q <= 0.5 {
                    p50_us
                } else if q >= 0.99 {
                    p99_us
                } else {
                    let f = (q - 0.5) / 0.49;
                    (p50_us.ln() + f * (p99_us.ln() - p50_us.ln())).exp()
                }
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ThroughputJsonError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a throughput report: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} has no get rows of {target} at batch 1, concurrency 1")]
    NoRows { path: String, target: String },
}

#[derive(Debug, Deserialize)]
struct TpReport {
    rows: Vec<TpRow>,
}

#[derive(Debug, Deserialize)]
struct TpRow {
    target: String,
    block_size: u64,
    batch: usize,
    concurrency: usize,
    op: String,
    result: TpResult,
}

#[derive(Debug, Deserialize)]
struct TpResult {
    p50_us: u64,
    p99_us: u64,
}

/// The get latency of `target` at batch 1, concurrency 1 and its smallest block size: the
/// per-block overhead (bytes are charged separately at link bandwidth).
pub fn measured_latency(path: &Path, target: &str) -> Result<BlockLatency, ThroughputJsonError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ThroughputJsonError::Io { path: p.clone(), source })?;
    let rep: TpReport =
        serde_json::from_str(&text).map_err(|source| ThroughputJsonError::Json { path: p.clone(), source })?;
    rep.rows
        .iter()
        .filter(|r| r.target == target && r.op == "get" && r.batch == 1 && r.concurrency == 1)
        .min_by_key(|r| r.block_size)
        .map(|r| BlockLatency::Measured {
            source: p.clone(),
            block_size: r.block_size,
            p50_us: r.result.p50_us.max(1) as f64,
            p99_us: r.result.p99_us.max(r.result.p50_us).max(1) as f64,
        })
        .ok_or(ThroughputJsonError::NoRows { path: p, target: target.into() })
}

/// The prefill model.
#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub prefill_us_per_token: f64,
    pub kv_bytes_per_token: u64,
    pub link_gbps: f64,
    pub block_latency: BlockLatency,
}

impl Model {
    /// TTFT of one request in microseconds, given its cache hits.
    pub fn ttft_us(&self, r: &Request, hit: &Hits, rng: &mut impl Rng) -> f64 {
        let tokens = r.tokens();
        let uncached = tokens.saturating_sub(hit.token_hits) as f64;
        let bytes = hit.token_hits as f64 * self.kv_bytes_per_token as f64;
        let transfer = bytes * 8.0 / (self.link_gbps * 1e9) * 1e6;
        let latency: f64 = (0..hit.block_hits).map(|_| self.block_latency.sample(rng)).sum();
        uncached * self.prefill_us_per_token + transfer + latency
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Stats {
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub fn stats(us: &[f64]) -> Stats {
    let mut v = us.to_vec();
    v.sort_by(f64::total_cmp);
    let q = |p: f64| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i] / 1e3
    };
    let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 / 1e3 };
    Stats { mean_ms: mean, p50_ms: q(0.5), p99_ms: q(0.99) }
}

#[derive(Debug, Serialize)]
struct TtftRow {
    setup: &'static str,
    block_hit_rate: f64,
    token_hit_rate: f64,
    #[serde(flatten)]
    stats: Stats,
    /// Mean TTFT change vs no cache (negative = faster).
    mean_change: f64,
    p50_change: f64,
    p99_change: f64,
}

#[derive(Debug, Serialize)]
struct TtftReport {
    command: String,
    trace: String,
    requests: usize,
    nodes: usize,
    capacity_per_node_blocks: usize,
    routing: Routing,
    policy: String,
    model: Model,
    rows: Vec<TtftRow>,
}

pub fn ttft(a: TtftArgs) -> Result<()> {
    if a.nodes == 0 || a.link_gbps.is_nan() || a.link_gbps <= 0.0 || a.prefill_us_per_token < 0.0 || a.transfer_us < 0.0
    {
        bail!("--nodes and --link-gbps must be positive, costs non-negative");
    }
    let block_latency = match &a.throughput_json {
        Some(p) => measured_latency(p, &a.throughput_target)?,
        None => BlockLatency::Fixed { us: a.transfer_us },
    };
    let model = Model {
        prefill_us_per_token: a.prefill_us_per_token,
        kv_bytes_per_token: a.kv_bytes_per_token,
        link_gbps: a.link_gbps,
        block_latency,
    };
    let path = resolve_trace(&a.trace)?;
    let trace = Trace::load(&path, a.limit)?;
    let params = parse_params(&a.params)?;
    let per_node = parse_capacity(&a.capacity_per_node, trace.distinct_blocks())?;
    let pb = progress(trace.requests.len() as u64, "requests");
    let run = pooled::run(&trace, a.nodes, per_node, a.routing, &a.policy, &params, || pb.inc(1))?;
    pb.finish_and_clear();

    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7474_6674);
    let none: Vec<f64> = trace.requests.iter().map(|r| model.ttft_us(r, &Hits::default(), &mut rng)).collect();
    let local: Vec<f64> = trace.requests.iter().zip(&run.local).map(|(r, h)| model.ttft_us(r, h, &mut rng)).collect();
    let pool: Vec<f64> = trace.requests.iter().zip(&run.pool).map(|(r, h)| model.ttft_us(r, h, &mut rng)).collect();
    let base = stats(&none);
    let change = |a: f64, b: f64| if b > 0.0 { a / b - 1.0 } else { 0.0 };
    let mk = |setup: &'static str, h: Hits, v: &[f64]| {
        let s = stats(v);
        TtftRow {
            setup,
            block_hit_rate: h.block_rate(),
            token_hit_rate: h.token_rate(),
            stats: s,
            mean_change: change(s.mean_ms, base.mean_ms),
            p50_change: change(s.p50_ms, base.p50_ms),
            p99_change: change(s.p99_ms, base.p99_ms),
        }
    };
    let rows = vec![
        mk("no cache", Hits::default(), &none),
        mk("node-local", run.local_total, &local),
        mk("pool", run.pool_total, &pool),
    ];
    println!(
        "trace {}: {} requests; {} nodes x {} blocks, {} routing, policy {}; {} us/token prefill, {} B/token KV, {} Gbit/s, per-block latency {}",
        path.display(),
        trace.requests.len(),
        a.nodes,
        per_node,
        a.routing.name(),
        a.policy,
        model.prefill_us_per_token,
        model.kv_bytes_per_token,
        model.link_gbps,
        match &model.block_latency {
            BlockLatency::Fixed { us } => format!("{us} us"),
            BlockLatency::Measured { source, block_size, p50_us, p99_us } =>
                format!("measured get of {block_size} B (p50 {p50_us} us, p99 {p99_us} us) from {source}"),
        }
    );
    println!(
        "{:<11} {:>9} {:>9} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "setup", "blk hit", "tok hit", "mean ms", "p50 ms", "p99 ms", "mean", "p50", "p99"
    );
    for r in &rows {
        println!(
            "{:<11} {:>9.3} {:>9.3} {:>10.1} {:>10.1} {:>10.1} {:>+7.1}% {:>+7.1}% {:>+7.1}%",
            r.setup,
            r.block_hit_rate,
            r.token_hit_rate,
            r.stats.mean_ms,
            r.stats.p50_ms,
            r.stats.p99_ms,
            r.mean_change * 100.0,
            r.p50_change * 100.0,
            r.p99_change * 100.0
        );
    }
    if let Some(p) = &a.json {
        let report = TtftReport {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            trace: path.display().to_string(),
            requests: trace.requests.len(),
            nodes: a.nodes,
            capacity_per_node_blocks: per_node,
            routing: a.routing,
            policy: a.policy.clone(),
            model,
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
    fn model_charges_compute_bytes_and_latency() {
        let m = Model {
            prefill_us_per_token: 100.0,
            kv_bytes_per_token: 1000,
            link_gbps: 8.0,
            block_latency: BlockLatency::Fixed { us: 10.0 },
        };
        let r = Request { timestamp: 0, input_length: 1024, output_length: 0, hash_ids: vec![1, 2] };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(m.ttft_us(&r, &Hits::default(), &mut rng), 102_400.0);
        let h = Hits { blocks: 2, tokens: 1024, block_hits: 1, token_hits: 512 };
        // 512 uncached x 100 us + 512 KB at 1 GB/s (512 us) + 1 block x 10 us
        assert!((m.ttft_us(&r, &h, &mut rng) - (51_200.0 + 512.0 + 10.0)).abs() < 1e-6);
        let s = stats(&[1000.0, 2000.0, 3000.0, 4000.0]);
        assert_eq!((s.mean_ms, s.p50_ms, s.p99_ms), (2.5, 2.0, 4.0));
    }

    #[test]
    fn measured_latency_reads_throughput_json() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.json");
        let row = |size: u64, op: &str, p50: u64| {
            serde_json::json!({"target": "kvpool", "block_size": size, "batch": 1, "concurrency": 1, "op": op,
                "result": {"ops": 1, "bytes": 1, "seconds": 1.0, "mb_per_s": 1.0, "p50_us": p50, "p99_us": 900}})
        };
        let doc = serde_json::json!({"rows": [row(1 << 20, "get", 700), row(65536, "put", 5), row(65536, "get", 400)]});
        std::fs::write(&p, doc.to_string()).unwrap();
        match measured_latency(&p, "kvpool").unwrap() {
            BlockLatency::Measured { block_size, p50_us, p99_us, .. } => {
                assert_eq!((block_size, p50_us, p99_us), (65536, 400.0, 900.0))
            }
            other => panic!("{other:?}"),
        }
        assert!(measured_latency(&p, "redis").is_err());
        let l = measured_latency(&p, "kvpool").unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        assert!((0..1000).map(|_| l.sample(&mut rng)).all(|x| (400.0..=900.0).contains(&x)));
    }
}
