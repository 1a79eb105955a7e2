//! `kvpool-bench replay`: hit rate of every policy at several capacities on a request trace,
//! beside libCacheSim's implementations, Belady and the unlimited cache.

use crate::pool::PoolStats;
use crate::sim::{self, Belady, CacheSim, OracleAdmission, Pair, WasmSet, BELADY_NOTE, ORACLE_NOTE};

/// The row of the offline admission bound (see [`OracleAdmission`]).
const ORACLE_ROW: &str = "offline/oracle-admission+leaf-lru";
use crate::trace::{self, Hits, Trace};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvpool_policy_host::PolicyKind;
use kvpool_policy_sdk::{AdmissionPolicy, EvictionPolicy, Params};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Mooncake-format trace (JSON lines); default: $KVPOOL_TRACE or shared/traces/mooncake-conversation.jsonl above the current directory
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Cache capacities as fractions of the trace's distinct blocks
    #[arg(long, value_delimiter = ',', default_value = "0.02,0.05,0.1,0.2,0.4")]
    pub capacities: Vec<f64>,
    /// Admission + eviction pairs to replay, `admission+eviction` (a bare eviction name pairs it
    /// with the server's default admission, `threshold`); default: the standard set
    #[arg(long, value_delimiter = ',')]
    pub pairs: Vec<String>,
    /// Extra Wasm components (eviction or admission), usable in --pairs by their file stem
    #[arg(long)]
    pub wasm: Vec<PathBuf>,
    /// Only rows matching these names (e.g. `threshold+lru`, `wasm/threshold+arc`,
    /// `libcachesim/lirs`, `belady`; a name without a family matches it in every family)
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Policy parameters k=v passed to every kvpool policy (native and Wasm)
    #[arg(long = "param")]
    pub params: Vec<String>,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a PNG plot of block hit rate vs capacity
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Skip libCacheSim
    #[arg(long)]
    pub no_libcachesim: bool,
    /// Skip the standard Wasm components (native policies and --wasm files still run)
    #[arg(long)]
    pub no_wasm: bool,
    /// Replay only the first N requests
    #[arg(long)]
    pub limit: Option<usize>,
    /// libCacheSim driver script
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/libcachesim_replay.py"))]
    pub libcachesim_script: PathBuf,
    /// Python interpreter for the libCacheSim driver
    #[arg(long, default_value = "python3")]
    pub python: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResultRow {
    pub policy: String,
    /// native | wasm | libcachesim | offline
    pub family: String,
    pub fraction: f64,
    pub capacity: usize,
    #[serde(flatten)]
    pub hits: Hits,
    pub block_hit_rate: f64,
    pub token_hit_rate: f64,
    /// Counters of the pool (kvpool pairs and Belady; zero for libCacheSim).
    pub pool: PoolStats,
    /// Linear memory the Wasm eviction module grew to, bytes (Wasm rows only).
    pub wasm_memory: Option<usize>,
    pub seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct ReplayReport {
    pub command: String,
    pub trace: String,
    pub requests: usize,
    pub block_accesses: u64,
    pub distinct_blocks: usize,
    pub unlimited: Hits,
    pub unlimited_block_hit_rate: f64,
    pub unlimited_token_hit_rate: f64,
    pub belady: &'static str,
    pub oracle: &'static str,
    pub libcachesim_version: Option<String>,
    pub rows: Vec<ResultRow>,
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("cannot run {python}: {source}")]
    Spawn {
        python: String,
        #[source]
        source: std::io::Error,
    },
    #[error("libcachesim is not installed for {0} (pip install libcachesim)")]
    Missing(String),
    #[error("libcachesim driver failed ({status}): {stderr}")]
    Failed { status: String, stderr: String },
    #[error("libcachesim driver printed bad JSON: {0}")]
    Json(#[from] serde_json::Error),
}

#[derive(Debug, Deserialize)]
struct LcsOut {
    libcachesim: String,
    results: Vec<LcsRow>,
}

#[derive(Debug, Deserialize)]
struct LcsRow {
    algo: String,
    capacity: usize,
    blocks: u64,
    tokens: u64,
    block_hits: u64,
    token_hits: u64,
    seconds: f64,
}

/// libCacheSim's algorithms driven by `bench/peers/libcachesim_replay.py`.
pub const LIBCACHESIM: [&str; 7] = ["lru", "arc", "clock", "s3fifo", "sieve", "lirs", "wtinylfu"];

/// One libCacheSim result: algorithm, capacity in blocks, hits, seconds.
pub type LcsResult = (String, usize, Hits, f64);

/// Run the libCacheSim driver for `algos` at `capacities` (blocks).
pub fn run_libcachesim(
    python: &str,
    script: &Path,
    trace: &Path,
    limit: Option<usize>,
    algos: &[&str],
    capacities: &[usize],
) -> Result<(String, Vec<LcsResult>), PeerError> {
    let caps: Vec<String> = capacities.iter().map(|c| c.to_string()).collect();
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .arg("--trace")
        .arg(trace)
        .arg("--capacities")
        .arg(caps.join(","))
        .arg("--algos")
        .arg(algos.join(","));
    if let Some(l) = limit {
        cmd.arg("--limit").arg(l.to_string());
    }
    tracing::info!(?cmd, "running libCacheSim");
    let out = cmd.output().map_err(|source| PeerError::Spawn { python: python.into(), source })?;
    if out.status.code() == Some(3) {
        return Err(PeerError::Missing(python.into()));
    }
    if !out.status.success() {
        return Err(PeerError::Failed {
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).lines().rev().take(20).collect::<Vec<_>>().join("\n"),
        });
    }
    let parsed: LcsOut = serde_json::from_slice(&out.stdout)?;
    let rows = parsed
        .results
        .into_iter()
        .map(|r| {
            let h = Hits { blocks: r.blocks, tokens: r.tokens, block_hits: r.block_hits, token_hits: r.token_hits };
            (r.algo, r.capacity, h, r.seconds)
        })
        .collect();
    Ok((parsed.libcachesim, rows))
}

