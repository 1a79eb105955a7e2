//! Mooncake-format request traces: one JSON object a line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids` (chained prefix-block hashes, one per block of
//! [`BLOCK_TOKENS`] tokens; equal ids at the same position are the same reusable prefix block).

use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Tokens per block in the Mooncake trace release.
pub const BLOCK_TOKENS: u64 = 512;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a trace record: {source}")]
    Parse {
        path: String,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("trace {0} has no requests")]
    Empty(String),
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Request {
    #[serde(default)]
    pub timestamp: u64,
    pub input_length: u64,
    #[serde(default)]
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

impl Request {
    /// Tokens held by block `i` of this request: full blocks, then the remainder of the prompt
    /// in the last one (clamped to 1..=BLOCK_TOKENS when the lengths disagree).
    pub fn block_tokens(&self, i: usize) -> u64 {
        let n = self.hash_ids.len() as u64;
        if (i as u64) + 1 < n {
            BLOCK_TOKENS
        } else {
            self.input_length.saturating_sub(BLOCK_TOKENS * n.saturating_sub(1)).clamp(1, BLOCK_TOKENS)
        }
    }

    /// Tokens of all blocks (equals `input_length` when the record is consistent).
    pub fn tokens(&self) -> u64 {
        (0..self.hash_ids.len()).map(|i| self.block_tokens(i)).sum()
    }
}

#[derive(Debug, Clone)]
pub struct Trace {
    pub requests: Vec<Request>,
}

impl Trace {
    /// Load a trace, keeping the first `limit` requests (all when `None`), in file order.
    pub fn load(path: &Path, limit: Option<usize>) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TraceError::Io { path: path.display().to_string(), source })?;
        let mut requests = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if limit.is_some_and(|l| requests.len() >= l) {
                break;
            }
            if line.trim().is_empty() {
                continue;
            }
            let r: Request = serde_json::from_str(line).map_err(|source| TraceError::Parse {
                path: path.display().to_string(),
                line: n + 1,
                source,
            })?;
            requests.push(r);
        }
        if requests.is_empty() {
            return Err(TraceError::Empty(path.display().to_string()));
        }
        // Replay in arrival order; a stable sort keeps file order among equal timestamps.
        requests.sort_by_key(|r| r.timestamp);
        Ok(Trace { requests })
    }

    #[cfg(test)]
    pub fn from_requests(requests: Vec<Request>) -> Trace {
        Trace { requests }
    }

    pub fn distinct_blocks(&self) -> usize {
        self.requests.iter().flat_map(|r| r.hash_ids.iter()).collect::<HashSet<_>>().len()
    }

    pub fn block_accesses(&self) -> u64 {
        self.requests.iter().map(|r| r.hash_ids.len() as u64).sum()
    }

    /// Capacity in blocks for a fraction of the distinct blocks (at least 1).
    pub fn capacity_for(&self, fraction: f64) -> usize {
        ((fraction * self.distinct_blocks() as f64).round() as usize).max(1)
    }
}

/// Hit counts of a replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Hits {
    pub blocks: u64,
    pub tokens: u64,
    pub block_hits: u64,
    pub token_hits: u64,
}

impl Hits {
    pub fn block_rate(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.block_hits as f64 / self.blocks as f64
        }
    }
    pub fn token_rate(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.token_hits as f64 / self.tokens as f64
        }
    }
    pub fn add(&mut self, o: &Hits) {
        self.blocks += o.blocks;
        self.tokens += o.tokens;
        self.block_hits += o.block_hits;
        self.token_hits += o.token_hits;
    }
}

/// Hits of a cache of unlimited size: a block hits when it was seen before and every block
/// before it in the request hit too.
pub fn unlimited(trace: &Trace) -> Hits {
    let mut seen = HashSet::new();
    let mut h = Hits::default();
    for r in &trace.requests {
        let mut prefix = true;
        for (i, id) in r.hash_ids.iter().enumerate() {
            let t = r.block_tokens(i);
            h.blocks += 1;
            h.tokens += t;
            prefix &= seen.contains(id);
            if prefix {
                h.block_hits += 1;
                h.token_hits += t;
            }
        }
        seen.extend(r.hash_ids.iter().copied());
    }
    h
}

/// Find the default trace: `$KVPOOL_TRACE`, else `shared/traces/mooncake-conversation.jsonl`
/// in the current directory or any ancestor (CI lays `shared/` beside the clone).
pub fn locate_default() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVPOOL_TRACE") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        dirs.push(cwd);
    }
    dirs.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for d in dirs {
        for a in d.ancestors() {
            let p = a.join("shared/traces/mooncake-conversation.jsonl");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_block_holds_the_remainder() {
        let r = Request { timestamp: 0, input_length: 1100, output_length: 1, hash_ids: vec![1, 2, 3] };
        assert_eq!((r.block_tokens(0), r.block_tokens(1), r.block_tokens(2)), (512, 512, 76));
        assert_eq!(r.tokens(), 1100);
    }

    #[test]
    fn unlimited_counts_prefix_hits_only() {
        let t = Trace::from_requests(vec![
            Request { timestamp: 0, input_length: 1024, output_length: 0, hash_ids: vec![1, 2] },
            Request { timestamp: 1, input_length: 1536, output_length: 0, hash_ids: vec![1, 3, 2] },
        ]);
        let h = unlimited(&t);
        assert_eq!((h.blocks, h.block_hits), (5, 1));
        assert_eq!((h.tokens, h.token_hits), (2560, 512));
    }
}
