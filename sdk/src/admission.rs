//! Admission: requests to enter a tier, as rows and columns, and the decisions.

use crate::{Events, Tier, NO_DEPTH, NO_PARENT};

/// One block asking to enter a tier; a batch of them is [`AdmitBatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmitRequest {
    /// The fresh id the block gets if it is stored.
    pub id: u64,
    /// Key hash ([`key_hash`](crate::key_hash)).
    pub key: u64,
    pub size: u64,
    pub tokens: u32,
    /// Length in tokens of the prefix this block completes (vLLM's `store_threshold` input).
    pub seq_tokens: u64,
    /// The tier the host would put it in.
    pub tier: Tier,
    /// A resident block, an earlier row of the same batch, or [`NO_PARENT`].
    pub parent: u64,
    /// Position in the prefix chain, or [`NO_DEPTH`].
    pub depth: u32,
}

impl AdmitRequest {
    /// A request with `key` = `id` and unknown depth (tests); hosts fill every field.
    pub fn new(id: u64, size: u64, tokens: u32, seq_tokens: u64, tier: Tier, parent: u64) -> AdmitRequest {
        AdmitRequest { id, key: id, size, tokens, seq_tokens, tier, parent, depth: NO_DEPTH }
    }
    pub fn with_key(mut self, key: u64) -> AdmitRequest {
        self.key = key;
        self
    }
    pub fn with_depth(mut self, depth: u32) -> AdmitRequest {
        self.depth = depth;
        self
    }
}

/// Admission requests as columns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdmitBatch {
    pub id: Vec<u64>,
    pub key: Vec<u64>,
    pub size: Vec<u64>,
    pub tokens: Vec<u32>,
    pub seq_tokens: Vec<u64>,
    pub tier: Vec<u8>,
    pub parent: Vec<u64>,
    pub depth: Vec<u32>,
}

impl AdmitBatch {
    pub fn len(&self) -> usize {
        self.id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.id.is_empty()
    }

    pub fn push(&mut self, r: AdmitRequest) {
        self.id.push(r.id);
        self.key.push(r.key);
        self.size.push(r.size);
        self.tokens.push(r.tokens);
        self.seq_tokens.push(r.seq_tokens);
        self.tier.push(r.tier as u8);
        self.parent.push(r.parent);
        self.depth.push(r.depth);
    }

    pub fn is_well_formed(&self) -> bool {
        let n = self.id.len();
        [
            self.key.len(),
            self.size.len(),
            self.tokens.len(),
            self.seq_tokens.len(),
            self.tier.len(),
            self.parent.len(),
            self.depth.len(),
        ]
        .iter()
        .all(|&l| l == n)
    }

    pub fn iter(&self) -> impl Iterator<Item = AdmitRequest> + '_ {
        let n = if self.is_well_formed() { self.id.len() } else { 0 };
        (0..n).map(move |i| AdmitRequest {
            id: self.id[i],
            key: self.key[i],
            size: self.size[i],
            tokens: self.tokens[i],
            seq_tokens: self.seq_tokens[i],
            tier: Tier::from_u8(self.tier[i]).unwrap_or(Tier::Dram),
            parent: self.parent[i],
            depth: self.depth[i],
        })
    }

    /// The host's chain rule for admission: a row whose parent is an earlier row of this batch
    /// that is rejected is rejected too (it could never be hit while its parent is absent).
    /// Hosts apply it to every answer, native or Wasm; returns how many rows it turned down.
    pub fn enforce_chain(&self, decisions: &mut [Admit]) -> usize {
        let n = self.id.len().min(decisions.len());
        let mut turned = 0;
        // Rows are few per put (one chain): a linear look-back is cheaper than a map.
        for i in 0..n {
            if decisions[i] == Admit::Reject {
                continue;
            }
            let p = self.parent[i];
            if p == NO_PARENT {
                continue;
            }
            let parent_rejected =
                (0..i).rev().find(|&j| self.id[j] == p).is_some_and(|j| decisions[j] == Admit::Reject);
            if parent_rejected {
                decisions[i] = Admit::Reject;
                turned += 1;
            }
        }
        turned
    }
}

impl FromIterator<AdmitRequest> for AdmitBatch {
    fn from_iter<I: IntoIterator<Item = AdmitRequest>>(iter: I) -> AdmitBatch {
        let mut b = AdmitBatch::default();
        for r in iter {
            b.push(r);
        }
        b
    }
}

/// An admission decision for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admit {
    /// Keep the block out of the pool.
    Reject,
    /// Store it in this tier (usually the one asked for).
    Into(Tier),
}

/// Admission: decide whether (and where) a new block, or a block being demoted, is stored.
pub trait AdmissionPolicy {
    fn on_events(&mut self, events: &Events);
    /// One decision per request, in order.
    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit>;
}

impl Admit {
    /// Wire code of a decision: the tier code, or [`ADMIT_REJECT`].
    pub fn to_u8(self) -> u8 {
        match self {
            Admit::Reject => ADMIT_REJECT,
            Admit::Into(t) => t as u8,
        }
    }

    /// Decode a wire code; `None` for a code that is neither a tier nor [`ADMIT_REJECT`].
    pub fn from_u8(v: u8) -> Option<Admit> {
        if v == ADMIT_REJECT {
            Some(Admit::Reject)
        } else {
            Tier::from_u8(v).map(Admit::Into)
        }
    }
}

/// Wire code of [`Admit::Reject`] in the `admit` result column.
pub const ADMIT_REJECT: u8 = 255;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admit_codes_round_trip() {
        for a in [Admit::Reject, Admit::Into(Tier::Device), Admit::Into(Tier::Dram), Admit::Into(Tier::Ssd)] {
            assert_eq!(Admit::from_u8(a.to_u8()), Some(a));
        }
        assert_eq!(Admit::from_u8(7), None);
    }

    #[test]
    fn chain_rule_rejects_children_of_rejected_rows() {
        // Chain 10 <- 11 <- 12 in one put, 13 a child of the resident block 5, 14 a root.
        let b: AdmitBatch = [
            AdmitRequest::new(10, 1, 1, 1, Tier::Dram, NO_PARENT),
            AdmitRequest::new(11, 1, 1, 2, Tier::Dram, 10),
            AdmitRequest::new(12, 1, 1, 3, Tier::Dram, 11),
            AdmitRequest::new(13, 1, 1, 2, Tier::Dram, 5),
            AdmitRequest::new(14, 1, 1, 1, Tier::Dram, NO_PARENT),
        ]
        .into_iter()
        .collect();
        let mut d = vec![
            Admit::Into(Tier::Dram),
            Admit::Reject,
            Admit::Into(Tier::Dram),
            Admit::Into(Tier::Dram),
            Admit::Reject,
        ];
        assert_eq!(b.enforce_chain(&mut d), 1);
        assert_eq!(d, [Admit::Into(Tier::Dram), Admit::Reject, Admit::Reject, Admit::Into(Tier::Dram), Admit::Reject]);
    }
}
