//! Synthetic request traces in the Mooncake format (`kvpool-bench gen`), seeded and
//! reproducible, for the shapes of KV-cache traffic a pool sees besides chat:
//!
//! - `system-prompts`: single-turn requests of many apps, each app with its own system prompt
//!   (app popularity Zipf 1.0); a few user queries repeat exactly (FAQ-like);
//! - `multi-turn`: conversations; each turn's prompt is the previous prompt, the answer and a
//!   new message; turns per conversation geometric, think time log-normal (median 60 s);
//! - `tool-loop`: agent sessions: a large agent prompt, a task, then many short-gap iterations
//!   appending a tool call and its result, some forking into parallel branches;
//! - `documents`: long one-off documents (RAG, summarization) that are never read again, with
//!   a minority of requests on a small hot set of shared documents (Zipf 0.8);
//! - `mix`: the four interleaved, a quarter of the requests each.
//!
//! Every prompt is a chain of 512-token blocks whose ids are chained hashes (an id is only
//! ever seen after the same prefix), the last block partial. Parameters are fixed by design,
//! not fitted to any trace; only `--requests` and `--seed` change. See [`Params`].

use crate::trace::{Request, BLOCK_TOKENS};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Write;
use std::path::PathBuf;

/// The generators.
pub const KINDS: [&str; 5] = ["system-prompts", "multi-turn", "tool-loop", "documents", "mix"];

#[derive(Debug, Args)]
pub struct GenArgs {
    /// Which workload (system-prompts, multi-turn, tool-loop, documents, mix)
    #[arg(long)]
    pub kind: String,
    /// Requests to generate
    #[arg(long, default_value_t = 12_000)]
    pub requests: usize,
    /// Random seed
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output file (JSON lines, Mooncake format)
    #[arg(long)]
    pub out: PathBuf,
}

pub fn gen(a: GenArgs) -> Result<()> {
    let reqs = generate(&a.kind, a.requests, a.seed)?;
    let f = std::fs::File::create(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut w = std::io::BufWriter::new(f);
    for r in &reqs {
        let line = serde_json::json!({
            "timestamp": r.timestamp,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": r.hash_ids,
        });
        writeln!(w, "{line}")?;
    }
    w.flush()?;
    eprintln!(
        "{}: {} requests, {} block accesses",
        a.out.display(),
        reqs.len(),
        reqs.iter().map(|r| r.hash_ids.len()).sum::<usize>()
    );
    Ok(())
}

/// Small, fast and version-stable generator (xoshiro256**, seeded through splitmix64): the
/// same seed gives the same trace whatever the `rand` crate does.
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let r = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n.max(1) as u128) >> 64) as u64
    }
    pub fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }
    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.f64()).ln()
    }
    /// Log-normal with the given median and sigma (of the log).
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let (u1, u2) = (1.0 - self.f64(), self.f64());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        median * (sigma * z).exp()
    }
    /// A count from a log-normal, clamped to [lo, hi].
    pub fn count(&mut self, median: f64, sigma: f64, lo: u64, hi: u64) -> u64 {
        (self.lognormal(median, sigma).round() as u64).clamp(lo, hi)
    }
    /// Geometric number of trials >= 1 with the given mean.
    pub fn geometric(&mut self, mean: f64) -> u64 {
        let p = 1.0 / mean.max(1.0);
        let mut n = 1;
        while !self.chance(p) && n < 10_000 {
            n += 1;
        }
        n
    }
}

/// Zipf(s) over 0..n by inverse CDF.
pub struct Zipf(Vec<f64>);

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut c = Vec::with_capacity(n);
        let mut acc = 0.0;
        for k in 1..=n.max(1) {
            acc += 1.0 / (k as f64).powf(s);
            c.push(acc);
        }
        Zipf(c.into_iter().map(|x| x / acc).collect())
    }
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.f64();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1)
    }
}

