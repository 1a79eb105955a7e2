//! `kvpool-bench live-replay`: the same trace through a live server and through the server's
//! core, request by request, for each admission + eviction pair; the two must agree.
//!
//! The live side is a real `kvpool-server` process with the pair loaded as Wasm modules
//! (`policy load`), driven by the client over same-host shared memory (lookups, gets and puts
//! on the control socket: no read in flight holds a block when the next request evicts). The
//! core side is [`SimPool`] with [`Semantics::Server`] and the native pair. Both go through
//! the one replay driver ([`CacheSim`]), so the same calls are made in the same order; the
//! server is set up to be deterministic: a 0 ms lease, both DRAM watermarks at 1.0 (only a
//! full reservation evicts), blocks of exactly one allocation unit.

use crate::pool::{trace_key, PoolStats, PutItem, ReplayPool, Semantics, SimPool};
use crate::replay::{parse_params, resolve_trace};
use crate::sim::{self, CacheSim, Pair};
use crate::target::LocalServer;
use crate::trace::Trace;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvpool_client::blocking::Client;
use kvpool_client::proto::PolicyKind;
use kvpool_client::{Buffer, ClientConfig, ErrorCode, PutMode, PutOptions, TransportChoice};
use serde::Serialize;
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;

/// Value size of every block: the DRAM tier's allocation unit, so that a block's size and its
/// footprint agree (eviction counts sizes, reservations count footprints).
const BLOCK: usize = kvpool_server::store::dram::UNIT as usize;

#[derive(Debug, Args)]
pub struct LiveArgs {
    /// Mooncake-format trace; default as for `replay`
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Requests replayed from the start of the trace
    #[arg(long, default_value_t = 2000)]
    pub limit: usize,
    /// ReplayPool capacity in blocks: a multiple of 64, at least 4096 (the server's smallest segment,
    /// 1 MiB, in 256-byte blocks)
    #[arg(long, default_value_t = 4096)]
    pub capacity: usize,
    /// Admission + eviction pairs (as for `replay`); default: the standard set
    #[arg(long, value_delimiter = ',')]
    pub pairs: Vec<String>,
    /// Policy parameters k=v given to both sides
    #[arg(long = "param")]
    pub params: Vec<String>,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
pub struct LiveRow {
    pub pair: String,
    pub requests: usize,
    pub block_accesses: u64,
    pub live_block_hits: u64,
    pub core_block_hits: u64,
    /// Requests whose hit counts differ.
    pub mismatched_requests: usize,
    /// The first of them (index into the trace), if any.
    pub first_mismatch: Option<usize>,
    pub core: PoolStats,
    pub live_seconds: f64,
}

/// A live server as a replay pool, through the blocking client.
struct LivePool {
    client: Client,
    buf: Buffer,
    max_batch: usize,
    /// The first failure; later calls do nothing and the run reports it.
    error: Rc<std::cell::RefCell<Option<anyhow::Error>>>,
    stats: PoolStats,
}

impl LivePool {
    fn fail(&self, e: impl Into<anyhow::Error>) {
        let mut slot = self.error.borrow_mut();
        if slot.is_none() {
            *slot = Some(e.into());
        }
    }

    fn failed(&self) -> bool {
        self.error.borrow().is_some()
    }
}

impl ReplayPool for LivePool {
    fn lookup(&mut self, chain: &[u64], _now_us: u64) -> usize {
        if self.failed() || chain.is_empty() {
            return 0;
        }
        let keys: Vec<Vec<u8>> = chain.iter().map(|&k| trace_key(k)).collect();
        match self.client.lookup(&keys) {
            Ok(n) => n,
            Err(e) => {
                self.fail(e);
                0
            }
        }
    }

    fn get(&mut self, keys: &[u64], _now_us: u64) {
        if self.failed() || keys.is_empty() {
            return;
        }
        if keys.len() > self.max_batch {
            return self.fail(anyhow::anyhow!("a get of {} blocks is above the batch limit", keys.len()));
        }
        let names: Vec<Vec<u8>> = keys.iter().map(|&k| trace_key(k)).collect();
        let dests: Result<Vec<_>, _> = (0..keys.len()).map(|i| self.buf.slice(i * BLOCK, BLOCK)).collect();
        let r = dests.map_err(anyhow::Error::from).and_then(|d| Ok(self.client.get_into_batch(&names, &d)?));
        match r {
            // Every key was resident a moment ago and nothing ran in between.
            Ok(st) if st.iter().all(|s| s.status == ErrorCode::Ok) => {}
            Ok(st) => self.fail(anyhow::anyhow!("a get of resident blocks answered {st:?}")),
            Err(e) => self.fail(e),
        }
    }

    fn put(&mut self, items: &[PutItem], _now_us: u64) {
        if self.failed() || items.is_empty() {
            return;
        }
        if items.len() > self.max_batch {
            return self.fail(anyhow::anyhow!("a put of {} blocks is above the batch limit", items.len()));
        }
        let mut entries = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            let slice = match self.buf.slice(i * BLOCK, BLOCK) {
                Ok(s) => s,
                Err(e) => return self.fail(e),
            };
            let opts = PutOptions {
                parent: it.parent.map(trace_key),
                tokens: it.tokens,
                seq_tokens: it.seq_tokens,
                ..PutOptions::default()
            };
            entries.push((trace_key(it.key), slice, opts));
        }
        match self.client.put_from_batch(&entries, PutMode::Insert) {
            Ok(st) => self.stats.count_put(st),
            Err(e) => self.fail(e),
        }
    }