/// True when `id` (`family/name` or a bare name) is selected by `filters`.
pub fn selected(filters: &[String], id: &str) -> bool {
    if filters.is_empty() {
        return true;
    }
    let name = id.rsplit('/').next().unwrap_or(id);
    filters.iter().any(|f| f == id || f == name)
}

pub fn parse_params(kv: &[String]) -> Result<Params> {
    let mut pairs = Vec::new();
    for p in kv {
        let (k, v) = p.split_once('=').with_context(|| format!("--param {p:?} is not k=v"))?;
        pairs.push((k.to_string(), v.to_string()));
    }
    Ok(Params::from_pairs(pairs))
}

pub fn resolve_trace(t: &Option<PathBuf>) -> Result<PathBuf> {
    match t {
        Some(p) => Ok(p.clone()),
        None => trace::locate_default()
            .context("no --trace given and no shared/traces/mooncake-conversation.jsonl found (set KVPOOL_TRACE)"),
    }
}

pub fn progress(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} [{{elapsed_precise}}] {{bar:40}} {{pos}}/{{len}} {what}  {{msg}}"
        ))
        .expect("static template"),
    );
    pb
}

/// Makes the pair of one run; the cell (Wasm runs) follows the eviction module's memory.
type Made = (Box<dyn AdmissionPolicy + Send>, Box<dyn EvictionPolicy + Send>, Option<sim::MemoryProbe>);
type Factory<'a> = Box<dyn Fn() -> Result<Made> + 'a>;