/// Fixed parameters of the generators (documented in `bench/RESULTS.md`).
pub mod params {
    /// Requests per minute over the whole trace (the real conversation trace has ~204).
    pub const RATE_PER_MIN: f64 = 200.0;
    // system-prompts
    pub const APPS: usize = 200;
    pub const APP_ZIPF: f64 = 1.0;
    pub const SYSTEM_BLOCKS_MEDIAN: f64 = 6.0;
    pub const USER_BLOCKS_MEDIAN: f64 = 4.0;
    pub const REPEAT_QUERY: f64 = 0.05;
    pub const QUERIES_PER_APP: usize = 20;
    // multi-turn
    pub const CHAT_PROMPTS: usize = 20;
    pub const CHAT_PROMPT_BLOCKS: u64 = 3;
    pub const FIRST_MESSAGE_MEDIAN: f64 = 6.0;
    pub const TURNS_MEAN: f64 = 2.5;
    pub const THINK_MEDIAN_S: f64 = 60.0;
    pub const ANSWER_BLOCKS_MEDIAN: f64 = 1.0;
    pub const MESSAGE_BLOCKS_MEDIAN: f64 = 1.5;
    pub const MAX_CONTEXT: u64 = 256;
    // tool-loop
    pub const AGENTS: usize = 8;
    pub const AGENT_PROMPT_BLOCKS: u64 = 16;
    pub const TASK_BLOCKS_MEDIAN: f64 = 4.0;
    pub const ITERATIONS_MEAN: f64 = 12.0;
    pub const TOOL_GAP_MEDIAN_S: f64 = 20.0;
    pub const TOOL_RESULT_BLOCKS_MEDIAN: f64 = 2.0;
    pub const FORK: f64 = 0.1;
    // documents
    pub const DOC_BLOCKS_MEDIAN: f64 = 32.0;
    pub const HOT_DOCS: usize = 300;
    pub const HOT_SHARE: f64 = 0.2;
    pub const HOT_ZIPF: f64 = 0.8;
    pub const INSTRUCTION_BLOCKS: u64 = 2;
}

use params::*;

/// State shared by the generators of one trace: fresh ids and the request list.
struct Out {
    next_id: u64,
    reqs: Vec<Request>,
}

impl Out {
    fn fresh(&mut self, n: u64) -> Vec<u64> {
        let v = (self.next_id..self.next_id + n).collect();
        self.next_id += n;
        v
    }
    /// A request over the chain `ids` whose last block is partial (1..=512 tokens).
    fn push(&mut self, t_ms: f64, ids: &[u64], last_tokens: u64, output: u64) {
        let n = ids.len() as u64;
        self.reqs.push(Request {
            timestamp: t_ms.max(0.0) as u64,
            input_length: BLOCK_TOKENS * (n - 1) + last_tokens,
            output_length: output,
            hash_ids: ids.to_vec(),
        });
    }
}

/// A pending step of a session: (time in ms, session index).
type Agenda = BinaryHeap<Reverse<(u64, usize)>>;

trait Workload {
    /// Start a new session at `t`; schedule its steps in `agenda` under `me`.
    fn start(&mut self, rng: &mut Rng, out: &mut Out, t: f64, me: usize, agenda: &mut Agenda);
    /// Run the step of session `s` due at `t`; schedule its next steps.
    fn step(&mut self, rng: &mut Rng, out: &mut Out, t: f64, s: usize, agenda: &mut Agenda);
}

fn last_tokens(rng: &mut Rng) -> u64 {
    1 + rng.below(BLOCK_TOKENS)
}

fn at(agenda: &mut Agenda, t: f64, s: usize) {
    agenda.push(Reverse((t.max(0.0) as u64, s)));
}

/// A block chain allocated on first use (its ids and the tokens of its last block).
type Lazy = Option<(Vec<u64>, u64)>;

/// Single-turn requests to many apps with their own system prompts.
struct SystemPrompts {
    prompts: Vec<Vec<u64>>,
    zipf: Zipf,
    /// Per app, the ids of its repeatable queries (allocated on first use).
    queries: Vec<Vec<Lazy>>,
}

impl SystemPrompts {
    fn new(rng: &mut Rng, out: &mut Out) -> SystemPrompts {
        let prompts = (0..APPS).map(|_| out.fresh(rng.count(SYSTEM_BLOCKS_MEDIAN, 0.8, 1, 64))).collect();
        SystemPrompts { prompts, zipf: Zipf::new(APPS, APP_ZIPF), queries: vec![vec![None; QUERIES_PER_APP]; APPS] }
    }
}