    fn release(&mut self) {}

    fn stats(&self) -> PoolStats {
        self.stats
    }
}

/// The server's settings that make it run the core's [`Semantics::Server`].
pub(crate) const SERVER_CONFIG: &str = r#"
[dram]
high_watermark = 1.0
low_watermark = 1.0

[cache]
lease_ttl_ms = 0
# A reservation that eviction cannot serve fails soon instead of waiting for reads to end.
put_wait_ms = 20
"#;

pub fn live_replay(a: LiveArgs) -> Result<()> {
    if a.capacity < 4096 || !a.capacity.is_multiple_of(64) {
        bail!("--capacity must be a multiple of 64 blocks and at least 4096");
    }
    let path = resolve_trace(&a.trace)?;
    let trace = Trace::load(&path, Some(a.limit))?;
    let params = parse_params(&a.params)?;
    let pairs: Vec<Pair> = if a.pairs.is_empty() {
        sim::DEFAULT_PAIRS.iter().map(|p| Pair::parse(p)).collect::<Result<_, _>>()?
    } else {
        a.pairs.iter().map(|p| Pair::parse(p)).collect::<Result<_, _>>()?
    };
    eprintln!("building the standard policy components (target/policy-components)...");
    let out = kvpool_policy_build::repo_root().join("target/policy-components");
    let built: HashMap<String, PathBuf> =
        kvpool_policy_build::build_standard(&out)?.into_iter().map(|b| (b.name, b.path)).collect();
    let wasm_params: Vec<(String, String)> =
        a.params.iter().filter_map(|p| p.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let cfg_dir = tempfile::tempdir()?;
    let cfg_path = cfg_dir.path().join("kvpool.toml");
    std::fs::write(&cfg_path, SERVER_CONFIG)?;

    let mut rows = Vec::new();
    for pair in &pairs {
        let module = |name: &str| -> Result<Vec<u8>> {
            let p = built.get(name).with_context(|| format!("no standard Wasm component named {name}"))?;
            Ok(std::fs::read(p)?)
        };
        let server = LocalServer::start(
            &(a.capacity * BLOCK).to_string(),
            &["--config".to_string(), cfg_path.display().to_string()],
        )?;
        let mut cfg = ClientConfig::from_data_dir(server.path())?;
        cfg.transport = TransportChoice::Shm;
        let client = Client::connect(cfg)?;
        client.policy_load(PolicyKind::Admission, &pair.admission, &wasm_params, &module(&pair.admission)?)?;
        client.policy_load(PolicyKind::Eviction, &pair.eviction, &wasm_params, &module(&pair.eviction)?)?;
        let max_batch = client.limits().max_batch as usize;
        let mut buf = client.alloc_buffer(max_batch * BLOCK)?;
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        let error = Rc::new(std::cell::RefCell::new(None));
        let live = LivePool { client, buf, max_batch, error: error.clone(), stats: PoolStats::default() };
        let mut live = CacheSim::over(Box::new(live), crate::sim::Clock::default());
        let core = SimPool::with_semantics(
            sim::native_admission(&pair.admission, &params)?,
            sim::native_eviction(&pair.eviction, &params)?,
            a.capacity,
            Semantics::Server,
        );
        let mut core = CacheSim::over(Box::new(core), crate::sim::Clock::default());
        let (mut mismatched, mut first) = (0, None);
        let started = std::time::Instant::now();
        for (i, r) in trace.requests.iter().enumerate() {
            let l = live.request(r);
            if let Some(e) = error.borrow_mut().take() {
                return Err(e.context(format!("{} at request {i}; server log:\n{}", pair.label(), server.log_tail())));
            }
            let c = core.request(r);
            if l.block_hits != c.block_hits {
                mismatched += 1;
                first.get_or_insert(i);
            }
        }
        let row = LiveRow {
            pair: pair.label(),
            requests: trace.requests.len(),
            block_accesses: live.hits.blocks,
            live_block_hits: live.hits.block_hits,
            core_block_hits: core.hits.block_hits,
            mismatched_requests: mismatched,
            first_mismatch: first,
            core: core.stats(),
            live_seconds: started.elapsed().as_secs_f64(),
        };
        println!(
            "{:<32} live {:>6} / core {:>6} block hits of {}; {} requests differ{}",
            row.pair,
            row.live_block_hits,
            row.core_block_hits,
            row.block_accesses,
            row.mismatched_requests,
            row.first_mismatch.map(|i| format!(" (first: request {i})")).unwrap_or_default()
        );
        rows.push(row);
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?).with_context(|| format!("writing {}", p.display()))?;
    }
    let bad: Vec<&str> = rows.iter().filter(|r| r.mismatched_requests > 0).map(|r| r.pair.as_str()).collect();
    if !bad.is_empty() {
        bail!("the live server and the core disagree for {}", bad.join(", "));
    }
    println!("the live server and the core agree request by request for every pair");
    Ok(())
}