pub fn replay(a: ReplayArgs) -> Result<()> {
    let path = resolve_trace(&a.trace)?;
    let trace = Trace::load(&path, a.limit)?;
    if a.capacities.is_empty() || a.capacities.iter().any(|c| c.is_nan() || *c <= 0.0) {
        bail!("capacities must be positive fractions");
    }
    let params = parse_params(&a.params)?;
    let distinct = trace.distinct_blocks();
    let caps: Vec<(f64, usize)> = a.capacities.iter().map(|&f| (f, trace.capacity_for(f))).collect();
    let unl = trace::unlimited(&trace);
    let pairs: Vec<Pair> = if a.pairs.is_empty() {
        sim::DEFAULT_PAIRS.iter().map(|p| Pair::parse(p)).collect::<Result<_, _>>()?
    } else {
        a.pairs.iter().map(|p| Pair::parse(p)).collect::<Result<_, _>>()?
    };

    let mut wasm = WasmSet::new()?;
    let want_wasm = !a.no_wasm && pairs.iter().any(|p| selected(&a.policies, &format!("wasm/{}", p.label())));
    if want_wasm {
        eprintln!("building the standard policy components (target/policy-components)...");
        wasm.add_standard(&params)?;
    }
    for w in &a.wasm {
        let name = sim::wasm_name(w);
        if wasm.add_file(&name, PolicyKind::Eviction, w, &params).is_err() {
            wasm.add_file(&name, PolicyKind::Admission, w, &params)?;
        }
    }
    let wasm = &wasm;
    let mut factories: Vec<(String, String, Factory)> = Vec::new();
    for pair in &pairs {
        let id = format!("native/{}", pair.label());
        let native_known = sim::native_admission(&pair.admission, &params).is_ok()
            && sim::native_eviction(&pair.eviction, &params).is_ok();
        if native_known && selected(&a.policies, &id) {
            let (params, pair) = (params.clone(), pair.clone());
            factories.push((
                id,
                "native".into(),
                Box::new(move || {
                    Ok((
                        sim::native_admission(&pair.admission, &params)?,
                        sim::native_eviction(&pair.eviction, &params)?,
                        None,
                    ))
                }),
            ));
        }
        let id = format!("wasm/{}", pair.label());
        let wasm_known =
            wasm.has(&pair.admission, PolicyKind::Admission) && wasm.has(&pair.eviction, PolicyKind::Eviction);
        if wasm_known && selected(&a.policies, &id) {
            let pair = pair.clone();
            factories.push((
                id,
                "wasm".into(),
                Box::new(move || {
                    let (e, mem) = wasm.eviction_probed(&pair.eviction)?;
                    Ok((wasm.admission(&pair.admission)?, e, Some(mem)))
                }),
            ));
        }
    }
    let with_belady = selected(&a.policies, "offline/belady");
    let with_oracle = selected(&a.policies, ORACLE_ROW);
    let runs = (factories.len() + usize::from(with_belady) + usize::from(with_oracle)) * caps.len();
    let pb = progress((runs * trace.requests.len()) as u64, "requests");

    let mut rows = Vec::new();
    let row = |policy: &str,
               family: &str,
               (fraction, capacity): (f64, usize),
               sim: &CacheSim,
               mem: Option<usize>,
               secs: f64| ResultRow {
        policy: policy.into(),
        family: family.into(),
        fraction,
        capacity,
        hits: sim.hits,
        block_hit_rate: sim.hits.block_rate(),
        token_hit_rate: sim.hits.token_rate(),
        pool: sim.stats(),
        wasm_memory: mem,
        seconds: secs,
    };
    for (id, family, make) in &factories {
        for &cap in &caps {
            pb.set_message(format!("{id} @ {}", cap.0));
            let t = Instant::now();
            let (adm, ev, mem) = make()?;
            let mut s = CacheSim::pair(adm, ev, cap.1);
            s.run(&trace, || pb.inc(1));
            rows.push(row(
                id,
                family,
                cap,
                &s,
                mem.map(|m| m.load(std::sync::atomic::Ordering::Relaxed)),
                t.elapsed().as_secs_f64(),
            ));
        }
    }
    if with_belady {
        for &cap in &caps {
            pb.set_message(format!("belady @ {}", cap.0));
            let t = Instant::now();
            let clock = sim::Clock::default();
            let mut s = CacheSim::with_clock(Box::new(Belady::new(&trace, clock.clone())), cap.1, clock);
            s.run(&trace, || pb.inc(1));
            rows.push(row("offline/belady", "offline", cap, &s, None, t.elapsed().as_secs_f64()));
        }
    }
    if with_oracle {
        for &cap in &caps {
            pb.set_message(format!("oracle admission @ {}", cap.0));
            let t = Instant::now();
            let clock = sim::Clock::default();
            let admission = Box::new(OracleAdmission::new(&trace, clock.clone()));
            let eviction = sim::native_eviction("leaf-lru", &Params::new())?;
            let mut s = CacheSim::pair_with_clock(admission, eviction, cap.1, clock);
            s.run(&trace, || pb.inc(1));
            rows.push(row(ORACLE_ROW, "offline", cap, &s, None, t.elapsed().as_secs_f64()));
        }
    }
    pb.finish_and_clear();

    let mut lcs_version = None;
    let algos: Vec<&str> =
        LIBCACHESIM.iter().copied().filter(|n| selected(&a.policies, &format!("libcachesim/{n}"))).collect();
    if !a.no_libcachesim && !algos.is_empty() {
        eprintln!("running libCacheSim ({})...", algos.join(", "));
        let blocks: Vec<usize> = caps.iter().map(|c| c.1).collect();
        match run_libcachesim(&a.python, &a.libcachesim_script, &path, a.limit, &algos, &blocks) {
            Ok((v, res)) => {
                lcs_version = Some(v);
                for (algo, capacity, hits, secs) in res {
                    let fraction = caps.iter().find(|c| c.1 == capacity).map_or(0.0, |c| c.0);
                    rows.push(ResultRow {
                        policy: format!("libcachesim/{algo}"),
                        family: "libcachesim".into(),
                        fraction,
                        capacity,
                        hits,
                        block_hit_rate: hits.block_rate(),
                        token_hit_rate: hits.token_rate(),
                        pool: PoolStats::default(),
                        wasm_memory: None,
                        seconds: secs,
                    });
                }
            }
            Err(PeerError::Missing(py)) if std::env::var_os("KVPOOL_REQUIRE_PEERS").is_none() => {
                tracing::warn!("libcachesim is not installed for {py}: skipped (pip install libcachesim)");
                eprintln!("libcachesim is not installed for {py}: skipped (pip install libcachesim)");
            }
            Err(e) => return Err(e.into()),
        }
    }

    let report = ReplayReport {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        trace: path.display().to_string(),
        requests: trace.requests.len(),
        block_accesses: trace.block_accesses(),
        distinct_blocks: distinct,
        unlimited: unl,
        unlimited_block_hit_rate: unl.block_rate(),
        unlimited_token_hit_rate: unl.token_rate(),
        belady: BELADY_NOTE,
        oracle: ORACLE_NOTE,
        libcachesim_version: lcs_version,
        rows,
    };
    print_report(&report, &caps);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        crate::hitplot::hit_rate_plot(p, &report, &caps).with_context(|| format!("plotting {}", p.display()))?;
    }
    Ok(())
}