impl Workload for SystemPrompts {
    fn start(&mut self, rng: &mut Rng, out: &mut Out, t: f64, _me: usize, _agenda: &mut Agenda) {
        let app = self.zipf.sample(rng);
        let mut ids = self.prompts[app].clone();
        let (user, last) = if rng.chance(REPEAT_QUERY) {
            let q = rng.below(QUERIES_PER_APP as u64) as usize;
            let n = rng.count(USER_BLOCKS_MEDIAN, 0.8, 1, 64);
            let (ids, last) = self.queries[app][q].get_or_insert_with(|| (out.fresh(n), last_tokens(rng))).clone();
            (ids, last)
        } else {
            (out.fresh(rng.count(USER_BLOCKS_MEDIAN, 1.0, 1, 128)), last_tokens(rng))
        };
        ids.extend(user);
        out.push(t, &ids, last, rng.count(300.0, 0.7, 1, 4096));
    }
    fn step(&mut self, _: &mut Rng, _: &mut Out, _: f64, _: usize, _: &mut Agenda) {}
}

/// Conversations.
struct MultiTurn {
    prompts: Vec<Vec<u64>>,
    zipf: Zipf,
    /// Per session: full blocks of the context, turns left.
    sessions: Vec<(Vec<u64>, u64)>,
}

impl MultiTurn {
    fn new(out: &mut Out) -> MultiTurn {
        let prompts = (0..CHAT_PROMPTS).map(|_| out.fresh(CHAT_PROMPT_BLOCKS)).collect();
        MultiTurn { prompts, zipf: Zipf::new(CHAT_PROMPTS, 1.0), sessions: Vec::new() }
    }
    fn turn(&mut self, rng: &mut Rng, out: &mut Out, t: f64, s: usize, added: u64, agenda: &mut Agenda) {
        let (ctx, left) = &mut self.sessions[s];
        // The new blocks: the previous partial block, completed, and what was added after it.
        let mut ids = ctx.clone();
        ids.extend(out.fresh(added));
        let last = last_tokens(rng);
        out.push(t, &ids, last, rng.count(400.0, 0.7, 1, 4096));
        // The next turn keeps this prompt's full blocks; its partial block changes.
        ids.pop();
        *ctx = ids;
        *left -= 1;
        if *left > 0 && (ctx.len() as u64) < MAX_CONTEXT {
            at(agenda, t + 1000.0 * rng.lognormal(THINK_MEDIAN_S, 1.0), s);
        }
    }
}

impl Workload for MultiTurn {
    fn start(&mut self, rng: &mut Rng, out: &mut Out, t: f64, me: usize, agenda: &mut Agenda) {
        let p = self.zipf.sample(rng);
        let turns = rng.geometric(TURNS_MEAN);
        while self.sessions.len() <= me {
            self.sessions.push((Vec::new(), 0));
        }
        self.sessions[me] = (self.prompts[p].clone(), turns);
        let first = rng.count(FIRST_MESSAGE_MEDIAN, 1.0, 1, 128);
        self.turn(rng, out, t, me, first, agenda);
    }
    fn step(&mut self, rng: &mut Rng, out: &mut Out, t: f64, s: usize, agenda: &mut Agenda) {
        let added = 1 + rng.count(ANSWER_BLOCKS_MEDIAN, 0.8, 0, 32) + rng.count(MESSAGE_BLOCKS_MEDIAN, 1.0, 0, 64);
        self.turn(rng, out, t, s, added, agenda);
    }
}

/// Agent sessions looping over tool calls.
struct ToolLoop {
    prompts: Vec<Vec<u64>>,
    /// Per branch: full blocks of the context, iterations left.
    branches: Vec<(Vec<u64>, u64)>,
}

impl ToolLoop {
    fn new(out: &mut Out) -> ToolLoop {
        ToolLoop { prompts: (0..AGENTS).map(|_| out.fresh(AGENT_PROMPT_BLOCKS)).collect(), branches: Vec::new() }
    }
    fn iterate(&mut self, rng: &mut Rng, out: &mut Out, t: f64, b: usize, added: u64, agenda: &mut Agenda) {
        let mut ids = self.branches[b].0.clone();
        ids.extend(out.fresh(added));
        out.push(t, &ids, last_tokens(rng), rng.count(60.0, 0.8, 1, 2048));
        ids.pop();
        self.branches[b].0 = ids;
        self.branches[b].1 -= 1;
        if self.branches[b].1 == 0 || self.branches[b].0.len() as u64 >= MAX_CONTEXT {
            return;
        }
        // Parallel tool calls: a branch of its own from here, a few iterations long.
        if rng.chance(FORK) {
            let ctx = self.branches[b].0.clone();
            self.branches.push((ctx, 1 + rng.geometric(3.0)));
            let nb = self.branches.len() - 1;
            at(agenda, t + 1000.0 * rng.lognormal(TOOL_GAP_MEDIAN_S, 0.8), nb);
        }
        at(agenda, t + 1000.0 * rng.lognormal(TOOL_GAP_MEDIAN_S, 0.8), b);
    }
}

impl Workload for ToolLoop {
    fn start(&mut self, rng: &mut Rng, out: &mut Out, t: f64, _me: usize, agenda: &mut Agenda) {
        let a = rng.below(AGENTS as u64) as usize;
        self.branches.push((self.prompts[a].clone(), rng.geometric(ITERATIONS_MEAN)));
        let b = self.branches.len() - 1;
        let task = rng.count(TASK_BLOCKS_MEDIAN, 0.8, 1, 64);
        self.iterate(rng, out, t, b, task, agenda);
    }
    fn step(&mut self, rng: &mut Rng, out: &mut Out, t: f64, b: usize, agenda: &mut Agenda) {
        let added = 1 + rng.count(TOOL_RESULT_BLOCKS_MEDIAN, 1.0, 0, 64);
        self.iterate(rng, out, t, b, added, agenda);
    }
}

/// One-off documents, and a hot set of shared ones.
struct Documents {
    instruction: Vec<u64>,
    hot: Vec<Lazy>,
    zipf: Zipf,
}

impl Documents {
    fn new(out: &mut Out) -> Documents {
        Documents {
            instruction: out.fresh(INSTRUCTION_BLOCKS),
            hot: vec![None; HOT_DOCS],
            zipf: Zipf::new(HOT_DOCS, HOT_ZIPF),
        }
    }
}

impl Workload for Documents {
    fn start(&mut self, rng: &mut Rng, out: &mut Out, t: f64, _me: usize, _agenda: &mut Agenda) {
        let mut ids = self.instruction.clone();
        let (doc, last) = if rng.chance(HOT_SHARE) {
            let d = self.zipf.sample(rng);
            let n = rng.count(DOC_BLOCKS_MEDIAN, 0.8, 2, 256);
            self.hot[d].get_or_insert_with(|| (out.fresh(n), last_tokens(rng))).clone()
        } else {
            (out.fresh(rng.count(DOC_BLOCKS_MEDIAN, 0.8, 2, 256)), last_tokens(rng))
        };
        ids.extend(doc);
        out.push(t, &ids, last, rng.count(200.0, 0.7, 1, 4096));
    }
    fn step(&mut self, _: &mut Rng, _: &mut Out, _: f64, _: usize, _: &mut Agenda) {}
}