fn print_report(r: &ReplayReport, caps: &[(f64, usize)]) {
    println!(
        "trace {}: {} requests, {} block accesses, {} distinct blocks; unlimited cache: block hit rate {:.3}, token hit rate {:.3}",
        r.trace, r.requests, r.block_accesses, r.distinct_blocks, r.unlimited_block_hit_rate, r.unlimited_token_hit_rate
    );
    println!("{}", r.belady);
    println!("{}", r.oracle);
    if let Some(v) = &r.libcachesim_version {
        println!("libCacheSim {v} (default parameters, driven the same way: prefix lookup, then get of every block)");
    }
    let mut policies: Vec<&str> = Vec::new();
    for row in &r.rows {
        if !policies.contains(&row.policy.as_str()) {
            policies.push(&row.policy);
        }
    }
    for (what, f) in [("block", Hits::block_rate as fn(&Hits) -> f64), ("token", Hits::token_rate)] {
        println!();
        print!("{:<34}", format!("{what} hit rate"));
        for (frac, blocks) in caps {
            print!(" {:>15}", format!("{:.0}% ({blocks})", frac * 100.0));
        }
        println!();
        for p in &policies {
            print!("{p:<34}");
            for (frac, _) in caps {
                match r.rows.iter().find(|x| x.policy == *p && x.fraction == *frac) {
                    Some(x) => print!(" {:>15.3}", f(&x.hits)),
                    None => print!(" {:>15}", "-"),
                }
            }
            println!();
        }
        print!("{:<34}", "unlimited");
        for _ in caps {
            print!(" {:>15.3}", f(&r.unlimited));
        }
        println!();
    }
    let wasm: Vec<&str> =
        policies.iter().copied().filter(|p| r.rows.iter().any(|x| x.policy == *p && x.wasm_memory.is_some())).collect();
    if !wasm.is_empty() {
        println!();
        print!("{:<34}", "wasm memory, bytes/block");
        for (frac, blocks) in caps {
            print!(" {:>15}", format!("{:.0}% ({blocks})", frac * 100.0));
        }
        println!();
        for p in wasm {
            print!("{p:<34}");
            for (frac, _) in caps {
                match r
                    .rows
                    .iter()
                    .find(|x| x.policy == p && x.fraction == *frac)
                    .and_then(|x| Some((x.wasm_memory?, x.capacity)))
                {
                    Some((m, c)) => print!(" {:>15.0}", m as f64 / c.max(1) as f64),
                    None => print!(" {:>15}", "-"),
                }
            }
            println!();
        }
    }
    let bad: Vec<&ResultRow> =
        r.rows.iter().filter(|x| x.pool.invalid_victims > 0 || x.pool.invalid_admissions > 0).collect();
    for x in bad {
        println!(
            "note: {} @ {}: {} invalid victims and {} invalid admission answers ignored",
            x.policy, x.fraction, x.pool.invalid_victims, x.pool.invalid_admissions
        );
    }
}