/// Generate `n` requests of `kind` with `seed`, in arrival order.
pub fn generate(kind: &str, n: usize, seed: u64) -> Result<Vec<Request>> {
    let mut rng = Rng::new(seed);
    let mut out = Out { next_id: 0, reqs: Vec::with_capacity(n) };
    if !KINDS.contains(&kind) {
        bail!("unknown generator {kind:?} (known: {})", KINDS.join(", "));
    }
    let names = kind_names(kind);
    let mut loads: Vec<Box<dyn Workload>> = Vec::new();
    for name in &names {
        loads.push(match *name {
            "system-prompts" => Box::new(SystemPrompts::new(&mut rng, &mut out)),
            "multi-turn" => Box::new(MultiTurn::new(&mut out)),
            "tool-loop" => Box::new(ToolLoop::new(&mut out)),
            _ => Box::new(Documents::new(&mut out)),
        });
    }
    // Sessions arrive as a Poisson process; each workload's share of requests is equal, so
    // sessions that make many requests (conversations, agents) start less often.
    let per_session: Vec<f64> = names
        .iter()
        .map(|k| match *k {
            "multi-turn" => TURNS_MEAN,
            "tool-loop" => ITERATIONS_MEAN * (1.0 + FORK * 4.0),
            _ => 1.0,
        })
        .collect();
    let share = 1.0 / loads.len() as f64;
    let mut agenda: Vec<Agenda> = loads.iter().map(|_| Agenda::new()).collect();
    let mut next_start: Vec<f64> = vec![0.0; loads.len()];
    let mut sessions = vec![0usize; loads.len()];
    let mean_gap_ms: Vec<f64> = per_session.iter().map(|k| 60_000.0 / (RATE_PER_MIN * share / k)).collect();
    while out.reqs.len() < n {
        // The earliest thing to happen: a session step or a session start, in any workload.
        let mut best: Option<(f64, usize, bool)> = None;
        for w in 0..loads.len() {
            let step = agenda[w].peek().map(|r| r.0 .0 as f64);
            for (t, is_step) in [(Some(next_start[w]), false), (step, true)] {
                if let Some(t) = t {
                    if best.is_none_or(|b| t < b.0) {
                        best = Some((t, w, is_step));
                    }
                }
            }
        }
        let (t, w, is_step) = best.expect("a start is always scheduled");
        if is_step {
            let Reverse((_, s)) = agenda[w].pop().expect("peeked");
            loads[w].step(&mut rng, &mut out, t, s, &mut agenda[w]);
        } else {
            let me = sessions[w];
            sessions[w] += 1;
            loads[w].start(&mut rng, &mut out, t, me, &mut agenda[w]);
            next_start[w] = t + rng.exp(mean_gap_ms[w]);
        }
    }
    out.reqs.truncate(n);
    // Stable sort: requests of one ms keep the order they were made in.
    out.reqs.sort_by_key(|r| r.timestamp);
    Ok(out.reqs)
}

fn kind_names(kind: &str) -> Vec<&'static str> {
    match kind {
        "mix" => KINDS[..4].to_vec(),
        k => KINDS.iter().copied().filter(|x| *x == k).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn seeded_and_chained() {
        for kind in KINDS {
            let a = generate(kind, 2_000, 7).unwrap();
            assert_eq!(a.len(), 2_000);
            assert_eq!(a, generate(kind, 2_000, 7).unwrap(), "{kind}: same seed, same trace");
            assert_ne!(a, generate(kind, 2_000, 8).unwrap(), "{kind}: another seed, another trace");
            assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            // Chained ids: an id is always seen after the same parent, at the same depth.
            let mut parent_of: HashMap<u64, (Option<u64>, usize)> = HashMap::new();
            for r in &a {
                assert!(!r.hash_ids.is_empty());
                assert_eq!(r.tokens(), r.input_length, "{kind}: lengths agree with the blocks");
                for (i, id) in r.hash_ids.iter().enumerate() {
                    let p = (i > 0).then(|| r.hash_ids[i - 1]);
                    assert_eq!(*parent_of.entry(*id).or_insert((p, i)), (p, i), "{kind}: id {id} moved");
                }
            }
        }
    }

    #[test]
    fn shapes_differ_as_designed() {
        // Reuse (unlimited-cache block hit rate): documents are mostly one-off, tool loops
        // mostly reuse; conversations in between.
        let rate = |k: &str| {
            let t = crate::trace::Trace { requests: generate(k, 6_000, 3).unwrap() };
            crate::trace::unlimited(&t).block_rate()
        };
        let (docs, chat, tools) = (rate("documents"), rate("multi-turn"), rate("tool-loop"));
        assert!(docs < chat && chat < tools, "documents {docs:.3} < multi-turn {chat:.3} < tool-loop {tools:.3}");
        assert!(rate("system-prompts") > 0.2);
    }
}
